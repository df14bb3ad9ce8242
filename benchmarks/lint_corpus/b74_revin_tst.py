"""Channel-independent patch transformer for multivariate time series with RevIN.

One backbone, two tasks: long-horizon forecasting and series classification. The task
heads override the `project` hook of `ForecasterBase`.
"""
import argparse
import logging
import math
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from data_provider import get_loaders

logger = logging.getLogger("tst")


class RevIN(nn.Module):
    """Reversible instance normalisation (Kim et al., ICLR 2022)."""

    def __init__(self, num_features, eps=1e-5, affine=True):
        super().__init__()
        self.num_features = num_features
        self.eps = eps
        self.affine = affine
        if affine:
            self.affine_weight = nn.Parameter(torch.ones(num_features))
            self.affine_bias = nn.Parameter(torch.zeros(num_features))

    def forward(self, x, mode):
        if mode == "norm":
            self._get_statistics(x)
            return self._normalize(x)
        if mode == "denorm":
            return self._denormalize(x)
        raise NotImplementedError(mode)

    def _get_statistics(self, x):
        self.mean = torch.mean(x, dim=1, keepdim=True).detach()
        self.stdev = torch.sqrt(torch.var(x, dim=1, keepdim=True, unbiased=False) + self.eps).detach()

    def _normalize(self, x):
        x = (x - self.mean) / self.stdev
        if self.affine:
            x = x * self.affine_weight + self.affine_bias
        return x

    def _denormalize(self, x):
        if self.affine:
            x = (x - self.affine_bias) / (self.affine_weight + self.eps * self.eps)
        return x * self.stdev + self.mean


class RobustRevIN(RevIN):
    """Median / IQR statistics, for series with outliers."""

    def _get_statistics(self, x):
        self.mean = x.median(dim=1, keepdim=True).values.detach()
        q75 = torch.quantile(x, 0.75, dim=1, keepdim=True)
        q25 = torch.quantile(x, 0.25, dim=1, keepdim=True)
        self.stdev = ((q75 - q25) / 1.349 + self.eps).detach()


class DecompBlock(nn.Module):
    """Feed-forward block that splits its output into a seasonal part and a level."""

    def __init__(self, d_model, d_ff, dropout=0.1):
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Dropout(dropout), nn.Linear(d_ff, d_model))
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x):
        y = self.ff(x)
        level = y.mean(dim=1, keepdim=True)  # expect: AMP004
        return self.norm(x + (y - level)), level


class ForecasterBase(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        revin_cls = RobustRevIN if cfg.robust_norm else RevIN
        self.revin = revin_cls(cfg.enc_in) if cfg.revin else None

    def encode(self, x):
        raise NotImplementedError

    def project(self, h):
        raise NotImplementedError

    def forward(self, x_enc):
        if self.revin is not None:
            x_enc = self.revin(x_enc, "norm")
        h = self.encode(x_enc)
        out = self.project(h)
        if self.revin is not None and out.dim() == 3:
            out = self.revin(out, "denorm")
        return out


class PatchTSTForecaster(ForecasterBase):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.patch_len, self.stride = cfg.patch_len, cfg.stride
        self.n_patches = (cfg.seq_len - cfg.patch_len) // cfg.stride + 1
        self.enc_in = cfg.enc_in
        self.patch_embed = nn.Linear(cfg.patch_len, cfg.d_model)
        self.pos = nn.Parameter(torch.randn(1, self.n_patches, cfg.d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, cfg.e_layers)
        self.decomp = DecompBlock(cfg.d_model, cfg.d_ff, cfg.dropout)
        self.out_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.head = nn.Linear(self.n_patches * cfg.d_model, cfg.pred_len)

    def encode(self, x):
        b, t, c = x.shape
        x = x.permute(0, 2, 1).reshape(b * c, t)
        patches = x.unfold(-1, self.patch_len, self.stride)
        z = self.encoder(self.patch_embed(patches) + self.pos)
        z, _ = self.decomp(z)
        return self.out_proj(z)

    def project(self, h):
        y = self.head(h.flatten(1))
        return y.view(-1, self.enc_in, y.shape[-1]).permute(0, 2, 1)


class PatchTSTClassifier(PatchTSTForecaster):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.classifier = nn.Sequential(nn.Dropout(cfg.dropout), nn.Linear(2 * cfg.d_model * cfg.enc_in, cfg.num_class))

    def project(self, h):
        mean = h.mean(dim=1)  # expect: AMP004
        std = h.std(dim=1)  # expect: AMP004
        feats = torch.cat([mean, std], dim=-1).view(-1, 2 * self.enc_in * mean.shape[-1])
        return self.classifier(feats)


MODELS = {"long_term_forecast": PatchTSTForecaster, "classification": PatchTSTClassifier}


def adjust_learning_rate(optimizer, epoch, base_lr):
    lr = base_lr * (0.5 ** ((epoch - 1) // 1)) if epoch > 3 else base_lr
    for g in optimizer.param_groups:
        g["lr"] = lr
    return lr


def train_epoch(model, loader, optimizer, scaler, cfg, device):
    model.train()
    losses = []
    for x, y in loader:
        x, y = x.float().to(device), y.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
            if cfg.task == "classification":
                loss = F.cross_entropy(out, y.long().squeeze(-1), label_smoothing=0.1)
            else:
                loss = F.mse_loss(out[:, -cfg.pred_len:], y[:, -cfg.pred_len:].float())
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
    return float(np.mean(losses))


@torch.no_grad()
def evaluate(model, loader, cfg, device):
    model.eval()
    se, ae, n, correct = 0.0, 0.0, 0, 0
    for x, y in loader:
        x, y = x.float().to(device), y.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
        out = out.float()
        if cfg.task == "classification":
            correct += (out.argmax(-1) == y.long().squeeze(-1)).sum().item()
            n += y.shape[0]
        else:
            diff = out[:, -cfg.pred_len:] - y[:, -cfg.pred_len:].float()
            se += diff.pow(2).sum().item()
            ae += diff.abs().sum().item()
            n += diff.numel()
    if cfg.task == "classification":
        return {"acc": correct / max(n, 1)}
    return {"mse": se / max(n, 1), "mae": ae / max(n, 1)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--task", default="long_term_forecast", choices=list(MODELS))
    p.add_argument("--data", default="ETTh1")
    p.add_argument("--seq-len", type=int, default=336)
    p.add_argument("--pred-len", type=int, default=96)
    p.add_argument("--enc-in", type=int, default=7)
    p.add_argument("--num-class", type=int, default=10)
    p.add_argument("--patch-len", type=int, default=16)
    p.add_argument("--stride", type=int, default=8)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-heads", type=int, default=16)
    p.add_argument("--d-ff", type=int, default=256)
    p.add_argument("--e-layers", type=int, default=3)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--revin", type=int, default=1)
    p.add_argument("--robust-norm", action="store_true")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--patience", type=int, default=10)
    p.add_argument("--checkpoints", default="./checkpoints")
    cfg = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    device = torch.device("cuda")

    train_loader, val_loader, test_loader = get_loaders(cfg)
    model = MODELS[cfg.task](cfg).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010

    best, bad_epochs = math.inf, 0
    path = os.path.join(cfg.checkpoints, f"{cfg.data}_{cfg.task}.pth")
    os.makedirs(cfg.checkpoints, exist_ok=True)
    for epoch in range(1, cfg.epochs + 1):
        t0 = time.time()
        train_loss = train_epoch(model, train_loader, optimizer, scaler, cfg, device)
        val = evaluate(model, val_loader, cfg, device)
        score = -val["acc"] if cfg.task == "classification" else val["mse"]
        logger.info("epoch %d | %.1fs | train %.5f | val %s", epoch, time.time() - t0, train_loss, val)
        if score < best:
            best, bad_epochs = score, 0
            torch.save(model.state_dict(), path)
        else:
            bad_epochs += 1
            if bad_epochs >= cfg.patience:
                logger.info("early stopping")
                break
        adjust_learning_rate(optimizer, epoch + 1, cfg.lr)
    model.load_state_dict(torch.load(path, map_location=device))
    logger.info("test %s", evaluate(model, test_loader, cfg, device))


if __name__ == "__main__":
    main()
