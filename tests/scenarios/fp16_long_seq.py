"""EXPECT: none
MAY: AMP102
FAULT: none injected (healthy control). A one-layer causal transformer (d=32, 2 heads,
vocabulary 32, learned positions) trains on long sequences (T=512, batch 2) under fp16
autocast with a GradScaler and AdamW for 16 steps: attention is written out (q @ k^T /
sqrt(d), causal mask filled with the recommended `torch.finfo(scores.dtype).min`, softmax,
@ v), residual stream in fp32 (embeddings), LayerNorm, MLP, loss = cross-entropy on
`.float()` logits over 1024 tokens. The plain run checks: every loss finite and the loss
falls, no step skipped (scale stays 65536), the largest unmasked fp16 attention score is
far below 60000, unscaled grad norm < 100, every layer's max |grad| > 1e-10. Run twice
under the guard, default `trace="auto"` (must be silent: no anomaly, so no per-op checks)
and `trace="always"`. MAY AMP102, only in the `trace="always"` run: the masked scores hold
exactly -65504 (finfo(fp16).min), and the AMP102 page reports "an op whose fp16 output holds
a value with |x| above 60000", while REAL_WORLD_IDIOMS lists `torch.finfo(t.dtype).min` as a
safe mask value and AMP007's page recommends it; the pages leave it open whether such a
fill is a near-overflow. Must not fire in either run: AMP101 (nothing non-finite: no row is
fully masked), AMP007 (-65504 is not beyond +-65504), AMP112/AMP103/AMP107/AMP108/AMP109,
AMP104/AMP105/AMP106 (see plain checks), AMP004/AMP111 (no fp16 reduction: softmax is not
one, the loss runs on fp32), AMP110 (the residual adds are fp32 + fp16 into fp32), AMP010.
EVENTS is the union of both runs.
"""
import json
import math
import sys

import torch
from torch import nn
import torch.nn.functional as F

torch.set_num_threads(1)
torch.manual_seed(0)

import amp_runtime  # noqa: E402

V, D, NH, T, B, STEPS = 32, 32, 2, 512, 2, 16


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.register_buffer("causal", torch.tril(torch.ones(T, T, dtype=torch.bool)), persistent=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split(D, dim=2)
        q, k, v = (z.view(b, t, NH, D // NH).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(D // NH)
        scores = scores.masked_fill(~self.causal[:t, :t], torch.finfo(scores.dtype).min)
        att = scores.softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, D)
        return self.proj(y)


class TinyTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.pos = nn.Embedding(T, D)
        self.ln1 = nn.LayerNorm(D)
        self.attn = CausalSelfAttention()
        self.ln2 = nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1)))
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return self.head(self.ln_f(x))


def batch(step):
    g = torch.Generator().manual_seed(900 + step)
    seq = torch.randint(0, V, (B, T + 1), generator=g)
    seq[:, 64:] = (seq[:, :-64] + 1) % V  # token t repeats token t-64 plus one: a long-range copy
    return seq[:, :-1], seq[:, 1:]


def train(probe=None):
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    losses, scales = [], []
    for step in range(STEPS):
        idx, tgt = batch(step)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(idx)
            loss = F.cross_entropy(logits.float().view(-1, V), tgt.reshape(-1))
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if probe is not None:
            probe(step, model, idx, loss, scaler)
        scaler.step(opt)
        scaler.update()
        losses.append(loss.detach().clone())
        scales.append(float(scaler.get_scale()))
    return model, losses, scales


def same(a, b):
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    bits = a.contiguous().view(torch.int32) == b.contiguous().view(torch.int32)
    return bool((bits | (torch.isnan(a) & torch.isnan(b))).all())


def main():
    facts = []

    def probe(step, model, idx, loss, scaler):
        cap = {}
        a = model.attn

        def fwd_hook(m, inp, out):
            x = inp[0]
            b, t, _ = x.shape
            with torch.no_grad():
                q, k, _ = m.qkv(x).split(D, dim=2)
                q, k = (z.view(b, t, NH, D // NH).transpose(1, 2) for z in (q, k))
                s = (q @ k.transpose(-2, -1)) / math.sqrt(D // NH)
                cap["score_dtype"] = str(s.dtype)
                cap["score_peak_unmasked"] = float(s.float().masked_fill(~m.causal[:t, :t], 0).abs().max())

        h = a.register_forward_hook(fwd_hook)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
            model(idx)
        h.remove()
        sc = scaler.get_scale()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        facts.append(dict(step=step, loss=float(loss.detach()), finite_grads=all(bool(torch.isfinite(g).all()) for g in grads),
                          gnorm=float(torch.stack([g.float().norm() for g in grads]).norm()) / sc,
                          layer_min=min(float(g.abs().max()) for g in grads) / sc, **cap))

    model0, l0, s0 = train(probe)
    for f in facts[:2] + facts[-2:]:
        print("plain step %(step)2d loss %(loss).4f scores %(score_dtype)s unmasked peak %(score_peak_unmasked).2f "
              "grad norm %(gnorm).3g min per-layer max %(layer_min).3g finite %(finite_grads)s" % f)
    print("plain: loss %.3f -> %.3f, scales %s, max unmasked score %.2f, max grad norm %.3g, min per-layer max %.3g"
          % (l0[0], l0[-1], sorted(set(s0)), max(f["score_peak_unmasked"] for f in facts),
             max(f["gnorm"] for f in facts), min(f["layer_min"] for f in facts)))
    assert all(torch.isfinite(v) for v in l0) and float(l0[-1]) < float(l0[0])
    assert set(s0) == {65536.0} and all(f["finite_grads"] for f in facts)
    assert max(f["gnorm"] for f in facts) < 100 and min(f["layer_min"] for f in facts) > 1e-10
    assert all(f["score_dtype"] == "torch.float16" for f in facts)
    if "--plain-only" in sys.argv:
        return

    codes = set()
    all_lm = all_wm = True
    for trace in ("auto", "always"):
        with amp_runtime.guard(policy="record", trace=trace) as g:
            model1, l1, s1 = train()
        lm = len(l0) == len(l1) and all(same(a, b) for a, b in zip(l0, l1))
        sd0, sd1 = model0.state_dict(), model1.state_dict()
        wm = all(same(sd0[k], sd1[k]) for k in sd0)
        print(f"--- guard(policy='record', trace='{trace}'): LOSSES_MATCH {lm} WEIGHTS_MATCH {wm} "
              f"SCALES_MATCH {s0 == s1}")
        for ev in g.report.events:
            codes.add(ev.code)
            print("EVENT", ev.code, "step", ev.step, "module", ev.module, "op", ev.op, "source", ev.source,
                  "|", ev.message)
        print(g.report.summary())
        all_lm &= lm
        all_wm &= wm
    print(f"LOSSES_MATCH {all_lm}")
    print(f"WEIGHTS_MATCH {all_wm}")
    print("EVENTS " + json.dumps(sorted(codes)))


if __name__ == "__main__":
    main()
