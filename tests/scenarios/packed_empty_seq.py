"""EXPECT: AMP101, AMP112
MAY: none
FAULT: GRUClassifier.forward (the root model, no submodule) mean-pools the GRU outputs over
time with `pooled = (out.float() * mask).sum(dim=1) / lengths[:, None]` (line 48).
The packing clamps lengths to >= 1 only for pack_padded_sequence (which rejects 0), so the
division still uses the true lengths. At step 23 (EMPTY_AT) sample 5 of the batch has length 0:
its masked sum is exactly 0 and 0/0 = NaN (measured in --plain: pooled row 5 = NaN, the only
NaN row; logits and loss NaN, scaled grads non-finite at step 23 only; every other step finite).
The division runs in fp32 (out.float()), inside fp16 CPU autocast, with a GradScaler, so step 23
is skipped and the scale halves once (65536 -> 32768), then training goes on normally.
Codes, per the pages:
  AMP112 - NaN loss at backward, step 23, line 83.
  AMP101 - the replay of step 23 (CPU: before the optimizer step) names op div / __truediv__
           (finite inputs 0 and 0 -> NaN), module: the root model GRUClassifier, line 48,
           step 23; AMP112's message should name it too.
  Not AMP103 (scaler skips), not AMP108 (one decrease), not AMP004 (the sum is fp32),
  not AMP102 (nothing near 65504).
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

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

VOCAB, TMAX, EMB, HID, CLASSES = 40, 20, 32, 48, 4
STEPS, BATCH = 50, 16
EMPTY_AT = 23          # the batch of this step holds one empty sequence (length 0)


class GRUClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, EMB, padding_idx=0)
        self.proj = nn.Linear(EMB, HID)
        self.gru = nn.GRU(HID, HID, batch_first=True)
        self.head = nn.Sequential(nn.Linear(HID, HID), nn.ReLU(), nn.Linear(HID, CLASSES))

    def forward(self, tokens, lengths):
        h = torch.relu(self.proj(self.embed(tokens)))
        # pack_padded_sequence rejects length 0, so the lengths are clamped for packing only
        packed = pack_padded_sequence(h, lengths.clamp(min=1), batch_first=True, enforce_sorted=False)
        out, _ = self.gru(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=tokens.shape[1])
        mask = (torch.arange(tokens.shape[1])[None, :] < lengths[:, None]).unsqueeze(-1)
        pooled = (out.float() * mask).sum(dim=1) / lengths[:, None]        # mean over time
        return self.head(pooled)


def make_batch(gen, step):
    lengths = torch.randint(3, TMAX + 1, (BATCH,), generator=gen)
    if step == EMPTY_AT:
        lengths[5] = 0                           # an utterance that was empty after filtering
    tokens = torch.randint(1, VOCAB, (BATCH, TMAX), generator=gen)
    tokens = tokens * (torch.arange(TMAX)[None, :] < lengths[:, None])     # pad with 0
    # label: which quarter of the vocabulary is most frequent in the sequence
    bucket = (tokens - 1).clamp(min=0) * CLASSES // (VOCAB - 1)
    counts = torch.stack([((bucket == c) & (tokens > 0)).sum(1) for c in range(CLASSES)], dim=1)
    labels = counts.argmax(dim=1)
    return tokens, lengths, labels


def setup():
    torch.manual_seed(0)
    model = GRUClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    gen = torch.Generator().manual_seed(99)
    return {"model": model, "opt": opt, "scaler": scaler, "gen": gen}


def loop(ctx, diag=False):
    model, opt, scaler, gen = ctx["model"], ctx["opt"], ctx["scaler"], ctx["gen"]
    losses, scales = [], []
    for step in range(STEPS):
        tokens, lengths, labels = make_batch(gen, step)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(tokens, lengths)
            loss = F.cross_entropy(logits.float(), labels)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if diag:
            gfin = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
        scaler.step(opt)
        scaler.update()
        losses.append(loss.detach().clone())
        scales.append(scaler.get_scale())
        if diag:
            if step == EMPTY_AT:
                with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
                    emb = torch.relu(model.proj(model.embed(tokens)))
                    pk = pack_padded_sequence(emb, lengths.clamp(min=1), batch_first=True, enforce_sorted=False)
                    o, _ = pad_packed_sequence(model.gru(pk)[0], batch_first=True, total_length=tokens.shape[1])
                    m = (torch.arange(tokens.shape[1])[None, :] < lengths[:, None]).unsqueeze(-1)
                    num = (o.float() * m).sum(dim=1)
                    print(f"   sample 5: length {lengths[5].item()}, masked sum all zero {bool((num[5] == 0).all())}, "
                          f"pooled = num/0 -> {(num / lengths[:, None])[5, :3].tolist()} (NaN rows: "
                          f"{torch.isnan(num / lengths[:, None]).any(1).nonzero().flatten().tolist()})")
            print(f"step {step:2d} loss {loss.item():.4f} scale {scales[-1]:.0f} min length {lengths.min().item()} "
                  f"logits finite {bool(torch.isfinite(logits).all())} grads finite(scaled) {gfin}")
    return {"losses": losses, "scales": scales,
            "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


GUARD_RUNS = [("auto", {})]

if __name__ == "__main__":
    main(sys.modules[__name__])
