"""CTR model trainer for the feed-ranking team.

DCN-v2 cross network over sparse embedding tables + dense features, with a
DIN-style target attention over the user's recent items. Reads .npz shards
produced by the feature pipeline, trains with AMP and writes a checkpoint
every ``ckpt_every`` steps.
"""
from __future__ import annotations

import argparse
import copy
import glob
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Dict, List

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

logger = logging.getLogger("ctr")


@dataclass
class FeatureColumn:
    name: str
    vocab_size: int
    dim: int = 16


@dataclass
class TrainConfig:
    data_dir: str = "/data/feed_ranking/v7"
    out_dir: str = "/checkpoints/ctr_dcn"
    sparse_features: List[FeatureColumn] = field(default_factory=lambda: [
        FeatureColumn("user_id", 2_000_000, 32),
        FeatureColumn("item_id", 500_000, 32),
        FeatureColumn("category", 2_000, 32),
        FeatureColumn("device", 64, 32),
    ])
    hist_len: int = 50
    num_dense: int = 13
    cross_layers: int = 3
    cross_rank: int = 64
    mlp_dims: tuple = (512, 256, 128)
    batch_size: int = 4096
    lr: float = 1e-3
    emb_lr: float = 0.01
    max_grad_norm: float = 10.0
    steps: int = 200_000
    ckpt_every: int = 5_000
    eval_every: int = 10_000
    use_amp: bool = True


class ShardDataset(Dataset):
    """Each shard holds dense [N, 13], sparse [N, F], hist [N, L] and label [N]."""

    def __init__(self, files: List[str]):
        self.shards = [np.load(f) for f in files]
        self.index = [(s, i) for s, sh in enumerate(self.shards) for i in range(len(sh["label"]))]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, idx):
        s, i = self.index[idx]
        sh = self.shards[s]
        return {
            "dense": torch.from_numpy(sh["dense"][i].astype(np.float32)),
            "sparse": torch.from_numpy(sh["sparse"][i].astype(np.int64)),
            "hist": torch.from_numpy(sh["hist"][i].astype(np.int64)),
            "label": torch.tensor(float(sh["label"][i])),
        }


class EmbeddingTables(nn.Module):
    def __init__(self, columns: List[FeatureColumn]):
        super().__init__()
        self.columns = columns
        self.tables = nn.ModuleDict({c.name: nn.Embedding(c.vocab_size, c.dim) for c in columns})

    def forward(self, sparse: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {c.name: self.tables[c.name](sparse[:, j]) for j, c in enumerate(self.columns)}


class TargetAttention(nn.Module):
    """DIN attention of the candidate item over the behaviour sequence."""

    def __init__(self, dim: int, hidden: int = 64):
        super().__init__()
        self.att_mlp = nn.Sequential(nn.Linear(4 * dim, hidden), nn.PReLU(), nn.Linear(hidden, 1))

    def forward(self, target, hist, hist_mask):
        length = hist.size(1)
        tgt = target.unsqueeze(1).expand(-1, length, -1)
        feats = torch.cat([tgt, hist, tgt - hist, tgt * hist], dim=-1)
        scores = self.att_mlp(feats).squeeze(-1)
        scores = scores.masked_fill(~hist_mask, -1e9)  # expect: AMP007
        weights = torch.softmax(scores, dim=-1)
        return torch.bmm(weights.unsqueeze(1), hist).squeeze(1)


class CrossLayerV2(nn.Module):
    def __init__(self, dim: int, rank: int):
        super().__init__()
        self.U = nn.Linear(dim, rank, bias=False)
        self.V = nn.Linear(rank, dim)

    def forward(self, x0, xl):
        return x0 * self.V(self.U(xl)) + xl


class DCNv2(nn.Module):
    def __init__(self, cfg: TrainConfig):
        super().__init__()
        self.embeddings = EmbeddingTables(cfg.sparse_features)
        item_dim = next(c.dim for c in cfg.sparse_features if c.name == "item_id")
        self.din = TargetAttention(item_dim)
        self.dense_proj = nn.Sequential(nn.Linear(cfg.num_dense, 64), nn.ReLU())
        d = sum(c.dim for c in cfg.sparse_features) + item_dim + 64
        self.cross = nn.ModuleList([CrossLayerV2(d, cfg.cross_rank) for _ in range(cfg.cross_layers)])
        layers = []
        for h in cfg.mlp_dims:
            layers += [nn.Linear(d, h), nn.ReLU(), nn.Dropout(0.1)]
            d = h
        self.mlp = nn.Sequential(*layers)
        self.head = nn.Linear(d, 1)

    def forward(self, dense, sparse, hist):
        embs = self.embeddings(sparse)
        hist_emb = self.embeddings.tables["item_id"](hist)
        interest = self.din(embs["item_id"], hist_emb, hist != 0)
        dense_h = self.dense_proj(torch.log1p(dense.clamp(min=0)))
        x0 = torch.cat(list(embs.values()) + [interest, dense_h], dim=1)
        xl = x0
        for layer in self.cross:
            xl = layer(x0, xl)
        return torch.sigmoid(self.head(self.mlp(xl)).squeeze(-1))


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    order = np.argsort(scores)
    ranks = np.empty_like(order, dtype=np.float64)
    ranks[order] = np.arange(1, len(scores) + 1)
    pos = labels == 1
    n_pos, n_neg = pos.sum(), (~pos).sum()
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


class CTRTrainer:
    def __init__(self, cfg: TrainConfig, model: DCNv2, device: torch.device):
        self.cfg = cfg
        self.device = device
        self.model = model
        # the id tables are ~2.5B floats; keep them in half so they fit in HBM
        model.embeddings.half()  # expect: AMP001
        dense_params = [p for n, p in model.named_parameters() if not n.startswith("embeddings.")]
        self.dense_opt = torch.optim.AdamW(dense_params, lr=cfg.lr, weight_decay=1e-5)
        self.sparse_opt = torch.optim.Adam(model.embeddings.parameters(), lr=cfg.emb_lr)  # expect: AMP011
        self.criterion = nn.BCELoss()
        self.scaler = torch.cuda.amp.GradScaler(enabled=cfg.use_amp)  # expect: AMP009
        self.step = 0
        self.best_logloss = 1e9

    def _to_device(self, batch):
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def _clip_dense_grads(self):
        params = [p for g in self.dense_opt.param_groups for p in g["params"] if p.grad is not None]
        return nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm)

    def train_step(self, batch) -> Dict[str, float]:
        b = self._to_device(batch)
        self.model.train()
        self.dense_opt.zero_grad(set_to_none=True)
        self.sparse_opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=self.cfg.use_amp):
            probs = self.model(b["dense"], b["sparse"], b["hist"])
            loss = self.criterion(probs, b["label"])  # expect: AMP003
        self.scaler.scale(loss).backward()
        grad_norm = self._clip_dense_grads()  # expect: AMP005
        self.scaler.step(self.dense_opt)
        # sparse rows are stepped directly: GradScaler refuses the half tables
        self.sparse_opt.step()  # expect: AMP006
        self.scaler.update()
        self.step += 1
        return {"loss": loss.item(), "grad_norm": float(grad_norm), "scale": self.scaler.get_scale()}

    @torch.no_grad()
    def evaluate(self, loader) -> Dict[str, float]:
        self.model.eval()
        labels, preds = [], []
        for batch in loader:
            b = self._to_device(batch)
            with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=self.cfg.use_amp):
                probs = self.model(b["dense"], b["sparse"], b["hist"])
            preds.append(probs.float().cpu().numpy())
            labels.append(b["label"].cpu().numpy())
        y, p = np.concatenate(labels), np.concatenate(preds)
        p = np.clip(p, 1e-7, 1 - 1e-7)
        logloss = float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean())
        self.model.train()
        return {"auc": roc_auc(y, p), "logloss": logloss, "pred_ctr": float(p.mean()), "ctr": float(y.mean())}

    def save(self, tag: str):
        os.makedirs(self.cfg.out_dir, exist_ok=True)
        torch.save({
            "model": self.model.state_dict(),
            "dense_opt": self.dense_opt.state_dict(),
            "sparse_opt": self.sparse_opt.state_dict(),
            "scaler": self.scaler.state_dict(),
            "step": self.step,
        }, os.path.join(self.cfg.out_dir, f"ckpt_{tag}.pt"))


def export_for_serving(model: DCNv2, path: str):
    serving = copy.deepcopy(model).half().eval()
    scripted = torch.jit.script(serving)
    scripted.save(path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", default=TrainConfig.data_dir)
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--no-amp", action="store_true")
    args = parser.parse_args()
    cfg = TrainConfig(data_dir=args.data_dir, steps=args.steps, use_amp=not args.no_amp)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    device = torch.device("cuda")
    train_files = sorted(glob.glob(os.path.join(cfg.data_dir, "train", "*.npz")))
    val_files = sorted(glob.glob(os.path.join(cfg.data_dir, "val", "*.npz")))
    train_loader = DataLoader(ShardDataset(train_files), batch_size=cfg.batch_size, shuffle=True,
                              num_workers=8, pin_memory=True, drop_last=True)
    val_loader = DataLoader(ShardDataset(val_files), batch_size=cfg.batch_size * 4, num_workers=4)

    model = DCNv2(cfg).to(device)
    trainer = CTRTrainer(cfg, model, device)
    t0 = time.time()
    while trainer.step < cfg.steps:
        for batch in train_loader:
            stats = trainer.train_step(batch)
            if trainer.step % 100 == 0:
                logger.info("step %d loss %.4f gnorm %.2f scale %.0f (%.1fs)", trainer.step, stats["loss"],
                            stats["grad_norm"], stats["scale"], time.time() - t0)
            if trainer.step % cfg.ckpt_every == 0:
                trainer.save(f"{trainer.step:07d}")
            if trainer.step % cfg.eval_every == 0:
                metrics = trainer.evaluate(val_loader)
                logger.info("eval step %d %s", trainer.step, metrics)
                if metrics["logloss"] < trainer.best_logloss:
                    trainer.best_logloss = metrics["logloss"]
                    trainer.save("best")
            if trainer.step >= cfg.steps:
                break
    export_for_serving(model, os.path.join(cfg.out_dir, "serving.pt"))


if __name__ == "__main__":
    main()
