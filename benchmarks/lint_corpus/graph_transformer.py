"""Graph transformer for molecule property regression, trained with an --amp flag."""
import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class GraphAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.edge_bias = nn.Linear(16, heads)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, edge_attr, adj_mask):
        B, N, C = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(C // self.heads)
        scores = scores + self.edge_bias(edge_attr).permute(0, 3, 1, 2)
        scores = scores.masked_fill(~adj_mask[:, None], float("-inf"))
        attn = torch.nan_to_num(scores.softmax(-1))
        return self.out((attn @ v).transpose(1, 2).reshape(B, N, C))


class Readout(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.gate = nn.Linear(dim, 1)
        self.proj = nn.Linear(dim, 1)

    def forward(self, h, node_mask):
        gate = self.gate(h).squeeze(-1).masked_fill(~node_mask, -1e9)  # expect: AMP007
        weights = gate.softmax(-1)
        return self.proj((weights[..., None] * h).sum(1)).squeeze(-1)


class PropertyTrainer:
    def __init__(self, model, args):
        self.model = model.cuda()
        self.args = args
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        self.scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
        self.head = nn.Linear(args.dim, 1).cuda()

    def step(self, batch):
        x, edge_attr, adj, node_mask, y = (t.cuda() for t in batch)
        with torch.autocast("cuda", enabled=self.args.amp):
            h = self.model(x, edge_attr, adj)
            pooled = self.head(h)
            centered = pooled - pooled.mean(dim=1, keepdim=True)  # expect: AMP004
            pred = centered.squeeze(-1).sum(1)
            loss = F.smooth_l1_loss(pred, y)
            self.scaler.scale(loss).backward()  # expect: AMP008
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


def pretrain_denoising(model, loader, optimizer, noise_std=0.1):
    """Coordinate denoising pretraining; runs entirely under bf16 autocast."""
    for x, pos, adj in loader:
        noisy = pos + noise_std * torch.randn_like(pos)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred_noise = model(x, noisy, adj)
            loss = F.mse_loss(pred_noise, (noisy - pos) / noise_std)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--amp", action="store_true")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--dim", type=int, default=256)
    p.parse_args()
