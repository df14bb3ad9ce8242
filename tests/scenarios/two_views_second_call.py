"""EXPECT: AMP101,AMP112
MAY: AMP102

FAULT: SimCLR-style contrastive training, fp16 CPU autocast + GradScaler("cpu",
init_scale=2**10) (a fairseq-style low initial scale: with the default 65536 this conv net's
fp16 backward overflows while the scale calibrates, which is not the fault under test); the
encoder is called twice per step (`z1 = model(view1)`, then `z2 = model(view2)`) and the
NT-Xent loss is computed in fp32 outside any module. The second augmentation pipeline has a
JPEG-quality augmentation on the 0..255 scale and, at step 5 only, forgets to divide back
by 255 (`augment_view2`, the line marked `# FAULT: 0..255 view`). So only the SECOND model
call of step 5 sees inputs 255x too large. The encoder ends with second-order (bilinear,
B-CNN) pooling; its `torch.einsum("bchw,bdhw->bcd", x, x)` (BilinearPool.forward, the line
marked `# FAULT OP`, module `encoder.pool`) sums products of activations of up to ~111 over
64 positions: the fp16 output is inf in 232 entries (finite entries up to 65440), its inputs
are finite (plain torch check). The first call of the same step is finite (its einsum peaks
at 4.5). Loss of step 5 is NaN, the GradScaler skips step 5 (scale 1024 -> 512); every
other step is finite and not skipped.

Codes from the pages: AMP112 (AMP112.md "reports when it is NaN or Inf" at backward) and
AMP101 (AMP101.md: trace="auto" replays the failing step's forward with per-op checks and
"AMP101 names the op of the step where it happened"; index.md: "the step's calls run again,
in order": both calls of the encoder are replayed, and only the second produces inf, so
AMP101 must name the einsum in `encoder.pool` at the BilinearPool line, step 5). Not AMP103
(skipped by the GradScaler), not AMP108/AMP109 (one skip; 512 is not below init/100 nor
below 128). MAY: AMP102 (per-op checks of the replay and of the traced steps after it: the
overflowing einsum's finite entries reach 65440 > 60000).
The projector's BatchNorm1d running stats are buffers that the replay must put back:
weights and buffers of the guarded run must equal the unguarded run's (NaN-equal).
"""
import json
import math

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.set_num_threads(1)
torch.manual_seed(0)

STEPS, BS, BAD_STEP = 10, 16, 5


class BilinearPool(nn.Module):
    """Second-order (bilinear) pooling, as in B-CNN: the mean over positions of x x^T."""

    def forward(self, x):
        b, c, h, w = x.shape
        gram = torch.einsum("bchw,bdhw->bcd", x, x)  # FAULT OP: fp16 sum of ~1e4 products is inf
        return (gram / (h * w)).flatten(1)


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 16, 3, stride=2, padding=1)
        self.pool = BilinearPool()

    def forward(self, x):
        return self.pool(F.relu(self.conv2(F.relu(self.conv1(x)))))


class SimCLR(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Encoder()
        self.projector = nn.Sequential(nn.Linear(256, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 32))

    def forward(self, x):
        return self.projector(self.encoder(x))


def nt_xent(z1, z2, tau=0.2):
    z1 = F.normalize(z1.float(), dim=1)
    z2 = F.normalize(z2.float(), dim=1)
    logits = z1 @ z2.t() / tau
    labels = torch.arange(z1.size(0))
    return 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels))


def augment_view1(img, gen):
    flip = torch.rand(img.size(0), 1, 1, 1, generator=gen) < 0.5
    img = torch.where(flip, img.flip(-1), img)
    return (img + 0.05 * torch.randn(img.shape, generator=gen)).clamp(0, 1)


def augment_view2(img, gen, step):
    q = torch.round(img * 255.0)  # "JPEG" quantisation on the 0..255 scale
    q = q + torch.randint(-3, 4, img.shape, generator=gen)
    if step == BAD_STEP:
        return q.clamp(0, 255)  # FAULT: 0..255 view, the / 255 is missing on this path
    return q.clamp(0, 255) / 255.0


def make_data():
    gen = torch.Generator().manual_seed(99)
    out = []
    for step in range(STEPS):
        img = torch.rand(BS, 3, 16, 16, generator=gen)
        out.append((augment_view1(img, gen), augment_view2(img, gen, step)))
    return out


def build():
    torch.manual_seed(0)
    model = SimCLR()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)  # fairseq-style low initial scale
    return model, opt, scaler


def train(model, opt, scaler, data):
    losses = []
    model.train()
    for step, (v1, v2) in enumerate(data):
        with torch.autocast("cpu", dtype=torch.float16):
            z1 = model(v1)  # call 1: always finite
            z2 = model(v2)  # call 2: overflows at step 5
            loss = nt_xent(z1, z2)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    return losses


def same(a, b):
    return len(a) == len(b) and all((math.isnan(p) and math.isnan(q)) or p == q for p, q in zip(a, b))


def same_state(m1, m2):
    return all(torch.allclose(p.float(), q.float(), rtol=0, atol=0, equal_nan=True)
               for p, q in zip(m1.state_dict().values(), m2.state_dict().values()))


def dump(g):
    for e in g.report.events:
        d = e.details or {}
        extra = {k: d[k] for k in ("replayed", "origin", "replay") if k in d}
        print(f"EVENT {e.code} sev={e.severity} step={e.step} module={e.module!r} op={e.op!r} "
              f"source={e.source!r} extra={str(extra)[:400]} details_keys={sorted(d)}")


data = make_data()
ref_model, ref_opt, ref_scaler = build()
ref_losses = train(ref_model, ref_opt, ref_scaler, data)
print("unguarded losses", [round(v, 4) for v in ref_losses], "scale", ref_scaler.get_scale())

model, opt, scaler = build()
with amp_runtime.guard(policy="record") as g:
    losses = train(model, opt, scaler, data)

print("LOSSES_MATCH", same(ref_losses, losses), "STATE_MATCH", same_state(ref_model, model),
      "SCALE", scaler.get_scale())
dump(g)
print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
