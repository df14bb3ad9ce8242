"""Barlow Twins pretraining, DDP + fp16 autocast. torchrun --nproc_per_node=4 barlow_twins_ddp.py"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from torch.nn.parallel import DistributedDataParallel

from augment import TwoViews
from lars import LARS


def off_diagonal(x):
    n, m = x.shape
    return x.flatten()[:-1].view(n - 1, n + 1)[:, 1:].flatten()


class BarlowTwins(nn.Module):
    def __init__(self, lambd=0.0051, proj_dims=(8192, 8192, 8192)):
        super().__init__()
        self.backbone = torchvision.models.resnet50()
        self.backbone.fc = nn.Identity()
        layers, dim = [], 2048
        for i, out in enumerate(proj_dims):
            layers.append(nn.Linear(dim, out, bias=False))
            if i < len(proj_dims) - 1:
                layers += [nn.BatchNorm1d(out), nn.ReLU(inplace=True)]
            dim = out
        self.projector = nn.Sequential(*layers)
        self.bn = nn.BatchNorm1d(dim, affine=False)
        self.lambd = lambd

    def forward(self, y1, y2):
        z1 = self.projector(self.backbone(y1))
        z2 = self.projector(self.backbone(y2))
        c = self.bn(z1).T @ self.bn(z2)
        c.div_(z1.size(0))
        dist.all_reduce(c)
        on_diag = torch.diagonal(c).add_(-1).pow_(2).sum()
        off_diag = off_diagonal(c).pow_(2).sum()
        return on_diag + self.lambd * off_diag


class VarianceCovarianceLoss(nn.Module):
    """The VICReg regulariser we also tried on top of Barlow Twins."""

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        z = z - z.mean(dim=0)
        std = torch.sqrt(z.var(dim=0) + 1e-4)
        var_loss = torch.relu(1 - std).mean()
        cov = (z.T @ z) / (z.size(0) - 1)
        cov_loss = off_diagonal(cov).pow(2).sum() / z.size(1)
        return var_loss + cov_loss


def main():
    dist.init_process_group("nccl")
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    model = BarlowTwins().cuda()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DistributedDataParallel(model, device_ids=[rank])
    vc_loss = VarianceCovarianceLoss()
    optimizer = LARS(model.parameters(), lr=0, weight_decay=1.5e-6)
    scaler = torch.amp.GradScaler("cuda")
    dataset = torchvision.datasets.ImageFolder("/data/imagenet/train", TwoViews())
    sampler = torch.utils.data.distributed.DistributedSampler(dataset)
    loader = torch.utils.data.DataLoader(dataset, batch_size=256, sampler=sampler, num_workers=10, pin_memory=True)

    for epoch in range(1000):
        sampler.set_epoch(epoch)
        for step, ((y1, y2), _) in enumerate(loader, start=epoch * len(loader)):
            y1, y2 = y1.cuda(non_blocking=True), y2.cuda(non_blocking=True)
            optimizer.zero_grad()
            with torch.autocast("cuda"):
                loss = model(y1, y2)
                emb = model.module.projector(model.module.backbone(y1))
                spread = emb.std(dim=0).mean()  # expect: AMP004
                reg = vc_loss(emb.float())
            scaler.scale(loss + 0.1 * reg).backward()
            scaler.step(optimizer)
            scaler.update()
            if step % 100 == 0 and rank == 0:
                print(f"step {step} loss {loss.item():.2f} spread {spread.item():.3f}")
        if rank == 0:
            torch.save(model.module.backbone.state_dict(), "resnet50_bt.pth")


if __name__ == "__main__":
    main()
