"""Masked autoencoder pre-training for tabular data.

Each column becomes a token (numerical: per-feature linear embedding; categorical:
embedding table). A random subset of columns is hidden, the encoder sees the rest,
a light decoder reconstructs the hidden ones. Two maskings of the same row also feed
a VICReg-style variance/covariance term on the [CLS] projection, which keeps the
row embedding from collapsing. Pre-training runs in bf16 autocast.

    python pretrain_tab_mae.py --config configs/adult.yaml
"""
import argparse
import logging
import math
import os
import time
from dataclasses import dataclass

import torch
from torch import nn
import torch.nn.functional as F
import yaml
from torch.utils.data import DataLoader

from tabdata import TabularDataset, column_spec
from utils.lr import cosine_with_warmup
from utils.io import save_checkpoint

logger = logging.getLogger("tab_mae")


@dataclass
class MAEConfig:
    d_model: int = 192
    depth: int = 6
    heads: int = 8
    decoder_depth: int = 2
    decoder_dim: int = 128
    mlp_ratio: int = 4
    dropout: float = 0.1
    mask_ratio: float = 0.5
    proj_dims: tuple = (512, 512)
    vc_weight: float = 0.05


def random_masking(x, mask_ratio):
    """Per-row random column masking (He et al., 2022). mask: 1 = hidden."""
    n, length, d = x.shape
    len_keep = max(1, int(length * (1 - mask_ratio)))
    noise = torch.rand(n, length, device=x.device)
    ids_shuffle = torch.argsort(noise, dim=1)
    ids_restore = torch.argsort(ids_shuffle, dim=1)
    ids_keep = ids_shuffle[:, :len_keep]
    x_visible = torch.gather(x, 1, ids_keep.unsqueeze(-1).expand(-1, -1, d))
    mask = torch.ones(n, length, device=x.device)
    mask[:, :len_keep] = 0
    mask = torch.gather(mask, 1, ids_restore)
    return x_visible, mask, ids_restore


def mlp(dims, last_bias=True):
    layers = []
    for a, b in zip(dims[:-2], dims[1:-1]):
        layers += [nn.Linear(a, b), nn.BatchNorm1d(b), nn.ReLU(inplace=True)]
    layers.append(nn.Linear(dims[-2], dims[-1], bias=last_bias))
    return nn.Sequential(*layers)


class FeatureTokenizer(nn.Module):
    def __init__(self, n_num, cat_cardinalities, d):
        super().__init__()
        self.num_weight = nn.Parameter(torch.randn(n_num, d) / math.sqrt(d))
        self.num_bias = nn.Parameter(torch.zeros(n_num, d))
        offsets = torch.tensor([0] + list(cat_cardinalities[:-1])).cumsum(0)
        self.register_buffer("cat_offsets", offsets, persistent=False)
        self.cat_embed = nn.Embedding(sum(cat_cardinalities), d)

    def forward(self, x_num, x_cat):
        num_tokens = x_num.unsqueeze(-1) * self.num_weight + self.num_bias
        cat_tokens = self.cat_embed(x_cat + self.cat_offsets)
        return torch.cat([num_tokens, cat_tokens], dim=1)


class Block(nn.Module):
    def __init__(self, d, heads, mlp_ratio, dropout):
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=dropout, batch_first=True)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, d * mlp_ratio), nn.GELU(), nn.Dropout(dropout), nn.Linear(d * mlp_ratio, d))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TabularEncoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cls = nn.Parameter(torch.zeros(1, 1, cfg.d_model))
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.heads, cfg.mlp_ratio, cfg.dropout) for _ in range(cfg.depth))
        self.norm = nn.LayerNorm(cfg.d_model)

    def forward(self, tokens):
        x = torch.cat([self.cls.expand(tokens.size(0), -1, -1), tokens], dim=1)
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)


class TabularMAE(nn.Module):
    def __init__(self, n_num, cat_cardinalities, cfg):
        super().__init__()
        self.cfg = cfg
        self.n_num = n_num
        n_cols = n_num + len(cat_cardinalities)
        self.tokenizer = FeatureTokenizer(n_num, cat_cardinalities, cfg.d_model)
        self.col_embed = nn.Parameter(torch.zeros(1, n_cols, cfg.d_model))
        self.encoder = TabularEncoder(cfg)
        self.decoder_embed = nn.Linear(cfg.d_model, cfg.decoder_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, cfg.decoder_dim))
        self.decoder_pos = nn.Parameter(torch.zeros(1, n_cols, cfg.decoder_dim))
        self.decoder = nn.ModuleList(Block(cfg.decoder_dim, 4, cfg.mlp_ratio, 0.0) for _ in range(cfg.decoder_depth))
        self.decoder_norm = nn.LayerNorm(cfg.decoder_dim)
        self.num_head = nn.Linear(cfg.decoder_dim, 1)
        self.cat_heads = nn.ModuleList(nn.Linear(cfg.decoder_dim, c) for c in cat_cardinalities)
        self.projector = mlp([cfg.d_model, *cfg.proj_dims])
        nn.init.trunc_normal_(self.col_embed, std=0.02)
        nn.init.trunc_normal_(self.decoder_pos, std=0.02)
        nn.init.normal_(self.mask_token, std=0.02)

    def encode_view(self, tokens):
        visible, mask, ids_restore = random_masking(tokens, self.cfg.mask_ratio)
        return self.encoder(visible), mask, ids_restore

    def decode(self, latent, ids_restore):
        x = self.decoder_embed(latent)
        n_hidden = ids_restore.size(1) - (x.size(1) - 1)
        x_ = torch.cat([x[:, 1:], self.mask_token.expand(x.size(0), n_hidden, -1)], dim=1)
        x_ = torch.gather(x_, 1, ids_restore.unsqueeze(-1).expand(-1, -1, x.size(2)))
        x_ = x_ + self.decoder_pos
        for blk in self.decoder:
            x_ = blk(x_)
        x_ = self.decoder_norm(x_)
        num_pred = self.num_head(x_[:, : self.n_num]).squeeze(-1)
        cat_logits = [head(x_[:, self.n_num + j]) for j, head in enumerate(self.cat_heads)]
        return num_pred, cat_logits

    def reconstruction_loss(self, x_num, x_cat, num_pred, cat_logits, mask):
        m_num = mask[:, : self.n_num]
        num_err = (num_pred.float() - x_num) ** 2
        num_loss = (num_err * m_num).sum() / m_num.sum().clamp(min=1.0)
        cat_loss = num_pred.new_zeros((), dtype=torch.float32)
        for j, logits in enumerate(cat_logits):
            hidden = mask[:, self.n_num + j].bool()
            if hidden.any():
                cat_loss = cat_loss + F.cross_entropy(logits[hidden], x_cat[hidden, j])
        return num_loss, cat_loss / max(len(cat_logits), 1)

    def variance_covariance(self, z):
        z = z - z.mean(dim=0)  # expect: AMP004
        std = torch.sqrt(z.var(dim=0) + 1e-4)  # expect: AMP004
        std_loss = torch.mean(F.relu(1.0 - std))  # expect: AMP004
        cov = (z.T @ z) / (z.size(0) - 1)
        off_diag = cov - torch.diag(torch.diagonal(cov))
        cov_loss = off_diag.pow(2).sum() / z.size(1)
        return std_loss, cov_loss

    def forward(self, x_num, x_cat):
        tokens = self.tokenizer(x_num, x_cat) + self.col_embed
        stats = {}
        total = 0.0
        cls_proj = []
        for view in range(2):
            latent, mask, ids_restore = self.encode_view(tokens)
            num_pred, cat_logits = self.decode(latent, ids_restore)
            num_loss, cat_loss = self.reconstruction_loss(x_num, x_cat, num_pred, cat_logits, mask)
            total = total + 0.5 * (num_loss + cat_loss)
            stats[f"num_{view}"], stats[f"cat_{view}"] = num_loss.detach(), cat_loss.detach()
            cls_proj.append(self.projector(latent[:, 0]))
        for z in cls_proj:
            std_loss, cov_loss = self.variance_covariance(z)
            total = total + self.cfg.vc_weight * (std_loss + cov_loss)
        stats["inv"] = F.mse_loss(cls_proj[0], cls_proj[1]).detach()
        return total, stats


def train_one_epoch(model, loader, optimizer, scaler, lr_at, epoch, args):
    model.train()
    t0 = time.time()
    for it, (x_num, x_cat) in enumerate(loader):
        step = epoch * len(loader) + it
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        x_num = x_num.cuda(non_blocking=True)
        x_cat = x_cat.cuda(non_blocking=True)

        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, stats = model(x_num, x_cat)

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        scaler.step(optimizer)
        scaler.update()

        if it % args.log_every == 0:
            logger.info("ep %d it %d loss %.4f |g| %.3f %s (%.2fs/it)", epoch, it, loss.item(), grad_norm.item(),
                        {k: round(v.item(), 4) for k, v in stats.items()}, (time.time() - t0) / (it + 1))


def encode_rows(model, loader):
    """Mean-pooled column embeddings of every row, for a linear probe."""
    model.eval()
    feats, labels = [], []
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        for x_num, x_cat, y in loader:
            tokens = model.tokenizer(x_num.cuda(), x_cat.cuda()) + model.col_embed
            h = model.encoder(tokens)
            feats.append(h[:, 1:].mean(dim=1).float().cpu())
            labels.append(y)
    return torch.cat(feats), torch.cat(labels)


def linear_probe(model, train_loader, test_loader, n_classes, epochs=100):
    x_tr, y_tr = encode_rows(model, train_loader)
    x_te, y_te = encode_rows(model, test_loader)
    mu, sd = x_tr.mean(0, keepdim=True), x_tr.std(0, keepdim=True) + 1e-8
    x_tr, x_te = (x_tr - mu) / sd, (x_te - mu) / sd
    clf = nn.Linear(x_tr.size(1), n_classes)
    opt = torch.optim.LBFGS(clf.parameters(), lr=0.5, max_iter=epochs)

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(clf(x_tr), y_tr) + 1e-4 * clf.weight.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return (clf(x_te).argmax(-1) == y_te).float().mean().item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--warmup-epochs", type=int, default=10)
    parser.add_argument("--clip", type=float, default=3.0)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--out", default="runs/tab_mae")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    with open(args.config) as f:
        raw = yaml.safe_load(f)
    cfg = MAEConfig(**raw.get("model", {}))

    spec = column_spec(raw["data"])
    train_set = TabularDataset(raw["data"], split="train", spec=spec)
    probe_train = TabularDataset(raw["data"], split="train", spec=spec, with_labels=True)
    probe_test = TabularDataset(raw["data"], split="test", spec=spec, with_labels=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=8, drop_last=True)

    model = TabularMAE(spec.n_num, spec.cat_cardinalities, cfg).cuda()
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "embed" in name or "token" in name else decay).append(p)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95),
    )
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010
    lr_at = cosine_with_warmup(args.lr, args.warmup_epochs * len(loader), args.epochs * len(loader))

    os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        train_one_epoch(model, loader, optimizer, scaler, lr_at, epoch, args)
        if (epoch + 1) % 20 == 0:
            acc = linear_probe(
                model,
                DataLoader(probe_train, batch_size=1024),
                DataLoader(probe_test, batch_size=1024),
                spec.n_classes,
            )
            logger.info("epoch %d  linear probe acc %.4f", epoch, acc)
            save_checkpoint({"model": model.state_dict(), "cfg": cfg.__dict__, "epoch": epoch},
                            os.path.join(args.out, f"ckpt_{epoch:04d}.pt"))


if __name__ == "__main__":
    main()
