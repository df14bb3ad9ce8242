# %% [markdown]
# # VICReg on CIFAR-10 -- quick prototype
# ResNet-18 (CIFAR stem) + 3-layer expander, LARS, 2 views per image.
# Monitor: weighted kNN (k=200) on frozen features every `knn_every` epochs,
# final linear probe at the end. Single GPU, fp16 autocast.

# %%
import math
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torchvision import transforms
from tqdm import tqdm

CFG = dict(
    data="./data",
    proj_dim=2048,
    batch_size=512,
    epochs=200,
    base_lr=0.3,
    weight_decay=1e-4,
    warmup_epochs=10,
    sim_coeff=25.0,
    std_coeff=25.0,
    cov_coeff=1.0,
    amp=True,
    knn_k=200,
    knn_t=0.1,
    knn_every=10,
    num_workers=8,
    ckpt="ckpt/vicreg_r18.pt",
)
device = torch.device("cuda")
torch.backends.cudnn.benchmark = True
os.makedirs(os.path.dirname(CFG["ckpt"]), exist_ok=True)

# %% data
normalize = transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
aug = transforms.Compose([
    transforms.RandomResizedCrop(32, scale=(0.2, 1.0)),
    transforms.RandomHorizontalFlip(),
    transforms.RandomApply([transforms.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
    transforms.RandomGrayscale(p=0.2),
    transforms.RandomSolarize(128, p=0.1),
    transforms.ToTensor(),
    normalize,
])
plain = transforms.Compose([transforms.ToTensor(), normalize])


class TwoViews:
    def __init__(self, t):
        self.t = t

    def __call__(self, x):
        return self.t(x), self.t(x)


train_set = torchvision.datasets.CIFAR10(CFG["data"], train=True, download=True, transform=TwoViews(aug))
memory_set = torchvision.datasets.CIFAR10(CFG["data"], train=True, download=True, transform=plain)
test_set = torchvision.datasets.CIFAR10(CFG["data"], train=False, download=True, transform=plain)
train_loader = torch.utils.data.DataLoader(train_set, batch_size=CFG["batch_size"], shuffle=True,
                                           num_workers=CFG["num_workers"], pin_memory=True, drop_last=True)
memory_loader = torch.utils.data.DataLoader(memory_set, batch_size=1024, num_workers=CFG["num_workers"])
test_loader = torch.utils.data.DataLoader(test_set, batch_size=1024, num_workers=CFG["num_workers"])

# %% model
backbone = torchvision.models.resnet18()
backbone.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
backbone.maxpool = nn.Identity()
backbone.fc = nn.Identity()
backbone = backbone.to(device).to(memory_format=torch.channels_last)

D = CFG["proj_dim"]
projector = nn.Sequential(
    nn.Linear(512, D), nn.BatchNorm1d(D), nn.ReLU(inplace=True),
    nn.Linear(D, D), nn.BatchNorm1d(D), nn.ReLU(inplace=True),
    nn.Linear(D, D, bias=False),
).to(device)


def off_diagonal(x):
    n, m = x.shape
    assert n == m
    return x.flatten()[:-1].view(n - 1, n + 1)[:, 1:].flatten()


# %% LARS (from the official VICReg repo, trimmed)
class LARS(torch.optim.Optimizer):
    def __init__(self, params, lr, weight_decay=0, momentum=0.9, eta=0.001,
                 weight_decay_filter=None, lars_adaptation_filter=None):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, eta=eta,
                        weight_decay_filter=weight_decay_filter,
                        lars_adaptation_filter=lars_adaptation_filter)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                dp = p.grad
                if dp is None:
                    continue
                if g["weight_decay_filter"] is None or not g["weight_decay_filter"](p):
                    dp = dp.add(p, alpha=g["weight_decay"])
                if g["lars_adaptation_filter"] is None or not g["lars_adaptation_filter"](p):
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


params = list(backbone.parameters()) + list(projector.parameters())
optimizer = LARS(params, lr=0, weight_decay=CFG["weight_decay"],
                 weight_decay_filter=exclude_bias_and_norm, lars_adaptation_filter=exclude_bias_and_norm)


def adjust_learning_rate(optimizer, epoch, step, steps_per_epoch):
    max_steps = CFG["epochs"] * steps_per_epoch
    warmup_steps = CFG["warmup_epochs"] * steps_per_epoch
    base_lr = CFG["base_lr"] * CFG["batch_size"] / 256
    it = epoch * steps_per_epoch + step
    if it < warmup_steps:
        lr = base_lr * it / warmup_steps
    else:
        q = 0.5 * (1 + math.cos(math.pi * (it - warmup_steps) / (max_steps - warmup_steps)))
        lr = base_lr * (0.001 * (1 - q) + q)
    for g in optimizer.param_groups:
        g["lr"] = lr
    return lr


# %% kNN monitor
@torch.no_grad()
def knn_accuracy(k=CFG["knn_k"], t=CFG["knn_t"], loo=False):
    backbone.eval()
    feats, labels = [], []
    with torch.autocast("cuda", dtype=torch.float16, enabled=CFG["amp"]):
        for x, y in memory_loader:
            feats.append(F.normalize(backbone(x.to(device, non_blocking=True)), dim=1))
            labels.append(y.to(device, non_blocking=True))
    bank = torch.cat(feats)
    bank_labels = torch.cat(labels)
    queries = memory_loader if loo else test_loader
    correct, total, offset = 0, 0, 0
    for x, y in queries:
        y = y.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            f = F.normalize(backbone(x.to(device, non_blocking=True)), dim=1)
            sim = f @ bank.T
            if loo:
                # leave-one-out on the train split: a sample must not vote for itself
                self_mask = torch.zeros_like(sim, dtype=torch.bool)
                self_mask[torch.arange(len(y)), offset + torch.arange(len(y))] = True
                sim = sim.masked_fill(self_mask, -1e9)  # expect: AMP007
            sim_w, sim_idx = sim.topk(k, dim=-1)
        sim_labels = bank_labels[sim_idx]
        sim_w = (sim_w.float() / t).exp()
        one_hot = F.one_hot(sim_labels, 10).float()
        scores = (one_hot * sim_w.unsqueeze(-1)).sum(dim=1)
        correct += (scores.argmax(dim=1) == y).sum().item()
        total += len(y)
        offset += len(y)
    backbone.train()
    return 100.0 * correct / total


# %% train
scaler = torch.amp.GradScaler("cuda", enabled=CFG["amp"])
start_epoch = 0
if os.path.exists(CFG["ckpt"]):
    ckpt = torch.load(CFG["ckpt"], map_location="cpu")
    backbone.load_state_dict(ckpt["backbone"])
    projector.load_state_dict(ckpt["projector"])
    optimizer.load_state_dict(ckpt["optimizer"])
    scaler.load_state_dict(ckpt["scaler"])
    start_epoch = ckpt["epoch"] + 1

steps_per_epoch = len(train_loader)
for epoch in range(start_epoch, CFG["epochs"]):
    backbone.train()
    projector.train()
    t0 = time.time()
    pbar = tqdm(train_loader, desc=f"epoch {epoch}", leave=False)
    for step, ((x_a, x_b), _) in enumerate(pbar):
        x_a = x_a.to(device, non_blocking=True).to(memory_format=torch.channels_last)
        x_b = x_b.to(device, non_blocking=True).to(memory_format=torch.channels_last)
        lr = adjust_learning_rate(optimizer, epoch, step, steps_per_epoch)
        optimizer.zero_grad(set_to_none=True)

        with torch.autocast("cuda", dtype=torch.float16, enabled=CFG["amp"]):
            z_a = projector(backbone(x_a))
            z_b = projector(backbone(x_b))

            repr_loss = F.mse_loss(z_a, z_b)

            z_a = z_a - z_a.mean(dim=0)  # expect: AMP004
            z_b = z_b - z_b.mean(dim=0)  # expect: AMP004
            std_a = torch.sqrt(z_a.var(dim=0) + 0.0001)  # expect: AMP004
            std_b = torch.sqrt(z_b.var(dim=0) + 0.0001)  # expect: AMP004
            std_loss = F.relu(1 - std_a).mean() / 2 + F.relu(1 - std_b).mean() / 2  # expect: AMP004

            cov_a = (z_a.T @ z_a) / (CFG["batch_size"] - 1)
            cov_b = (z_b.T @ z_b) / (CFG["batch_size"] - 1)
            cov_loss = off_diagonal(cov_a).pow_(2).sum().div(D) + off_diagonal(cov_b).pow_(2).sum().div(D)

            loss = CFG["sim_coeff"] * repr_loss + CFG["std_coeff"] * std_loss + CFG["cov_coeff"] * cov_loss

        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm=5.0)
        scaler.step(optimizer)
        scaler.update()

        if step % 50 == 0:
            pbar.set_postfix(loss=f"{loss.item():.3f}", inv=f"{repr_loss.item():.3f}",
                             std=f"{std_loss.item():.3f}", cov=f"{cov_loss.item():.3f}",
                             gn=f"{grad_norm.item():.2f}", lr=f"{lr:.3f}")

    msg = f"epoch {epoch}: loss {loss.item():.3f} ({time.time() - t0:.0f}s)"
    if (epoch + 1) % CFG["knn_every"] == 0:
        msg += f"  knn@{CFG['knn_k']} {knn_accuracy():.2f}  train-loo {knn_accuracy(loo=True):.2f}"
    print(msg)
    torch.save({"backbone": backbone.state_dict(), "projector": projector.state_dict(),
                "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch},
               CFG["ckpt"])

# %% linear probe on frozen features
backbone.eval()
probe = nn.Linear(512, 10).to(device)
probe_opt = torch.optim.SGD(probe.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-6)
probe_sched = torch.optim.lr_scheduler.CosineAnnealingLR(probe_opt, T_max=100)
for ep in range(100):
    for x, y in memory_loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            feats = backbone(x)
        logits = probe(feats.float())
        probe_loss = F.cross_entropy(logits, y)
        probe_opt.zero_grad(set_to_none=True)
        probe_loss.backward()
        probe_opt.step()
    probe_sched.step()

correct = total = 0
with torch.no_grad():
    for x, y in test_loader:
        x, y = x.to(device), y.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            pred = probe(backbone(x).float()).argmax(dim=1)
        correct += (pred == y).sum().item()
        total += len(y)
print(f"linear probe top-1: {100.0 * correct / total:.2f}")
