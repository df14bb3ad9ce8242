"""EXPECT: AMP004,AMP101,AMP112
MAY: AMP102,AMP110,AMP111

FAULT: a streaming keyword-spotting model normalises its frontend features with a
causal running mean (streaming cepstral mean normalisation) computed in fp16 under
CPU autocast, in the root module ``StreamingKWS.forward``, line 53:
``running_mean = torch.cumsum(h, dim=1) / frames``. ``h`` is the fp16 output of the
``frontend`` Linear over log-mel features (which sit around -6), so several channels
carry a steady offset of up to ~7 per frame. Ordinary clips (300-600 frames) stay far
below 65504 (running sums up to ~4300), but the batches of steps 5 and 13 hold
recordings of 20000 frames (200 s), where the running sum of those channels passes
65504 after ~9200 frames and becomes inf; inf / frames stays inf, ``h - running_mean`` is -inf, and the loss is NaN.
GradScaler skips those two steps.

Pages: AMP004 runtime "a reduction's input and output are both fp16/bf16", with
``cumsum`` in its list and "under CPU autocast ... outside autocast every listed
reduction of a low-precision tensor is reported" (every watched step, not only the
long ones). AMP112: the loss is NaN when backward starts (steps 5 and 13). AMP101:
the failing step is replayed with per-op checks (model = root module, CPU), and the
first op whose output holds inf while its inputs were finite is the fp16 cumsum
(AMP101's page: "In fp16 it is most often an overflow past 65504: ... a sum of many
values").
MAY: AMP102 (cumsum outputs between 60000 and 65504 next to the inf ones, seen while
per-op checks are on; whether an infinite output counts is not said); AMP111 (the
cumsum input may mix near-zero and ~20 magnitudes, > 1e4 apart, sampled while per-op
checks are on); AMP110 (``h - running_mean`` with a running mean of inf is an fp16
add/sub with an infinite operand while per-op checks are on).
"""
import json

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

N_MELS, DIM, KEYWORDS = 40, 64, 6


class StreamingKWS(nn.Module):
    def __init__(self):
        super().__init__()
        self.frontend = nn.Linear(N_MELS, DIM)
        self.body = nn.Sequential(nn.Linear(DIM, DIM), nn.GELU(), nn.Linear(DIM, DIM))
        self.head = nn.Linear(DIM, KEYWORDS)

    def forward(self, feats):
        h = self.frontend(feats)                                  # fp16 under autocast
        frames = torch.arange(1, feats.size(1) + 1, device=feats.device).view(1, -1, 1)
        running_mean = torch.cumsum(h, dim=1) / frames            # causal mean, fp16
        h = h - running_mean
        h = self.body(h)
        pooled = h.float().mean(dim=1)
        return self.head(pooled)


def make_batch(step, batch_size=8):
    frames = 20000 if step in (5, 13) else int(torch.randint(300, 600, ()).item())
    size = 2 if frames > 10000 else batch_size
    # log-mel energies: around -6 with speech bursts
    feats = -6.0 + 2.0 * torch.randn(size, frames, N_MELS)
    labels = torch.randint(0, KEYWORDS, (size,))
    return feats, labels


model = StreamingKWS()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")

with amp_runtime.guard(policy="record") as g:
    for step in range(20):
        feats, labels = make_batch(step)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(feats)
            loss = F.cross_entropy(logits, labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step:2d} frames {feats.size(1):5d} loss {loss.item():.4f} "
              f"scale {scaler.get_scale():g}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
