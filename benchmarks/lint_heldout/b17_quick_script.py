# quick exp: SimCLR-style pretrain on tiny images, then finetune / probe
# usage: python b17_quick_script.py --data /scratch/tiny.pt --pretrain_epochs 50
import argparse
import copy
import math
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--data", default="/scratch/tiny.pt")
parser.add_argument("--bs", type=int, default=512)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--ft_lr", type=float, default=0.05)
parser.add_argument("--temp", type=float, default=0.2)
parser.add_argument("--pretrain_epochs", type=int, default=50)
parser.add_argument("--ft_epochs", type=int, default=20)
parser.add_argument("--probe_epochs", type=int, default=10)
parser.add_argument("--mixup", action="store_true")
parser.add_argument("--std_w", type=float, default=0.1)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--out", default="runs/quick")
args = parser.parse_args()

torch.manual_seed(args.seed)
np.random.seed(args.seed)
device = "cuda"
os.makedirs(args.out, exist_ok=True)

blob = torch.load(args.data)
train_ds = TensorDataset(blob["x_train"], blob["y_train"])
test_ds = TensorDataset(blob["x_test"], blob["y_test"])
train_loader = DataLoader(train_ds, batch_size=args.bs, shuffle=True, drop_last=True, num_workers=4)
test_loader = DataLoader(test_ds, batch_size=1024, shuffle=False, num_workers=4)

MEAN = torch.tensor([0.485, 0.456, 0.406], device=device).view(1, 3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225], device=device).view(1, 3, 1, 1)


def augment(x):
    # cheap GPU aug: random crop via roll + flip + color jitter
    b = x.size(0)
    flip = torch.rand(b, device=x.device) < 0.5
    x = torch.where(flip[:, None, None, None], x.flip(3), x)
    dx, dy = np.random.randint(-4, 5, size=2)
    x = torch.roll(x, shifts=(int(dx), int(dy)), dims=(2, 3))
    jitter = 1.0 + 0.4 * (torch.rand(b, 3, 1, 1, device=x.device) - 0.5)
    return ((x * jitter).clamp(0, 1) - MEAN) / STD


class Net(nn.Module):
    def __init__(self, dim=256, n_cls=10):
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Linear(3 * 32 * 32, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, dim)
        )
        self.proj = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, 128))
        self.head = nn.Linear(dim, n_cls)

    def forward(self, x):
        return self.head(self.encoder(x.flatten(1)))


def nt_xent(z1, z2, t=0.5):
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    sim = z @ z.t() / t
    self_mask = torch.eye(sim.size(0), dtype=torch.bool, device=sim.device)
    sim = sim.masked_fill(self_mask, -1e9)  # expect: AMP007
    n = z1.size(0)
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]).to(sim.device)
    return F.cross_entropy(sim, targets)


model = Net().to(device)
opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
ft_opt = torch.optim.SGD(model.parameters(), lr=args.ft_lr, momentum=0.9, nesterov=True)
scaler = torch.cuda.amp.GradScaler()  # expect: AMP009
log = open(os.path.join(args.out, "log.txt"), "a")


def pretrain_epoch(ep):
    model.train()
    t0 = time.time()
    tot = 0.0
    for it, (x, _) in enumerate(train_loader):
        x = x.to(device, non_blocking=True)
        x1, x2 = augment(x), augment(x)
        with torch.autocast("cuda", dtype=torch.float16):
            emb = model.encoder(x1.flatten(1))
            z1 = model.proj(emb)
            z2 = model.proj(model.encoder(x2.flatten(1)))
            loss = nt_xent(z1, z2, args.temp)
            # variance term so the embedding doesn't collapse (vicreg-ish)
            std_reg = F.relu(1.0 - torch.sqrt(emb.var(dim=0) + 1e-4)).mean()  # expect: AMP004
            loss = loss + args.std_w * std_reg
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        tot += loss.item()
    print(f"[pretrain] ep {ep} loss {tot / (it + 1):.4f} ({time.time() - t0:.1f}s)", file=log, flush=True)


def finetune_epoch(ep):
    model.train()
    tot = 0.0
    for it, (x, y) in enumerate(train_loader):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        x = augment(x)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(x)
            loss = F.cross_entropy(logits, y, label_smoothing=0.1)
            ft_opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()  # expect: AMP008
        scaler.step(ft_opt)
        scaler.update()
        tot += loss.item()
    print(f"[ft] ep {ep} loss {tot / (it + 1):.4f}", file=log, flush=True)


def finetune_mixup_epoch(ep, alpha=0.4):
    model.train()
    tot = 0.0
    for it, (x, y) in enumerate(train_loader):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        x = augment(x)
        lam = float(np.random.beta(alpha, alpha))
        perm = torch.randperm(x.size(0), device=device)
        x = lam * x + (1 - lam) * x[perm]
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(x)
            loss = lam * F.cross_entropy(logits, y) + (1 - lam) * F.cross_entropy(logits, y[perm])
        ft_opt.zero_grad(set_to_none=True)
        loss = scaler.scale(loss)
        loss.backward()
        ft_opt.step()  # expect: AMP006
        tot += loss.item() / scaler.get_scale()
    print(f"[ft-mix] ep {ep} loss {tot / (it + 1):.4f}", file=log, flush=True)


@torch.no_grad()
def evaluate():
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    for x, y in test_loader:
        x, y = x.to(device), y.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model((x - MEAN) / STD)
        loss_sum += F.cross_entropy(logits.float(), y, reduction="sum").item()
        correct += (logits.argmax(1) == y).sum().item()
        total += y.numel()
    model.train()
    return loss_sum / total, correct / total


def train_probe(n_epochs):
    # linear probe on frozen features, in half to go fast
    model.eval()
    probe = nn.Linear(256, 10).to(device).half()  # expect: AMP001
    probe_opt = torch.optim.Adam(probe.parameters(), lr=1e-3)  # expect: AMP011
    for ep in range(n_epochs):
        for x, y in train_loader:
            x, y = x.to(device), y.to(device)
            with torch.no_grad():
                feats = model.encoder(((x - MEAN) / STD).flatten(1)).half()
            loss = F.cross_entropy(probe(feats).float(), y)
            probe_opt.zero_grad()
            loss.backward()
            probe_opt.step()
    correct = total = 0
    with torch.no_grad():
        for x, y in test_loader:
            x, y = x.to(device), y.to(device)
            feats = model.encoder(((x - MEAN) / STD).flatten(1)).half()
            correct += (probe(feats).argmax(1) == y).sum().item()
            total += y.numel()
    return correct / total


best_acc = 0.0
best_loss = 1e9
history = {"best_val": 1e9, "acc": []}

for ep in range(args.pretrain_epochs):
    pretrain_epoch(ep)
    if ep % 10 == 0 or ep == args.pretrain_epochs - 1:
        torch.save(model.state_dict(), os.path.join(args.out, "pretrain.pt"))

probe_acc = train_probe(args.probe_epochs)
print(f"probe acc {probe_acc:.4f}", file=log, flush=True)

for ep in range(args.ft_epochs):
    if args.mixup:
        finetune_mixup_epoch(ep)
    else:
        finetune_epoch(ep)
    val_loss, acc = evaluate()
    history["acc"].append(acc)
    if val_loss < history["best_val"]:
        history["best_val"] = val_loss
    if acc > best_acc:
        best_acc = acc
        torch.save(model.state_dict(), os.path.join(args.out, "best.pt"))
    print(f"ep {ep} val_loss {val_loss:.4f} acc {acc:.4f} (best {best_acc:.4f})", file=log, flush=True)

log.close()
