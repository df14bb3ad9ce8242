"""EXPECT: AMP101,AMP112
MAY: AMP102
FAULT: a multi-task MLP whose trunk (`block` = Linear(24,96) -> GELU -> Linear(96,32)) runs
under `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`, trained under fp16
autocast with a GradScaler, gradient accumulation over 4 micro-batches (loss / 4), and
`opt.zero_grad(set_to_none=False)` once per optimizer step; 12 steps. Injected fault: at
step 5 the third micro-batch (micro 2) holds raw counts 2e4..5e4 (they fit fp16); plain
torch shows `block.0` (Linear) turns them into 17 inf, the loss of that micro-batch is NaN
(the other 47 are finite), the step's gradients are non-finite and the scaler skips it
(65536 -> 32768, no other skip). The auxiliary head is used only on even steps; with
`set_to_none=False` its gradients on odd steps are tensors of exact zeros (checked).
Codes: AMP112 "the loss is NaN/Inf when backward starts" (step 5, the backward line);
AMP101 via the replay of the skipped step, "where the step called the model more than once,
as with gradient accumulation ..., details["call"] and details["calls"] say which call"
(expect op linear, module `block.0` inside the checkpointed block, step 5, call 3 of 4,
source: the forward line that calls `checkpoint`). Must not fire: AMP105 for `aux_head` on
odd steps: its zeros are kept by set_to_none=False, but no backward reached it, so it is
unused, not vanishing (the AMP105 page; written to expect it before that was decided),
AMP008 (backward starts outside autocast; the checkpoint's recomputation re-enters the
saved autocast state inside backward, which is torch's doing, not a backward under
autocast), AMP103 (the scaler skips the bad step), AMP108 (one skip), AMP104 (norms of good
steps <= 0.63), AMP010, AMP002/AMP004 (losses inside autocast on `.float()` values). MAY:
AMP102: `block.0`'s output on the bad micro-batch holds inf and may also hold finite values
above 60000; the pages do not say whether an op already reported as AMP101 is also AMP102.
"""
import json
import sys

import torch
from torch import nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

torch.set_num_threads(1)
torch.manual_seed(0)

import amp_runtime  # noqa: E402

STEPS, ACCUM, BAD_STEP, BAD_MICRO = 12, 4, 5, 2


class MultiTaskNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(24, 96), nn.GELU(), nn.Linear(96, 32))  # checkpointed
        self.cls_head = nn.Linear(32, 5)
        self.aux_head = nn.Linear(32, 1)  # auxiliary regression, only on batches with aux labels

    def forward(self, x, with_aux):
        h = checkpoint(self.block, x, use_reentrant=False)
        logits = self.cls_head(h)
        aux = self.aux_head(h) if with_aux else None
        return logits, aux


def micro_batch(step, micro):
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(16, 24, generator=g)
    y = (x[:, :5] * 3).argmax(1)
    z = x[:, 5:6] * 0.5
    if step == BAD_STEP and micro == BAD_MICRO:
        x = 2.0e4 + 3.0e4 * torch.rand(16, 24, generator=g)  # raw sensor counts, not standardised (fit fp16)
    return x, y, z


def train(probe=False):
    torch.manual_seed(0)
    model = MultiTaskNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    losses, scales, facts = [], [], []
    for step in range(STEPS):
        with_aux = step % 2 == 0  # aux labels come with every other step's batches
        opt.zero_grad(set_to_none=False)
        for micro in range(ACCUM):
            x, y, z = micro_batch(step, micro)
            with torch.autocast("cpu", dtype=torch.float16):
                logits, aux = model(x, with_aux)
                loss = F.cross_entropy(logits.float(), y)
                if aux is not None:
                    loss = loss + 0.5 * F.mse_loss(aux.float(), z)
                loss = loss / ACCUM
            scaler.scale(loss).backward()
            losses.append(loss.detach().clone())
            if probe:
                facts.append(dict(step=step, micro=micro, loss=float(loss.detach())))
        if probe:
            sc = scaler.get_scale()
            facts[-1].update(
                nonfinite=[n for n, p in model.named_parameters() if not torch.isfinite(p.grad).all()],
                zero_layers=[n for n, p in model.named_parameters() if float(p.grad.abs().max()) == 0.0],
                gnorm=float(torch.stack([p.grad.float().norm() for p in model.parameters()]).norm()) / sc,
                layer_min_nonzero=min((float(p.grad.abs().max()) for p in model.parameters()
                                       if float(p.grad.abs().max()) > 0), default=0.0) / sc)
        scaler.step(opt)
        scaler.update()
        scales.append(float(scaler.get_scale()))
    return model, losses, scales, facts


def same(a, b):
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    bits = a.contiguous().view(torch.int32) == b.contiguous().view(torch.int32)
    return bool((bits | (torch.isnan(a) & torch.isnan(b))).all())


def first_inf_module():
    """Plain torch: which layer of the checkpointed block first overflows on the bad micro-batch."""
    torch.manual_seed(0)
    model = MultiTaskNet()
    x, _, _ = micro_batch(BAD_STEP, BAD_MICRO)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        h = x
        for i, layer in enumerate(model.block):
            out = layer(h)
            print(f"plain: block.{i} ({type(layer).__name__}) input finite {bool(torch.isfinite(h).all())} "
                  f"max {float(h.float().abs().max()):.0f} -> output inf count {int(torch.isinf(out).sum())}")
            h = out


def main():
    first_inf_module()
    model0, l0, s0, facts = train(probe=True)
    for f in facts:
        if "nonfinite" in f:
            print("plain step %(step)2d last micro loss %(loss)8.4f norm %(gnorm)8.3g non-finite %(nonfinite)s "
                  "all-zero layers %(zero_layers)s min nonzero layer max %(layer_min_nonzero).3g" % f,
                  "scale after", s0[f["step"]])
    bad = [f for f in facts if f["step"] == BAD_STEP]
    print("plain: losses of step %d's micro-batches:" % BAD_STEP, [round(f["loss"], 4) for f in bad])
    assert not torch.isfinite(l0[BAD_STEP * ACCUM + BAD_MICRO])
    assert all(torch.isfinite(v) for i, v in enumerate(l0) if i != BAD_STEP * ACCUM + BAD_MICRO)
    assert s0 == [65536.0] * BAD_STEP + [32768.0] * (STEPS - BAD_STEP), s0
    if "--plain-only" in sys.argv:
        return

    with amp_runtime.guard(policy="record", model=None) as g:
        model1, l1, s1, _ = train()
    lm = len(l0) == len(l1) and all(same(a, b) for a, b in zip(l0, l1))
    sd0, sd1 = model0.state_dict(), model1.state_dict()
    wm = all(same(sd0[k], sd1[k]) for k in sd0)
    codes = set()
    for ev in g.report.events:
        codes.add(ev.code)
        print("EVENT", ev.code, "step", ev.step, "module", ev.module, "op", ev.op, "source", ev.source,
              "|", ev.message)
        d = ev.details if isinstance(ev.details, dict) else {}
        extra = {k: d[k] for k in ("call", "calls", "replayed", "origin") if k in d}
        if extra:
            print("      details:", extra)
    print(g.report.summary())
    print("SCALES_MATCH", s0 == s1)
    print(f"LOSSES_MATCH {lm}")
    print(f"WEIGHTS_MATCH {wm}")
    print("EVENTS " + json.dumps(sorted(codes)))


if __name__ == "__main__":
    main()
