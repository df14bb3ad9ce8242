"""SchNet for molecular property regression (QM9-style), dense padded-batch implementation.

Each molecule is padded to ``max_atoms``; interactions are all-pairs continuous-filter
convolutions inside a cosine cutoff. The model predicts a property and its aleatoric
variance (Gaussian NLL). Training runs on CPU nodes with bf16 autocast.
"""
import argparse
import math
from typing import NamedTuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class ShiftedSoftplus(nn.Module):
    def __init__(self):
        super().__init__()
        self.shift = math.log(2.0)

    def forward(self, x):
        return F.softplus(x) - self.shift


ACTIVATIONS = {"ssp": ShiftedSoftplus, "silu": nn.SiLU}


class SchNetOutput(NamedTuple):
    energy: torch.Tensor
    var: torch.Tensor


class GaussianSmearing(nn.Module):
    def __init__(self, start=0.0, stop=5.0, num_gaussians=50):
        super().__init__()
        offset = torch.linspace(start, stop, num_gaussians)
        self.coeff = -0.5 / (offset[1] - offset[0]).item() ** 2
        self.register_buffer("offset", offset)

    def forward(self, dist):
        return torch.exp(self.coeff * (dist.unsqueeze(-1) - self.offset).pow(2))


class CFConv(nn.Module):
    """Continuous-filter convolution over all atom pairs (B, N, N)."""

    def __init__(self, hidden, num_filters, num_gaussians, cutoff, act):
        super().__init__()
        self.lin1 = nn.Linear(hidden, num_filters, bias=False)
        self.lin2 = nn.Linear(num_filters, hidden)
        self.filter_net = nn.Sequential(nn.Linear(num_gaussians, num_filters), ACTIVATIONS[act](),
                                        nn.Linear(num_filters, num_filters))
        self.cutoff = cutoff

    def forward(self, h, rbf, dist, pair_mask):
        c = 0.5 * (torch.cos(dist * math.pi / self.cutoff) + 1.0) * (dist < self.cutoff)
        w = self.filter_net(rbf * c.unsqueeze(-1))
        x = self.lin1(h)
        msg = (x.unsqueeze(1) * w).masked_fill(~pair_mask.unsqueeze(-1), 0.0)
        agg = msg.sum(dim=2)  # expect: AMP004
        return self.lin2(agg)


class InteractionBlock(nn.Module):
    def __init__(self, hidden, num_gaussians, num_filters, cutoff, act):
        super().__init__()
        self.conv = CFConv(hidden, num_filters, num_gaussians, cutoff, act)
        self.act = ACTIVATIONS[act]()
        self.lin = nn.Linear(hidden, hidden)

    def forward(self, h, rbf, dist, pair_mask):
        return self.lin(self.act(self.conv(h, rbf, dist, pair_mask)))


class SchNet(nn.Module):
    def __init__(self, hidden=128, num_filters=128, num_interactions=6, num_gaussians=50, cutoff=10.0,
                 act="ssp", readout="sum", target_mean=0.0, target_std=1.0):
        super().__init__()
        self.embedding = nn.Embedding(100, hidden, padding_idx=0)
        self.rbf = GaussianSmearing(0.0, cutoff, num_gaussians)
        self.interactions = nn.ModuleList(
            [InteractionBlock(hidden, num_gaussians, num_filters, cutoff, act) for _ in range(num_interactions)]
        )
        self.out_net = nn.Sequential(nn.Linear(hidden, hidden // 2), ACTIVATIONS[act](), nn.Linear(hidden // 2, 2))
        self.readout = readout
        self.register_buffer("target_mean", torch.tensor(float(target_mean)))
        self.register_buffer("target_std", torch.tensor(float(target_std)))

    def forward(self, z, pos, atom_mask):
        h = self.embedding(z)
        dist = torch.cdist(pos, pos)
        pair_mask = atom_mask.unsqueeze(1) & atom_mask.unsqueeze(2)
        pair_mask = pair_mask & ~torch.eye(z.size(1), dtype=torch.bool, device=z.device)
        rbf = self.rbf(dist)
        for block in self.interactions:
            h = h + block(h, rbf, dist, pair_mask)
        out = self.out_net(h)
        out = out * atom_mask.unsqueeze(-1).to(out.dtype)
        summed = out.sum(dim=1)  # expect: AMP004
        if self.readout == "mean":
            summed = summed / atom_mask.sum(dim=1, keepdim=True)
        energy = summed[:, 0] * self.target_std + self.target_mean
        var = F.softplus(summed[:, 1]) + 1e-8
        return SchNetOutput(energy=energy, var=var * self.target_std ** 2)


def build_model(args, stats):
    return SchNet(hidden=args.hidden, num_interactions=args.interactions, cutoff=args.cutoff, act=args.act,
                  readout=args.readout, target_mean=stats["mean"], target_std=stats["std"])


def collate_molecules(batch, max_atoms=29):
    n = len(batch)
    z = np.zeros((n, max_atoms), dtype=np.int64)
    pos = np.zeros((n, max_atoms, 3), dtype=np.float32)
    y = np.zeros(n, dtype=np.float32)
    for i, (zi, posi, yi) in enumerate(batch):
        z[i, : len(zi)] = zi
        pos[i, : len(zi)] = posi
        y[i] = yi
    z = torch.from_numpy(z)
    return z, torch.from_numpy(pos), z > 0, torch.from_numpy(y)


def train(model, loader, optimizer, scaler, args):
    model.train()
    for z, pos, atom_mask, y in loader:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp):
            out = model(z, pos, atom_mask)
            loss = F.gaussian_nll_loss(out.energy, y, out.var)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        scaler.step(optimizer)
        scaler.update()


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    abs_err, rel_err, n = 0.0, 0.0, 0
    for z, pos, atom_mask, y in loader:
        with torch.cpu.amp.autocast(dtype=torch.bfloat16):  # expect: AMP009
            out = model(z, pos, atom_mask)
        err = (out.energy.float() - y).abs()
        abs_err += err.sum().item()
        rel_err += (err / (y.abs() + 1e-8)).sum().item()
        n += y.numel()
    model.train()
    return abs_err / n, rel_err / n


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/qm9_u0.npz")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--interactions", type=int, default=6)
    p.add_argument("--cutoff", type=float, default=10.0)
    p.add_argument("--act", default="ssp", choices=sorted(ACTIVATIONS))
    p.add_argument("--readout", default="sum", choices=("sum", "mean"))
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--amp", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(32)
    raw = np.load(args.data, allow_pickle=True)
    mols = list(zip(raw["z"], raw["pos"], raw["y"]))
    targets = torch.tensor(raw["y"], dtype=torch.float32)
    stats = {"mean": targets.mean().item(), "std": targets.std().item()}
    n_val = len(mols) // 10
    loader = torch.utils.data.DataLoader(mols[n_val:], batch_size=100, shuffle=True, collate_fn=collate_molecules)
    val_loader = torch.utils.data.DataLoader(mols[:n_val], batch_size=250, collate_fn=collate_molecules)

    model = build_model(args, stats)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.8, patience=10)
    scaler = torch.amp.GradScaler("cpu", enabled=args.amp)  # expect: AMP010
    best_mae = float("inf")
    for epoch in range(args.epochs):
        train(model, loader, optimizer, scaler, args)
        mae, rel = evaluate(model, val_loader)
        scheduler.step(mae)
        if mae < best_mae:
            best_mae = mae
            torch.save(model.state_dict(), "schnet_best.pt")
        print(f"epoch {epoch:3d} val MAE {mae:.5f} rel {rel:.4f} best {best_mae:.5f}")


if __name__ == "__main__":
    main()
