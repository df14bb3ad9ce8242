"""DeepAR-style probabilistic forecaster: an autoregressive LSTM over scaled
targets plus covariates, emitting a Gaussian (mu, sigma) per step. Pretrains on a
large panel in bf16, then fine-tunes on a target store group."""
import argparse
import math

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F


class WindowDataset(torch.utils.data.Dataset):
    def __init__(self, frame: pd.DataFrame, context=168, horizon=24, covariates=("dow", "hour", "promo")):
        self.series = [g["sales"].to_numpy(np.float32) for _, g in frame.groupby("item_id")]
        self.covs = [g[list(covariates)].to_numpy(np.float32) for _, g in frame.groupby("item_id")]
        self.context, self.horizon = context, horizon
        self.index = [(i, s) for i, y in enumerate(self.series)
                      for s in range(0, len(y) - context - horizon, horizon)]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, k):
        i, s = self.index[k]
        y = self.series[i][s:s + self.context + self.horizon]
        x = self.covs[i][s:s + self.context + self.horizon]
        scale = 1.0 + np.abs(y[:self.context]).mean()
        return torch.from_numpy(y / scale), torch.from_numpy(x), torch.tensor(i, dtype=torch.long)


class DeepAR(nn.Module):
    def __init__(self, n_cov, n_items, hidden=128, layers=3, emb_dim=16):
        super().__init__()
        self.item_emb = nn.Embedding(n_items, emb_dim)
        self.rnn = nn.LSTM(1 + n_cov + emb_dim, hidden, num_layers=layers, batch_first=True, dropout=0.1)
        self.head = nn.Linear(hidden, 2)

    def forward(self, y_prev, cov, item):
        emb = self.item_emb(item)[:, None, :].expand(-1, y_prev.shape[1], -1)
        h, _ = self.rnn(torch.cat([y_prev.unsqueeze(-1), cov, emb], dim=-1))
        return self.head(h)


def gaussian_nll_loss(mu, sigma, target, mask=None):
    mu, sigma = mu.float(), sigma.float()
    nll = torch.log(sigma) + 0.5 * math.log(2 * math.pi) + 0.5 * ((target - mu) / sigma) ** 2
    if mask is not None:
        return (nll * mask).sum() / mask.sum().clamp(min=1.0)
    return nll.mean()


def split_params(out):
    mu = out[..., 0]
    sigma = F.softplus(out[..., 1].float()) + 1e-6
    return mu, sigma


def train(model, loader, epochs, lr, device="cuda"):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-2)
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010
    sched = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=epochs * len(loader))
    for epoch in range(epochs):
        model.train()
        running = 0.0
        for y, cov, item in loader:
            y, cov, item = y.to(device), cov.to(device), item.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(y[:, :-1], cov[:, 1:], item)
                mu = out[..., 0]
                sigma = F.softplus(out[..., 1].float()) + 1e-6
                nll = gaussian_nll_loss(mu, sigma, y[:, 1:])
                smooth = (mu[:, 1:] - mu[:, :-1]).abs().mean()  # expect: AMP004
                loss = nll + 1e-3 * smooth
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            scaler.step(optimizer)  # expect: AMP006
            sched.step()
            running += loss.item()
        print(f"epoch {epoch} nll {running / len(loader):.4f}")
    return model


def finetune_store_group(model, loader, epochs, lr, device="cuda"):
    for p in model.rnn.parameters():
        p.requires_grad_(False)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    for epoch in range(epochs):
        for y, cov, item in loader:
            y, cov, item = y.to(device), cov.to(device), item.to(device)
            with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
                out = model(y[:, :-1], cov[:, 1:], item)
                mu, sigma = split_params(out)
                loss = gaussian_nll_loss(mu, sigma, y[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return model


@torch.no_grad()
def forecast(model, y_ctx, cov, item, horizon, n_samples=100):
    model.eval()
    y = y_ctx.repeat_interleave(n_samples, 0)
    cov, item = cov.repeat_interleave(n_samples, 0), item.repeat_interleave(n_samples, 0)
    for _ in range(horizon):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(y, cov[:, 1:y.shape[1] + 1], item)
        mu, sigma = split_params(out[:, -1:].float())
        y = torch.cat([y, (mu + sigma * torch.randn_like(mu)).float()], dim=1)
    samples = y[:, -horizon:].view(-1, n_samples, horizon)
    return samples.median(dim=1).values, samples.quantile(torch.tensor([0.1, 0.9], device=y.device), dim=1)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--panel", required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args()
    panel = pd.read_parquet(args.panel)
    ds = WindowDataset(panel)
    dl = torch.utils.data.DataLoader(ds, batch_size=256, shuffle=True, num_workers=4)
    net = DeepAR(n_cov=3, n_items=panel["item_id"].nunique()).cuda()
    net = train(net, dl, args.epochs, args.lr)
    target_dl = torch.utils.data.DataLoader(WindowDataset(pd.read_parquet(args.target)), batch_size=64, shuffle=True)
    finetune_store_group(net, target_dl, 5, args.lr / 10)
    torch.save(net.state_dict(), "deepar.pt")
