"""EXPECT: none
MAY: none
FAULT: none (healthy control). An MLP built from a hand-written fused
`LinearGELU` autograd.Function (custom_fwd/custom_bwd for the CPU autocast: the forward
runs its GEMM in fp16 under autocast, the backward runs under the same autocast state and
computes the GELU derivative in fp32, the bias gradient as an fp32 sum, and the GEMMs of
the backward in fp16 on scaled gradients). Trained with fp16 autocast + GradScaler,
`unscale_` before clipping, under trace="always" (per-op checks on every step, so the ops
inside the custom forward AND the custom backward may be seen by the guard's mode).
Nothing overflows (fp16 peaks < 10), no reduction keeps fp16 in and out (the backward's
sums are on fp32 tensors), no fp16 addition is absorbed (the only additions in the custom
code are fp32), backward starts outside autocast (custom_bwd re-enabling autocast inside
the engine is not "backward under autocast"). The custom gradient is checked against
autograd once, before the guard. No event expected.
"""
import json
import math

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

_C = math.sqrt(2.0 / math.pi)


class LinearGELU(torch.autograd.Function):
    """gelu_tanh(x @ W^T + b) with a fused hand-written backward."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, x, weight, bias):
        pre = F.linear(x, weight, bias)
        ctx.save_for_backward(x, weight, pre)
        return F.gelu(pre, approximate="tanh")

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad_out):
        x, weight, pre = ctx.saved_tensors
        p = pre.float()
        inner = _C * (p + 0.044715 * p * p * p)
        t = torch.tanh(inner)
        dgelu = 0.5 * (1.0 + t) + 0.5 * p * (1.0 - t * t) * _C * (1.0 + 3 * 0.044715 * p * p)
        grad_pre = grad_out.float() * dgelu                       # fp32
        grad_x = grad_pre.to(pre.dtype) @ weight.to(pre.dtype)    # GEMM in the forward's dtype
        grad_w = grad_pre.to(pre.dtype).t() @ x.to(pre.dtype)
        grad_b = grad_pre.sum(0)                                  # fp32 accumulation
        return grad_x, grad_w, grad_b


class FusedLinearGELU(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        self.bias = nn.Parameter(torch.zeros(d_out))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x):
        return LinearGELU.apply(x, self.weight, self.bias)


class FusedMLP(nn.Module):
    def __init__(self, d_in=20, d=64, d_out=3):
        super().__init__()
        self.l1 = FusedLinearGELU(d_in, d)
        self.l2 = FusedLinearGELU(d, d)
        self.head = nn.Linear(d, d_out)

    def forward(self, x):
        return self.head(self.l2(self.l1(x)))


def check_custom_grad():
    layer = FusedLinearGELU(5, 4).double()
    x = torch.randn(3, 5, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: layer(a), (x,))


def make_data(n=2048):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 20, generator=g)
    y = torch.stack([x[:, :5].sum(1), (x[:, 5:10] ** 2).mean(1), torch.sin(x[:, 10])], 1)
    return x, y


def main(steps=40, batch_size=64):
    check_custom_grad()
    x_all, y_all = make_data()
    model = FusedMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    scaler = torch.amp.GradScaler("cpu")
    g_data = torch.Generator().manual_seed(2)
    losses = []
    with amp_runtime.guard(policy="record", trace="always", model=model) as g:
        for step in range(steps):
            idx = torch.randint(0, x_all.shape[0], (batch_size,), generator=g_data)
            with torch.autocast("cpu", dtype=torch.float16):
                pred = model(x_all[idx])
                loss = F.mse_loss(pred.float(), y_all[idx])
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            losses.append(loss.item())
    assert sum(losses[-5:]) < sum(losses[:5]), losses
    print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))


if __name__ == "__main__":
    main()
