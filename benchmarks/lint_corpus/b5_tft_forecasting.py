"""Temporal Fusion Transformer for multi-horizon quantile forecasting; fp16 autocast behind --amp, CPU bf16 debug step."""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


class GRN(nn.Module):
    """Gated residual network."""

    def __init__(self, d_in, d_hidden, d_out, dropout=0.1):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, 2 * d_out)
        self.skip = nn.Linear(d_in, d_out) if d_in != d_out else nn.Identity()
        self.norm = nn.LayerNorm(d_out)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        h = self.drop(self.fc2(F.elu(self.fc1(x))))
        return self.norm(self.skip(x) + F.glu(h, dim=-1))


class VariableSelection(nn.Module):
    def __init__(self, n_vars, d_model):
        super().__init__()
        self.var_grns = nn.ModuleList([GRN(1, d_model, d_model) for _ in range(n_vars)])
        self.weight_grn = GRN(n_vars, d_model, n_vars)

    def forward(self, x):
        weights = torch.softmax(self.weight_grn(x), dim=-1, dtype=torch.float32)
        embs = torch.stack([g(x[..., i:i + 1]) for i, g in enumerate(self.var_grns)], dim=-1)
        return (embs * weights.unsqueeze(-2)).sum(-1), weights


class TemporalEncoder(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        self.lstm = nn.LSTM(d_model, d_model, batch_first=True)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        h, _ = self.lstm(x)
        return self.proj(h)


class InterpretableMHA(nn.Module):
    def __init__(self, d_model, heads=4):
        super().__init__()
        self.heads, self.dk = heads, d_model // heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, self.dk)
        self.out = nn.Linear(self.dk, d_model)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.dk).transpose(1, 2)
        k = self.k(x).view(b, t, self.heads, self.dk).transpose(1, 2)
        scores = q @ k.transpose(-1, -2) / self.dk ** 0.5
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(causal, -1e10)  # expect: AMP007
        attn = scores.softmax(-1)
        return self.out((attn @ self.v(x).unsqueeze(1)).mean(1, dtype=torch.float32)), attn


class TFT(nn.Module):
    def __init__(self, n_past, n_future, d_model=64, n_quantiles=3):
        super().__init__()
        self.past_vsn = VariableSelection(n_past, d_model)
        self.future_vsn = VariableSelection(n_future, d_model)
        self.past_encoder = TemporalEncoder(d_model)
        self.future_encoder = TemporalEncoder(d_model)
        self.enrich = GRN(2 * d_model, d_model, d_model)
        self.attn = InterpretableMHA(d_model)
        self.head = nn.Linear(d_model, n_quantiles)

    def decode(self, enc, ctx_vec, future):
        f, _ = self.future_vsn(future)
        dec = self.future_encoder(f)
        h = self.enrich(torch.cat([dec, ctx_vec.unsqueeze(1).expand_as(dec)], dim=-1))
        a, _ = self.attn(torch.cat([enc, h], dim=1))
        return a[:, enc.size(1):] + h


def quantile_loss(preds, y, quantiles):
    diff = y.unsqueeze(-1) - preds
    q = torch.tensor(quantiles, device=preds.device)
    return torch.maximum(q * diff, (q - 1) * diff).mean()


def train_epoch(model: TFT, loader, optimizer, scaler, quantiles, use_amp, mape_w=0.1):
    model.train()
    for past, future, y in loader:
        past, future, y = past.cuda(), future.cuda(), y.cuda()
        with torch.autocast("cuda", dtype=torch.float16, enabled=use_amp):
            p, _ = model.past_vsn(past)
            enc = model.past_encoder(p)
            ctx_vec = enc.mean(dim=1)  # expect: AMP004
            preds = model.head(model.decode(enc, ctx_vec, future))
            median = preds[..., 1]
            smape = ((median - y).abs() / (median.abs() + 1e-8)).sum() / y.numel()  # expect: AMP011
        loss = quantile_loss(preds, y, quantiles) + mape_w * smape  # expect: AMP002
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()


def cpu_debug_step(model: TFT, batch, optimizer, quantiles):
    past, future, y = batch
    with torch.autocast("cpu", dtype=torch.bfloat16):
        p, _ = model.past_vsn(past)
        enc = model.past_encoder(p)
        act_reg = enc.abs().sum(dim=-1).mean()  # expect: AMP004
        preds = model.head(model.decode(enc, enc[:, -1], future))
        loss = quantile_loss(preds.float(), y, quantiles) + 1e-5 * act_reg.float()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


@torch.no_grad()
def interpret(model: TFT, past):
    model.eval()
    with torch.autocast("cuda", dtype=torch.float16):
        p, weights = model.past_vsn(past.cuda())
        enc = model.past_encoder(p)
    return weights.mean(dim=(0, 1)).cpu(), enc.float().norm(dim=-1).cpu()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--amp", action="store_true")
    ap.add_argument("--epochs", type=int, default=30)
    args = ap.parse_args()
    quantiles = [0.1, 0.5, 0.9]
    model = TFT(n_past=12, n_future=4).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-10)
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
    loader = torch.load("tft_batches.pt")
    for _ in range(args.epochs):
        train_epoch(model, loader, optimizer, scaler, quantiles, args.amp)
