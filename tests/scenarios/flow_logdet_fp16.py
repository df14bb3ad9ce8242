"""EXPECT: AMP004, AMP101, AMP112
MAY: AMP110, AMP111
FAULT: fp16 log-determinant. On the 4096-sample batches the batch log-det is 37,000-47,000
(it grows as training goes on; measured with --plain), close to fp16's 65504; on the two
8192-sample batches, steps 17 and 41, it is ~75,000: `torch.sum(log_s)` of the first two
couplings is ~18,900 each per 4096 samples, and the accumulation
`log_s_total = log_s_total + torch.sum(log_s)` (line 73, in the root module WaveFlow's
forward) turns inf (op: Tensor add; its inputs are finite). The loss is then -inf, but the
gradients are finite (d loss / d log_s_total is a constant), so the GradScaler does NOT skip:
the optimizer applies both steps and the scale stays 65536. Expected: AMP004 on a watched
step (the fp16 `sum` at line 73: fp16 in, fp16 out); AMP101 at steps 17 and 41, op add,
module WaveFlow/root, line 73 (replay of the AMP112 step); AMP112 at steps 17 and 41 (loss
-inf at the backward line). No AMP103 (gradients finite) and no loss-scale codes (no skip).
AMP110 may show: the last two couplings' log-dets (near 0) are wholly absorbed when added
to the ~37,000 fp16 total; AMP111 may show for the same sums over log_s values near 0.

A WaveGlow-style normalizing flow for audio (waveform squeezed into 8 channels, 4 affine
coupling layers with a softplus scale, channel flips between them) trained in fp16 autocast
with a GradScaler. Clips are bucketed by length: most batches hold 4096-sample clips, the
longest bucket (8192 samples) comes around twice. As in WaveGlow, the log-determinant is
accumulated over the whole batch, `log_s_total = log_s_total + torch.sum(log_s)`, starting
from the Python number 0, so under CPU autocast it is an fp16 tensor: `log_s` is fp16 (conv
output -> softplus -> log) and `sum` stays fp16 on the CPU.
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

SEED, STEPS, GROUP, HIDDEN, FLOWS, B = 0, 48, 8, 32, 4, 4
LONG_STEPS = (17, 41)           # the long bucket's batches
SIGMA = 1.0


class AffineCoupling(nn.Module):
    def __init__(self):
        super().__init__()
        self.start = nn.Conv1d(GROUP // 2, HIDDEN, 3, padding=1)
        self.end = nn.Conv1d(HIDDEN, GROUP, 3, padding=1)
        nn.init.normal_(self.end.weight, std=0.05)   # near-identity start
        nn.init.zeros_(self.end.bias)

    def forward(self, audio):
        a, b = audio.chunk(2, 1)
        raw, t = self.end(torch.tanh(self.start(a))).chunk(2, 1)
        s = F.softplus(raw)                     # positive scale
        log_s = torch.log(s)
        return torch.cat([a, b * s + t], 1), log_s


class WaveFlow(nn.Module):
    def __init__(self):
        super().__init__()
        self.couplings = nn.ModuleList([AffineCoupling() for _ in range(FLOWS)])

    def forward(self, wav):
        audio = wav.unfold(1, GROUP, GROUP).permute(0, 2, 1)      # (B, 8, L/8)
        log_s_total = 0
        for c in self.couplings:
            audio, log_s = c(audio)
            log_s_total = log_s_total + torch.sum(log_s)           # fp16 accumulation
            audio = audio.flip(1)
        return audio, log_s_total

    @torch.no_grad()
    def data_init(self, wav):
        """ActNorm-style data-dependent init: each coupling's scale starts at 1/std of its input half."""
        audio = wav.unfold(1, GROUP, GROUP).permute(0, 2, 1)
        for c in self.couplings:
            b = audio.chunk(2, 1)[1]
            target = (1.0 / b.std()).clamp(max=20.0)
            c.end.bias[: GROUP // 2] = torch.log(torch.expm1(target))   # softplus^-1
            audio = c(audio)[0].flip(1)


def wave_loss(z, log_s_total):
    loss = torch.sum(z.float() * z.float()) / (2 * SIGMA * SIGMA) - log_s_total
    return loss / (z.size(0) * z.size(1) * z.size(2))


def make_batches():
    g = torch.Generator().manual_seed(1)
    out = []
    for step in range(STEPS):
        n = 8192 if step in LONG_STEPS else 4096
        t = torch.arange(n) / 16000.0
        f = 80 + 600 * torch.rand(B, 3, 1, generator=g)
        ph = 6.28 * torch.rand(B, 3, 1, generator=g)
        wav = (torch.sin(6.283 * f * t + ph) * torch.rand(B, 3, 1, generator=g)).sum(1)
        wav = wav + 0.05 * torch.randn(B, n, generator=g)
        out.append(0.1 * wav / wav.std(dim=1, keepdim=True))    # normalised clips, std 0.1
    return out


def train(guarded, probe=None):
    torch.manual_seed(SEED)
    model = WaveFlow()
    batches = make_batches()
    model.data_init(batches[0])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    losses, scales = [], []
    if guarded:
        import amp_runtime
        ctx = amp_runtime.guard(policy="record")
    else:
        ctx = nullcontext()
    t0 = time.time()
    with ctx as g:
        for step, wav in enumerate(batches):
            with (probe.trace(step, model) if probe else nullcontext()):
                with torch.autocast("cpu", dtype=torch.float16):
                    z, log_s_total = model(wav)
                    loss = wave_loss(z, log_s_total)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if probe:
                probe.after_backward(step, model, loss, scaler, log_s_total)
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
            scales.append(scaler.get_scale())
    return {"losses": losses, "scales": scales, "weights": snapshot(model), "guard": g, "time": time.time() - t0}


class Probe:
    def __init__(self):
        self.tracer = None

    def trace(self, step, model):
        self.tracer = OpTracer(model)
        return self.tracer

    def after_backward(self, step, model, loss, scaler, log_s_total):
        self.tracer.remove()
        s = scaler.get_scale()
        grads = [p.grad.float() for p in model.parameters() if p.grad is not None]
        gn = float(torch.stack([x.norm() for x in grads]).norm()) / s
        print(f"step {step:2d} loss {loss.item():9.4g} log_s_total {float(log_s_total):9.6g} ({log_s_total.dtype}) "
              f"scale {s:8.4g} unscaled grad norm {gn:9.4g} grads finite {all(bool(torch.isfinite(x).all()) for x in grads)}")
        if self.tracer.first:
            print(f"        first non-finite op: {self.tracer.first}")
        if self.tracer.near:
            print(f"        fp16 outputs > 60000: {self.tracer.near[:4]}")


def plain():
    res = train(guarded=False, probe=Probe())
    bad = [i for i, v in enumerate(res["losses"]) if not math.isfinite(v)]
    fell = [i for i in range(len(res["scales"])) if res["scales"][i] < (res["scales"][i - 1] if i else 65536.0)]
    print("non-finite losses at steps", bad)
    print("steps the scaler skipped (scale fell):", fell)
    print("final scale", res["scales"][-1])


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
