"""EXPECT: none
MAY: none
FAULT: none (healthy control). A residual MLP classifier (LayerNorm, GELU, Dropout 0.1)
trains for 40 steps in fp16 autocast with the standard recipe (`GradScaler("cpu")`,
`scale -> backward -> unscale_ -> clip_grad_norm_ -> step -> update`). Every 5 steps
(step % 5 == 4) it evaluates a held-out set the nanoGPT way: `model.eval()`,
`torch.no_grad()`, the SAME fp16 autocast, loss (upcast) and accuracy, then
`model.train()`. The guard watches every step (`Thresholds(watch_every=1)`, documented on
the index page) so the evaluation code is seen by the code-pattern rules, not just by the
sampled steps. Plain torch (`--plain`) confirms: no skipped step after the first one
(if any: the scale settling), finite losses, total grad norm < 100.
Must NOT fire, per the pages: AMP010 (the evaluation runs no backward: "fp16 autocast
backward with no scaler active" cannot happen; the linter page also says "an evaluation
loop under fp16 autocast next to the scaled one" is fine), AMP002 (the loss is inside the
autocast block, upcast), AMP004 (no fp16 reduction: accuracy is `.float().mean()` of a
bool tensor, the loss upcasts), AMP005 (unscale_ before clipping), AMP006, AMP008
(backward outside the region), AMP001 (no casts), any numeric code (healthy run), and
nothing attributed to the evaluation's no_grad forward (it must not be replayed or
counted as a training step: events, if any, would name steps 0-39).
"""
import json
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.set_num_threads(1)

STEPS, EVAL_EVERY = 40, 5


def make_data():
    gen = torch.Generator().manual_seed(8)
    proj = torch.randn(16, 4, generator=gen)

    def sample(n):
        x = torch.randn(n, 16, generator=gen)
        y = (x @ proj + 0.5 * torch.randn(n, 4, generator=gen)).argmax(1)
        return x, y

    train = [sample(64) for _ in range(STEPS)]
    val = sample(128)
    return train, val


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, h):
        return h + self.drop(self.fc2(F.gelu(self.fc1(self.norm(h)))))


class ResMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.Sequential(Block(32), Block(32))
        self.out = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 4))

    def forward(self, x):
        return self.out(self.blocks(self.inp(x)))


@torch.no_grad()
def evaluate(model, val):
    model.eval()
    x, y = val
    with torch.autocast("cpu", dtype=torch.float16):
        logits = model(x)
        loss = F.cross_entropy(logits.float(), y)
    acc = (logits.argmax(-1) == y).float().mean()
    model.train()
    return loss.item(), acc.item()


def train(data, diag=None):
    train_batches, val = data
    torch.manual_seed(0)
    model = ResMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cpu")
    hist = []
    for step, (x, y) in enumerate(train_batches):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x).float(), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        hist.append(loss.item())
        hist.append(scaler.get_scale())
        if diag is not None:
            diag.append((step, loss.item(), scaler.get_scale(), norm.item()))
        if step % EVAL_EVERY == EVAL_EVERY - 1:
            val_loss, val_acc = evaluate(model, val)
            hist += [val_loss, val_acc]
            if diag is not None:
                print(f"plain eval after step {step}: val_loss={val_loss:.4f} acc={val_acc:.3f}")
    return model, hist


# ---------------------------------------------------------------- harness
def same(a, b):
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def same_list(a, b):
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


def main():
    data = make_data()
    diag = []
    ref_model, ref_hist = train(data, diag)
    for step, loss, scale, norm in diag:
        if step % 5 == 0 or step < 3:
            print(f"plain step {step:2d}: loss={loss:.4g} scale={scale:g} grad_norm(unscaled)={norm:.3g}")
    print("plain: scales", sorted({d[2] for d in diag}), " max norm", max(d[3] for d in diag))
    if "--plain" in sys.argv:
        return
    ref_model, ref_hist = train(data)
    with amp_runtime.guard(policy="record", thresholds=amp_runtime.Thresholds(watch_every=1)) as g:
        model, hist = train(data)
    print("LOSSES_MATCH", same_list(ref_hist, hist))
    ref_sd, sd = ref_model.state_dict(), model.state_dict()
    print("WEIGHTS_MATCH", all(same(ref_sd[k], sd[k]) for k in ref_sd))
    for e in g.report.events:
        print(f"EVENT {e.code} step={e.step} module={e.module} op={e.op} source={e.source} | {e.message}")
    print(g.report.summary())
    print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))


if __name__ == "__main__":
    main()
