"""Metric learning for retrieval with an additive-margin (CosFace / AM-Softmax) head.

bf16 autocast on Ampere+; the GradScaler is kept (disabled) so the loop is the
same as the fp16 recipe. The backbone is compiled with torch.compile.
"""
import argparse
from collections import namedtuple
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from retrieval_data import build_sop_datasets, MPerClassSampler  # local

amp_autocast = partial(torch.autocast, device_type="cuda", dtype=torch.bfloat16)

EmbedOutput = namedtuple("EmbedOutput", ["embedding", "feature_map"])


class GeM(nn.Module):
    """Generalized-mean pooling (Radenovic et al.)."""

    def __init__(self, p=3.0, eps=1e-6):
        super().__init__()
        self.p = nn.Parameter(torch.ones(1) * p)
        self.eps = eps

    def forward(self, x):
        return x.clamp(min=self.eps).pow(self.p).mean(dim=(-2, -1)).pow(1.0 / self.p)


class ResidualStage(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.shortcut = nn.Conv2d(cin, cout, 1, stride=2)

    def forward(self, x):
        h = F.relu(self.conv1(x))
        return F.relu(self.conv2(h) + self.shortcut(x))


class EmbeddingNet(nn.Module):
    def __init__(self, emb_dim=512, width=64):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 7, stride=2, padding=3)
        self.stages = nn.Sequential(
            ResidualStage(width, width * 2),
            ResidualStage(width * 2, width * 4),
            ResidualStage(width * 4, width * 8),
        )
        self.gem = GeM()
        self.neck = nn.Linear(2 * width * 8, emb_dim)

    def forward(self, x):
        f = self.stages(F.relu(self.stem(x)))
        pooled = torch.cat([self.gem(f), f.mean(dim=(2, 3))], dim=1)  # expect: AMP004
        emb = self.neck(pooled)
        return EmbedOutput(embedding=emb, feature_map=f)


class CosFaceHead(nn.Module):
    def __init__(self, emb_dim, num_classes, s=30.0, m=0.35):
        super().__init__()
        self.s, self.m = s, m
        self.weight = nn.Parameter(torch.empty(num_classes, emb_dim))
        nn.init.xavier_uniform_(self.weight)

    def forward(self, emb, labels=None):
        cosine = F.linear(F.normalize(emb), F.normalize(self.weight))
        if labels is None:
            return self.s * cosine
        one_hot = torch.zeros_like(cosine).scatter_(1, labels.view(-1, 1), 1.0)
        return self.s * (cosine - one_hot * self.m)


def build_model(args):
    return EmbeddingNet(args.emb_dim, args.width)


def warmup_head(model, head, loader, args):
    """Fit the margin head on frozen features before the backbone is unfrozen."""
    opt = torch.optim.SGD(head.parameters(), lr=args.warmup_lr, momentum=0.9)
    model.eval()
    for step, (images, labels) in enumerate(loader):
        if step >= args.warmup_steps:
            break
        images, labels = images.cuda(non_blocking=True), labels.cuda(non_blocking=True)
        with amp_autocast():
            with torch.no_grad():
                emb = model(images).embedding
            loss = F.cross_entropy(head(emb, labels), labels)
            loss.backward()  # expect: AMP008
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.train()


def train_one_epoch(model, head, loader, optimizer, scaler, criterion, epoch, args):
    model.train()
    head.train()
    for i, (images, labels) in enumerate(loader):
        images, labels = images.cuda(non_blocking=True), labels.cuda(non_blocking=True)
        with amp_autocast(enabled=args.amp):
            out = model(images)
            logits = head(out.embedding, labels)
        loss = criterion(logits, labels)  # expect: AMP002
        scaler.scale(loss / args.accum_steps).backward()

        if (i + 1) % args.accum_steps == 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(list(model.parameters()) + list(head.parameters()), args.clip)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)

        if i % args.print_freq == 0:
            emb_norm = out.embedding.detach().norm(dim=1)  # expect: AMP004
            print(f"ep {epoch} it {i} loss {loss.item():.4f} |emb| {emb_norm.float().mean().item():.2f}")


@torch.no_grad()
def evaluate_recall(model, loader, ks=(1, 10, 100)):
    model.eval()
    embs, labels, spread = [], [], 0.0
    for images, y in loader:
        with amp_autocast():
            emb = model(images.cuda(non_blocking=True)).embedding
            spread += emb.std(dim=0).mean().item()
        embs.append(F.normalize(emb.float(), dim=1))
        labels.append(y.cuda())
    embs, labels = torch.cat(embs), torch.cat(labels)
    sim = embs @ embs.t()
    sim.fill_diagonal_(-1e9)
    topk = sim.topk(max(ks), dim=1).indices
    hits = labels[topk] == labels[:, None]
    model.train()
    return {f"R@{k}": hits[:, :k].any(dim=1).float().mean().item() for k in ks}, spread / len(loader)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--emb-dim", dest="emb_dim", type=int, default=512)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--num-classes", dest="num_classes", type=int, default=11318)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--head-lr", dest="head_lr", type=float, default=1e-2)
    p.add_argument("--warmup-lr", dest="warmup_lr", type=float, default=0.1)
    p.add_argument("--warmup-steps", dest="warmup_steps", type=int, default=500)
    p.add_argument("--smoothing", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=5.0)
    p.add_argument("--accum-steps", dest="accum_steps", type=int, default=2)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--print-freq", dest="print_freq", type=int, default=100)
    p.add_argument("--amp", action="store_true")
    return p.parse_args()


def main():
    args = parse_args()
    train_set, query_set = build_sop_datasets(args.data)
    train_loader = DataLoader(train_set, batch_size=128, sampler=MPerClassSampler(train_set.labels, m=4), num_workers=8, drop_last=True)
    query_loader = DataLoader(query_set, batch_size=256, num_workers=8)

    model = torch.compile(build_model(args).cuda())
    head = CosFaceHead(args.emb_dim, args.num_classes).cuda()
    criterion = nn.CrossEntropyLoss(label_smoothing=args.smoothing)
    optimizer = torch.optim.AdamW(
        [{"params": model.parameters(), "lr": args.lr}, {"params": head.parameters(), "lr": args.head_lr}],
        weight_decay=1e-4,
    )
    scaler = torch.amp.GradScaler("cuda", enabled=False)  # bf16: no loss scaling

    warmup_head(model, head, train_loader, args)
    best = 0.0
    for epoch in range(args.epochs):
        train_one_epoch(model, head, train_loader, optimizer, scaler, criterion, epoch, args)
        recall, spread = evaluate_recall(model, query_loader)
        print(f"epoch {epoch}: {recall} embedding spread {spread:.3f}")
        if recall["R@1"] > best:
            best = recall["R@1"]
            torch.save({"model": model._orig_mod.state_dict(), "head": head.state_dict()}, "cosface_best.pt")


if __name__ == "__main__":
    main()
