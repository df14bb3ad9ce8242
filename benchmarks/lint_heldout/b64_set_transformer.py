"""Set Transformer (Lee et al., ICML 2019) for point-cloud classification.

ISAB encoder + PMA decoder over variable-size point sets (ModelNet40, padded and
masked). A DeepSets baseline is included for comparison. Small enough to train on a
CPU box: we use CPU autocast with bfloat16 (AMX/AVX512-BF16), no loss scaling.

    python set_transformer.py --data data/modelnet40_ply_hdf5_2048 --model isab --threads 32
"""
import argparse
import json
import logging
import math
import os
import random
import time

import numpy as np
import torch as th
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

log = logging.getLogger("set_transformer")


# --------------------------------------------------------------------------- data


class PointSetDataset(Dataset):
    def __init__(self, root, split, max_points=1024, min_points=256, augment=False):
        data = np.load(os.path.join(root, f"{split}.npz"))
        self.points, self.labels = data["points"], data["labels"]
        self.max_points, self.min_points, self.augment = max_points, min_points, augment

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        n = random.randint(self.min_points, self.max_points) if self.augment else self.max_points
        pts = self.points[i][np.random.choice(len(self.points[i]), n, replace=False)]
        pts = pts - pts.mean(axis=0, keepdims=True)
        pts = pts / (np.linalg.norm(pts, axis=1).max() + 1e-8)
        if self.augment:
            pts = pts * np.random.uniform(0.8, 1.25) + np.random.normal(0, 0.01, pts.shape)
        return th.from_numpy(pts.astype(np.float32)), int(self.labels[i])


def collate_sets(batch):
    sizes = [p.size(0) for p, _ in batch]
    n_max = max(sizes)
    points = th.zeros(len(batch), n_max, 3)
    mask = th.zeros(len(batch), n_max, dtype=th.bool)
    for b, (p, _) in enumerate(batch):
        points[b, : p.size(0)] = p
        mask[b, : p.size(0)] = True
    labels = th.tensor([y for _, y in batch])
    return points, mask, labels


# --------------------------------------------------------------------------- layers


class SetNorm(nn.Module):
    """Normalises each set over its elements and features (Zhang et al., 2022)."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(th.ones(dim))
        self.bias = nn.Parameter(th.zeros(dim))

    def forward(self, x):
        # statistics over the whole set are sensitive to precision; keep autocast out of it
        with th.autocast("cpu", enabled=False):
            mu = x.mean(dim=(1, 2), keepdim=True)  # expect: AMP004
            var = x.var(dim=(1, 2), keepdim=True, unbiased=False)  # expect: AMP004
            out = (x - mu) / th.sqrt(var + self.eps)
        return (out * self.weight + self.bias).to(x.dtype)


def make_norm(kind, dim):
    if kind == "set":
        return SetNorm(dim)
    if kind == "layer":
        return nn.LayerNorm(dim)
    return nn.Identity()


def masked_attention(q, k, v, key_mask, num_heads):
    """Multi-head attention; padded keys get no weight."""
    b, nq, d = q.shape
    dh = d // num_heads
    q_ = q.view(b, nq, num_heads, dh).transpose(1, 2)
    k_ = k.view(b, -1, num_heads, dh).transpose(1, 2)
    v_ = v.view(b, -1, num_heads, dh).transpose(1, 2)
    scores = th.matmul(q_, k_.transpose(-1, -2)) / math.sqrt(d)
    attn = th.softmax(scores, dim=-1)
    if key_mask is not None:
        attn = attn.masked_fill(~key_mask[:, None, None, :], 0.0)
        attn = attn / (attn.sum(dim=-1, keepdim=True) + 1e-8)  # expect: AMP004
    out = th.matmul(attn, v_)
    return out.transpose(1, 2).reshape(b, nq, d)


class MAB(nn.Module):
    def __init__(self, dim_q, dim_k, dim_v, num_heads, norm="layer"):
        super().__init__()
        self.num_heads = num_heads
        self.fc_q = nn.Linear(dim_q, dim_v)
        self.fc_k = nn.Linear(dim_k, dim_v)
        self.fc_v = nn.Linear(dim_k, dim_v)
        self.fc_o = nn.Linear(dim_v, dim_v)
        self.norm0 = make_norm(norm, dim_v)
        self.norm1 = make_norm(norm, dim_v)

    def forward(self, queries, keys, key_mask=None):
        q = self.fc_q(queries)
        o = q + masked_attention(q, self.fc_k(keys), self.fc_v(keys), key_mask, self.num_heads)
        o = self.norm0(o)
        o = o + F.relu(self.fc_o(o))
        return self.norm1(o)


class ISAB(nn.Module):
    def __init__(self, dim_in, dim_out, num_heads, num_inducing, norm="layer"):
        super().__init__()
        self.inducing = nn.Parameter(th.empty(1, num_inducing, dim_out))
        nn.init.xavier_uniform_(self.inducing)
        self.mab0 = MAB(dim_out, dim_in, dim_out, num_heads, norm)
        self.mab1 = MAB(dim_in, dim_out, dim_out, num_heads, norm)

    def forward(self, x, mask=None):
        h = self.mab0(self.inducing.expand(x.size(0), -1, -1), x, key_mask=mask)
        return self.mab1(x, h)


class PMA(nn.Module):
    def __init__(self, dim, num_heads, num_seeds, norm="layer"):
        super().__init__()
        self.seeds = nn.Parameter(th.empty(1, num_seeds, dim))
        nn.init.xavier_uniform_(self.seeds)
        self.mab = MAB(dim, dim, dim, num_heads, norm)

    def forward(self, x, mask=None):
        return self.mab(self.seeds.expand(x.size(0), -1, -1), x, key_mask=mask)


# --------------------------------------------------------------------------- models


class SetTransformerClassifier(nn.Module):
    def __init__(self, num_classes, dim=128, num_heads=4, num_inducing=32, depth=2, norm="layer", dropout=0.5):
        super().__init__()
        self.embed = nn.Linear(3, dim)
        self.encoder = nn.ModuleList(ISAB(dim, dim, num_heads, num_inducing, norm) for _ in range(depth))
        self.pool = PMA(dim, num_heads, num_seeds=1, norm=norm)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, points, mask):
        h = self.embed(points)
        for isab in self.encoder:
            h = isab(h, mask)
        z = self.pool(h, mask).squeeze(1)
        return self.head(self.dropout(z))


class DeepSet(nn.Module):
    def __init__(self, num_classes, dim=256, pool="mean"):
        super().__init__()
        self.pool = pool
        self.phi = nn.Sequential(nn.Linear(3, dim), nn.ReLU(), nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))
        self.rho = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Dropout(0.5), nn.Linear(dim, num_classes))

    def forward(self, points, mask):
        h = self.phi(points).masked_fill(~mask.unsqueeze(-1), 0.0)
        if self.pool == "sum":
            z = h.sum(dim=1)  # expect: AMP004
        elif self.pool == "mean":
            z = h.mean(dim=1)  # expect: AMP004
        else:
            z = h.masked_fill(~mask.unsqueeze(-1), float("-inf")).amax(dim=1)
        return self.rho(z)


MODELS = {
    "isab": SetTransformerClassifier,
    "deepsets": DeepSet,
}


# --------------------------------------------------------------------------- loops


def train_epoch(model, loader, optimizer, criterion, epoch, args):
    model.train()
    seen, correct, running = 0, 0, 0.0
    t0 = time.time()
    for i, (points, mask, labels) in enumerate(loader):
        with th.autocast("cpu", dtype=th.bfloat16, enabled=args.bf16):
            logits = model(points, mask)
            loss = criterion(logits, labels)

        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()

        running += loss.item() * labels.size(0)
        correct += (logits.argmax(-1) == labels).sum().item()
        seen += labels.size(0)
        if i % args.log_every == 0:
            log.info("epoch %d [%d/%d] loss %.4f acc %.3f (%.1f samples/s)", epoch, i, len(loader),
                     running / seen, correct / seen, seen / (time.time() - t0))
    return running / seen, correct / seen


@th.no_grad()
def evaluate(model, loader, args):
    model.eval()
    all_logits, all_labels = [], []
    for points, mask, labels in loader:
        with th.autocast("cpu", dtype=th.bfloat16, enabled=args.bf16):
            logits = model(points, mask)
        all_logits.append(logits.float())
        all_labels.append(labels)
    logits, labels = th.cat(all_logits), th.cat(all_labels)
    probs = logits.softmax(-1)
    pred = probs.argmax(-1)
    acc = (pred == labels).float().mean().item()
    per_class = th.stack([(pred[labels == c] == c).float().mean() for c in labels.unique()])
    nll = -th.log(probs.gather(1, labels[:, None]) + 1e-12).mean().item()
    return {"acc": acc, "mean_class_acc": per_class.mean().item(), "nll": nll}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--model", default="isab", choices=sorted(MODELS))
    p.add_argument("--norm", default="layer", choices=["layer", "set", "none"])
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=5.0)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--no-bf16", dest="bf16", action="store_false")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--out", default="runs/set_transformer")
    args = p.parse_args()

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    th.set_num_threads(args.threads)
    th.manual_seed(0)
    os.makedirs(args.out, exist_ok=True)

    train_set = PointSetDataset(args.data, "train", augment=True)
    test_set = PointSetDataset(args.data, "test")
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                              collate_fn=collate_sets, num_workers=4, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=128, collate_fn=collate_sets, num_workers=4)

    if args.model == "isab":
        model = MODELS[args.model](num_classes=40, norm=args.norm)
    else:
        model = MODELS[args.model](num_classes=40)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    optimizer = th.optim.Adam(model.parameters(), lr=args.lr, eps=1e-8)
    scheduler = th.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    best = 0.0
    for epoch in range(args.epochs):
        train_loss, train_acc = train_epoch(model, train_loader, optimizer, criterion, epoch, args)
        scheduler.step()
        metrics = evaluate(model, test_loader, args)
        log.info("epoch %d  train loss %.4f acc %.3f | test %s", epoch, train_loss, train_acc, json.dumps(metrics))
        if metrics["acc"] > best:
            best = metrics["acc"]
            th.save({"model": model.state_dict(), "epoch": epoch, "metrics": metrics},
                    os.path.join(args.out, "best.pt"))
    log.info("best test accuracy %.4f", best)


if __name__ == "__main__":
    main()
