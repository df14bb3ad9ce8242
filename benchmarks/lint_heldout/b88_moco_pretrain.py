"""MoCo v2 pretraining (single node) with bfloat16 autocast.

The negative queue holds 65536 keys, so the contrastive logits are (N, 1 + 65536) per step.
"""
import argparse
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.utils.data import DataLoader


class TwoCrops:
    def __init__(self, base):
        self.base = base

    def __call__(self, x):
        return self.base(x), self.base(x)


def moco_v2_augment(size=224):
    normalize = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    return T.Compose([
        T.RandomResizedCrop(size, scale=(0.2, 1.0)),
        T.RandomApply([T.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8),
        T.RandomGrayscale(p=0.2),
        T.RandomApply([T.GaussianBlur(23, sigma=(0.1, 2.0))], p=0.5),
        T.RandomHorizontalFlip(),
        T.ToTensor(),
        normalize,
    ])


class MoCo(nn.Module):
    def __init__(self, dim=128, K=65536, m=0.999, mlp_dim=2048):
        super().__init__()
        self.K, self.m = K, m
        self.encoder_q = torchvision.models.resnet50(num_classes=dim)
        self.encoder_k = torchvision.models.resnet50(num_classes=dim)
        hidden = self.encoder_q.fc.weight.shape[1]
        self.encoder_q.fc = nn.Sequential(nn.Linear(hidden, mlp_dim), nn.ReLU(), nn.Linear(mlp_dim, dim))
        self.encoder_k.fc = nn.Sequential(nn.Linear(hidden, mlp_dim), nn.ReLU(), nn.Linear(mlp_dim, dim))
        for pq, pk in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            pk.data.copy_(pq.data)
            pk.requires_grad = False
        self.register_buffer("queue", F.normalize(torch.randn(dim, K), dim=0))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    @torch.no_grad()
    def momentum_update(self):
        for pq, pk in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            pk.data.mul_(self.m).add_(pq.data, alpha=1.0 - self.m)

    @torch.no_grad()
    def enqueue(self, keys):
        n = keys.shape[0]
        ptr = int(self.queue_ptr)
        assert self.K % n == 0
        self.queue[:, ptr: ptr + n] = keys.T.to(self.queue.dtype)
        self.queue_ptr[0] = (ptr + n) % self.K


def adjust_lr(optimizer, epoch, args):
    lr = args.lr * 0.5 * (1.0 + math.cos(math.pi * epoch / args.epochs))
    for g in optimizer.param_groups:
        g["lr"] = lr
    return lr


def main():
    parser = argparse.ArgumentParser(description="MoCo v2 pretraining")
    parser.add_argument("data")
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("-b", "--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=0.03)
    parser.add_argument("--wd", type=float, default=1e-4)
    parser.add_argument("--moco-t", type=float, default=0.2)
    parser.add_argument("--moco-k", type=int, default=65536)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--save-dir", default="checkpoints/moco_v2")
    args = parser.parse_args()

    device = torch.device("cuda")
    dataset = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), TwoCrops(moco_v2_augment()))
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = MoCo(K=args.moco_k).to(device).to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.encoder_q.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.wd)
    os.makedirs(args.save_dir, exist_ok=True)

    for epoch in range(args.epochs):
        lr = adjust_lr(optimizer, epoch, args)
        model.train()
        for i, ((im_q, im_k), _) in enumerate(loader):
            im_q = im_q.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
            im_k = im_k.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
            optimizer.zero_grad(set_to_none=True)

            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                q = F.normalize(model.encoder_q(im_q), dim=1)
                with torch.no_grad():
                    model.momentum_update()
                    k = F.normalize(model.encoder_k(im_k), dim=1)
                pos = torch.einsum("nc,nc->n", q, k)
                neg = torch.einsum("nc,ck->nk", q, model.queue.clone().detach())
                logits = torch.cat([pos.unsqueeze(-1), neg], dim=1) / args.moco_t
                labels = torch.zeros(logits.shape[0], dtype=torch.long, device=device)
                loss = F.cross_entropy(logits, labels)
                pos_sim = pos.mean().detach()  # expect: AMP004
                neg_sim = neg.mean().detach()  # expect: AMP004
                loss.backward()  # expect: AMP008

            optimizer.step()
            model.enqueue(k)

            if i % 50 == 0:
                acc1 = (logits.argmax(dim=1) == 0).float().mean().item() * 100
                print(f"[{epoch}][{i}/{len(loader)}] lr {lr:.4f} loss {loss.item():.4f} "
                      f"acc@1 {acc1:.2f} pos {pos_sim.item():.3f} neg {neg_sim.item():.3f}")

        torch.save({"epoch": epoch + 1, "state_dict": model.state_dict(), "optimizer": optimizer.state_dict()},
                   os.path.join(args.save_dir, f"checkpoint_{epoch:04d}.pth.tar"))


if __name__ == "__main__":
    main()
