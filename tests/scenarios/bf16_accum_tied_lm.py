"""EXPECT: none
MAY: none
FAULT: none (healthy but tricky). A nanoGPT-style tiny LM: a 12288 x 64 token embedding
(`sparse=False`) tied to the output head (`head.weight = tok.weight`), 2 pre-LN blocks with SDPA
attention, loss computed inside the model (`logits, loss = model(x, y)`); bf16 autocast on the CPU,
gradient accumulation of 8 micro-batches per optimizer step (loss / 8, the next micro-batch fetched
between forward and backward), `GradScaler("cpu", enabled=(dtype == torch.float16))` (disabled in
bf16) called unconditionally (`scale`, `unscale_`, `step`, `update`), clip_grad_norm_(1.0), AdamW,
40 optimizer steps (320 forward/backward), and `estimate_loss()` under `@torch.no_grad()` with
`model.eval()`/`model.train()` every 10 steps and at the end (its losses are compared too).
Measured with `--plain`: loss 9.44 -> 6.68, val 9.42 -> 6.87, pre-clip norm 0.42-0.95, scale
stays 1.0 (disabled); the tied weight's gradient has no exact-zero row (the tied head gives every
row a gradient), max 0.03-0.12 and smallest nonzero values down to 3e-11, so up to 1.3% of its
nonzero gradients lie below fp16's flush point at scale 1. Traps: AMP010 (a disabled scaler with
bf16 is fine), AMP106 (bf16 gradients do not flush; a disabled scaler's scale of 1 is no fp16 loss
scale), AMP105 (tiny entries are not a layer whose max is < 1e-10), the per-micro-batch backward
(judged once per step), the eval forward under no_grad, and the fp32 residual stream fed bf16
branch outputs (fp32 adds, not AMP110).
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

STEPS = 40                 # optimizer steps
ACCUM = 8                  # micro-batches per optimizer step
VOCAB, D, T, MICRO_B = 12288, 64, 16, 4
EVAL_EVERY = 10
DTYPE = torch.bfloat16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.ln2 = nn.LayerNorm(D)
        self.fc = nn.Linear(D, 4 * D)
        self.out = nn.Linear(4 * D, D)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, 4, D // 4).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, D))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D, sparse=False)
        self.pos = nn.Embedding(T, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.tok.weight                    # weight tying
        nn.init.normal_(self.tok.weight, std=0.02)

    def forward(self, idx, targets=None):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))
        return logits, loss


def make_stream(n_tokens, seed):
    """Zipf-distributed tokens with a simple dependency: most tokens repeat a shifted predecessor."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, VOCAB + 1, dtype=torch.float64)
    zipf = (1.0 / ranks) / (1.0 / ranks).sum()
    base = torch.multinomial(zipf, n_tokens, replacement=True, generator=g)
    copy = torch.rand(n_tokens, generator=g) < 0.5
    stream = base.clone()
    stream[1:][copy[1:]] = (base[:-1][copy[1:]] * 7 + 3) % 512   # learnable structure on 512 tokens
    return stream


def batches(stream, n, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        starts = torch.randint(0, stream.numel() - T - 1, (MICRO_B,), generator=g)
        x = torch.stack([stream[s:s + T] for s in starts])
        y = torch.stack([stream[s + 1:s + T + 1] for s in starts])
        yield x, y


@torch.no_grad()
def estimate_loss(model, val):
    model.eval()
    out = []
    for x, y in val:
        with torch.autocast("cpu", dtype=DTYPE):
            _, loss = model(x, y)
        out.append(loss.item())
    model.train()
    return sum(out) / len(out)


def run(guarded, inspect=None):
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=(DTYPE == torch.float16))   # nanoGPT idiom: off in bf16
    train_stream, val_stream = make_stream(200_000, 1), make_stream(20_000, 2)
    val = list(batches(val_stream, 2, 3))
    it = batches(train_stream, STEPS * ACCUM, 4)
    losses, scales, evals = [], [], []
    ctx = amp_runtime.guard(policy="record", model=model) if guarded else nullcontext()
    x, y = next(it)
    with ctx as g:
        for step in range(STEPS):
            if step % EVAL_EVERY == 0:
                evals.append((step, estimate_loss(model, val)))
            total = torch.zeros(())
            for micro in range(ACCUM):
                with torch.autocast("cpu", dtype=DTYPE):
                    _, loss = model(x, y)
                    loss = loss / ACCUM
                x, y = next(it, (x, y))        # prefetch the next micro-batch before backward (nanoGPT)
                scaler.scale(loss).backward()
                total += loss.detach().float()
            scaler.unscale_(optimizer)
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if inspect is not None:
                inspect(step, model, total, gnorm, x)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            losses.append(total.clone())
            scales.append(scaler.get_scale())
        evals.append((STEPS, estimate_loss(model, val)))
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses + [torch.tensor(e) for _, e in evals], "scales": scales, "weights": weights,
            "guard": g, "evals": evals}


def plain():
    rows = []

    def inspect(step, model, total, gnorm, x):
        gw = model.tok.weight.grad
        zero_rows = (gw.abs().amax(dim=1) == 0).sum().item()
        nz = gw[gw != 0].abs()
        flush = (nz < 2.0 ** -25).float().mean().item()   # would flush to 0 in fp16 at scale 1
        rows.append((step, total.item(), gnorm.item(), zero_rows, gw.abs().max().item(), nz.min().item(), flush))

    t = time.time()
    r = run(guarded=False, inspect=inspect)
    print(f"run took {time.time() - t:.2f}s")
    for step, loss, gn, zr, gmax, gmin, flush in rows:
        if step % 5 == 0 or step == STEPS - 1 or step == 32:
            print(f"step {step:2d} train loss={loss:.4f} grad norm (pre-clip)={gn:.4g} tied tok/head weight grad: "
                  f"exact-zero rows={zr} max={gmax:.3g} smallest nonzero={gmin:.3g} "
                  f"share of nonzero below fp16's flush point (2^-25) at scale 1={flush:.3%}")
    print("evals (step, val loss):", [(s, round(v, 4)) for s, v in r["evals"]])
    print("scaler enabled:", False, "; scales:", set(r["scales"]))
    print("all finite:", all(torch.isfinite(v) for v in r["losses"]))

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
