"""Frozen-backbone evaluation: extract features once into an fp16 cache,
then run k-NN and linear-probe evaluation from the cache.

    python feature_probe.py extract --backbone dinov2_vitl14 --data /datasets/inet --out feats/
    python feature_probe.py probe --cache feats/ --epochs 100
"""
import argparse
import os
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision import datasets, transforms


def make_loader(root, split, batch_size, workers):
    tf = transforms.Compose([
        transforms.Resize(256, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
        transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    ])
    ds = datasets.ImageFolder(os.path.join(root, split), tf)
    return DataLoader(ds, batch_size=batch_size, num_workers=workers, pin_memory=True), len(ds.classes)


@torch.inference_mode()
def extract(backbone, loader, device, out_file):
    backbone.eval()
    n = len(loader.dataset)
    feats = torch.empty((n, backbone.embed_dim), dtype=torch.float16)
    labels = torch.empty(n, dtype=torch.long)
    i = 0
    for images, targets in loader:
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            f = backbone(images.to(device, non_blocking=True))
        feats[i:i + f.shape[0]] = f.to(torch.float16).cpu()
        labels[i:i + f.shape[0]] = targets
        i += f.shape[0]
    mean = feats.mean(dim=0)
    std = feats.float().std(dim=0)
    torch.save({"feats": feats, "labels": labels, "mean": mean, "std": std}, out_file)
    return out_file


class FeatureCache:
    def __init__(self, path, device):
        blob = torch.load(path, map_location="cpu")
        self.device = device
        self.labels = blob["labels"]
        self.feats = torch.empty(tuple(blob["feats"].shape), dtype=torch.float16).pin_memory()
        self.feats.copy_(blob["feats"])
        self.mean = blob["mean"].float()
        self.std = blob["std"].float().clamp_min(1e-6)

    def __len__(self):
        return self.feats.shape[0]

    def batch(self, idx):
        x = self.feats[idx].to(self.device, non_blocking=True).float()
        return (x - self.mean.to(self.device)) / self.std.to(self.device), self.labels[idx].to(self.device)

    @torch.inference_mode()
    def knn_predict(self, queries, num_classes, k=20, temperature=0.07, chunk=4096):
        bank = self.feats.to(self.device, non_blocking=True)
        norms = torch.linalg.vector_norm(bank.float(), dim=1, keepdim=True).half()
        bank = bank / (norms + 1e-8)  # expect: AMP011
        queries = F.normalize(queries.float(), dim=-1).half()
        bank_labels = self.labels.to(self.device)
        preds = []
        for q in queries.split(chunk):
            sims, idx = (q @ bank.T).topk(k, dim=-1)
            weights = (sims.float() / temperature).exp()
            votes = torch.zeros(q.shape[0], num_classes, device=self.device, dtype=torch.float32)
            votes.scatter_add_(1, bank_labels[idx], weights)
            preds.append(votes.argmax(dim=-1))
        return torch.cat(preds)


def train_probe(train_cache, val_cache, num_classes, epochs, lr, batch_size, use_bf16, device):
    dim = train_cache.feats.shape[1]
    probe = nn.Linear(dim, num_classes).to(device)
    nn.init.zeros_(probe.bias)
    nn.init.normal_(probe.weight, std=0.01)
    opt = torch.optim.AdamW(probe.parameters(), lr=lr, weight_decay=1e-4, eps=1e-8)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs)
    autocast_ctx = torch.autocast(device_type="cuda", dtype=torch.bfloat16) if use_bf16 else nullcontext()
    best_acc, n = 0.0, len(train_cache)
    for epoch in range(epochs):
        probe.train()
        perm = torch.randperm(n)
        running = 0.0
        for start in range(0, n, batch_size):
            x, y = train_cache.batch(perm[start:start + batch_size])
            with autocast_ctx:
                loss = F.cross_entropy(probe(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            running += loss.item() * y.numel()
        sched.step()
        acc = eval_probe(probe, val_cache, batch_size)
        best_acc = max(best_acc, acc)
        print(f"epoch {epoch}: train loss {running / n:.4f} val acc {acc:.2f} (best {best_acc:.2f})")
    return probe, best_acc


@torch.no_grad()
def eval_probe(probe, cache, batch_size):
    probe.eval()
    correct = 0
    for start in range(0, len(cache), batch_size):
        idx = torch.arange(start, min(start + batch_size, len(cache)))
        x, y = cache.batch(idx)
        correct += (probe(x).argmax(-1) == y).sum().item()
    return 100.0 * correct / len(cache)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("cmd", choices=["extract", "probe", "knn"])
    p.add_argument("--backbone", default="dinov2_vitl14")
    p.add_argument("--data", default="/datasets/imagenet")
    p.add_argument("--cache", default="feats")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--bf16", action="store_true")
    args = p.parse_args()
    device = torch.device("cuda")
    os.makedirs(args.cache, exist_ok=True)

    if args.cmd == "extract":
        backbone = torch.hub.load("facebookresearch/dinov2", args.backbone).to(device)
        for split in ("train", "val"):
            loader, _ = make_loader(args.data, split, 256, args.workers)
            extract(backbone, loader, device, os.path.join(args.cache, f"{split}.pt"))
        return

    train_cache = FeatureCache(os.path.join(args.cache, "train.pt"), device)
    val_cache = FeatureCache(os.path.join(args.cache, "val.pt"), device)
    num_classes = int(train_cache.labels.max()) + 1
    if args.cmd == "knn":
        queries = val_cache.feats.to(device)
        preds = train_cache.knn_predict(queries, num_classes)
        acc = (preds.cpu() == val_cache.labels).float().mean().item() * 100
        print(f"k-NN top-1: {acc:.2f}")
    else:
        _, best = train_probe(train_cache, val_cache, num_classes, args.epochs, args.lr,
                              args.batch_size, args.bf16, device)
        print(f"linear probe top-1: {best:.2f}")


if __name__ == "__main__":
    main()
