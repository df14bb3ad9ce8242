"""Masked autoencoding for tabular data (numeric, categorical and binary columns), with a
SCARF-style contrastive term between two corrupted views. Meant for CPU boxes with AMX:
training runs under CPU autocast in bfloat16.

    python tabular_mae.py --train data/credit_train.parquet --epochs 50
"""
from __future__ import annotations

import argparse
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List

import torch
import torch.nn as nn
import torch.nn.functional as F

log = logging.getLogger("tabmae")


@dataclass
class MAEConfig:
    n_num: int = 12
    cat_cardinalities: tuple = (7, 12, 31, 4)
    n_bin: int = 5
    d_token: int = 64
    depth: int = 4
    heads: int = 4
    dec_dim: int = 32
    mask_ratio: float = 0.3
    temperature: float = 0.1
    con_weight: float = 0.5
    lr: float = 3e-4
    weight_decay: float = 1e-5
    epochs: int = 50
    batch_size: int = 512
    amp: bool = True
    clip: float = 1.0
    out: str = "runs/tabmae"


class FeatureTokenizer(nn.Module):
    def __init__(self, cfg: MAEConfig):
        super().__init__()
        self.num_weight = nn.Parameter(torch.randn(cfg.n_num, cfg.d_token) * 0.02)
        self.num_bias = nn.Parameter(torch.zeros(cfg.n_num, cfg.d_token))
        self.cat_emb = nn.ModuleList(nn.Embedding(c, cfg.d_token) for c in cfg.cat_cardinalities)
        self.bin_emb = nn.Embedding(2 * cfg.n_bin, cfg.d_token)
        self.register_buffer("bin_offset", torch.arange(cfg.n_bin) * 2)

    def forward(self, x_num, x_cat, x_bin):
        num = x_num.unsqueeze(-1) * self.num_weight + self.num_bias
        cat = torch.stack([emb(x_cat[:, i]) for i, emb in enumerate(self.cat_emb)], dim=1)
        bins = self.bin_emb(x_bin.long() + self.bin_offset)
        return torch.cat([num, cat, bins], dim=1)


class TabularMAE(nn.Module):
    def __init__(self, cfg: MAEConfig):
        super().__init__()
        self.cfg = cfg
        self.n_cols = cfg.n_num + len(cfg.cat_cardinalities) + cfg.n_bin
        self.tokenizer = FeatureTokenizer(cfg)
        self.col_emb = nn.Parameter(torch.zeros(1, self.n_cols, cfg.d_token))
        layer = nn.TransformerEncoderLayer(cfg.d_token, cfg.heads, 4 * cfg.d_token, dropout=0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, cfg.depth)
        self.decoder_embed = nn.Linear(cfg.d_token, cfg.dec_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, cfg.dec_dim))
        self.dec_col_emb = nn.Parameter(torch.zeros(1, self.n_cols, cfg.dec_dim))
        self.decoder = nn.Sequential(nn.Linear(cfg.dec_dim, cfg.dec_dim), nn.GELU(), nn.Linear(cfg.dec_dim, cfg.dec_dim))
        self.num_head = nn.Linear(cfg.dec_dim, 1)
        self.cat_heads = nn.ModuleList(nn.Linear(cfg.dec_dim, c) for c in cfg.cat_cardinalities)
        self.bin_head = nn.Linear(cfg.dec_dim, 1)
        self.pool_score = nn.Linear(cfg.dec_dim, 1)
        self.proj_head = nn.Sequential(nn.Linear(cfg.dec_dim, 128), nn.ReLU(), nn.Linear(128, 64))
        nn.init.normal_(self.mask_token, std=0.02)
        nn.init.normal_(self.col_emb, std=0.02)

    def random_masking(self, tokens, ratio):
        b, n, d = tokens.shape
        keep = max(1, int(n * (1 - ratio)))
        noise = torch.rand(b, n, device=tokens.device)
        ids_shuffle = torch.argsort(noise, dim=1)
        ids_restore = torch.argsort(ids_shuffle, dim=1)
        ids_keep = ids_shuffle[:, :keep]
        kept = torch.gather(tokens, 1, ids_keep.unsqueeze(-1).expand(-1, -1, d))
        mask = torch.ones(b, n, device=tokens.device)
        mask[:, :keep] = 0
        return kept, torch.gather(mask, 1, ids_restore), ids_restore

    def encode(self, x_num, x_cat, x_bin, ratio):
        tokens = self.tokenizer(x_num, x_cat, x_bin) + self.col_emb
        kept, mask, ids_restore = self.random_masking(tokens, ratio)
        latent = self.decoder_embed(self.encoder(kept))
        b, keep, d = latent.shape
        ctx_tok = latent.mean(dim=1, keepdim=True)  # expect: AMP004
        mask_tokens = (self.mask_token + ctx_tok).expand(b, self.n_cols - keep, d)
        full = torch.cat([latent, mask_tokens], dim=1)
        full = torch.gather(full, 1, ids_restore.unsqueeze(-1).expand(-1, -1, d)) + self.dec_col_emb
        return self.decoder(full), latent, mask

    def forward(self, x_num, x_cat, x_bin, mask_ratio=0.3):
        h, latent, mask = self.encode(x_num, x_cat, x_bin, mask_ratio)
        c = self.cfg
        num_pred = self.num_head(h[:, : c.n_num]).squeeze(-1)
        cat_pred = [head(h[:, c.n_num + i]) for i, head in enumerate(self.cat_heads)]
        bin_pred = self.bin_head(h[:, -c.n_bin:]).squeeze(-1)
        weights = torch.softmax(self.pool_score(latent), dim=1)
        pooled = (weights * latent).sum(dim=1)  # expect: AMP004
        return {"num": num_pred, "cat": cat_pred, "bin": bin_pred, "mask": mask, "z": self.proj_head(pooled)}


def info_nce_loss(z1, z2, temperature):
    z1, z2 = F.normalize(z1, dim=-1), F.normalize(z2, dim=-1)
    logits = z1 @ z2.t() / temperature
    labels = torch.arange(z1.size(0), device=z1.device)
    return 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels))


def corrupt(x_num, x_cat, x_bin, p=0.3):
    """SCARF corruption: replace a random subset of each row's values with values from other rows."""
    b = x_num.size(0)
    perm = torch.randperm(b, device=x_num.device)
    m_num = torch.rand_like(x_num) < p
    m_cat = torch.rand(x_cat.shape, device=x_cat.device) < p
    m_bin = torch.rand(x_bin.shape, device=x_bin.device) < p
    return (torch.where(m_num, x_num[perm], x_num), torch.where(m_cat, x_cat[perm], x_cat),
            torch.where(m_bin, x_bin[perm], x_bin))


class TabularTrainer:
    def __init__(self, cfg: MAEConfig, model: TabularMAE, train_loader, val_loader=None):
        self.cfg = cfg
        self.device = torch.device("cpu")
        self.model = model.to(self.device)
        self.train_loader, self.val_loader = train_loader, val_loader
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.scaler = torch.amp.GradScaler("cpu", enabled=cfg.amp)  # expect: AMP010
        self.step = 0

    def _to_device(self, batch):
        x_num = batch["num"].to(self.device, dtype=torch.bfloat16)  # expect: AMP001
        x_cat = batch["cat"].to(self.device)
        x_bin = batch["bin"].to(self.device)
        return x_num, x_cat, x_bin

    def reconstruction_terms(self, out, x_num, x_cat, x_bin) -> Dict[str, torch.Tensor]:
        c = self.cfg
        mask = out["mask"]
        m_num, m_cat, m_bin = mask[:, : c.n_num], mask[:, c.n_num: c.n_num + len(c.cat_cardinalities)], mask[:, -c.n_bin:]
        num = F.mse_loss(out["num"].float(), x_num.float(), reduction="none")
        num = (num * m_num).sum() / m_num.sum().clamp(min=1)
        cat = sum(
            (F.cross_entropy(logits.float(), x_cat[:, i], reduction="none") * m_cat[:, i]).sum()
            for i, logits in enumerate(out["cat"])
        ) / m_cat.sum().clamp(min=1)
        probs = torch.sigmoid(out["bin"].float())
        bce = F.binary_cross_entropy(probs, x_bin.float(), reduction="none")  # expect: AMP003
        bce = (bce * m_bin).sum() / m_bin.sum().clamp(min=1)
        return {"num": num, "cat": cat, "bin": bce}

    def train_step(self, batch):
        self.model.train()
        x_num, x_cat, x_bin = self._to_device(batch)
        v1, v2 = corrupt(x_num, x_cat, x_bin), corrupt(x_num, x_cat, x_bin)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.cfg.amp):
            out1 = self.model(*v1, mask_ratio=self.cfg.mask_ratio)
            out2 = self.model(*v2, mask_ratio=self.cfg.mask_ratio)
            terms = self.reconstruction_terms(out1, x_num, x_cat, x_bin)
        terms["con"] = info_nce_loss(out1["z"], out2["z"], self.cfg.temperature)  # expect: AMP002
        loss = terms["num"] + terms["cat"] + terms["bin"] + self.cfg.con_weight * terms["con"]

        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.step += 1
        return {k: v.item() for k, v in terms.items()} | {"loss": loss.item()}

    @torch.no_grad()
    def validate(self):
        self.model.eval()
        totals: Dict[str, float] = {}
        n = 0
        for batch in self.val_loader:
            x_num = batch["num"].float()
            x_cat, x_bin = batch["cat"], batch["bin"]
            with torch.cpu.amp.autocast(enabled=self.cfg.amp, dtype=torch.bfloat16):  # expect: AMP009
                out = self.model(x_num, x_cat, x_bin, mask_ratio=self.cfg.mask_ratio)
            for k, v in self.reconstruction_terms(out, x_num, x_cat, x_bin).items():
                totals[k] = totals.get(k, 0.0) + v.item()
            n += 1
        return {k: v / max(n, 1) for k, v in totals.items()}

    def fit(self):
        best = math.inf
        history: List[Dict[str, float]] = []
        for epoch in range(self.cfg.epochs):
            for batch in self.train_loader:
                stats = self.train_step(batch)
                if self.step % 50 == 0:
                    log.info("epoch %d step %d %s", epoch, self.step, {k: round(v, 4) for k, v in stats.items()})
            if self.val_loader is not None:
                val = self.validate()
                history.append(val)
                score = sum(val.values())
                if score < best:
                    best = score
                    Path(self.cfg.out).mkdir(parents=True, exist_ok=True)
                    torch.save({"model": self.model.state_dict(), "cfg": asdict(self.cfg)}, f"{self.cfg.out}/best.pt")
        return history


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", required=True)
    parser.add_argument("--val")
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--no-amp", action="store_true")
    args = parser.parse_args()
    cfg = MAEConfig(epochs=args.epochs, amp=not args.no_amp)
    from tabdata import make_loader  # project-local parquet loader

    train_loader = make_loader(args.train, cfg.batch_size, shuffle=True)
    val_loader = make_loader(args.val, cfg.batch_size) if args.val else None
    TabularTrainer(cfg, TabularMAE(cfg), train_loader, val_loader).fit()


if __name__ == "__main__":
    main()
