"""EXPECT: AMP101,AMP107,AMP108
MAY: AMP102,AMP106,AMP110
FAULT: a sequence regressor whose LSTM is written out per timestep (`ManualLSTM`, module
`rnn`; nn.LSTM itself fails under CPU fp16 autocast in oneDNN) trains under fp16 autocast
with a GradScaler, 40 steps, every 4th batch of long sequences (T=48, else T=16). The
initial state comes from Linear layers, so under autocast the cell state is fp16. Injected
fault in the recurrent state: `c = c_new + c` (a "residual" on the cell state, line marked
`# FAULT`), so c grows by about (1+f) per timestep. `h = o * tanh(c)` saturates, so the
loss stays finite at every step (checked), but in fp16 c reaches inf: at step 3 (the first
long batch) plain torch shows `c_new + c` is the first op to turn finite values (max
45504) into inf, at t=21; the model learns larger c, and from step 29 short batches
overflow too. Steps whose gradients are non-finite are skipped by the scaler: 0 and 2
(settling at 65536), every long batch, then nearly every step from 30: 18 skips, scale
65536 -> 0.25 (plain run). Codes: AMP101 "the first op whose output holds NaN/Inf while
its inputs were finite" -> the add of the FAULT line in module `rnn`, first at step 3
(the replay of a skipped step, or live when per-op checks are already on after the skips
of steps 0/2); AMP108 "5 consecutive decreases ..., or scale < init/100, or < 128 and
falling" (scale 512 at step 19; steps 34-39 fall in a row); AMP107 "loss scale <= 1 and not
rising" (1.0 at step 37, then 0.5, 0.25). Must not fire: AMP112 (the loss is finite at
every backward), AMP103 (every non-finite step is skipped: "Steps that a GradScaler skips
... are not AMP103"), AMP109 (the 100-step window is never full), AMP104 (largest unscaled
norm of a step that went through: 65.9 < 100), AMP105 (smallest per-layer max |grad| of a
step that went through: 1.5e-4), AMP010, AMP004 (the only reduction, `x.mean`, is on fp32
input). MAY: AMP102 (c reaches 63008 in fp16 at step 28, seen only if per-op checks are on
then: "cheap until an anomaly ... off again after Thresholds.auto_quiet_steps"); AMP110
(`f * c + i * tanh(g)` adds ~0.5 to values ~1e4 in fp16: "an operand is wholly absorbed",
sampled one call in 16 under per-op checks); AMP106 (the scale falls to 16 and below:
"Lower scales also push small gradients below fp16's floor ... (AMP106)", AMP108 page).
"""
import json
import sys

import torch
from torch import nn
import torch.nn.functional as F

torch.set_num_threads(1)
torch.manual_seed(0)

import amp_runtime  # noqa: E402

H, I, STEPS = 32, 8, 40


class ManualLSTM(nn.Module):
    """An LSTM written out per timestep (nn.LSTM itself fails under CPU fp16 autocast)."""

    def __init__(self):
        super().__init__()
        self.x2g = nn.Linear(I, 4 * H)
        self.h2g = nn.Linear(H, 4 * H, bias=False)

    def forward(self, x, state):
        h, c = state
        for t in range(x.size(1)):
            gates = self.x2g(x[:, t]) + self.h2g(h)
            i, f, g, o = gates.chunk(4, dim=-1)
            i, f, o = torch.sigmoid(i), torch.sigmoid(f), torch.sigmoid(o)
            c_new = f * c + i * torch.tanh(g)
            c = c_new + c  # FAULT: a "residual" on the cell state: c grows ~(1+f)^t
            h = o * torch.tanh(c)
        return h, c


class SeqRegressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.init_h = nn.Linear(I, H)  # initial state from a summary of the sequence
        self.init_c = nn.Linear(I, H)  # (fp16 under autocast, so the state stays fp16)
        self.rnn = ManualLSTM()
        self.head = nn.Linear(H, 1)

    def forward(self, x):
        summary = x.mean(dim=1)
        state = (torch.tanh(self.init_h(summary)), self.init_c(summary))
        h, _ = self.rnn(x, state)
        return self.head(h)


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    T = 48 if step % 4 == 3 else 16  # every 4th batch holds long sequences
    x = torch.randn(16, T, I, generator=g)
    y = x[:, :, 0].sum(1, keepdim=True) / T ** 0.5
    return x, y


def train(probe=False):
    torch.manual_seed(0)
    model = SeqRegressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    losses, scales, facts = [], [], []
    for step in range(STEPS):
        x, y = batch(step)
        cell = []
        hk = model.rnn.register_forward_hook(lambda m, i, o: cell.append(o[1])) if probe else None
        with torch.autocast("cpu", dtype=torch.float16):
            pred = model(x)
            loss = F.mse_loss(pred.float(), y)
        if hk is not None:
            hk.remove()
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if probe:
            grads_finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
            sc = scaler.get_scale()
            gnorm = float(torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in model.parameters()]))) / sc
            layer_min = min(float(p.grad.abs().max()) for p in model.parameters()) / sc
            facts.append(dict(step=step, T=x.size(1), loss=float(loss.detach()), c_max=float(cell[0].float().abs().max()),
                              c_dtype=str(cell[0].dtype), grads_finite=grads_finite, gnorm=gnorm,
                              layer_min=layer_min))
        scaler.step(opt)
        scaler.update()
        losses.append(loss.detach().clone())
        scales.append(float(scaler.get_scale()))
    return model, losses, scales, facts


def same(a, b):
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    bits = a.contiguous().view(torch.int32) == b.contiguous().view(torch.int32)
    return bool((bits | (torch.isnan(a) & torch.isnan(b))).all())


def first_inf_op():
    """Plain torch: where does the cell state first become inf (step 3, the first long batch)?"""
    torch.manual_seed(0)
    model = SeqRegressor()
    x, _ = batch(3)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        summary = x.mean(dim=1)
        h, c = torch.tanh(model.init_h(summary)), model.init_c(summary)
        rnn = model.rnn
        for t in range(x.size(1)):
            gates = rnn.x2g(x[:, t]) + rnn.h2g(h)
            i, f, g, o = gates.chunk(4, dim=-1)
            i, f, o = torch.sigmoid(i), torch.sigmoid(f), torch.sigmoid(o)
            c_new = f * c + i * torch.tanh(g)
            if not torch.isfinite(c_new).all():
                return t, "c_new", float(c.float().abs().max())
            c2 = c_new + c
            if not torch.isfinite(c2).all():
                return t, "c_new + c", float(c.float().abs().max())
            c = c2
            h = o * torch.tanh(c)
    return None


def main():
    model0, l0, s0, facts = train(probe=True)
    skipped = [i for i in range(STEPS) if (s0[i] < (s0[i - 1] if i else 65536.0))]
    print("plain: first inf in the cell state (step 3):", first_inf_op())
    for f in facts:
        print("plain step %(step)2d T=%(T)2d loss %(loss)8.4f c_max %(c_max)10.1f %(c_dtype)s grads finite %(grads_finite)-5s norm %(gnorm)9.3g min layer max %(layer_min)9.3g" % f,
              "scale after", s0[f["step"]])
    print("plain: skipped steps", skipped, "final scale", s0[-1])
    assert all(torch.isfinite(v) for v in l0), "the loss stays finite (h = o * tanh(c) saturates)"
    ok = [f for f in facts if f["grads_finite"]]
    print("plain: steps that went through: max unscaled grad norm %.3g, min per-layer max |grad| %.3g"
          % (max(f["gnorm"] for f in ok), min(f["layer_min"] for f in ok)))
    if "--plain-only" in sys.argv:
        return

    with amp_runtime.guard(policy="record", model=None) as g:
        model1, l1, s1, _ = train()
    lm = len(l0) == len(l1) and all(same(a, b) for a, b in zip(l0, l1))
    sd0, sd1 = model0.state_dict(), model1.state_dict()
    wm = all(same(sd0[k], sd1[k]) for k in sd0)
    codes = set()
    for ev in g.report.events:
        codes.add(ev.code)
        print("EVENT", ev.code, "step", ev.step, "module", ev.module, "op", ev.op, "source", ev.source,
              "|", ev.message)
    print(g.report.summary())
    print("SCALES_MATCH", s0 == s1)
    print(f"LOSSES_MATCH {lm}")
    print(f"WEIGHTS_MATCH {wm}")
    print("EVENTS " + json.dumps(sorted(codes)))


if __name__ == "__main__":
    main()
