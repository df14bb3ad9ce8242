"""MoCo v2 / v3 self-supervised pre-training and the linear-evaluation protocol.

v2: query encoder trained with SGD, key encoder = EMA of the query encoder, a queue
    of 65536 negative keys, InfoNCE with temperature 0.2, fp16 autocast + GradScaler.
v3: symmetric contrastive loss without a queue, bf16 autocast (no scaler needed).
"""
import argparse
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ssl_lib.data import build_pretrain_loader, build_linear_loaders
from ssl_lib.models import MoCoV3, build_encoder


def info_nce(q, k, queue, temperature):
    q = F.normalize(q, dim=1)
    k = F.normalize(k, dim=1)
    l_pos = torch.einsum("nc,nc->n", q, k).unsqueeze(-1)
    l_neg = torch.einsum("nc,ck->nk", q, queue.clone().detach())
    logits = torch.cat([l_pos, l_neg], dim=1) / temperature
    labels = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
    return F.cross_entropy(logits, labels)


def contrastive_loss(q, k, temperature):
    q = F.normalize(q, dim=1)
    k = F.normalize(k, dim=1)
    logits = torch.einsum("nc,mc->nm", q, k) / temperature
    labels = torch.arange(logits.shape[0], dtype=torch.long, device=logits.device)
    return F.cross_entropy(logits, labels) * (2 * temperature)


class MoCoTrainer:
    def __init__(self, cfg, device):
        self.cfg = cfg
        self.device = device
        self.encoder_q = build_encoder(cfg.arch, cfg.dim, mlp=True).to(device)
        self.encoder_k = copy.deepcopy(self.encoder_q)
        self.encoder_k.requires_grad_(False)
        self.queue = F.normalize(torch.randn(cfg.dim, cfg.queue_size, device=device), dim=0)
        self.queue_ptr = 0
        self.optimizer = torch.optim.SGD(self.encoder_q.parameters(), lr=cfg.lr, momentum=0.9,
                                         weight_decay=cfg.wd)
        self.scaler = torch.amp.GradScaler("cuda")
        self.T = cfg.temperature
        self.m = cfg.moco_m

    @torch.no_grad()
    def _momentum_update_key_encoder(self):
        for p_q, p_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            p_k.mul_(self.m).add_(p_q.detach(), alpha=1.0 - self.m)

    @torch.no_grad()
    def _dequeue_and_enqueue(self, keys):
        keys = F.normalize(keys.float(), dim=1)
        bs = keys.shape[0]
        ptr = self.queue_ptr
        assert self.cfg.queue_size % bs == 0
        self.queue[:, ptr:ptr + bs] = keys.T
        self.queue_ptr = (ptr + bs) % self.cfg.queue_size

    def train_step(self, images):
        im_q, im_k = [im.to(self.device, non_blocking=True).half() for im in images]  # expect: AMP001
        with torch.autocast("cuda", dtype=torch.float16):
            q = self.encoder_q(im_q)
        with torch.no_grad():
            self._momentum_update_key_encoder()
            with torch.autocast("cuda", dtype=torch.float16):
                k = self.encoder_k(im_k)
        loss = info_nce(q, k, self.queue, self.T)  # expect: AMP002

        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self._dequeue_and_enqueue(k)
        return loss.detach()

    def adjust_lr(self, epoch):
        lr = self.cfg.lr * 0.5 * (1.0 + math.cos(math.pi * epoch / self.cfg.epochs))
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def fit(self, loader):
        for epoch in range(self.cfg.epochs):
            self.adjust_lr(epoch)
            self.encoder_q.train()
            for i, (images, _) in enumerate(loader):
                loss = self.train_step(images)
                if i % 50 == 0:
                    print(f"epoch {epoch} it {i} loss {loss.item():.4f} scale {self.scaler.get_scale():.0f}")
            torch.save({"encoder_q": self.encoder_q.state_dict(), "encoder_k": self.encoder_k.state_dict(),
                        "queue": self.queue, "optimizer": self.optimizer.state_dict(),
                        "scaler": self.scaler.state_dict(), "epoch": epoch}, self.cfg.ckpt)


def adjust_moco_momentum(progress, args):
    return 1.0 - 0.5 * (1.0 + math.cos(math.pi * progress / args.epochs)) * (1.0 - args.moco_m)


def train_one_epoch_v3(model, loader, optimizer, scheduler, epoch, args):
    model.train()
    for i, (x1, x2) in enumerate(loader):
        x1 = x1.cuda(non_blocking=True)
        x2 = x2.cuda(non_blocking=True)
        m = adjust_moco_momentum(epoch + i / len(loader), args)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            q1, q2, k1, k2 = model(x1, x2, m)
            loss = contrastive_loss(q1, k2, args.temperature) + contrastive_loss(q2, k1, args.temperature)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # expect: AMP008
        optimizer.step()
        scheduler.step()
        if i % 50 == 0:
            print(f"v3 epoch {epoch} it {i} loss {loss.item():.4f} m {m:.4f}")


@torch.no_grad()
def knn_monitor(backbone, memory_loader, test_loader, k=200, t=0.1):
    backbone.eval()
    bank, bank_labels = [], []
    for images, labels in memory_loader:
        feats = backbone(images.cuda(non_blocking=True).half())
        bank.append(F.normalize(feats.float(), dim=1))
        bank_labels.append(labels.cuda(non_blocking=True))
    bank = torch.cat(bank).T
    bank_labels = torch.cat(bank_labels)
    correct = total = 0
    for images, labels in test_loader:
        feats = F.normalize(backbone(images.cuda(non_blocking=True).half()).float(), dim=1)
        sim, idx = (feats @ bank).topk(k, dim=-1)
        votes = torch.zeros(feats.size(0), int(bank_labels.max()) + 1, device=feats.device)
        votes.scatter_add_(1, bank_labels[idx], (sim / t).exp())
        correct += (votes.argmax(1).cpu() == labels).sum().item()
        total += labels.numel()
    return correct / total


def train_linear_classifier(backbone, train_loader, val_loader, args):
    """Linear evaluation protocol: frozen backbone, one nn.Linear on pooled features."""
    backbone = backbone.cuda().eval().half()
    backbone.requires_grad_(False)
    head = nn.Linear(args.feat_dim, args.num_classes).cuda().half()  # expect: AMP001
    head.weight.data.normal_(mean=0.0, std=0.01)
    head.bias.data.zero_()
    optimizer = torch.optim.SGD(head.parameters(), lr=args.lin_lr, momentum=0.9, weight_decay=0.0)
    for epoch in range(args.lin_epochs):
        head.train()
        for images, targets in train_loader:
            images = images.cuda(non_blocking=True)
            targets = targets.cuda(non_blocking=True)
            with torch.no_grad():
                feats = backbone(images.half()).flatten(1)
            with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
                logits = head(feats)
                loss = F.cross_entropy(logits, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        acc = knn_monitor(backbone, train_loader, val_loader)
        print(f"linear epoch {epoch}: loss {loss.item():.4f} knn acc {acc:.4f}")
    return head


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--version", choices=["v2", "v3"], default="v2")
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--queue-size", type=int, default=65536)
    p.add_argument("--moco-m", type=float, default=0.999)
    p.add_argument("--temperature", type=float, default=0.2)
    p.add_argument("--lr", type=float, default=0.03)
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--feat-dim", type=int, default=2048)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--lin-lr", type=float, default=30.0)
    p.add_argument("--lin-epochs", type=int, default=100)
    p.add_argument("--ckpt", default="moco_last.pth")
    args = p.parse_args()

    loader = build_pretrain_loader(args)
    if args.version == "v2":
        trainer = MoCoTrainer(args, torch.device("cuda"))
        trainer.fit(loader)
        backbone = trainer.encoder_q.backbone
    else:
        model = MoCoV3(args.arch, dim=256, mlp_dim=4096, T=args.temperature).cuda()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1.5e-4, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(loader))
        for epoch in range(args.epochs):
            train_one_epoch_v3(model, loader, optimizer, scheduler, epoch, args)
        backbone = model.base_encoder.backbone
    train_loader, val_loader = build_linear_loaders(args)
    train_linear_classifier(backbone, train_loader, val_loader, args)


if __name__ == "__main__":
    main()
