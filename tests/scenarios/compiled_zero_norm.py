"""EXPECT: AMP101, AMP103, AMP112
MAY: none
FAULT: a set classifier (per-token MLP `tok.0`/`tok.2`, masked mean-pooling, L2-normalised
embedding, cosine classifier over `classes`) run through `torch.compile(model,
backend="aot_eager")` (inductor's C++ compile takes ~20 s per run on this machine, too slow for
the 10 s budget; the script falls back to eager if compile is unavailable and prints so), bf16
autocast, fp32 pooling, AdamW, no GradScaler (bf16), 50 steps. The pooling is safe for an empty
set (`clamp(min=1.0)`), but the normalisation `emb = pooled / pooled.norm(dim=-1, keepdim=True)`
(line marked FAULT LINE in SetEncoder.forward) divides 0 by 0 for an all-padding sample. At step
37 the batch's last sample (row 15) has length 0: measured with `--plain`, its pooled norm is 0.0,
its embedding row is NaN, the loss is NaN at step 37, every parameter's gradient is NaN, AdamW
writes NaN into every weight, and all 13 losses from step 37 to 49 are NaN. Per the pages:
AMP112 (NaN loss at backward, step 37, and each later step), AMP101 (the replay of step 37 runs
the compiled model's `_orig_mod` eagerly and names the division (div / true_divide) in the root
module SetEncoder, no `_orig_mod` in the name, at the FAULT LINE), AMP103 (NaN gradients reach
AdamW at step 37, caused by that div; not repeated while the same layers stay NaN). Later steps
start from NaN parameters, which the AMP112 messages should name instead of an op.
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

STEPS = 50
PAD_STEP = 37            # the last, padded batch of an epoch holds one empty (all-padding) sequence
N_CLS, D_TOK, T, BATCH = 6, 16, 12, 16
BACKEND = "aot_eager"    # inductor needs ~20 s of C++ compilation per run here: too slow for < 10 s


class SetEncoder(nn.Module):
    """Masked mean-pooling of token features, L2-normalised embedding, cosine classifier."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Sequential(nn.Linear(D_TOK, 64), nn.GELU(), nn.Linear(64, 64))
        self.classes = nn.Parameter(torch.randn(N_CLS, 64) * 0.1)
        self.logit_scale = 10.0

    def forward(self, x, mask):
        h = self.tok(x).float()                                        # bf16 -> fp32 for pooling
        m = mask.unsqueeze(-1).float()
        pooled = (h * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)      # safe for empty sets: zeros
        emb = pooled / pooled.norm(dim=-1, keepdim=True)               # <-- FAULT LINE: 0 / 0 = NaN
        w = self.classes / self.classes.norm(dim=-1, keepdim=True)
        return self.logit_scale * emb @ w.t()


def make_data():
    g = torch.Generator().manual_seed(11)
    centers = torch.randn(N_CLS, D_TOK, generator=g)
    batches = []
    for step in range(STEPS):
        y = torch.randint(0, N_CLS, (BATCH,), generator=g)
        x = centers[y].unsqueeze(1) + 0.8 * torch.randn(BATCH, T, D_TOK, generator=g)
        lengths = torch.randint(3, T + 1, (BATCH,), generator=g)
        if step == PAD_STEP:
            lengths[BATCH - 1] = 0                                     # an all-padding sample
        mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
        x = x * mask.unsqueeze(-1)                                     # padding positions are zeros
        batches.append((x, mask, y))
    return batches


def compile_or_eager(model):
    try:
        probe = torch.compile(nn.Linear(2, 2), backend=BACKEND)
        probe(torch.randn(1, 2)).sum().backward()
        return torch.compile(model, backend=BACKEND), f"torch.compile(backend={BACKEND!r})"
    except Exception as exc:  # compile unavailable: fall back to eager, and say so
        print(f"COMPILE UNAVAILABLE ({type(exc).__name__}: {exc}); running eager")
        return model, "eager (compile unavailable)"


def run(guarded, inspect=None):
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = SetEncoder()
    cmodel, how = compile_or_eager(model)
    print(f"[{'guarded' if guarded else 'reference'}] model runs through {how}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = make_data()
    losses = []
    ctx = amp_runtime.guard(policy="record", model=cmodel) if guarded else nullcontext()
    with ctx as g:
        for step, (x, mask, y) in enumerate(batches):
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = cmodel(x, mask)
                loss = F.cross_entropy(logits, y)
            loss.backward()
            if inspect is not None:
                inspect(step, model, loss, x, mask)
            optimizer.step()
            losses.append(loss.detach().float().clone())
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "scales": [None] * len(losses), "weights": weights, "guard": g}


def plain():
    rows = []

    def inspect(step, model, loss, x, mask):
        nan_grads = [n for n, p in model.named_parameters() if not torch.isfinite(p.grad).all()]
        nan_w = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
        empty = (mask.sum(1) == 0).nonzero().flatten().tolist()
        rows.append((step, loss.item(), empty, nan_grads, nan_w))
        if step == PAD_STEP:
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                h = model.tok(x).float()
                m = mask.unsqueeze(-1).float()
                pooled = (h * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
                nrm = pooled.norm(dim=-1)
                emb = pooled / nrm.unsqueeze(-1)
            print(f"step {step}: empty samples {empty}; their pooled norm {nrm[empty].tolist()}; "
                  f"NaN rows of emb {torch.isnan(emb).any(-1).nonzero().flatten().tolist()}")

    r = run(guarded=False, inspect=inspect)
    for step, loss, empty, nan_grads, nan_w in rows:
        if step % 10 == 0 or PAD_STEP - 1 <= step <= PAD_STEP + 2 or step == STEPS - 1:
            print(f"step {step:2d} loss={loss:.4f} empty samples={empty} non-finite grads={nan_grads} "
                  f"non-finite weights (before this step's update)={nan_w}")
    print("first NaN loss at step", next((x[0] for x in rows if not math.isfinite(x[1])), None),
          "; NaN losses:", sum(1 for x in rows if not math.isfinite(x[1])), "of", len(rows))

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
