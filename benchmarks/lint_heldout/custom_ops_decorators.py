"""Custom autograd ops and decorated steps used by the point-cloud models."""
import functools

import torch
import torch.nn as nn
from torch.cuda.amp import custom_bwd, custom_fwd


class BallQueryFeature(torch.autograd.Function):
    @staticmethod
    @custom_fwd(cast_inputs=torch.float32)  # expect: AMP009
    def forward(ctx, feats, idx):
        ctx.save_for_backward(idx)
        ctx.n = feats.size(1)
        return feats.gather(1, idx.unsqueeze(-1).expand(-1, -1, feats.size(-1)))

    @staticmethod
    @custom_bwd  # expect: AMP009
    def backward(ctx, grad_out):
        (idx,) = ctx.saved_tensors
        grad = grad_out.new_zeros(grad_out.size(0), ctx.n, grad_out.size(-1))
        grad.scatter_add_(1, idx.unsqueeze(-1).expand_as(grad_out), grad_out)
        return grad, None


class ChamferDistance(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)
    def forward(ctx, a, b):
        d = torch.cdist(a, b)
        d1, i1 = d.min(dim=2)
        d2, i2 = d.min(dim=1)
        ctx.save_for_backward(a, b, i1, i2)
        return d1.mean() + d2.mean()

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, g):
        a, b, i1, i2 = ctx.saved_tensors
        ga = 2 * (a - b.gather(1, i1.unsqueeze(-1).expand_as(a))) * g / a.size(1)
        gb = 2 * (b - a.gather(1, i2.unsqueeze(-1).expand_as(b))) * g / b.size(1)
        return ga, gb


def log_step(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        print(f"{fn.__name__}: {out:.4f}")
        return out
    return wrapper


@log_step
@torch.autocast("cuda", dtype=torch.float16)
def completion_step(model, partial, full, optimizer, scaler):
    pred = model(partial)
    loss = ChamferDistance.apply(pred, full)
    optimizer.zero_grad()
    scaler.scale(loss).backward()  # expect: AMP008
    scaler.step(optimizer)
    scaler.update()
    return loss.item()


@torch.autocast("cuda", dtype=torch.float16)
def completion_forward(model, partial, full):
    return ChamferDistance.apply(model(partial), full)


@log_step
def completion_step_fixed(model, partial, full, optimizer, scaler):
    loss = completion_forward(model, partial, full)
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss.item()


class PointNetSetAbstraction(nn.Module):
    def __init__(self, cin, cout, k=32):
        super().__init__()
        self.k = k
        self.mlp = nn.Sequential(nn.Conv2d(cin + 3, cout, 1), nn.BatchNorm2d(cout), nn.ReLU())

    def forward(self, xyz, feats, centers):
        d = torch.cdist(centers, xyz)
        d = d.masked_fill(d > 0.2, 1e4)
        idx = d.topk(self.k, dim=-1, largest=False).indices
        grouped = BallQueryFeature.apply(torch.cat([xyz, feats], -1), idx.flatten(1))
        grouped = grouped.view(*idx.shape, -1).permute(0, 3, 1, 2)
        return self.mlp(grouped).max(dim=-1).values
