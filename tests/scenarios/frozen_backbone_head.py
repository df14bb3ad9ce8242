"""EXPECT: none
MAY: none
FAULT: none (healthy but tricky). Linear probing with a small head on a frozen CNN backbone
(Conv-BN-ReLU x2, AdaptiveAvgPool2d, Flatten; BN running statistics "pretrained", then
`requires_grad_(False)` and `.eval()`), the backbone called under `torch.no_grad()` inside the
fp16 autocast region, so the head receives fp16 features without grad; the head (Linear-ReLU-
Dropout-Linear) trains with CE (label smoothing) inside the region, SGD+momentum over the head's
parameters only, GradScaler("cpu") with `scaler.unscale_(optimizer)` then
`clip_grad_norm_(head.parameters(), 0.5)`, `scaler.step`, `scaler.update`, and a StepLR
(step_size 20, gamma 0.5) stepped after each scaler step; 60 steps. Both modules are passed to the
guard as one nn.ModuleDict for names. Measured with `--plain`: no skipped step (scale stays
65536), loss 2.30 -> 1.17, unscaled pre-clip gradient norm 0.15-0.50 with 13 of 60 steps clipped,
lr 0.1 -> 0.05 -> 0.025, features fp16 with max |x| ~1.3. Traps: AMP005 must see the unscale_
before the clip, AMP105 must not count the frozen backbone (no grads at all) as vanishing, AMP010
must see the active scaler, and the frozen fp16 forward under no_grad is not training code.
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
N_CLS, BATCH, HW = 10, 32, 16


def make_backbone():
    """A small CNN standing in for a pretrained feature extractor."""
    torch.manual_seed(42)
    net = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten())
    with torch.no_grad():                                  # "pretrained" running statistics
        net.train()
        for _ in range(5):
            net(torch.randn(64, 3, HW, HW))
    return net


def make_data():
    g = torch.Generator().manual_seed(21)
    templates = 1.5 * torch.randn(N_CLS, 3, 1, 1, generator=g) + torch.randn(N_CLS, 3, HW, HW, generator=g)
    out = []
    for _ in range(STEPS):
        y = torch.randint(0, N_CLS, (BATCH,), generator=g)
        x = templates[y] + 0.7 * torch.randn(BATCH, 3, HW, HW, generator=g)
        out.append((x, y))
    return out


def run(guarded, inspect=None):
    backbone = make_backbone()
    backbone.requires_grad_(False)
    backbone.eval()
    torch.manual_seed(0)
    head = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, N_CLS))
    optimizer = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu")
    data = make_data()
    both = nn.ModuleDict({"backbone": backbone, "head": head})
    losses, scales = [], []
    ctx = amp_runtime.guard(policy="record", model=both) if guarded else nullcontext()
    with ctx as g:
        for step, (x, y) in enumerate(data):
            head.train()
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                with torch.no_grad():
                    feats = backbone(x)                      # frozen, eval mode, fp16 features
                logits = head(feats)
                loss = F.cross_entropy(logits, y, label_smoothing=0.1)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            gnorm = torch.nn.utils.clip_grad_norm_(head.parameters(), max_norm=0.5)
            if inspect is not None:
                inspect(step, head, scaler, loss, feats, gnorm, optimizer)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            losses.append(loss.detach().float().clone())
            scales.append(scaler.get_scale())
    weights = {k: v.detach().clone() for k, v in both.state_dict().items()}
    return {"losses": losses, "scales": scales, "weights": weights, "guard": g}


def plain():
    rows = []

    def inspect(step, head, scaler, loss, feats, gnorm, optimizer):
        rows.append((step, loss.item(), scaler.get_scale(), gnorm.item(), feats.dtype, feats.abs().max().item(),
                     optimizer.param_groups[0]["lr"], min(p.grad.abs().max().item() for p in head.parameters())))

    r = run(guarded=False, inspect=inspect)
    for step, loss, s, gn, dt, fmax, lr, gmin in rows:
        if step % 10 == 0 or step < 3 or not math.isfinite(gn) or step == STEPS - 1:
            print(f"step {step:2d} loss={loss:.4f} scale={s:g} unscaled grad norm (pre-clip)={gn:.4g} lr={lr:g} "
                  f"feats {dt} max={fmax:.3g} smallest per-param max|g|={gmin:.3g}")
    print("skipped steps:", [x[0] for x in rows if not math.isfinite(x[3])], "; final scale", r["scales"][-1])
    print("clipped steps (norm > 0.5):", sum(1 for x in rows if x[3] > 0.5), "of", len(rows))
    print("losses all finite:", all(torch.isfinite(v) for v in r["losses"]))

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
