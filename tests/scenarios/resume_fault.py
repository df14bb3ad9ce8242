"""EXPECT: AMP101,AMP112
MAY: AMP102
FAULT: a metric-learning classifier (bias-free ReLU MLP encoder, cosine-similarity head
that normalises the embedding with `z / z.norm(dim=-1, keepdim=True)` in fp32) trains in
fp16 autocast with Adam and `GradScaler("cpu", init_scale=4096)`. The job is pre-empted:
phase 1 (global steps 0-29) runs under one guard and writes a checkpoint (model,
optimizer, scaler, next step) into a temporary folder; phase 2 is the resumed job: fresh
objects, `load_state_dict` of all three, global steps 30-59 under a NEW guard (what a
restarted `python train.py --resume` under `with amp_runtime.guard():` looks like). At
global step 45 the collate function pads the batch with one all-zero row: the bias-free
encoder maps it to an exactly zero embedding and the head computes 0/0 = NaN in the
division (fp32, inputs finite); the loss is NaN and GradScaler skips that step
(4096 -> 2048). Everything else is healthy (plain torch, `--plain`).

Why these codes (pages): AMP101 "the first op whose output holds NaN or Inf while all of
its inputs were finite" (the division in module `head`, the `z / z.norm(...)` line,
replayed at the skipped step); AMP112 "the loss is NaN/Inf when backward starts".
Phase 1 must record nothing. Must NOT fire: AMP103 (skipped), AMP108 (one halving; 2048 is
above 1/100 of both the constructor's 65536 and the loaded 4096, and above 128), AMP107,
AMP109, AMP004 (the norm is computed on an fp32 copy), AMP011.
STEP NUMBERS: the brief asks that events carry the resumed step (45). The pages describe
no way to tell a plain `guard()` where a resumed run stands (only the Lightning / Hugging
Face callbacks "name the step the trainer counts ... also on a resumed run"); DESIGN
defines `step` as the "0-based index of the training step the event happened in, i.e.
optimizer steps or scaler updates completed before it". Printed: both the guard's step
and the global step it should correspond to (15 counted from the guard's entry, 45
counted in the run). Not part of EXPECT; reported in README.
MAY: AMP102 - per-op checks switch on after the anomaly; no fp16 op of this model comes
near 6e4 in plain torch, but the page's wording ("an fp16 output with |x| > 60000")
leaves open whether the NaN output counts.
"""
import json
import math
import os
import sys
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.set_num_threads(1)

STEPS, RESUME_AT, FAULT_STEP = 60, 30, 45


def make_data():
    gen = torch.Generator().manual_seed(6)
    centers = torch.randn(5, 12, generator=gen) * 2
    data = []
    for step in range(STEPS):
        y = torch.randint(0, 5, (32,), generator=gen)
        x = centers[y] + torch.randn(32, 12, generator=gen)
        if step == FAULT_STEP:                      # collate pads the batch with a zero row
            x = torch.cat([x[:-1], torch.zeros(1, 12)])
        data.append((x, y))
    return data


class CosineHead(nn.Module):
    def __init__(self, dim, classes, scale=10.0):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(classes, dim) * 0.1)
        self.scale = scale

    def forward(self, e):
        z = e.float()
        z = z / z.norm(dim=-1, keepdim=True)  # <-- L:div
        w = F.normalize(self.weight, dim=-1)
        return self.scale * z @ w.t()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(12, 48, bias=False), nn.ReLU(), nn.Linear(48, 16, bias=False))
        self.head = CosineHead(16, 5)

    def forward(self, x):
        return self.head(self.encoder(x))  # <-- L:head_call


def build():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    return model, opt


def run_steps(model, opt, scaler, data, start, stop, hist):
    for step in range(start, stop):
        x, y = data[step]
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x)
            loss = F.cross_entropy(logits.float(), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # <-- L:backward
        scaler.step(opt)
        scaler.update()  # <-- L:update
        hist.append((step, loss.item(), scaler.get_scale()))


def job(data, ckpt_dir, guard_kwargs=None):
    """Phase 1, checkpoint, phase 2 (resumed). Returns final model, history, guards."""
    hist, guards = [], []
    ctx = (lambda: amp_runtime.guard(**guard_kwargs)) if guard_kwargs else None
    # ---- phase 1: the original job
    model, opt = build()
    scaler = torch.amp.GradScaler("cpu", init_scale=4096.0)
    if ctx:
        with ctx() as g1:
            run_steps(model, opt, scaler, data, 0, RESUME_AT, hist)
        guards.append(g1)
    else:
        run_steps(model, opt, scaler, data, 0, RESUME_AT, hist)
    path = os.path.join(ckpt_dir, "ckpt.pt")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict(),
                "step": RESUME_AT}, path)
    del model, opt, scaler
    # ---- phase 2: the resumed job (fresh objects, as after a restart)
    model, opt = build()
    scaler = torch.amp.GradScaler("cpu")
    ckpt = torch.load(path, weights_only=True)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    scaler.load_state_dict(ckpt["scaler"])
    start = ckpt["step"]
    if ctx:
        with ctx() as g2:
            run_steps(model, opt, scaler, data, start, STEPS, hist)
        guards.append(g2)
    else:
        run_steps(model, opt, scaler, data, start, STEPS, hist)
    return model, hist, guards


# ---------------------------------------------------------------- harness
def same(a, b):
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def same_list(a, b):
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


def marker_lines():
    out = {}
    with open(__file__) as f:
        for i, line in enumerate(f, 1):
            if "# <-- L:" in line and "out[" not in line:
                out[line.split("# <-- L:")[1].strip()] = i
    return out


def main():
    data = make_data()
    with tempfile.TemporaryDirectory() as tmp:
        ref_model, ref_hist, _ = job(data, tmp)
        for step, loss, scale in ref_hist:
            if step % 5 == 0 or 43 <= step <= 47:
                print(f"plain global step {step:2d}: loss={loss:.4g} scale={scale:g}")
        if "--plain" in sys.argv:
            return
    with tempfile.TemporaryDirectory() as tmp:
        model, hist, (g1, g2) = job(data, tmp, {"policy": "record"})
    flat = lambda h: [v for row in h for v in row]
    print("LOSSES_MATCH", same_list(flat(ref_hist), flat(hist)))
    ref_sd, sd = ref_model.state_dict(), model.state_dict()
    print("WEIGHTS_MATCH", all(same(ref_sd[k], sd[k]) for k in ref_sd))
    print("LINES", marker_lines())
    print("PHASE1_EVENTS", json.dumps(sorted({e.code for e in g1.report.events})))
    for e in g1.report.events:
        print(f"PHASE1 EVENT {e.code} step={e.step} module={e.module} op={e.op} source={e.source} | {e.message}")
    for e in g2.report.events:
        print(f"EVENT {e.code} step={e.step} (the run's global step: "
              f"{None if e.step is None else e.step + RESUME_AT}) module={e.module} op={e.op} source={e.source} | {e.message}")
    print(g2.report.summary())
    codes = sorted({e.code for e in g1.report.events} | {e.code for e in g2.report.events})
    print("EVENTS " + json.dumps(codes))


if __name__ == "__main__":
    main()
