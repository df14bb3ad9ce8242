"""Self-supervised pretraining with a whitening projector (W-MSE flavour), fp16 autocast on V100s."""
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision


class Projector(nn.Module):
    def __init__(self, dim_in=2048, dim_out=64):
        super().__init__()
        self.fc1 = nn.Linear(dim_in, 1024)
        self.bn = nn.BatchNorm1d(1024)
        self.fc2 = nn.Linear(1024, dim_out)

    def forward(self, x):
        return self.fc2(F.relu(self.bn(self.fc1(x))))


class WhiteningSSL(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = torchvision.models.resnet50()
        self.backbone.fc = nn.Identity()
        self.projector = Projector()
        self.head = nn.Linear(64, 64)

    def embed(self, x):
        return self.projector(self.backbone(x))


def standardise(z: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    z = z.float()
    return (z - z.mean(0)) / (z.std(0) + eps)


def train_step(model: WhiteningSSL, v1, v2, optimizer, scaler):
    with torch.autocast("cuda", dtype=torch.float16):
        z1 = model.head(model.embed(v1))
        z2 = model.head(model.embed(v2))
        z1 = (z1 - z1.mean(0)) / (z1.std(0) + 1e-8)  # expect: AMP004 AMP011
        z2 = standardise(z2)
        loss = F.mse_loss(z1.float(), z2)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss.item()


def train_step_v2(model: WhiteningSSL, v1, v2, optimizer, scaler):
    with torch.autocast("cuda", dtype=torch.float16):
        h1 = model.head(model.embed(v1))
        h2 = model.head(model.embed(v2))
    h1, h2 = standardise(h1), standardise(h2)
    loss = F.mse_loss(h1, h2)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss.item()


def uniformity_step(model: WhiteningSSL, views, optimizer, scaler, t=2.0):
    with torch.autocast("cuda", dtype=torch.float16):
        z = model.head(model.embed(views))
    sq = (z[:, None, :] - z[None, :, :]).pow(2).sum(-1)  # expect: AMP004
    uniform = sq.mul(-t).exp().mean().log()  # expect: AMP004
    optimizer.zero_grad()
    scaler.scale(uniform).backward()
    scaler.step(optimizer)
    scaler.update()


def grad_stats(model):
    norms = torch.stack([p.grad.detach().float().norm() for p in model.parameters() if p.grad is not None])
    return norms.mean().item(), norms.max().item()
