"""Barlow Twins self-supervised pretraining (Zbontar et al., 2021) with a LARS optimizer.

Mirrors facebookresearch/barlowtwins main.py, but the batch standardisation of the
embeddings is written out as in the paper's pseudo-code instead of an affine-free BatchNorm1d.
"""
import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision


def off_diagonal(x):
    n, m = x.shape
    assert n == m
    return x.flatten()[:-1].view(n - 1, n + 1)[:, 1:].flatten()


def barlow_twins_loss(z_a, z_b, lambd=0.0051):
    n = z_a.shape[0]
    z_a_norm = (z_a - z_a.mean(0)) / (z_a.std(0) + 1e-8)  # expect: AMP004, AMP011
    z_b_norm = (z_b - z_b.mean(0)) / (z_b.std(0) + 1e-8)  # expect: AMP004, AMP011
    c = z_a_norm.T @ z_b_norm / n
    on_diag = (torch.diagonal(c) - 1).pow(2).sum()
    off_diag = off_diagonal(c).pow(2).sum()
    return on_diag + lambd * off_diag


class BarlowTwins(nn.Module):
    def __init__(self, projector="8192-8192-8192", lambd=0.0051):
        super().__init__()
        self.backbone = torchvision.models.resnet50(zero_init_residual=True)
        self.backbone.fc = nn.Identity()
        sizes = [2048] + [int(s) for s in projector.split("-")]
        layers = []
        for i in range(len(sizes) - 2):
            layers += [nn.Linear(sizes[i], sizes[i + 1], bias=False), nn.BatchNorm1d(sizes[i + 1]), nn.ReLU(inplace=True)]
        self.projector = nn.Sequential(*layers, nn.Linear(sizes[-2], sizes[-1], bias=False))
        self.lambd = lambd
        self.feat_std = 0.0

    def forward(self, y1, y2):
        f1, f2 = self.backbone(y1), self.backbone(y2)
        with torch.no_grad():
            # collapse monitor on the backbone features
            self.feat_std = f1.std(0).mean().item()
        return barlow_twins_loss(self.projector(f1), self.projector(f2), self.lambd)


class LARS(torch.optim.Optimizer):
    def __init__(self, params, lr, weight_decay=0, momentum=0.9, eta=0.001,
                 weight_decay_filter=False, lars_adaptation_filter=False):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, eta=eta,
                        weight_decay_filter=weight_decay_filter, lars_adaptation_filter=lars_adaptation_filter)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                dp = p.grad
                if dp is None:
                    continue
                if not g["weight_decay_filter"] or p.ndim != 1:
                    dp = dp.add(p, alpha=g["weight_decay"])
                if not g["lars_adaptation_filter"] or p.ndim != 1:
                    param_norm = torch.norm(p)
                    update_norm = torch.norm(dp)
                    one = torch.ones_like(param_norm)
                    q = torch.where(param_norm > 0.0,
                                    torch.where(update_norm > 0, (g["eta"] * param_norm / update_norm), one), one)
                    dp = dp.mul(q)
                state = self.state[p]
                if "mu" not in state:
                    state["mu"] = torch.zeros_like(p)
                mu = state["mu"]
                mu.mul_(g["momentum"]).add_(dp)
                p.add_(mu, alpha=-g["lr"])


def exclude_bias_and_norm(p):
    return p.ndim == 1


def adjust_learning_rate(args, optimizer, loader_len, step):
    max_steps = args.epochs * loader_len
    warmup_steps = 10 * loader_len
    base_lr = args.batch_size / 256
    if step < warmup_steps:
        lr = base_lr * step / warmup_steps
    else:
        step -= warmup_steps
        q = 0.5 * (1 + math.cos(math.pi * step / (max_steps - warmup_steps)))
        lr = base_lr * (q + 0.001 * (1 - q))
    optimizer.param_groups[0]["lr"] = lr * args.lr_weights
    optimizer.param_groups[1]["lr"] = lr * args.lr_biases


def train(model, loader, optimizer, scaler, args):
    start = time.time()
    for epoch in range(args.epochs):
        for step, ((y1, y2), _) in enumerate(loader, start=epoch * len(loader)):
            y1, y2 = y1.cuda(non_blocking=True), y2.cuda(non_blocking=True)
            adjust_learning_rate(args, optimizer, len(loader), step)
            optimizer.zero_grad()
            if args.amp:
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = model(y1, y2)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss = model(y1, y2)
                loss.backward()
            optimizer.step()  # expect: AMP006
            if step % args.print_freq == 0:
                print(dict(epoch=epoch, step=step, loss=loss.item(), feat_std=model.feat_std,
                           time=int(time.time() - start)))


@torch.no_grad()
def knn_eval(model, bank_loader, test_loader, k=20):
    model.eval()
    bank, labels = [], []
    for x, y in bank_loader:
        with torch.autocast("cuda", dtype=torch.float16):
            z = model.projector(model.backbone(x.cuda()))
            z = z - z.mean(0)
        bank.append(F.normalize(z.float(), dim=1))
        labels.append(y.cuda())
    bank, labels = torch.cat(bank), torch.cat(labels)
    correct = total = 0
    for x, y in test_loader:
        z = model.projector(model.backbone(x.cuda())).float()
        sim = F.normalize(z - z.mean(0), dim=1) @ bank.T
        pred = labels[sim.topk(k, dim=1).indices].mode(dim=1).values
        correct += (pred.cpu() == y).sum().item()
        total += y.numel()
    model.train()
    return correct / max(total, 1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=1000)
    parser.add_argument("--batch-size", dest="batch_size", type=int, default=2048)
    parser.add_argument("--lr-weights", dest="lr_weights", type=float, default=0.2)
    parser.add_argument("--lr-biases", dest="lr_biases", type=float, default=0.0048)
    parser.add_argument("--weight-decay", dest="weight_decay", type=float, default=1.5e-6)
    parser.add_argument("--print-freq", dest="print_freq", type=int, default=100)
    parser.add_argument("--amp", action="store_true")
    args = parser.parse_args()
    model = BarlowTwins().cuda()
    param_weights = [p for p in model.parameters() if p.ndim != 1]
    param_biases = [p for p in model.parameters() if p.ndim == 1]
    optimizer = LARS([{"params": param_weights}, {"params": param_biases}], lr=0, weight_decay=args.weight_decay,
                     weight_decay_filter=True, lars_adaptation_filter=True)
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
    loader = []  # two-crop ImageNet loader from the augmentations module
    train(model, loader, optimizer, scaler, args)


if __name__ == "__main__":
    main()
