"""EXPECT: AMP103,AMP112

FAULT: fine-tuning starts from an encoder checkpoint that upstream published in fp16 to halve its
size (`publish_compact_checkpoint`, lines 54-59, run before the guard: it stands in for the
downloaded file). In fp32 one weight, `encoder.2.weight[17, 40]`, was 7.2e4 (line 58); the fp16
copy holds inf there (line 59). Inside the guard, line 76 loads it into the fp32 model
(module path `encoder.2`, the second Linear): load_state_dict copies the inf into the fp32
parameter before step 0. Training is bf16 autocast without a GradScaler (correct for bf16) and
AdamW. In step 0 unit 17 of `encoder.2` is +-inf for every row, GELU turns it into NaN, the
logits and the loss are NaN, and every gradient is NaN (plain torch, no guard: all 25,348 gradient
entries NaN, none inf, total norm NaN); AdamW writes NaN into every weight, so the loss is NaN at
all 8 steps.

Pages: AMP112: "the loss is NaN/Inf when backward starts" (line 85, steps 0-7). AMP103: "NaN/Inf
gradients that reached an optimizer step without a GradScaler catching them, naming the
parameters (or layers)" (the step at line 86, steps 0-7; all layers). Not expected: AMP101,
whose page requires "the first op whose output holds NaN or Inf while all of its inputs were
finite": the first non-finite output (`linear` of `encoder.2`) has a non-finite input, the
loaded weight, and everything after it propagates (step 0), then every weight is NaN (steps 1-7).
AMP104 (the total norm is NaN, which exceeds no threshold), AMP105 (no layer has finite tiny or
all-zero gradients: they are all NaN), AMP001 (the fp16 copy is made before the guard, from a
state dict, and the model stays fp32), AMP010 (bf16 without a scaler is correct).
"""
import json
import os
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.set_num_threads(1)
torch.manual_seed(0)

D_IN, D_HID, N_CLASSES = 64, 128, 4


def make_encoder():
    return nn.Sequential(nn.Linear(D_IN, D_HID), nn.GELU(), nn.Linear(D_HID, D_HID), nn.GELU())


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = make_encoder()
        self.head = nn.Linear(D_HID, N_CLASSES)

    def forward(self, x):
        return self.head(self.encoder(x))


def publish_compact_checkpoint(path):
    """What the upstream project did: train in fp32, then save an fp16 copy to halve the file."""
    encoder = make_encoder()
    with torch.no_grad():
        encoder[2].weight[17, 40] = 7.2e4  # a rarely active unit whose weight grew huge (fine in fp32)
    torch.save({k: v.half() for k, v in encoder.state_dict().items()}, path)  # 7.2e4 -> inf


ckpt_dir = tempfile.mkdtemp()
ckpt_path = os.path.join(ckpt_dir, "encoder_fp16.pt")
publish_compact_checkpoint(ckpt_path)

W_TRUE = torch.randn(D_IN, N_CLASSES)


def batch(gen, n=32):
    x = torch.randn(n, D_IN, generator=gen)
    return x, (x @ W_TRUE).argmax(-1)


with amp_runtime.guard(policy="record") as g:
    model = Classifier()
    model.encoder.load_state_dict(torch.load(ckpt_path))  # INJECTED: fp16 tensors (one inf) into fp32 params
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1)
    for step in range(8):
        x, y = batch(gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.4f}")

for e in g.report.events:
    print(f"EVENT {e.code} step={e.step} op={e.op} module={e.module!r} source={e.source} :: {e.message}")
print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
