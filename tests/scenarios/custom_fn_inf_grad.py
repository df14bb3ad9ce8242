"""EXPECT: AMP103, AMP112
MAY: AMP104
FAULT: backward-only inf in one parameter. At step 23 clip 5 of the batch ends in a zero frame;
the forward stays finite ((0 + delta)^r - delta^r = 0), but RootCompression.backward computes
delta^r * log(0) = -inf there, so frontend.r's gradient is +-inf in all 40 channels while
every other gradient is finite (measured with --plain; detect_anomaly(check_nan=True) does
not catch it, inf is not NaN). No scaler (bf16): AdamW applies it, frontend.r becomes NaN,
and from step 24 on the loss is NaN and every gradient NaN. Expected: AMP103 at step 23
naming frontend.r, with the origin found by the replayed backward: the backward of the
custom Function RootCompression (node RootCompressionBackward), module frontend, the line
`return RootCompression.apply(spec, self.r)` (or the `d_r = ... torch.log(x)` line);
AMP112 from step 24 on (loss NaN, the forward started from the parameter frontend.r, NaN
before the forward), repeating; AMP103 again at step 24 when every layer's gradients turn
NaN. No AMP101: the forward never turns finite inputs non-finite. AMP104 may show at step 23
if an infinite total norm counts as an explosion.

A keyword-spotting CNN on power spectrograms with a learnable root-compression frontend
(PCEN-style: y = (x + delta)^r - delta^r, one exponent r per mel channel). The frontend is a
custom torch.autograd.Function with a hand-written backward (written "to save memory"),
run in fp32 inside bf16 autocast through torch.amp.custom_fwd(cast_inputs=torch.float32),
the documented AMP idiom for custom functions. bf16 autocast, no GradScaler (correct for
bf16), AdamW. The hand-written gradient for r uses log(x) where the derivative needs
log(x + delta): finite for every x > 0, -inf for x == 0. The forward is finite everywhere.
Batches are zero-padded to the longest clip; one clip in one batch is a frame short.
"""
import argparse
import json
import math
import os
import struct
import sys
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

torch.set_num_threads(1)   # small scenario; deterministic and stable timings on a shared 2-core machine

SEED, STEPS, MELS, FRAMES, B, CLASSES = 0, 50, 40, 48, 16, 6
SHORT_CLIP_STEP = 23       # the batch holding a clip one frame shorter than the rest
DELTA = 0.01


class RootCompression(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x, r):
        r_ = r.view(1, 1, -1, 1)
        y_plus = (x + DELTA).pow(r_)
        ctx.save_for_backward(x, r_, y_plus)
        return y_plus - DELTA ** r_

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        x, r_, y_plus = ctx.saved_tensors
        grad_x = grad * r_ * y_plus / (x + DELTA)
        d_r = y_plus * torch.log(x) - DELTA ** r_ * math.log(DELTA)   # BUG: log(x), not log(x + DELTA)
        grad_r = (grad * d_r).sum(dim=(0, 1, 3))
        return grad_x, grad_r


class Frontend(nn.Module):
    def __init__(self):
        super().__init__()
        self.r = nn.Parameter(torch.full((MELS,), 0.5))

    def forward(self, spec):
        return RootCompression.apply(spec, self.r)


class KWSNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.frontend = Frontend()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16, CLASSES)

    def forward(self, spec):
        h = self.frontend(spec)
        h = F.max_pool2d(F.relu(self.conv1(h)), 2)
        h = F.relu(self.conv2(h))
        return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))


def make_batches():
    g = torch.Generator().manual_seed(1)
    band = torch.randn(CLASSES, MELS, 1, generator=g).exp()
    out = []
    for step in range(STEPS):
        y = torch.randint(0, CLASSES, (B,), generator=g)
        spec = band[y] * torch.rand(B, MELS, FRAMES, generator=g) * 4.0 + 0.05 * torch.rand(B, MELS, FRAMES, generator=g)
        if step == SHORT_CLIP_STEP:
            spec[5, :, -1] = 0.0           # clip 5 is one frame short: padded with a zero frame
        out.append((spec.unsqueeze(1), y))
    return out


def train(guarded, probe=None):
    torch.manual_seed(SEED)
    model = KWSNet()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = make_batches()
    losses = []
    if guarded:
        import amp_runtime
        ctx = amp_runtime.guard(policy="record", model=model)
    else:
        ctx = nullcontext()
    t0 = time.time()
    with ctx as g:
        for step, (spec, y) in enumerate(batches):
            with (probe.trace(step, model) if probe else nullcontext()):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = model(spec)
                    loss = F.cross_entropy(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if probe:
                probe.after_backward(step, model, loss)
            opt.step()
            losses.append(loss.item())
    return {"losses": losses, "scales": [], "weights": snapshot(model), "guard": g, "time": time.time() - t0}


class Probe:
    def __init__(self):
        self.tracer = None

    def trace(self, step, model):
        self.tracer = OpTracer(model)
        return self.tracer

    def after_backward(self, step, model, loss):
        self.tracer.remove()
        bad = {n: int((~torch.isfinite(p.grad)).sum()) for n, p in model.named_parameters()
               if p.grad is not None and not bool(torch.isfinite(p.grad).all())}
        nonfinite_params = [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
        gn = float(torch.stack([p.grad.float().norm() for p in model.parameters()]).norm())
        print(f"step {step:2d} loss {loss.item():8.4g} grad norm {gn:9.4g} non-finite grads {bad} "
              f"non-finite params (before the step) {nonfinite_params}")
        if self.tracer.first:
            print(f"        first non-finite op in the forward: {self.tracer.first}")


def plain():
    res = train(guarded=False, probe=Probe())
    bad = [i for i, v in enumerate(res["losses"]) if not math.isfinite(v)]
    print("non-finite losses at steps", bad)
    # where the backward first turns non-finite: anomaly mode on the faulty step
    torch.manual_seed(SEED)
    model = KWSNet()
    spec, y = make_batches()[SHORT_CLIP_STEP]
    with torch.autograd.detect_anomaly(check_nan=True):
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(spec), y)
            loss.backward()
            print("anomaly mode: backward finished; grad r finite:", bool(torch.isfinite(model.frontend.r.grad).all()),
                  "values at non-finite channels:", model.frontend.r.grad[~torch.isfinite(model.frontend.r.grad)].tolist())
        except RuntimeError as e:
            print("anomaly mode:", str(e).splitlines()[0])


# ---------------------------------------------------------------- harness (same in every s13 script)
HERE = os.path.abspath(__file__)


class OpTracer(TorchFunctionMode):
    """Plain-torch diagnostic for --plain: the first op whose output holds NaN/Inf while its
    floating inputs were finite, and fp16 outputs above 60000 (module path + line of this file)."""

    def __init__(self, model, near=60000.0):
        super().__init__()
        self.stack, self.first, self.near, self.limit = [], None, [], near
        self.handles = []
        for name, mod in model.named_modules():
            name = name or "<root>"
            self.handles.append(mod.register_forward_pre_hook(lambda m, i, n=name: self.stack.append(n)))
            self.handles.append(mod.register_forward_hook(lambda m, i, o: self._pop()))

    def _pop(self):
        self.stack.pop()  # returns None: a forward hook's return value would replace the output

    def remove(self):
        for h in self.handles:
            h.remove()

    def _where(self):
        f = sys._getframe(3)
        while f is not None and os.path.abspath(f.f_code.co_filename) != HERE:
            f = f.f_back
        return f"{os.path.basename(HERE)}:{f.f_lineno}" if f else "?"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        with torch.no_grad():
            self._check(func, args, kwargs, out)
        return out

    def _check(self, func, args, kwargs, out):
        fl = lambda xs: [t for t in tree_leaves(xs) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
        outs = fl(out)
        if outs:
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))
            mod = self.stack[-1] if self.stack else "-"
            if self.first is None and not all(bool(torch.isfinite(t).all()) for t in outs):
                if all(bool(torch.isfinite(t).all()) for t in fl((args, kwargs))):
                    self.first = (name, mod, self._where(), [str(t.dtype) for t in outs])
            for t in outs:
                if t.dtype == torch.float16:
                    peak = float(torch.nan_to_num(t.abs(), nan=0.0, posinf=0.0).max())
                    if peak > self.limit:
                        self.near.append((name, mod, self._where(), peak))


def _fkey(x):
    return "nan" if x is None or math.isnan(x) else struct.pack("<d", float(x))


def same_floats(a, b):
    return len(a) == len(b) and all(_fkey(x) == _fkey(y) for x, y in zip(a, b))


def same_tensor(a, b):
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    na, nb = torch.isnan(a), torch.isnan(b)
    if not torch.equal(na, nb):
        return False
    ints = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
    return torch.equal(a[~na].contiguous().view(ints[a.dtype]), b[~nb].contiguous().view(ints[b.dtype]))


def snapshot(*modules):
    return {f"{i}.{k}": v.detach().clone() for i, m in enumerate(modules) for k, v in m.state_dict().items()}


def compare_and_report(ref, got, g):
    lm, sm = same_floats(ref["losses"], got["losses"]), same_floats(ref["scales"], got["scales"])
    wm = ref["weights"].keys() == got["weights"].keys() and all(
        same_tensor(ref["weights"][k], got["weights"][k]) for k in ref["weights"])
    print(f"LOSSES_MATCH {lm and sm} (losses {lm}, loss scales {sm}; {len(ref['losses'])} loss values)")
    print(f"WEIGHTS_MATCH {wm}")
    print(f"time: unguarded {ref['time']:.2f}s, guarded {got['time']:.2f}s")
    for e in g.report.events:
        print(f"EVENT {e.code} {e.severity} step={e.step} module={e.module} op={e.op} line={e.source}")
        print(f"    message: {e.message}")
        d = e.details or {}
        keep = {k: d[k] for k in ("replayed", "call", "calls", "origin", "replay", "max", "scale", "fraction") if k in d}
        if keep:
            print("    details:", json.dumps(keep, default=str)[:700])
    counts = g.report.to_json().get("counts", {})
    print("COUNTS", json.dumps(counts, sort_keys=True))
    print("EVENTS", json.dumps(sorted({e.code for e in g.report.events})))


def main(train, plain):
    ap = argparse.ArgumentParser()
    ap.add_argument("--plain", action="store_true", help="check the fault with plain torch only")
    a = ap.parse_args()
    if a.plain:
        plain()
        return
    ref = train(guarded=False)
    got = train(guarded=True)
    compare_and_report(ref, got, got["guard"])


if __name__ == "__main__":
    main(train, plain)
