"""EXPECT: AMP103,AMP112
MAY: AMP104
FAULT: a two-tower recommender trains its user tower in bf16 autocast (no GradScaler,
correctly). The tower ends in a bias-free projection and a hand-written fused
L2-normalisation (`FusedL2Normalize`, a custom autograd.Function with
custom_fwd(cast_inputs=float32)/custom_bwd). Its forward clamps the norm with eps, but its
backward divides by the raw norm. From step 7 on, the batches contain cold-start users
whose interaction vector is all zeros (one per batch at steps 7..): the bias-free
Linear/ReLU/Linear tower maps that row to an exact zero vector, the forward gives a finite
zero embedding and a finite loss, but the backward of FusedL2Normalize returns +-inf for
that row, and `tower.2.weight`'s gradient (inf * 0 in the GEMM) becomes NaN. No scaler is
there to catch it: AdamW steps on it at step 7 -> AMP103 at step 7, naming
`tower.2.weight` (layer `tower.2`), its origin being the backward of the custom function
in module `norm` (source: `return FusedL2Normalize.apply(x, self.eps)` in
`L2Norm.forward`, reached from `return self.norm(self.tower(interactions))`); the replayed
backward (gradient of a mean of the model's output) reproduces exactly that set of
parameters. The forward of step 7 is finite (no AMP101 in step 7). From step 8 on the
weights of tower.2 are NaN, so the loss is NaN when backward starts -> AMP112 (step 8, the
`loss.backward()` line in `train_epoch`), and AMP103 again. No AMP101 later either: the
first non-finite forward output comes from a linear whose weight is already NaN (a
non-finite input). MAY AMP104: the docs do not say how a non-finite total gradient norm is
judged (NaN > 100 is false).
"""
import json

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

N_ITEMS = 256
DIM = 32


class FusedL2Normalize(torch.autograd.Function):
    """y = x / max(||x||, eps), with a hand-written backward (one pass over x)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x, eps):
        norm = x.norm(dim=-1, keepdim=True)
        y = x / norm.clamp_min(eps)
        ctx.save_for_backward(y, norm)
        return y

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad_y):
        y, norm = ctx.saved_tensors
        # d(x/|x|) = (g - y <y, g>) / |x|   -- the eps of the forward is missing here
        grad_x = (grad_y - y * (y * grad_y).sum(dim=-1, keepdim=True)) / norm
        return grad_x, None


class L2Norm(nn.Module):
    def __init__(self, eps=1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return FusedL2Normalize.apply(x, self.eps)


class UserTower(nn.Module):
    def __init__(self, n_items=N_ITEMS, d_hidden=128, dim=DIM):
        super().__init__()
        self.tower = nn.Sequential(
            nn.Linear(n_items, d_hidden, bias=False), nn.ReLU(),
            nn.Linear(d_hidden, dim, bias=False),
        )
        self.norm = L2Norm()

    def forward(self, interactions):
        return self.norm(self.tower(interactions))


def make_batches(steps, batch_size=64, cold_start_from=7):
    g = torch.Generator().manual_seed(5)
    for step in range(steps):
        inter = (torch.rand(batch_size, N_ITEMS, generator=g) < 0.05).float()
        target_item = torch.randint(0, N_ITEMS, (batch_size,), generator=g)
        if step >= cold_start_from:
            inter[step % batch_size] = 0.0    # a cold-start user: no interactions yet
        yield inter, target_item


def train_epoch(user_tower, item_emb, optimizer, batches, temperature=0.1):
    for inter, target_item in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            u = user_tower(inter)                                   # fp32, unit norm
            items = F.normalize(item_emb.weight.float(), dim=-1)
            logits = (u @ items.t()).float() / temperature
            loss = F.cross_entropy(logits, target_item)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def main():
    user_tower = UserTower()
    item_emb = nn.Embedding(N_ITEMS, DIM)
    optimizer = torch.optim.AdamW(
        list(user_tower.parameters()) + list(item_emb.parameters()), lr=1e-3)
    with amp_runtime.guard(policy="record", model=user_tower) as g:
        train_epoch(user_tower, item_emb, optimizer, make_batches(16))
    print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))


if __name__ == "__main__":
    main()
