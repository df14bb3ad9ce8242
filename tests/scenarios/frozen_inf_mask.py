"""EXPECT: none
MAY: none
FAULT: none (healthy but tricky). Every MaskedSelfAttention (blocks.0.attn, blocks.1.attn) holds
its causal mask as nn.Parameter(torch.full((T, T), -inf).triu(1), requires_grad=False) (line 43):
120 of its 256 entries are -inf, by design. It is sliced and cast to the scores' dtype (fp16) at
every forward and added to fp16 scores (line 52), so the sum holds -inf; the softmax
runs in fp32 and is cast back with .type_as(q) (line 53, the LLaMA idiom). Every row keeps its
diagonal, so no row is all -inf and nothing is NaN. AdamW(model.parameters(), weight_decay=0.1)
holds the frozen -inf parameter too (its grad stays None, AdamW skips it), and clip_grad_norm_
runs after scaler.unscale_. GradScaler(init_scale=2**24) settles down: measured in --plain,
steps 0-4 skip (2^24 -> 2^19) and step 9 skips once more (2^19 -> 2^18), then the scale holds at
262144 through step 49; all losses finite (3.28 -> ~0.95), unscaled grad norms 0.3-1.15.
Two guarded runs: trace="auto" (the skipped steps are replayed, whose parameter pass must not take
the frozen -inf mask for a trained parameter gone non-finite: the pages say frozen parameters are
not looked at) and trace="always" (every op checked live: the -inf comes from a parameter, so no
op turns finite inputs into Inf: no AMP101; -inf is not a finite value near 65504: no AMP102).
Per the pages nothing should be reported: no AMP001 (the cast mask does not require grad; the
.type_as(q) is the upcast-and-back idiom), no AMP007 (no literal fill meets an fp16 tensor),
no AMP108 (the start-up decreases are settling; the scale never goes below 2^16/100), no AMP103.
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

VOCAB, T, D, HEADS, LAYERS = 24, 16, 32, 4, 2
STEPS, BATCH = 50, 16


class MaskedSelfAttention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d, bias=False)
        self.o = nn.Linear(d, d)
        # frozen additive causal mask kept as a parameter (so it is in state_dict and moves with .to())
        self.causal_bias = nn.Parameter(torch.full((T, T), float("-inf")).triu(1), requires_grad=False)

    def forward(self, x):
        B, L, C = x.shape
        hd = C // self.heads
        q = self.q(x).view(B, L, self.heads, hd).transpose(1, 2)
        k = self.k(x).view(B, L, self.heads, hd).transpose(1, 2)
        v = self.v(x).view(B, L, self.heads, hd).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
        scores = scores + self.causal_bias[:L, :L].to(scores.dtype)
        attn = F.softmax(scores.float(), dim=-1).type_as(q)      # softmax in fp32, back to q's dtype
        y = (attn @ v).transpose(1, 2).reshape(B, L, C)
        return self.o(y)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = MaskedSelfAttention(D, HEADS)
        self.ff = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.ff(self.ln2(x))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.pos = nn.Parameter(torch.zeros(1, T, D))
        self.blocks = nn.Sequential(*[Block() for _ in range(LAYERS)])
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx):
        h = self.tok(idx) + self.pos[:, : idx.shape[1]]
        return self.head(self.ln(self.blocks(h)))


def make_batch(gen):
    # sequences that count up modulo VOCAB from a random start, with 10% noise tokens
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=gen)
    seq = (start + torch.arange(T + 1)) % VOCAB
    noise = torch.rand(BATCH, T + 1, generator=gen) < 0.1
    seq = torch.where(noise, torch.randint(0, VOCAB, (BATCH, T + 1), generator=gen), seq)
    return seq[:, :-1], seq[:, 1:]


def setup():
    torch.manual_seed(0)
    model = LM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)   # includes the frozen mask
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)   # large start, Megatron-style; settles down
    gen = torch.Generator().manual_seed(11)
    return {"model": model, "opt": opt, "scaler": scaler, "gen": gen}


def loop(ctx, diag=False):
    model, opt, scaler, gen = ctx["model"], ctx["opt"], ctx["scaler"], ctx["gen"]
    losses, scales = [], []
    for step in range(STEPS):
        x, y = make_batch(gen)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x)
            loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
        scales.append(scaler.get_scale())
        if diag:
            m = model.blocks[0].attn.causal_bias
            print(f"step {step:2d} loss {loss.item():.4f} scale {scales[-1]:.0f} grad norm {gn.item():.3g} "
                  f"mask: requires_grad={m.requires_grad} grad={m.grad} -inf entries={int(torch.isneginf(m).sum())} "
                  f"finite entries={int(torch.isfinite(m).sum())}")
    return {"losses": losses, "scales": scales,
            "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


GUARD_RUNS = [("auto", {}), ("always", {"trace": "always"})]

if __name__ == "__main__":
    main(sys.modules[__name__])
