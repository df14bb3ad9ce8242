"""EXPECT: AMP107,AMP108
MAY: AMP104,AMP106
FAULT: few-shot face-ID enrolment. A frozen backbone feeds a trainable ArcFace head
(`head`: `head.proj` + class weights `head.weight`). The 10 new identities have one
sample each; `head.weight` is imprinted with their own normalised embeddings, then the
head is fine-tuned on that support set in fp16 autocast with a GradScaler, 30 steps.
In `ArcFaceHead.forward` (line 51, marked `# <-- FAULT`) the angle is
`acos(cos.clamp(-1.0, 1.0))`, with no margin inside +-1. The fp16 cosine of each sample
with its own imprinted row rounds to exactly 1.0, and d/dx acos(x) = -1/sqrt(1-x^2) is
-inf there: the forward is finite (acos(1) = 0, finite logits, finite loss ~1e-4) but the
gradients of `head.weight` and `head.proj` are inf/NaN on every step. The scaler skips
every step, the weights never change, so it recurs forever and the scale halves each
step: 32768 after step 0, 1.0 after step 15, 2^-14 after step 29 (checked with plain
torch, no guard: 30 skips out of 30).
Why these codes (from the pages): AMP108 = "5 consecutive decreases, or scale < init/100,
or < 128 and falling" (from step 4). AMP107 = "loss scale <= 1 and not rising" (from
step 15). Not AMP103 (its page: steps a GradScaler skips are counted for AMP108/AMP109,
not AMP103), not AMP112 (finite loss), not AMP101 (no forward op produces inf/NaN; the
replay of the skipped step finds a finite forward), not AMP109 (its window counts from
the first step the scaler did not skip, which never comes). MAY: AMP104 (the unscaled
total norm of these grads is inf/NaN; the page does not say if a non-finite norm of a
skipped step counts as > 1000), AMP106 (its check runs "every 32nd step"; if step 0
counts, the gradients it estimates from are non-finite).
"""
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

N_ID, EMB = 10, 64


class ArcFaceHead(nn.Module):
    def __init__(self, n_id=N_ID, dim=EMB, s=30.0, m=0.3):
        super().__init__()
        self.proj = nn.Linear(256, dim)
        self.weight = nn.Parameter(torch.empty(n_id, dim))
        self.s, self.m = s, m

    def embed(self, feats):
        return F.normalize(self.proj(feats).float(), dim=-1)

    def forward(self, feats, labels):
        cos = F.linear(self.embed(feats), F.normalize(self.weight, dim=-1))
        theta = torch.acos(cos.clamp(-1.0, 1.0))  # <-- FAULT: acos'(1) = -inf; fp16 cos hits 1.0
        target = torch.cos(theta + self.m)
        onehot = F.one_hot(labels, self.weight.shape[0]).bool()
        return torch.where(onehot, target, cos) * self.s


backbone = nn.Sequential(nn.Linear(48, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU())
backbone.requires_grad_(False).eval()           # "pretrained", frozen
head = ArcFaceHead()

support_x = torch.randn(N_ID, 48)              # one enrolment sample per new identity
support_y = torch.arange(N_ID)
with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
    head.weight.copy_(head.embed(backbone(support_x)))   # weight imprinting

optimizer = torch.optim.SGD(head.parameters(), lr=0.05, momentum=0.9)
scaler = torch.amp.GradScaler("cpu")

with amp_runtime.guard(policy="record") as g:
    for step in range(30):
        with torch.no_grad():
            feats = backbone(support_x)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = head(feats, support_y)
            loss = F.cross_entropy(logits, support_y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if step % 10 == 0:
            print(f"step {step} loss {loss.item():.6f} scale {scaler.get_scale()}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
