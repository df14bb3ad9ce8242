"""EXPECT: AMP004, AMP101, AMP108, AMP107, AMP112
MAY: AMP102, AMP111
FAULT: ManualCausalAttention.forward (modules blocks.0.attn / blocks.1.attn) computes its
softmax by hand, `weights = torch.exp(scores)` then `weights / weights.sum(-1)`, with no max
subtracted, inside fp16 CPU autocast (scores come from an fp16 matmul; exp stays fp16 on CPU).
The copy task sharpens attention, so the largest score grows: measured in --plain 1.2 at step 0,
10.3 at step 12, 11.88 at step 15, where exp(11.88) > 65504 = inf in blocks.0.attn, inf/inf =
NaN and the loss is NaN (first NaN loss: step 15). Steps 16-20 are finite again (max exp 36k-64k,
blocks.1 60350 at step 19, blocks.0 63740 at step 20), then step 21-29 all overflow (9
consecutive skips: scale 32768 -> 64), 30-31 pass, 32 onward every step overflows and the scale
reaches 1 at step 37 and keeps halving. At step 25 the first inf is in blocks.1.attn's exp
(blocks.0 finite).
Codes, per the pages:
  AMP004 - `weights.sum(dim=-1, keepdim=True)`: a reduction whose input and output are both fp16
           (CPU autocast keeps sum in fp16), in blocks.*.attn, on the watched steps from step 0,
           op sum, line 59 `attn = weights / weights.sum(...)`.
  AMP112 - NaN loss at backward, step 15 (line 137 `scaler.scale(loss).backward()`), and again
           on each later NaN step; message should name the replay's first non-finite op.
  AMP101 - replay of step 15: op exp (torch.exp), module blocks.0.attn, line
           line 58 `weights = torch.exp(scores)`, step 15; later live (per-op tracing on after the
           anomaly) possibly blocks.1.attn at step 25.
  AMP108 - 5 consecutive scale decreases after steps went through (steps 21-25), and scale
           < 128 falling (step 29) / < init/100 (step 27); line 141 scaler.update().
  AMP107 - scale reaches 1.0 at step 37 and keeps falling (steps 32-59 all skipped).
  MAY AMP102 - after the anomaly per-op checks may see exp/sum outputs of 60350-63740 at
           steps 19-20 (> 60000) before they overflow.
  MAY AMP111 - exp(scores) values spread over more than 1e4 once scores span > 9.2.
  Not AMP103 (GradScaler skips those steps), not AMP109 (100-step window never fills in 60).
"""
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

# -- the shared driver of this batch's scenarios, inlined --------------------------------
import json
import math
import struct
import sys

import torch

torch.set_num_threads(1)


def bits_equal(a, b):
    """Bit-for-bit equality of two tensors; NaN equals NaN (any payload)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    an, bn = torch.isnan(a), torch.isnan(b)
    if not torch.equal(an, bn):
        return False
    a2, b2 = a[~an], b[~bn]
    itype = {torch.float32: torch.int32, torch.float64: torch.int64,
             torch.float16: torch.int16, torch.bfloat16: torch.int16}[a.dtype]
    return torch.equal(a2.contiguous().view(itype), b2.contiguous().view(itype))


def float_bits_equal(x, y):
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    return struct.pack("<d", float(x)) == struct.pack("<d", float(y))


def compare(ref, got):
    lm = len(ref["losses"]) == len(got["losses"]) and all(
        bits_equal(a, b) for a, b in zip(ref["losses"], got["losses"]))
    sm = len(ref["scales"]) == len(got["scales"]) and all(
        float_bits_equal(a, b) for a, b in zip(ref["scales"], got["scales"]))
    wm = ref["weights"].keys() == got["weights"].keys() and all(
        bits_equal(ref["weights"][k], got["weights"][k]) for k in ref["weights"])
    first_diff = None
    for i, (a, b) in enumerate(zip(ref["losses"], got["losses"])):
        if not bits_equal(a, b):
            first_diff = (i, a.item(), b.item())
            break
    return lm, sm, wm, first_diff


def fmt_event(e):
    return (f"  {e.code} [{e.severity}] step={e.step} module={e.module!r} op={e.op!r} "
            f"line={e.source}\n      message: {e.message}")


def main(mod):
    torch.set_num_threads(1)
    if "--plain" in sys.argv:
        print("== PLAIN (torch only, diagnostics) ==")
        ctx = mod.setup()
        res = mod.loop(ctx, diag=True)
        print("losses:", [round(l.item(), 4) for l in res["losses"]])
        if res["scales"]:
            print("scales:", res["scales"])
        return

    import amp_runtime

    ctx = mod.setup()
    ref = mod.loop(ctx, diag=False)
    print("== REFERENCE (unguarded) ==")
    print("losses:", [round(l.item(), 4) for l in ref["losses"]])
    if ref["scales"]:
        print("scales:", ref["scales"])

    all_codes = set()
    all_lm = all_sm = all_wm = True
    for label, kwargs in mod.GUARD_RUNS:
        ctx = mod.setup()
        kw = dict(kwargs)
        if kw.pop("pass_model", True) and ctx.get("model") is not None:
            kw["model"] = ctx["model"]
        kw["policy"] = "record"
        shown = {k: (type(v).__name__ if k == "model" else v) for k, v in kw.items()}
        print(f"\n== GUARDED run '{label}': guard({shown}) ==")
        with amp_runtime.guard(**kw) as g:
            got = mod.loop(ctx, diag=False)
        lm, sm, wm, diff = compare(ref, got)
        all_lm &= lm
        all_sm &= sm
        all_wm &= wm
        print(f"  [{label}] losses bit-identical: {lm}; scales: {sm}; weights: {wm}"
              + (f"; first loss diff at step {diff}" if diff else ""))
        events = list(g.report.events)
        print(f"  [{label}] {len(events)} events kept, len(report)={len(g.report)}")
        for e in events:
            print(fmt_event(e))
        try:
            js = g.report.to_json()
            counts = js.get("counts", {})
            print(f"  [{label}] counts: {json.dumps(counts, sort_keys=True)}")
            all_codes |= set(counts)
        except Exception as exc:  # pragma: no cover - report only
            print("  to_json failed:", repr(exc))
        try:
            print(g.report.summary())
        except Exception as exc:  # pragma: no cover
            print("  summary failed:", repr(exc))
        all_codes |= {e.code for e in events}
    print()
    print(f"LOSSES_MATCH {all_lm}")
    print(f"SCALES_MATCH {all_sm}")
    print(f"WEIGHTS_MATCH {all_wm}")
    print("EVENTS " + json.dumps(sorted(all_codes)))

# -- the scenario ---------------------------------------------------------------------

VOCAB, T, D, HEADS, LAYERS = 16, 16, 48, 2, 2
STEPS, BATCH, LAG = 60, 16, 3


class ManualCausalAttention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.scale = 1.0 / math.sqrt(d // heads)
        self.register_buffer("causal", torch.tril(torch.ones(T, T, dtype=torch.bool)))

    def forward(self, x):
        B, L, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)
        q, k, v = (t.view(B, L, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * self.scale
        scores = scores.masked_fill(~self.causal[:L, :L], torch.finfo(scores.dtype).min)
        weights = torch.exp(scores)                                   # FAULT: no max subtracted, fp16
        attn = weights / weights.sum(dim=-1, keepdim=True)            # hand-written softmax
        y = (attn @ v).transpose(1, 2).reshape(B, L, C)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = ManualCausalAttention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.pos = nn.Embedding(T, D)
        self.blocks = nn.ModuleList(Block(D, HEADS) for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def make_batch(gen):
    # copy task: the target at position t is the token LAG positions back (t >= LAG)
    x = torch.randint(0, VOCAB, (BATCH, T), generator=gen)
    y = torch.full_like(x, -100)
    y[:, LAG:] = x[:, :-LAG]
    return x, y


def setup():
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    scaler = torch.amp.GradScaler("cpu")
    gen = torch.Generator().manual_seed(1234)
    return {"model": model, "opt": opt, "scaler": scaler, "gen": gen}


def loop(ctx, diag=False):
    model, opt, scaler, gen = ctx["model"], ctx["opt"], ctx["scaler"], ctx["gen"]
    losses, scales = [], []
    stats = {}
    if diag:
        def hook(name):
            def fn(mod, inp, out):
                x = inp[0]
                with torch.no_grad():
                    C = x.shape[-1]
                    qkv = mod.qkv(x)
                    q, k, v = qkv.split(C, dim=-1)
                    B, L, _ = x.shape
                    q, k = (t.view(B, L, mod.heads, -1).transpose(1, 2) for t in (q, k))
                    s = ((q @ k.transpose(-2, -1)) * mod.scale).masked_fill(~mod.causal[:L, :L], -1e4)
                    e = torch.exp(s)
                    stats[name] = (s.float().max().item(), e.float().max().item(),
                                   bool(torch.isinf(e).any()), bool(torch.isinf(e.sum(-1)).any()))
            return fn
        for i, blk in enumerate(model.blocks):
            blk.attn.register_forward_hook(hook(f"blocks.{i}.attn"))
    for step in range(STEPS):
        x, y = make_batch(gen)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x)
            loss = F.cross_entropy(logits.float().view(-1, VOCAB), y.view(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        losses.append(loss.detach().clone())
        scales.append(scaler.get_scale())
        if diag:
            print(f"step {step:2d} loss {loss.item():.4f} scale {scales[-1]:.0f} gradnorm {gn.item():.3g} "
                  + " ".join(f"{n}: maxscore={v[0]:.2f} maxexp={v[1]:.4g} exp_inf={v[2]} sum_inf={v[3]}"
                             for n, v in stats.items()))
    return {"losses": losses, "scales": scales,
            "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


GUARD_RUNS = [("auto", {})]

if __name__ == "__main__":
    main(sys.modules[__name__])
