"""Deep metric learning on CUB-200 / Cars196 / SOP.

Batch-hard triplets mined inside each P x K batch, an optional supervised-contrastive
term, GeM pooling. Evaluation: Recall@K on the test classes.
"""
import argparse
import copy
import logging
import os
import random
from collections import defaultdict

import torch as th
import torch.nn.functional as F
import torchvision
from torch import nn
from torch.utils.data import DataLoader, Sampler

from dml.datasets import build_dataset
from dml.utils import WarmupCosine, save_checkpoint

log = logging.getLogger(__name__)


class GeM(nn.Module):
    def __init__(self, p=3.0, eps=1e-6):
        super().__init__()
        self.p = nn.Parameter(th.ones(1) * p)
        self.eps = eps

    def forward(self, x):
        return F.avg_pool2d(x.clamp(min=self.eps).pow(self.p), x.shape[-2:]).pow(1.0 / self.p).flatten(1)


class EmbeddingNet(nn.Module):
    def __init__(self, arch="resnet50", embed_dim=512, pretrained=True):
        super().__init__()
        backbone = getattr(torchvision.models, arch)(weights="IMAGENET1K_V2" if pretrained else None)
        self.features = nn.Sequential(*list(backbone.children())[:-2])
        self.pool = GeM()
        self.embed = nn.Linear(backbone.fc.in_features, embed_dim)
        nn.init.orthogonal_(self.embed.weight)
        nn.init.zeros_(self.embed.bias)

    def forward(self, x):
        return self.embed(self.pool(self.features(x)))


def build_model(cfg):
    return EmbeddingNet(cfg.arch, cfg.embed_dim, pretrained=not cfg.no_pretrained)


class PKSampler(Sampler):
    """P classes per batch, K images per class."""

    def __init__(self, labels, p, k):
        self.p, self.k = p, k
        self.index = defaultdict(list)
        for i, y in enumerate(labels):
            self.index[int(y)].append(i)
        self.classes = [c for c, idx in self.index.items() if len(idx) >= 2]

    def __iter__(self):
        classes = random.sample(self.classes, len(self.classes))
        for start in range(0, len(classes) - self.p + 1, self.p):
            batch = []
            for c in classes[start:start + self.p]:
                idx = self.index[c]
                batch.extend(random.sample(idx, self.k) if len(idx) >= self.k else random.choices(idx, k=self.k))
            yield batch

    def __len__(self):
        return len(self.classes) // self.p


@th.no_grad()
def mine_batch_hard(dist, labels):
    same = labels[:, None] == labels[None, :]
    eye = th.eye(len(labels), dtype=th.bool, device=labels.device)
    pos_dist = dist.masked_fill(~same | eye, float("-inf"))
    neg_dist = dist.masked_fill(same, th.finfo(dist.dtype).max)
    valid = (same & ~eye).any(1) & (~same).any(1)
    anchors = th.nonzero(valid).squeeze(1)
    return anchors, pos_dist.argmax(1)[anchors], neg_dist.argmin(1)[anchors]


class SupConLoss(nn.Module):
    """Supervised contrastive loss (Khosla et al., 2020) on L2-normalised embeddings."""

    def __init__(self, temperature=0.07):
        super().__init__()
        self.temperature = temperature

    def forward(self, features, labels):
        n = features.size(0)
        sim = features @ features.t()
        self_mask = th.eye(n, dtype=th.bool, device=features.device)
        sim = sim.masked_fill(self_mask, -1e9)  # expect: AMP007
        logits = sim.float() / self.temperature
        log_prob = logits - th.logsumexp(logits, dim=1, keepdim=True)
        pos_mask = (labels[:, None] == labels[None, :]) & ~self_mask
        pos_count = pos_mask.sum(1)
        mean_log_prob_pos = (log_prob * pos_mask).sum(1) / pos_count.clamp(min=1)
        return -mean_log_prob_pos[pos_count > 0].mean()


def train_epoch(model, loader, criterion, supcon, optimizer, scheduler, scaler, epoch, cfg):
    model.train()
    for it, (images, labels) in enumerate(loader):
        images = images.cuda(non_blocking=True)
        labels = labels.cuda(non_blocking=True)
        with th.autocast("cuda", dtype=th.float16):
            emb = model(images)
            sim = emb @ emb.t()
            sq = th.diagonal(sim)
            dist = th.sqrt((sq[:, None] + sq[None, :] - 2.0 * sim).clamp_min(0.0) + 1e-12)  # expect: AMP011
            anchors, positives, negatives = mine_batch_hard(dist.detach(), labels)
            aux = supcon(F.normalize(emb, dim=1), labels) if supcon is not None else None
            with th.no_grad():
                same = labels[:, None] == labels[None, :]
                pos = same & ~th.eye(len(labels), dtype=th.bool, device=labels.device)
                sim_gap = (sim[pos].mean() - sim[~same].mean()).item()  # expect: AMP004
        loss = criterion(emb[anchors], emb[positives], emb[negatives])  # expect: AMP002
        if aux is not None:
            loss = loss + cfg.supcon_weight * aux

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        if it % cfg.log_every == 0:
            log.info("ep %d it %d loss %.4f triplets %d sim_gap %.3f |g| %.2f", epoch, it, loss.item(),
                     anchors.numel(), sim_gap, grad_norm.item())


@th.no_grad()
def extract(model, loader):
    model.eval()
    feats, labels = [], []
    for images, y in loader:
        with th.autocast("cuda", dtype=th.float16):
            f = model(images.cuda(non_blocking=True))
        feats.append(F.normalize(f.float(), dim=1).cpu())
        labels.append(y)
    return th.cat(feats), th.cat(labels)


def recall_at_k(feats, labels, ks=(1, 2, 4, 8)):
    sim = feats @ feats.t()
    sim.fill_diagonal_(float("-inf"))
    topk = sim.topk(max(ks), dim=1).indices
    hits = labels[topk] == labels[:, None]
    return {k: hits[:, :k].any(1).float().mean().item() for k in ks}


@th.no_grad()
def export_torchscript(model, path, image_size=224):
    serving = copy.deepcopy(model).half().eval().cuda()
    example = th.randn(1, 3, image_size, image_size, device="cuda", dtype=th.float16)
    th.jit.save(th.jit.trace(serving, example), path)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", default="cub200")
    p.add_argument("--root", required=True)
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--embed-dim", type=int, default=512)
    p.add_argument("--no-pretrained", action="store_true")
    p.add_argument("--p", type=int, default=16)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--margin", type=float, default=0.2)
    p.add_argument("--supcon-weight", type=float, default=0.0)
    p.add_argument("--temperature", type=float, default=0.07)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--clip", type=float, default=10.0)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--out", default="runs/dml")
    return p.parse_args()


def main():
    cfg = parse_args()
    logging.basicConfig(level=logging.INFO)
    os.makedirs(cfg.out, exist_ok=True)
    train_set = build_dataset(cfg.dataset, cfg.root, split="train")
    test_set = build_dataset(cfg.dataset, cfg.root, split="test")
    train_loader = DataLoader(train_set, batch_sampler=PKSampler(train_set.labels, cfg.p, cfg.k),
                              num_workers=8, pin_memory=True)
    test_loader = DataLoader(test_set, batch_size=128, num_workers=8)

    model = build_model(cfg)
    model.to("cuda")
    criterion = nn.TripletMarginLoss(margin=cfg.margin, p=2)
    supcon = SupConLoss(cfg.temperature) if cfg.supcon_weight > 0 else None
    backbone_params = [p for n, p in model.named_parameters() if not n.startswith("embed.")]
    optimizer = th.optim.AdamW([
        {"params": backbone_params, "lr": cfg.lr},
        {"params": model.embed.parameters(), "lr": cfg.lr * 10},
    ], weight_decay=1e-4)
    scheduler = WarmupCosine(optimizer, warmup=500, total=cfg.epochs * len(train_loader))
    scaler = th.amp.GradScaler("cuda")

    best_r1 = 0.0
    for epoch in range(cfg.epochs):
        train_epoch(model, train_loader, criterion, supcon, optimizer, scheduler, scaler, epoch, cfg)
        feats, labels = extract(model, test_loader)
        recalls = recall_at_k(feats, labels)
        log.info("epoch %d %s", epoch, " ".join(f"R@{k}={100 * v:.2f}" for k, v in recalls.items()))
        if recalls[1] > best_r1:
            best_r1 = recalls[1]
            save_checkpoint({"model": model.state_dict(), "epoch": epoch, "r1": best_r1},
                            os.path.join(cfg.out, "best.pth"))
    export_torchscript(model, os.path.join(cfg.out, "embedder_fp16.pt"))


if __name__ == "__main__":
    main()
