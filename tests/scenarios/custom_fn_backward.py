"""EXPECT: AMP107,AMP108
MAY: AMP101,AMP102,AMP106,AMP110
FAULT: a 16-64-4 classifier whose activation is a custom autograd Function, Mish with the
paper's closed-form derivative written by hand in `backward` (`MishFn`, called by module
`act`; `torch.amp.custom_fwd/custom_bwd(device_type="cpu")`), trained under fp16 autocast
with a GradScaler and SGD for 36 steps. The forward is the stable `x * tanh(softplus(x))`;
the backward computes e^x, e^{2x}, e^{3x} and delta^2 in the saved fp16 input's dtype (line
marked `# FAULT`). In fp32 the run is healthy (checked). In fp16, `ex ** 2` is inf for
x > 5.5, `ex ** 3` for x > 3.7 (checked), so omega / delta^2 is inf/inf = NaN. Steps 0-9
use standardised features (max pre-activation 1.3): no skip, scale stays 65536. From step
10 a shard of unstandardised features (x3) pushes pre-activations to 6-9: every step has
NaN gradients in fc1 only (fc2's stay finite), the forward and the loss stay finite, and
the GradScaler skips every step: 65536 -> 2^-10 at step 35 (plain run). The replay of a
skipped step must localize it: "When the forward is finite but the gradients are not, the
replay also runs a backward with a hook on every autograd node" and "AMP107/AMP108 name
what was found (steps the scaler skips are not AMP103)". Codes: AMP108 "5 consecutive
decreases once a step has gone through" (steps 10-14), "scale below 1/100" (512 at step
16), "< 128 and falling" (64 at step 19); AMP107 "at or below 1 and not rising" (1.0 at step
25); their message/details["origin"] should name the backward of the custom function in
`act` (the node, or the pow/exp of the FAULT line). Must not fire: AMP112 (loss finite),
AMP103 (every non-finite step is skipped), AMP104/AMP105 (steps that went through: norm
<= 0.43, per-layer max >= 0.0095), AMP109 (window never full), AMP010, AMP004. MAY: AMP101:
its page says "the first op whose output holds NaN or Inf while all of its inputs were
finite"; the custom backward's exp/pow run as Python torch calls a TorchFunctionMode can
see, and the pages do not say whether a user-written backward counts as "forward" (the
code's name); AMP102 and AMP110 for the same reason (an exp/pow output in (60000, 65504],
`... + 2` next to e^{2x} ~ 1e4 in fp16 is absorbed) under the per-op checks that switch on
after the first skip; AMP106: "every 32nd training step" includes step 32, skipped, at a
scale of 2^-7, and the pages do not say whether a skipped step is judged.
"""
import json
import sys

import torch
from torch import nn
import torch.nn.functional as F

torch.set_num_threads(1)
torch.manual_seed(0)

import amp_runtime  # noqa: E402

STEPS = 36


class MishFn(torch.autograd.Function):
    """Mish with the closed-form derivative of the paper, written by hand to save memory."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.tanh(F.softplus(x))

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        ex = torch.exp(x)
        omega = 4 * (x + 1) + 4 * ex ** 2 + ex ** 3 + ex * (4 * x + 6)  # FAULT: e^{3x} > 65504 for x > 3.7 in fp16
        delta = 2 * ex + ex ** 2 + 2
        return grad_out * ex * omega / delta ** 2


class Mish(nn.Module):
    def forward(self, x):
        return MishFn.apply(x)


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.act = Mish()
        self.fc2 = nn.Linear(64, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def batch(step):
    g = torch.Generator().manual_seed(500 + step)
    w = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    x = torch.randn(64, 16, generator=g)
    y = (x @ w).argmax(1)
    # from step 10 a new data shard arrives whose features were not standardised
    x = x * (3.0 if step >= 10 else 0.5)
    return x, y


def train(dtype=torch.float16, probe=False):
    torch.manual_seed(0)
    model = Classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    losses, scales, facts = [], [], []
    for step in range(STEPS):
        x, y = batch(step)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            logits = model(x)
            loss = F.cross_entropy(logits.float(), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if probe:
            with torch.no_grad():
                pre = model.fc1(x).float()
            sc = scaler.get_scale() if scaler.is_enabled() else 1.0
            facts.append(dict(step=step, pre_max=float(pre.max()), loss=float(loss.detach()),
                              nonfinite=[n for n, p in model.named_parameters() if not torch.isfinite(p.grad).all()],
                              gnorm=float(torch.stack([p.grad.float().norm() for p in model.parameters()]).norm()) / sc,
                              layer_min=min(float(p.grad.abs().max()) for p in model.parameters()) / sc))
        scaler.step(opt)
        scaler.update()
        losses.append(loss.detach().clone())
        scales.append(float(scaler.get_scale()) if scaler.is_enabled() else None)
    return model, losses, scales, facts


def same(a, b):
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    bits = a.contiguous().view(torch.int32) == b.contiguous().view(torch.int32)
    return bool((bits | (torch.isnan(a) & torch.isnan(b))).all())


def first_nonfinite_in_backward():
    """Plain torch: the first op of the hand-written backward that turns finite values non-finite."""
    x = torch.tensor([2.0, 3.0, 3.8, 6.0], dtype=torch.float16)
    ex = torch.exp(x)
    steps = {"exp": ex, "ex**2": ex ** 2, "ex**3": ex ** 3, "delta**2": (2 * ex + ex ** 2 + 2) ** 2}
    return {k: v.tolist() for k, v in steps.items()}


def main():
    _, l32, _, f32 = train(dtype=None, probe=True)
    print("plain fp32: loss %.3f -> %.3f, all grads finite: %s" % (l32[0], l32[-1], all(not f["nonfinite"] for f in f32)))
    model0, l0, s0, facts = train(probe=True)
    print("plain fp16 backward pieces for x = [2, 3, 3.8, 6]:", first_nonfinite_in_backward())
    for f in facts:
        print("plain fp16 step %(step)2d fc1 max pre-activation %(pre_max)6.2f loss %(loss)7.4f norm %(gnorm)8.3g "
              "min layer max %(layer_min)8.3g non-finite grads %(nonfinite)s" % f, "scale after", s0[f["step"]])
    ok = [f for f in facts if not f["nonfinite"]]
    print("plain fp16: steps that went through: max norm %.3g, min per-layer max |grad| %.3g"
          % (max(f["gnorm"] for f in ok), min(f["layer_min"] for f in ok)))
    assert all(torch.isfinite(v) for v in l0)
    assert s0[:10] == [65536.0] * 10 and all(f["nonfinite"] for f in facts[10:])
    if "--plain-only" in sys.argv:
        return

    with amp_runtime.guard(policy="record") as g:
        model1, l1, s1, _ = train()
    lm = len(l0) == len(l1) and all(same(a, b) for a, b in zip(l0, l1))
    sd0, sd1 = model0.state_dict(), model1.state_dict()
    wm = all(same(sd0[k], sd1[k]) for k in sd0)
    codes = set()
    for ev in g.report.events:
        codes.add(ev.code)
        print("EVENT", ev.code, "step", ev.step, "module", ev.module, "op", ev.op, "source", ev.source,
              "|", ev.message)
        if isinstance(ev.details, dict) and ("origin" in ev.details or "replay" in ev.details):
            print("      origin:", ev.details.get("origin"), "| replay:", str(ev.details.get("replay"))[:400])
    print(g.report.summary())
    print("SCALES_MATCH", s0 == s1)
    print(f"LOSSES_MATCH {lm}")
    print(f"WEIGHTS_MATCH {wm}")
    print("EVENTS " + json.dumps(sorted(codes)))


if __name__ == "__main__":
    main()
