"""EXPECT: none
MAY: none
FAULT: none (healthy but tricky). bf16 CPU autocast on a residual MLP text classifier with
LayerNorm (pre-norm blocks, final norm; pooled in fp32: `self.norm(h).float().mean(dim=1)`,
line 62), Dropout, AdamW with weight decay in two param groups (none on norms,
biases, embeddings), clip_grad_norm_ after unscale_. The nanoGPT idiom: a GradScaler built with
enabled=(DTYPE == torch.float16), i.e. disabled in bf16, and still called every step
(scale/unscale_/step/update). Every 5 steps (before the step, including step 0, so the model's
very first call is an evaluation) evaluate() runs under @torch.inference_mode() with
model.eval() and its own bf16 autocast block, then model.train(). At step 30 the model and
optimizer state dicts are saved with torch.save, and training resumes in FRESH model/optimizer
objects built by build() and filled with torch.load(weights_only=True) + load_state_dict (the
model handed to guard(model=...) is the pre-checkpoint object).
Measured in --plain: all 60 train losses finite (1.6 -> ~0.8), grad norms 0.32-1.36 (clip at 1
bites a few times), every layer's max |grad| >= 7e-4, eval loss 1.59 -> 1.29 and accuracy
0.29 -> 0.48 across the checkpoint.
Per the pages nothing should be reported: no AMP010 (a disabled scaler scales nothing and bf16
needs none: "bf16 autocast with no scaler (correct)", "Every scaler method must work on a
disabled scaler"), no AMP001 (load_state_dict copies, no cast), no AMP004 (the pooling mean is
fp32; evaluation code under inference_mode is left alone), no AMP002 (losses get .float()
logits inside the region), no AMP105 (no layer near 1e-10), no AMP104 (norm < 100).
"""
import os
import sys
import shutil
import tempfile

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

VOCAB, T, D, CLASSES = 50, 24, 64, 5
STEPS, BATCH, EVAL_EVERY, CKPT_AT = 60, 32, 5, 30
DTYPE = torch.bfloat16


class ResidualMLPBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm(x)))))


class TextClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(ResidualMLPBlock(D) for _ in range(3))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, CLASSES)

    def forward(self, tokens):
        h = self.embed(tokens)
        for blk in self.blocks:
            h = blk(h)
        pooled = self.norm(h).float().mean(dim=1)      # pool in fp32
        return self.head(pooled)


def param_groups(model, wd):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in name or "embed" in name else decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


class Data:
    def __init__(self, seed):
        self.g = torch.Generator().manual_seed(seed)
        self.eval_x, self.eval_y = self.sample(128)

    def sample(self, n):
        x = torch.randint(0, VOCAB, (n, T), generator=self.g)
        y = ((x < 10).sum(1) - 3).clamp(0, CLASSES - 1)            # how many "rare" tokens, bucketed
        return x, y


def build():
    model = TextClassifier()
    opt = torch.optim.AdamW(param_groups(model, 0.05), lr=2e-3, betas=(0.9, 0.95))
    return model, opt


def setup():
    torch.manual_seed(0)
    model, opt = build()
    # nanoGPT idiom: a scaler that is only on for fp16, called unconditionally
    scaler = torch.amp.GradScaler("cpu", enabled=(DTYPE == torch.float16))
    return {"model": model, "opt": opt, "scaler": scaler, "data": Data(21),
            "ckpt_dir": tempfile.mkdtemp(prefix="amp_scenario_ckpt_")}


@torch.inference_mode()
def evaluate(model, data):
    model.eval()
    with torch.autocast("cpu", dtype=DTYPE):
        logits = model(data.eval_x)
        loss = F.cross_entropy(logits.float(), data.eval_y)
    acc = (logits.argmax(1) == data.eval_y).float().mean()
    model.train()
    return loss.item(), acc.item()


def loop(ctx, diag=False):
    model, opt, scaler, data = ctx["model"], ctx["opt"], ctx["scaler"], ctx["data"]
    losses, evals = [], []
    path = os.path.join(ctx["ckpt_dir"], "ckpt.pt")
    model.train()
    for step in range(STEPS):
        if step % EVAL_EVERY == 0:
            evals.append(evaluate(model, data))
            if diag:
                print(f"   eval at step {step}: loss {evals[-1][0]:.4f} acc {evals[-1][1]:.3f}")
        if step == CKPT_AT:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, path)
            # resume as a restarted job would: fresh objects, state loaded from the file
            model, opt = build()
            ckpt = torch.load(path, weights_only=True)
            shutil.rmtree(ctx["ckpt_dir"], ignore_errors=True)
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["opt"])
            model.train()
            if diag:
                print(f"   checkpoint saved and reloaded into fresh model/optimizer at step {ckpt['step']}")
        x, y = data.sample(BATCH)
        with torch.autocast("cpu", dtype=DTYPE):
            logits = model(x)
            loss = F.cross_entropy(logits.float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        if diag:
            layer_max = {n: p.grad.abs().max().item() for n, p in model.named_parameters() if p.grad is not None}
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
        if diag:
            print(f"step {step:2d} loss {loss.item():.4f} grad norm {gn.item():.3g} scaler enabled {scaler.is_enabled()} "
                  f"smallest layer max|grad| {min(layer_max.values()):.3g} ({min(layer_max, key=layer_max.get)})")
    losses += [torch.tensor(e[0]) for e in evals]
    return {"losses": losses, "scales": [],
            "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


GUARD_RUNS = [("auto", {})]

if __name__ == "__main__":
    main(sys.modules[__name__])
