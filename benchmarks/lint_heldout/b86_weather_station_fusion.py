"""Medium-range forecasting on a 1.5-degree lat-lon grid, fusing sparse station observations.

Grid state (ERA5 variables) is encoded by a conv stem; grid tokens cross-attend to the
station reports of the same hour, then a temporal attention over the last frames and a
conv decoder predict the 6-hour tendency.
"""
import argparse
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class TrainConfig:
    n_vars: int = 69
    hidden: int = 256
    heads: int = 8
    history: int = 2
    lr: float = 3e-4
    clip: float = 1.0
    accum_steps: int = 4
    epochs: int = 30


def latitude_weights(n_lat):
    lat = torch.linspace(-90.0, 90.0, n_lat, dtype=torch.float32)
    w = torch.cos(torch.deg2rad(lat))
    return (w / w.mean())[:, None]


def lat_weighted_mse(pred, target, w):
    return ((pred - target) ** 2 * w).mean()


class StationCrossAttention(nn.Module):
    def __init__(self, dim, obs_dim, heads):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(obs_dim, 2 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, grid_tokens, obs, obs_valid):
        b, n, d = grid_tokens.shape
        hd = d // self.heads
        q = self.q(grid_tokens).view(b, n, self.heads, hd).transpose(1, 2)
        k, v = self.kv(obs).chunk(2, dim=-1)
        k = k.view(b, -1, self.heads, hd).transpose(1, 2)
        v = v.view(b, -1, self.heads, hd).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(hd)
        scores = scores.masked_fill(~obs_valid[:, None, None, :], float("-1e9"))  # expect: AMP007
        attn = torch.softmax(scores, dim=-1)
        return grid_tokens + self.out((attn @ v).transpose(1, 2).reshape(b, n, d))


class TemporalAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, frames):
        # frames: (B*N, T, D), causal over T
        bn, t, d = frames.shape
        hd = d // self.heads
        q, k, v = self.qkv(frames).view(bn, t, 3, self.heads, hd).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(hd)
        causal = torch.ones(t, t, dtype=torch.bool, device=frames.device).triu(1)
        mask_value = -1e9 if scores.dtype == torch.float32 else -1e4
        scores = scores.masked_fill(causal, mask_value)
        attn = scores.softmax(dim=-1)
        return frames + self.out((attn @ v).transpose(1, 2).reshape(bn, t, d))


class WeatherNet(nn.Module):
    def __init__(self, cfg, obs_dim=8):
        super().__init__()
        self.history = cfg.history
        self.stem = nn.Conv2d(cfg.n_vars, cfg.hidden, kernel_size=4, stride=4)
        self.station_attn = StationCrossAttention(cfg.hidden, obs_dim, cfg.heads)
        self.temporal = TemporalAttention(cfg.hidden, cfg.heads)
        self.decoder = nn.Sequential(
            nn.ConvTranspose2d(cfg.hidden, cfg.hidden, kernel_size=4, stride=4),
            nn.GELU(),
            nn.Conv2d(cfg.hidden, cfg.n_vars, kernel_size=3, padding=1),
        )

    def forward(self, states, obs, obs_valid):
        # states: (B, T, V, H, W); obs: (B, S, obs_dim); obs_valid: (B, S)
        b, t, v, h, w = states.shape
        feats = self.stem(states.flatten(0, 1))
        _, d, hh, ww = feats.shape
        tokens = feats.flatten(2).transpose(1, 2).reshape(b, t, hh * ww, d)
        last = self.station_attn(tokens[:, -1], obs, obs_valid)
        tokens = torch.cat([tokens[:, :-1], last[:, None]], dim=1)
        tokens = tokens.permute(0, 2, 1, 3).reshape(b * hh * ww, t, d)
        fused = self.temporal(tokens)[:, -1].reshape(b, hh, ww, d).permute(0, 3, 1, 2)
        return states[:, -1] + self.decoder(fused)


class Trainer:
    def __init__(self, model, cfg, n_lat, device):
        self.model = model.to(device)
        self.cfg = cfg
        self.device = device
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
        self.scaler = torch.amp.GradScaler("cuda")
        self.lat_w = latitude_weights(n_lat).to(device)

    def train_step(self, batch):
        states = batch["states"].to(self.device, non_blocking=True).half()  # expect: AMP001
        target = batch["target"].to(self.device, non_blocking=True)
        obs, obs_valid = batch["obs"].to(self.device), batch["obs_valid"].to(self.device)
        with torch.autocast("cuda", dtype=torch.float16):
            pred = self.model(states, obs, obs_valid)
            loss = lat_weighted_mse(pred.float(), target, self.lat_w) / self.cfg.accum_steps
            self.scaler.scale(loss).backward()  # expect: AMP008
        return loss.detach() * self.cfg.accum_steps

    def optimizer_step(self):
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip)  # expect: AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def validate(self, loader):
        self.model.eval()
        per_var = []
        for batch in loader:
            states = batch["states"].to(self.device)
            target = batch["target"].to(self.device)
            with torch.cuda.amp.autocast():  # expect: AMP009
                pred = self.model(states, batch["obs"].to(self.device), batch["obs_valid"].to(self.device))
            err = (pred.float() - target) ** 2 * self.lat_w
            per_var.append(err.mean(dim=(-2, -1)).sqrt().mean(dim=0).cpu())
        self.model.train()
        return torch.stack(per_var).mean(dim=0)

    def fit(self, train_loader, valid_loader, var_names):
        for epoch in range(self.cfg.epochs):
            running = 0.0
            for i, batch in enumerate(train_loader):
                running += self.train_step(batch).item()
                if (i + 1) % self.cfg.accum_steps == 0:
                    self.optimizer_step()
            rmse = self.validate(valid_loader)
            worst = int(torch.argmax(rmse))
            print(f"epoch {epoch}: train {running / len(train_loader):.4f}  worst rmse {var_names[worst]}={rmse[worst]:.3f}")


class ShardDataset(torch.utils.data.Dataset):
    def __init__(self, path, history):
        self.arr = np.load(path, mmap_mode="r")
        self.obs = np.load(path.replace(".npy", "_obs.npz"))
        self.history = history

    def __len__(self):
        return self.arr.shape[0] - self.history

    def __getitem__(self, i):
        states = torch.from_numpy(np.array(self.arr[i : i + self.history], dtype=np.float32))
        target = torch.from_numpy(np.array(self.arr[i + self.history], dtype=np.float32))
        obs = torch.from_numpy(self.obs["values"][i + self.history - 1]).float()
        valid = torch.from_numpy(self.obs["valid"][i + self.history - 1]).bool()
        return {"states": states, "target": target, "obs": obs, "obs_valid": valid}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", default="data/era5_1p5deg_train.npy")
    ap.add_argument("--valid", default="data/era5_1p5deg_valid.npy")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=30)
    opts = ap.parse_args()
    cfg = TrainConfig(epochs=opts.epochs)
    train_ds, valid_ds = ShardDataset(opts.train, cfg.history), ShardDataset(opts.valid, cfg.history)
    n_lat = train_ds.arr.shape[-2]
    trainer = Trainer(WeatherNet(cfg), cfg, n_lat, torch.device("cuda"))
    train_loader = torch.utils.data.DataLoader(train_ds, batch_size=opts.batch_size, shuffle=True, num_workers=8)
    valid_loader = torch.utils.data.DataLoader(valid_ds, batch_size=opts.batch_size, num_workers=8)
    names = [f"var{i}" for i in range(cfg.n_vars)]
    trainer.fit(train_loader, valid_loader, names)
