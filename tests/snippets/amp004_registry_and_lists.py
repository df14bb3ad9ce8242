"""AMP004 through a norm registry that also holds a torch class, and through lists of outputs
that are read by index as well as iterated."""
import torch
import torch.nn.functional as F
from torch import nn


class GlobalNorm(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, y):
        mean = y.mean(dim=(1, 2), keepdim=True)  # AMP004
        return self.gamma * (y - mean)


class UpcastNorm(nn.Module):
    def forward(self, y):
        x = y.float()
        return (x - x.mean(dim=1, keepdim=True)).to(y.dtype)


NORMS = {"gLN": GlobalNorm, "up": UpcastNorm, "BN": nn.BatchNorm1d}


def make_norm(kind, channels):
    return NORMS[kind](channels)


class SeparationBlock(nn.Module):
    def __init__(self, channels, norm="gLN"):
        super().__init__()
        self.body = nn.Sequential(nn.Conv1d(channels, channels, 1), nn.PReLU(),
                                  make_norm(norm, channels))
        self.proj = nn.Linear(channels, channels)

    def forward(self, x):
        return self.body(x)


class TwoViewModel(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.block = SeparationBlock(d)
        self.projector = nn.Linear(d, d)

    def variance(self, z):
        return F.relu(1.0 - z.std(dim=0)).mean()  # AMP004

    def kept_in_fp32(self, z):
        return z.std(dim=0).mean()

    def forward(self, views):
        projected = []
        for view in views:
            feats = self.block(view)
            projected.append(self.projector(feats.float().mean(dim=-1)))
        upcast = [self.projector(view) for view in views]
        for i in range(len(upcast)):
            upcast[i] = upcast[i].float()
        loss = F.mse_loss(projected[0].float(), projected[1].float())
        for z in projected:
            loss = loss + self.variance(z)
        for z in upcast:
            loss = loss + self.kept_in_fp32(z)
        return loss


def train(model: TwoViewModel, loader, optimizer, scaler):
    for views in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(views)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
