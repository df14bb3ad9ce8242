"""EXPECT: none

HEALTHY: fp16 CPU autocast with a GradScaler under ``guard(policy="record",
trace="always")`` (per-op checks on every step), and a cluster-style soft
preemption: a ``PreemptionNotice`` that derives from ``BaseException`` (like
``KeyboardInterrupt``, so ``except Exception`` does not swallow it) is raised from a
forward hook on ``body.2`` in the middle of the forward pass of iteration 7. The loop
catches it, writes a checkpoint (model, optimizer, scaler state to an in-memory
buffer), drops the half-finished step (``optimizer.zero_grad``) and continues with the
next batch; 20 iterations, 19 completed steps. The model is a LayerNorm'd MLP
regressor on standardised data; losses are computed inside the region.

Pages: AMP100 "the guard contains Exception, not KeyboardInterrupt" and "Your own
calls ... run exactly once ... the exceptions they raise reach you unchanged": the
notice must pass through the guard to the loop, and nothing of the guard should fail
because a forward was abandoned. With trace="always": AMP101 (no NaN/Inf anywhere),
AMP102 (activations are O(1), far below 60000), AMP110 (no fp16 additions of operands
of very different size are written: Linear biases are inside addmm, no residual
adds), AMP111 (no fp16 reductions are written; mse_loss runs in fp32 on CPU
autocast). Scaler used correctly (AMP005/AMP006/AMP010), gradient norms ~1.
Nothing should be reported.
"""
import io
import json

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)


class PreemptionNotice(BaseException):
    """Raised by the (simulated) scheduler signal handler."""


class Regressor(nn.Module):
    def __init__(self, d_in=24, hidden=96):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(d_in, hidden), nn.GELU(),
            nn.Linear(hidden, hidden), nn.LayerNorm(hidden), nn.GELU(),
            nn.Linear(hidden, hidden), nn.GELU(),
        )
        self.head = nn.Linear(hidden, 1)

    def forward(self, x):
        return self.head(self.body(x)).squeeze(-1)


model = Regressor()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
w_true = torch.randn(24)

pending_signal = {"iteration": 7}
current = {"iteration": -1}


def signal_hook(module, inputs):
    if current["iteration"] == pending_signal["iteration"]:
        pending_signal["iteration"] = None
        raise PreemptionNotice("SIGUSR1: node will be drained soon")


model.body[2].register_forward_pre_hook(signal_hook)
checkpoints = []

with amp_runtime.guard(policy="record", trace="always") as g:
    for it in range(20):
        current["iteration"] = it
        x = torch.randn(64, 24)
        y = torch.tanh(x @ w_true / 4.0) + 0.05 * torch.randn(64)
        try:
            with torch.autocast("cpu", dtype=torch.float16):
                pred = model(x)
                loss = F.mse_loss(pred, y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        except PreemptionNotice as notice:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(), "iteration": it}, buf)
            checkpoints.append(buf.getbuffer().nbytes)
            optimizer.zero_grad(set_to_none=True)
            print(f"iter {it:2d} preempted ({notice}); checkpoint {checkpoints[-1]} bytes, continuing")
            continue
        print(f"iter {it:2d} loss {loss.item():.4f} scale {scaler.get_scale():g}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
