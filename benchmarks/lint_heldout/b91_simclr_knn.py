"""SimCLR pre-training on CIFAR-10 with an online linear probe and a kNN monitor.

    python simclr_knn.py --data ./data --arch resnet18 --epochs 200 --batch-size 512
"""
import argparse
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T


CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


class TwoCrop:
    def __init__(self, transform):
        self.transform = transform

    def __call__(self, img):
        return self.transform(img), self.transform(img)


def build_loaders(root, batch_size, workers):
    aug = T.Compose([
        T.RandomResizedCrop(32, scale=(0.2, 1.0)),
        T.RandomHorizontalFlip(),
        T.RandomApply([T.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8),
        T.RandomGrayscale(p=0.2),
        T.ToTensor(),
        T.Normalize(CIFAR_MEAN, CIFAR_STD),
    ])
    plain = T.Compose([T.ToTensor(), T.Normalize(CIFAR_MEAN, CIFAR_STD)])
    train = torchvision.datasets.CIFAR10(root, train=True, download=True, transform=TwoCrop(aug))
    memory = torchvision.datasets.CIFAR10(root, train=True, download=True, transform=plain)
    test = torchvision.datasets.CIFAR10(root, train=False, download=True, transform=plain)
    kw = dict(num_workers=workers, pin_memory=True)
    return (
        torch.utils.data.DataLoader(train, batch_size, shuffle=True, drop_last=True, **kw),
        torch.utils.data.DataLoader(memory, 512, shuffle=False, **kw),
        torch.utils.data.DataLoader(test, 512, shuffle=False, **kw),
    )


class SimCLR(nn.Module):
    def __init__(self, arch="resnet18", proj_dim=128, num_classes=10):
        super().__init__()
        backbone = getattr(torchvision.models, arch)(num_classes=num_classes)
        # CIFAR stem: 3x3 conv, no max-pool
        backbone.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        backbone.maxpool = nn.Identity()
        self.out_dim = backbone.fc.in_features
        backbone.fc = nn.Identity()
        self.backbone = backbone
        self.projector = nn.Sequential(
            nn.Linear(self.out_dim, 2048),
            nn.BatchNorm1d(2048),
            nn.ReLU(inplace=True),
            nn.Linear(2048, proj_dim),
        )
        self.probe = nn.Linear(self.out_dim, num_classes)

    def forward(self, x):
        h = self.backbone(x)
        return h, self.projector(h)


def nt_xent(z1, z2, temperature=0.5):
    n = z1.size(0)
    z = F.normalize(torch.cat([z1, z2], dim=0), dim=1)
    sim = z @ z.t() / temperature
    self_mask = torch.eye(2 * n, dtype=torch.bool, device=z.device)
    sim.masked_fill_(self_mask, -9e15)  # expect: AMP007
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]).to(z.device)
    return F.cross_entropy(sim, targets)


@torch.no_grad()
def knn_monitor(model, memory_loader, test_loader, device, k=200, t=0.1, num_classes=10):
    model.eval()
    n = len(memory_loader.dataset)
    bank = torch.zeros(n, model.out_dim, dtype=torch.float16, device=device)
    bank_labels = torch.zeros(n, dtype=torch.long, device=device)
    ptr = 0
    for images, labels in memory_loader:
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            feats = model.backbone(images.to(device, non_blocking=True))
        bs = feats.size(0)
        bank[ptr:ptr + bs] = feats
        bank_labels[ptr:ptr + bs] = labels.to(device)
        ptr += bs
    bank = bank / (bank.norm(dim=1, keepdim=True) + 1e-8)  # expect: AMP004 AMP011
    gallery = bank.float().t().contiguous()

    correct = total = 0
    for images, labels in test_loader:
        labels = labels.to(device, non_blocking=True)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            feats = model.backbone(images.to(device, non_blocking=True))
        feats = F.normalize(feats.float(), dim=1)
        sim = feats @ gallery
        sim_w, sim_idx = sim.topk(k, dim=-1)
        sim_labels = torch.gather(bank_labels.expand(feats.size(0), -1), -1, sim_idx)
        sim_w = (sim_w / t).exp()
        one_hot = F.one_hot(sim_labels, num_classes).float()
        scores = (one_hot * sim_w.unsqueeze(-1)).sum(dim=1)
        correct += (scores.argmax(dim=1) == labels).sum().item()
        total += labels.size(0)
    model.train()
    return 100.0 * correct / total


def cosine_with_warmup(optimizer, warmup_steps, total_steps):
    def lr_lambda(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)


def train_one_epoch(model, loader, optimizer, scaler, scheduler, device, epoch, args):
    model.train()
    for it, ((x1, x2), labels) in enumerate(loader):
        x1 = x1.to(device, non_blocking=True)
        x2 = x2.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)

        with torch.autocast(device_type="cuda", dtype=torch.float16):
            h1, z1 = model(x1)
            _, z2 = model(x2)
            loss = nt_xent(z1, z2, args.temperature)
            # the probe sees detached features so it does not shape the representation
            probe_logits = model.probe(h1.detach())
        probe_loss = F.cross_entropy(probe_logits, labels)  # expect: AMP002

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss + probe_loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()

        if it % args.log_every == 0:
            acc = (probe_logits.argmax(1) == labels).float().mean().item()
            print(
                f"epoch {epoch} it {it:4d} loss {loss.item():.4f} probe {probe_loss.item():.3f} "
                f"acc {acc:.3f} gnorm {grad_norm:.2f} scale {scaler.get_scale():.0f}"
            )


def main():
    parser = argparse.ArgumentParser(description="SimCLR on CIFAR-10")
    parser.add_argument("--data", default="./data")
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--wd", type=float, default=1e-6)
    parser.add_argument("--temperature", type=float, default=0.5)
    parser.add_argument("--clip", type=float, default=3.0)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--knn-every", type=int, default=10)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--out", default="checkpoints/simclr")
    args = parser.parse_args()

    torch.backends.cudnn.benchmark = True
    device = torch.device("cuda")
    train_loader, memory_loader, test_loader = build_loaders(args.data, args.batch_size, args.workers)

    model = SimCLR(args.arch).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wd, eps=1e-8)
    total_steps = args.epochs * len(train_loader)
    scheduler = cosine_with_warmup(optimizer, 10 * len(train_loader), total_steps)
    scaler = torch.amp.GradScaler("cuda")

    os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        t0 = time.time()
        train_one_epoch(model, train_loader, optimizer, scaler, scheduler, device, epoch, args)
        if (epoch + 1) % args.knn_every == 0 or epoch + 1 == args.epochs:
            acc = knn_monitor(model, memory_loader, test_loader, device)
            print(f"epoch {epoch} knn@200 {acc:.2f} ({time.time() - t0:.0f}s)")
            if acc > best:
                best = acc
                torch.save({"model": model.state_dict(), "epoch": epoch, "knn": acc},
                           os.path.join(args.out, "best.pt"))
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scaler": scaler.state_dict(), "epoch": epoch},
                   os.path.join(args.out, "last.pt"))


if __name__ == "__main__":
    main()
