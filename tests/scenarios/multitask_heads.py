"""EXPECT: none
MAY: none
FAULT: none (healthy but tricky). A shared trunk (Linear-GELU-LayerNorm-Linear-GELU) with one
head per task (5-way classification, scalar regression, 8-label tagging) in an nn.ModuleDict.
Batches alternate between the tasks (step t trains task t % 3), so each step's backward reaches
the trunk and exactly one head. `optimizer.zero_grad(set_to_none=False)` keeps the two other
heads' .grad as tensors of exact zeros, which AdamW (with weight decay) still steps on. fp16
autocast on the CPU with torch.amp.GradScaler("cpu"), losses computed inside the region with
fp32-autocast losses (cross_entropy, mse_loss on an upcast output, BCE-with-logits), 60 steps.
Traps for the guard: AMP105 must not take the untouched heads' exact-zero gradients for
vanishing gradients (AMP105.md says layers the backward did not reach are told apart), AMP106
must not count exact zeros, and the LayerNorm runs in fp16 on the CPU (not a listed reduction,
so no AMP004). Measured with `--plain`: losses finite and falling for all three tasks; the idle
heads' grads are exactly 0 at every step (None before a head's first batch); the regression
head's scaled grads reach 3e4-5.6e4 at scale 65536 and at step 34 one of them overflows: the
scaler skips that single step and halves the scale to 32768 (ordinary GradScaler settling in the
middle of a run, one skip in 60 steps: not AMP107/108/109 per their pages), so the replay of that
skip must find nothing and report nothing.
"""
import argparse
import json
import linecache
import math
import struct
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.set_num_threads(1)

STEPS = 60
TASKS = ("cls", "reg", "tag")
D_IN, D_H, BATCH = 32, 64, 32


class MultiTaskNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(
            nn.Linear(D_IN, D_H), nn.GELU(), nn.LayerNorm(D_H), nn.Linear(D_H, D_H), nn.GELU())
        self.heads = nn.ModuleDict({
            "cls": nn.Linear(D_H, 5),
            "reg": nn.Linear(D_H, 1),
            "tag": nn.Linear(D_H, 8),
        })

    def forward(self, x, task):
        return self.heads[task](self.trunk(x))


def make_batches():
    g = torch.Generator().manual_seed(1234)
    teach = {t: torch.randn(D_IN, k, generator=g) / math.sqrt(D_IN) for t, k in (("cls", 5), ("reg", 1), ("tag", 8))}
    batches = []
    for step in range(STEPS):
        task = TASKS[step % 3]
        x = torch.randn(BATCH, D_IN, generator=g)
        z = x @ teach[task]
        if task == "cls":
            y = z.argmax(dim=1)
        elif task == "reg":
            y = z[:, 0] * 2.0 + 0.1 * torch.randn(BATCH, generator=g)
        else:
            y = (z > 0.2).float()
        batches.append((task, x, y))
    return batches


def task_loss(task, out, y):
    if task == "cls":
        return F.cross_entropy(out, y)
    if task == "reg":
        return F.mse_loss(out.squeeze(-1).float(), y)
    return F.binary_cross_entropy_with_logits(out, y)


def run(guarded, inspect=None):
    torch.manual_seed(0)
    model = MultiTaskNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cpu")
    batches = make_batches()
    losses, scales = [], []
    ctx = amp_runtime.guard(policy="record", model=model) if guarded else nullcontext()
    with ctx as g:
        for step, (task, x, y) in enumerate(batches):
            optimizer.zero_grad(set_to_none=False)
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x, task)
                loss = task_loss(task, out, y)
            scaler.scale(loss).backward()
            if inspect is not None:
                inspect(step, task, model, scaler, loss)
            scaler.step(optimizer)
            scaler.update()
            losses.append(loss.detach().float().clone())
            scales.append(scaler.get_scale())
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "scales": scales, "weights": weights, "guard": g}


def plain():
    stats = []

    def inspect(step, task, model, scaler, loss):
        heads = {t: max((p.grad.abs().max().item() if p.grad is not None else float('nan'))
                        for p in model.heads[t].parameters()) for t in TASKS}
        found_inf = not all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        stats.append((step, task, loss.item(), scaler.get_scale(), found_inf, heads))

    r = run(guarded=False, inspect=inspect)
    for step, task, loss, scale, inf, heads in stats:
        if step < 6 or step % 10 == 0 or inf:
            hs = " ".join(f"{t}={v:.3g}" for t, v in heads.items())
            print(f"step {step:2d} task={task} loss={loss:.4f} scale={scale:g} inf_grad={inf} head grad max: {hs}")
    idle_zero = all(heads[t] == 0.0 for step, task, _, _, _, heads in stats for t in TASKS if t != task and step >= 2)
    print("skipped steps (scale changes):", sum(1 for a, b in zip(r["scales"], r["scales"][1:]) if b < a))
    print("idle heads' grads exactly zero at every step from step 2 (None before their first batch):", idle_zero)
    print("all losses finite:", all(torch.isfinite(v) for v in r["losses"]))
    per_task = {t: [s[2] for s in stats if s[1] == t] for t in TASKS}
    print("first/last loss per task:", {t: (round(v[0], 4), round(v[-1], 4)) for t, v in per_task.items()})

# ----------------------------------------------------------------------------- harness
# (identical in every script of this batch: reference run, guarded run, bitwise comparison, events)
def _bits(t):
    t = t.detach().cpu().contiguous()
    if t.is_floating_point():
        t = torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)  # NaN == NaN
        return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def _same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _same_float(a, b):
    if a is None or b is None:
        return a is b
    return (math.isnan(a) and math.isnan(b)) or struct.pack("<d", a) == struct.pack("<d", b)


def _print_events(g):
    rep = g.report
    counts = rep.to_json().get("counts", {})
    codes = set(counts) | {e.code for e in rep.events}
    print(f"--- {len(rep.events)} events kept, {len(rep)} occurrences; counts {json.dumps(counts, sort_keys=True)}")
    for e in rep.events:
        src = e.source or ""
        text = ""
        f, _, ln = src.rpartition(":")
        if ln.isdigit():
            text = linecache.getline(f, int(ln)).strip()
        print(f"EVENT {e.code} [{e.severity}] step={e.step} module={e.module} op={e.op} line={src}")
        if text:
            print(f"    src: {text}")
        print(f"    msg: {e.message}")
        d = {k: e.details[k] for k in ("call", "calls", "replayed", "origin", "replay") if e.details and k in e.details}
        if d:
            print("    details: " + json.dumps(d, default=str)[:900])
    print(rep.summary())
    print("EVENTS " + json.dumps(sorted(codes)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plain", action="store_true", help="check the fault with plain torch only")
    args = ap.parse_args()
    if args.plain:
        plain()
        return
    t0 = time.time()
    ref = run(guarded=False)
    t1 = time.time()
    got = run(guarded=True)
    t2 = time.time()
    losses_ok = len(ref["losses"]) == len(got["losses"]) and all(
        _same(a, b) for a, b in zip(ref["losses"], got["losses"]))
    scales_ok = len(ref["scales"]) == len(got["scales"]) and all(
        _same_float(a, b) for a, b in zip(ref["scales"], got["scales"]))
    weights_ok = ref["weights"].keys() == got["weights"].keys() and all(
        _same(ref["weights"][k], got["weights"][k]) for k in ref["weights"])
    print(f"reference run {t1 - t0:.2f}s, guarded run {t2 - t1:.2f}s")
    print(f"final loss ref={ref['losses'][-1].item():.6g} guarded={got['losses'][-1].item():.6g}; "
          f"final scale ref={ref['scales'][-1]} guarded={got['scales'][-1]}")
    print("LOSSES_MATCH", losses_ok and scales_ok, f"(losses {losses_ok}, loss scales {scales_ok})")
    print("WEIGHTS_MATCH", weights_ok)
    _print_events(got["guard"])


if __name__ == "__main__":
    main()
