"""Self-supervised pretraining with a VICReg-style objective and an --amp flag."""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision


def off_diagonal(x):
    n, m = x.shape
    return x.flatten()[:-1].view(n - 1, n + 1)[:, 1:].flatten()


class VICReg(nn.Module):
    def __init__(self, dim=8192, sim_coeff=25.0, std_coeff=25.0, cov_coeff=1.0):
        super().__init__()
        self.backbone = torchvision.models.resnet50()
        self.backbone.fc = nn.Identity()
        self.projector = nn.Sequential(nn.Linear(2048, dim), nn.BatchNorm1d(dim), nn.ReLU(), nn.Linear(dim, dim))
        self.sim_coeff = sim_coeff
        self.std_coeff = std_coeff
        self.cov_coeff = cov_coeff

    def forward(self, x, y):
        return self.projector(self.backbone(x)), self.projector(self.backbone(y))


def vicreg_loss(x, y, sim_coeff, std_coeff, cov_coeff):
    x = x.float()
    y = y.float()
    repr_loss = F.mse_loss(x, y)
    x = x - x.mean(dim=0)
    y = y - y.mean(dim=0)
    std_x = torch.sqrt(x.var(dim=0) + 0.0001)
    std_y = torch.sqrt(y.var(dim=0) + 0.0001)
    std_loss = torch.mean(F.relu(1 - std_x)) / 2 + torch.mean(F.relu(1 - std_y)) / 2
    n, d = x.shape
    cov_x = (x.T @ x) / (n - 1)
    cov_y = (y.T @ y) / (n - 1)
    cov_loss = off_diagonal(cov_x).pow_(2).sum().div(d) + off_diagonal(cov_y).pow_(2).sum().div(d)
    return sim_coeff * repr_loss + std_coeff * std_loss + cov_coeff * cov_loss


def train(args, model, loader, optimizer):
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
    for epoch in range(args.epochs):
        model.train()
        for (x, y), _ in loader:
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            with torch.autocast("cuda", enabled=args.amp):
                zx = model.projector(model.backbone(x))
                zy = model.projector(model.backbone(y))
                loss = vicreg_loss(zx, zy, model.sim_coeff, model.std_coeff, model.cov_coeff)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()


class InlineVICReg:
    """The same objective written inline in a trainer, without the upcast."""

    def __init__(self, backbone, args):
        self.backbone = backbone
        self.args = args
        self.expander = nn.Linear(2048, 8192).cuda()
        self.head = nn.Linear(8192, 8192).cuda()
        params = [*backbone.parameters(), *self.expander.parameters(), *self.head.parameters()]
        self.optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9)
        self.scaler = torch.amp.GradScaler("cuda", enabled=args.amp)

    def train_step(self, x):
        with torch.autocast("cuda", enabled=self.args.amp):
            h = self.backbone(x.cuda())
            zx = self.head(F.relu(self.expander(h)))
            zx = zx - zx.mean(dim=0)  # expect: AMP004
            std_x = torch.sqrt(zx.var(dim=0) + 0.0001)  # expect: AMP004
            spread = self.expander(h).std(dim=0).sum()  # expect: AMP004
            loss = F.relu(1 - std_x).sum() + 0.1 * spread
        self.optimizer.zero_grad()
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()


def train_barlow(args, model, bn, loader, optimizer, lambd=0.0051):
    scaler = torch.amp.GradScaler("cuda")
    for (y1, y2), _ in loader:
        with torch.autocast("cuda"):
            z1 = model.projector(model.backbone(y1.cuda()))
            z2 = model.projector(model.backbone(y2.cuda()))
            c = bn(z1).T @ bn(z2)
            c.div_(z1.size(0))
            on_diag = torch.diagonal(c).add_(-1).pow_(2).sum()
            off_diag = off_diagonal(c).pow_(2).sum()
            loss = on_diag + lambd * off_diag
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def train_simsiam(model, predictor, loader, optimizer):
    scaler = torch.amp.GradScaler("cuda")
    for (x1, x2), _ in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            z1, z2 = model(x1.cuda()), model(x2.cuda())
            p1, p2 = predictor(z1), predictor(z2)
            p1 = p1 / (p1.norm(dim=1, keepdim=True) + 1e-8)
            loss = -(F.cosine_similarity(p1, z2.detach(), dim=-1).mean()
                     + F.cosine_similarity(p2, z1.detach(), dim=-1).mean()) * 0.5
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


@torch.no_grad()
def knn_eval(model, bank_loader, test_loader):
    model.eval()
    bank = []
    for x, _ in bank_loader:
        with torch.autocast("cuda"):
            f = model.backbone(x.cuda())
        bank.append(F.normalize(f.float(), dim=1))
    return torch.cat(bank).mean(dim=0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--epochs", type=int, default=100)
    args = parser.parse_args()
