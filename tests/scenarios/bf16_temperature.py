"""EXPECT: none
MAY: none
FAULT: none (healthy control). A CLIP-style dual encoder (two GELU MLPs, embeddings
L2-normalised in fp32) trains with a symmetric InfoNCE loss under bf16 autocast, AdamW,
no GradScaler (the documented bf16 recipe). The learned temperature `logit_scale`
(init log(1/0.07), scale 14.3) has its own param group with lr 0.5 and, unlike CLIP, no
clamp at 100: the scale first falls to ~0.5 while the embeddings are random, then grows
~300x to ~150 by step 59, and the similarity logits, computed by a bf16 matmul and
multiplied by the scale, reach ~140 in bf16 (finite; bf16's range is that of fp32).
Plain torch (`--plain`) confirms: every loss finite, total grad norm < 100 and every layer's max
|grad| > 1e-10 at every step.
Run under `trace="always"` with `Thresholds(sample_every=1)` so every op and every add /
reduction is checked.
Must NOT fire, per the pages: AMP102 ("an fp16 output with |x| > 60000" - bf16 is not
fp16, and the values are far below anyway), AMP101 (nothing non-finite), AMP010 ("bf16
autocast with no scaler (correct)"), AMP004/AMP111 (no bf16 reduction: the norms run on
`.float()` copies, the loss upcasts), AMP110 (no bf16 add in this model: the bias adds are
inside `linear`, the temperature is a multiplication), AMP104 (norm < 100), AMP105, AMP001
(`.float()` upcasts are not low-precision casts).
"""
import json
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.set_num_threads(1)

STEPS = 60


def make_data():
    gen = torch.Generator().manual_seed(7)
    mix_a, mix_b = torch.randn(8, 20, generator=gen), torch.randn(8, 24, generator=gen)
    data = []
    for _ in range(STEPS):
        z = torch.randn(32, 8, generator=gen)
        data.append((z @ mix_a + 0.3 * torch.randn(32, 20, generator=gen),
                     z @ mix_b + 0.3 * torch.randn(32, 24, generator=gen)))
    return data


class DualEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.image = nn.Sequential(nn.Linear(20, 48), nn.GELU(), nn.Linear(48, 16))
        self.text = nn.Sequential(nn.Linear(24, 48), nn.GELU(), nn.Linear(48, 16))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, a, b):
        ea = F.normalize(self.image(a).float(), dim=-1)
        eb = F.normalize(self.text(b).float(), dim=-1)
        return self.logit_scale.exp() * (ea @ eb.t())       # bf16 logits under autocast


def train(data, diag=None):
    torch.manual_seed(0)
    model = DualEncoder()
    others = [p for n, p in model.named_parameters() if n != "logit_scale"]
    opt = torch.optim.AdamW([{"params": others, "lr": 2e-3},
                             {"params": [model.logit_scale], "lr": 0.5, "weight_decay": 0.0}])
    labels = torch.arange(32)
    losses = []
    for a, b in data:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(a, b)
            loss = (F.cross_entropy(logits.float(), labels) + F.cross_entropy(logits.float().t(), labels)) / 2
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if diag is not None:
            norm = torch.norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()
            layer_min = min(p.grad.abs().max().item() for p in model.parameters())
            diag.append((loss.item(), model.logit_scale.exp().item(), logits.dtype, logits.abs().max().item(), norm, layer_min))
        opt.step()
        losses.append(loss.item())
    return model, losses


# ---------------------------------------------------------------- harness
def same(a, b):
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def same_list(a, b):
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


def main():
    data = make_data()
    diag = []
    ref_model, ref_losses = train(data, diag)
    for step, (loss, scale, dtype, lmax, norm, lmin) in enumerate(diag):
        if step % 6 == 0 or step == STEPS - 1:
            print(f"plain step {step:2d}: loss={loss:.4g} scale={scale:.4g} logits {dtype} max={lmax:.4g} grad_norm={norm:.3g} min_layer_max_grad={lmin:.3g}")
    print("plain: max grad norm", max(d[4] for d in diag), " min layer max grad", min(d[5] for d in diag),
          " all finite", all(math.isfinite(d[0]) for d in diag), " final scale", diag[-1][1])
    if "--plain" in sys.argv:
        return
    ref_model, ref_losses = train(data)
    with amp_runtime.guard(policy="record", trace="always", thresholds=amp_runtime.Thresholds(sample_every=1)) as g:
        model, losses = train(data)
    print("LOSSES_MATCH", same_list(ref_losses, losses))
    ref_sd, sd = ref_model.state_dict(), model.state_dict()
    print("WEIGHTS_MATCH", all(same(ref_sd[k], sd[k]) for k in ref_sd))
    for e in g.report.events:
        print(f"EVENT {e.code} step={e.step} module={e.module} op={e.op} source={e.source} | {e.message}")
    print(g.report.summary())
    print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))


if __name__ == "__main__":
    main()
