"""PatchTST-style long-horizon forecaster: model, trainer and experiment entry point.

The data are standardised per channel by the dataset (as in the Informer/Autoformer
loaders), so the model works on normalised series and has no RevIN layer.

The trainer splits one optimisation step into ``forward_step`` / ``backward_step`` /
``optimizer_step`` so that the self-supervised pretraining variant can override just
the phase it changes (it swaps the head and the loss, nothing else).
"""
import argparse
import copy
import math
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import clip_grad_value_ as clamp_grad_values


class FullAttention(nn.Module):
    """Scaled dot-product attention over [B, L, H, E] tensors (Informer layout)."""

    def __init__(self, mask_flag=False, scale=None, attention_dropout=0.1):
        super().__init__()
        self.mask_flag = mask_flag
        self.scale = scale
        self.dropout = nn.Dropout(attention_dropout)

    def forward(self, queries, keys, values, attn_mask=None):
        B, L, H, E = queries.shape
        _, S, _, D = values.shape
        scale = self.scale or 1.0 / math.sqrt(E)
        scores = torch.einsum("blhe,bshe->bhls", queries, keys)
        if self.mask_flag:
            if attn_mask is None:
                attn_mask = torch.triu(
                    torch.ones(L, S, dtype=torch.bool, device=queries.device), diagonal=1
                )
            scores.masked_fill_(attn_mask, -1e10)  # expect: AMP007
        A = self.dropout(torch.softmax(scale * scores, dim=-1))
        V = torch.einsum("bhls,bshd->blhd", A, values)
        return V.contiguous(), A


class AttentionLayer(nn.Module):
    def __init__(self, attention, d_model, n_heads):
        super().__init__()
        d_keys = d_model // n_heads
        self.inner_attention = attention
        self.query_projection = nn.Linear(d_model, d_keys * n_heads)
        self.key_projection = nn.Linear(d_model, d_keys * n_heads)
        self.value_projection = nn.Linear(d_model, d_keys * n_heads)
        self.out_projection = nn.Linear(d_keys * n_heads, d_model)
        self.n_heads = n_heads

    def forward(self, queries, keys, values, attn_mask=None):
        B, L, _ = queries.shape
        _, S, _ = keys.shape
        H = self.n_heads
        q = self.query_projection(queries).view(B, L, H, -1)
        k = self.key_projection(keys).view(B, S, H, -1)
        v = self.value_projection(values).view(B, S, H, -1)
        out, attn = self.inner_attention(q, k, v, attn_mask)
        return self.out_projection(out.view(B, L, -1)), attn


class Transpose(nn.Module):
    def __init__(self, *dims):
        super().__init__()
        self.dims = dims

    def forward(self, x):
        return x.transpose(*self.dims)


class EncoderLayer(nn.Module):
    def __init__(self, d_model, n_heads, d_ff, dropout=0.1, causal=False):
        super().__init__()
        self.attention = AttentionLayer(FullAttention(mask_flag=causal), d_model, n_heads)
        self.norm1 = nn.Sequential(Transpose(1, 2), nn.BatchNorm1d(d_model), Transpose(1, 2))
        self.norm2 = nn.Sequential(Transpose(1, 2), nn.BatchNorm1d(d_model), Transpose(1, 2))
        self.ff = nn.Sequential(
            nn.Linear(d_model, d_ff), nn.GELU(), nn.Dropout(dropout), nn.Linear(d_ff, d_model)
        )
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        new_x, _ = self.attention(x, x, x)
        x = self.norm1(x + self.dropout(new_x))
        return self.norm2(x + self.dropout(self.ff(x)))


class FlattenHead(nn.Module):
    def __init__(self, nf, target_window, head_dropout=0.0):
        super().__init__()
        self.flatten = nn.Flatten(start_dim=-2)
        self.linear = nn.Linear(nf, target_window)
        self.dropout = nn.Dropout(head_dropout)

    def forward(self, x):  # x: [B, C, d_model, patch_num]
        return self.dropout(self.linear(self.flatten(x)))


class PatchTST(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.patch_len = cfg["patch_len"]
        self.stride = cfg["stride"]
        d_model = cfg["d_model"]
        patch_num = (cfg["seq_len"] - self.patch_len) // self.stride + 2
        self.padding = nn.ReplicationPad1d((0, self.stride))
        self.value_embedding = nn.Linear(self.patch_len, d_model, bias=False)
        self.position = nn.Parameter(torch.randn(1, patch_num, d_model) * 0.02)
        self.dropout = nn.Dropout(cfg["dropout"])
        self.layers = nn.ModuleList(
            [
                EncoderLayer(d_model, cfg["n_heads"], cfg["d_ff"], cfg["dropout"], cfg.get("causal", False))
                for _ in range(cfg["e_layers"])
            ]
        )
        self.head = FlattenHead(d_model * patch_num, cfg["pred_len"], cfg["head_dropout"])

    def forward(self, x_enc):
        B, L, C = x_enc.shape
        x = self.padding(x_enc.permute(0, 2, 1))
        x = x.unfold(dimension=-1, size=self.patch_len, step=self.stride)
        x = x.reshape(B * C, x.shape[2], x.shape[3])
        x = self.dropout(self.value_embedding(x) + self.position)
        for layer in self.layers:
            x = layer(x)
        x = x.reshape(B, C, x.shape[-2], x.shape[-1]).permute(0, 1, 3, 2)
        return self.head(x).permute(0, 2, 1)


class ForecastTrainer:
    def __init__(self, model, cfg, device):
        self.model = model.to(device)
        self.cfg = cfg
        self.device = device
        self.use_amp = cfg["use_amp"]
        self.pred_len = cfg["pred_len"]
        self.f_dim = -1 if cfg["features"] == "MS" else 0
        self.clip_value = cfg.get("clip_value")
        self.criterion = nn.MSELoss()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=cfg["lr"])
        self.scheduler = torch.optim.lr_scheduler.OneCycleLR(
            self.optimizer,
            max_lr=cfg["lr"],
            steps_per_epoch=cfg["steps_per_epoch"],
            epochs=cfg["epochs"],
            pct_start=cfg.get("pct_start", 0.3),
        )
        self.scaler = torch.cuda.amp.GradScaler(enabled=self.use_amp)  # expect: AMP009

    def _to_device(self, batch):
        batch_x, batch_y = batch[0], batch[1]
        return batch_x.float().to(self.device, non_blocking=True), batch_y.float().to(self.device, non_blocking=True)

    def forward_step(self, batch):
        batch_x, batch_y = self._to_device(batch)
        with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=self.use_amp):
            outputs = self.model(batch_x)
        outputs = outputs[:, -self.pred_len:, self.f_dim:]
        batch_y = batch_y[:, -self.pred_len:, self.f_dim:]
        loss = self.criterion(outputs, batch_y)  # expect: AMP002
        return loss

    def backward_step(self, loss):
        self.scaler.scale(loss).backward()

    def optimizer_step(self):
        if self.clip_value is not None:
            clamp_grad_values(self.model.parameters(), self.clip_value)  # expect: AMP005
        self.scaler.step(self.optimizer)  # expect: AMP006
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    @torch.no_grad()
    def validate(self, loader):
        self.model.eval()
        total, count = 0.0, 0
        for batch in loader:
            batch_x, batch_y = self._to_device(batch)
            with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=self.use_amp):
                outputs = self.model(batch_x)
            pred = outputs[:, -self.pred_len:, self.f_dim:].float()
            true = batch_y[:, -self.pred_len:, self.f_dim:]
            total += F.mse_loss(pred, true, reduction="sum").item()
            count += true.numel()
        self.model.train()
        return total / max(count, 1)

    @torch.inference_mode()
    def predict(self, loader):
        self.model.eval()
        preds = []
        for batch in loader:
            batch_x, _ = self._to_device(batch)
            with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=self.use_amp):
                outputs = self.model(batch_x)
            preds.append(outputs[:, -self.pred_len:, :].float().cpu().numpy())
        return np.concatenate(preds, axis=0)

    def save(self, path, epoch, best):
        torch.save(
            {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict(),
                "epoch": epoch,
                "best": best,
            },
            path,
        )

    def export_half(self, path):
        serving = copy.deepcopy(self.model).half().eval()
        torch.save(serving.state_dict(), path)

    def fit(self, train_loader, vali_loader, ckpt_dir):
        os.makedirs(ckpt_dir, exist_ok=True)
        best, bad_epochs = float("inf"), 0
        for epoch in range(self.cfg["epochs"]):
            self.model.train()
            t0, losses = time.time(), []
            for i, batch in enumerate(train_loader):
                loss = self.forward_step(batch)
                self.backward_step(loss)
                self.optimizer_step()
                losses.append(loss.item())
                if (i + 1) % 100 == 0:
                    print(f"\titers: {i + 1}, epoch: {epoch + 1} | loss: {np.mean(losses[-100:]):.7f}")
            vali_loss = self.validate(vali_loader)
            print(
                f"Epoch {epoch + 1} | train {np.average(losses):.7f} vali {vali_loss:.7f} "
                f"| {time.time() - t0:.1f}s"
            )
            if vali_loss < best:
                best, bad_epochs = vali_loss, 0
                self.save(os.path.join(ckpt_dir, "checkpoint.pth"), epoch, best)
            else:
                bad_epochs += 1
                if bad_epochs >= self.cfg["patience"]:
                    print("Early stopping")
                    break
        return best


def parse_args():
    p = argparse.ArgumentParser("PatchTST long-term forecasting")
    p.add_argument("--seq_len", type=int, default=336)
    p.add_argument("--pred_len", type=int, default=96)
    p.add_argument("--enc_in", type=int, default=7)
    p.add_argument("--patch_len", type=int, default=16)
    p.add_argument("--stride", type=int, default=8)
    p.add_argument("--d_model", type=int, default=128)
    p.add_argument("--n_heads", type=int, default=16)
    p.add_argument("--d_ff", type=int, default=256)
    p.add_argument("--e_layers", type=int, default=3)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--patience", type=int, default=10)
    p.add_argument("--clip_value", type=float, default=None)
    p.add_argument("--features", default="M")
    p.add_argument("--use_amp", action="store_true")
    p.add_argument("--checkpoints", default="./checkpoints")
    return p.parse_args()


def main():
    args = parse_args()
    from data_provider import data_provider  # project-local

    _, train_loader = data_provider(args, "train")
    _, vali_loader = data_provider(args, "val")
    cfg = dict(vars(args), head_dropout=0.0, steps_per_epoch=len(train_loader))
    model = PatchTST(cfg)
    trainer = ForecastTrainer(model, cfg, torch.device("cuda"))
    trainer.fit(train_loader, vali_loader, args.checkpoints)


if __name__ == "__main__":
    main()
