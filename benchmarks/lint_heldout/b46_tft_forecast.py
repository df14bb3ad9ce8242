"""Temporal Fusion Transformer (Lim et al., 2021) for multi-horizon quantile forecasting.

Static covariates select variables and initialise the LSTM state; an interpretable multi-head
attention (values shared across heads, heads averaged) runs over the enriched sequence.
Inputs are scaled per series by the mean absolute history; outputs are in scaled units.
"""
import argparse
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class TFTConfig:
    n_static: int = 4
    n_hist: int = 8
    n_future: int = 5
    d_model: int = 160
    n_head: int = 4
    dropout: float = 0.1
    quantiles: tuple = (0.1, 0.5, 0.9)
    act: str = "ELU"


class TFTOutput(NamedTuple):
    quantiles: torch.Tensor
    attention: torch.Tensor
    static_weights: torch.Tensor
    scale: torch.Tensor


class GatedResidualNetwork(nn.Module):
    def __init__(self, d_in, d_hidden, d_out, dropout=0.1, context_dim=None, act="ELU"):
        super().__init__()
        self.skip = nn.Linear(d_in, d_out) if d_in != d_out else nn.Identity()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.context = nn.Linear(context_dim, d_hidden, bias=False) if context_dim else None
        self.act = getattr(nn, act)()
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.dropout = nn.Dropout(dropout)
        self.gate = nn.Linear(d_hidden, 2 * d_out)
        self.norm = nn.LayerNorm(d_out)

    def forward(self, x, context=None):
        h = self.fc1(x)
        if context is not None:
            h = h + self.context(context)
        h = self.dropout(self.fc2(self.act(h)))
        return self.norm(self.skip(x) + F.glu(self.gate(h), dim=-1))


class VariableSelectionNetwork(nn.Module):
    def __init__(self, n_vars, d_model, dropout=0.1, context_dim=None):
        super().__init__()
        self.var_proj = nn.ModuleList([nn.Linear(1, d_model) for _ in range(n_vars)])
        self.var_grns = nn.ModuleList([GatedResidualNetwork(d_model, d_model, d_model, dropout) for _ in range(n_vars)])
        self.flat_grn = GatedResidualNetwork(n_vars * d_model, d_model, n_vars, dropout, context_dim)

    def forward(self, x, context=None):
        embs = [proj(x[..., i : i + 1]) for i, proj in enumerate(self.var_proj)]
        weights = torch.softmax(self.flat_grn(torch.cat(embs, dim=-1), context), dim=-1)
        sparsity = -(weights * torch.log(weights + 1e-8)).sum(-1).mean()
        processed = torch.stack([grn(e) for grn, e in zip(self.var_grns, embs)], dim=-1)
        return (processed * weights.unsqueeze(-2)).sum(dim=-1), weights, sparsity


class InterpretableMultiHeadAttention(nn.Module):
    def __init__(self, d_model, n_head, dropout=0.1):
        super().__init__()
        self.n_head, self.d_head = n_head, d_model // n_head
        self.q_proj = nn.Linear(d_model, n_head * self.d_head)
        self.k_proj = nn.Linear(d_model, n_head * self.d_head)
        self.v_proj = nn.Linear(d_model, self.d_head)
        self.out_proj = nn.Linear(self.d_head, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, q, k, v, mask):
        b, t, _ = q.shape
        qh = self.q_proj(q).view(b, t, self.n_head, self.d_head).transpose(1, 2)
        kh = self.k_proj(k).view(b, -1, self.n_head, self.d_head).transpose(1, 2)
        vh = self.v_proj(v).unsqueeze(1)
        scores = torch.matmul(qh, kh.transpose(-1, -2)) / math.sqrt(self.d_head)
        scores = scores.masked_fill(mask, -1e9)  # expect: AMP007
        attn = self.dropout(torch.softmax(scores, dim=-1))
        heads = torch.matmul(attn, vh)
        out = self.out_proj(heads.mean(dim=1))  # expect: AMP004
        return out, attn.mean(dim=1)


class QuantileHead(nn.Module):
    """RMS-normalised projection followed by one output per quantile."""

    def __init__(self, d_model, n_quantiles):
        super().__init__()
        self.proj = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, n_quantiles)

    def forward(self, x):
        h = self.proj(x)
        ms = (h * h).mean(dim=-1, keepdim=True)  # expect: AMP004
        h = h / torch.sqrt(ms + 1e-8)  # expect: AMP011
        return self.out(h)


class TemporalFusionTransformer(nn.Module):
    def __init__(self, cfg: TFTConfig):
        super().__init__()
        d = cfg.d_model
        self.static_vsn = VariableSelectionNetwork(cfg.n_static, d, cfg.dropout)
        self.static_ctx = nn.ModuleDict({name: GatedResidualNetwork(d, d, d, cfg.dropout, act=cfg.act)
                                         for name in ("select", "enrich", "state_h", "state_c")})
        self.hist_vsn = VariableSelectionNetwork(cfg.n_hist, d, cfg.dropout, context_dim=d)
        self.fut_vsn = VariableSelectionNetwork(cfg.n_future, d, cfg.dropout, context_dim=d)
        self.encoder = nn.LSTM(d, d, batch_first=True)
        self.decoder = nn.LSTM(d, d, batch_first=True)
        self.post_lstm_gate = nn.Linear(d, 2 * d)
        self.post_lstm_norm = nn.LayerNorm(d)
        self.enrich = GatedResidualNetwork(d, d, d, cfg.dropout, context_dim=d, act=cfg.act)
        self.attention = InterpretableMultiHeadAttention(d, cfg.n_head, cfg.dropout)
        self.post_attn_norm = nn.LayerNorm(d)
        self.ctx_proj = nn.Linear(d, d)
        self.position_wise = GatedResidualNetwork(d, d, d, cfg.dropout, context_dim=d, act=cfg.act)
        self.quantile_head = QuantileHead(d, len(cfg.quantiles))

    def forward(self, x_static, x_hist, x_fut):
        scale = x_hist[..., :1].abs().mean(dim=1, keepdim=True) + 1e-8
        x_hist = torch.cat([x_hist[..., :1] / scale, x_hist[..., 1:]], dim=-1)
        static, static_w, _ = self.static_vsn(x_static)
        ctx = {name: grn(static) for name, grn in self.static_ctx.items()}
        hist, _, _ = self.hist_vsn(x_hist, ctx["select"][:, None])
        fut, _, _ = self.fut_vsn(x_fut, ctx["select"][:, None])
        state = (ctx["state_h"][None].contiguous(), ctx["state_c"][None].contiguous())
        enc_out, state = self.encoder(hist, state)
        dec_out, _ = self.decoder(fut, state)
        lstm_out = torch.cat([enc_out, dec_out], dim=1)
        temporal = self.post_lstm_norm(torch.cat([hist, fut], dim=1) + F.glu(self.post_lstm_gate(lstm_out), dim=-1))
        enriched = self.enrich(temporal, ctx["enrich"][:, None])
        t = enriched.size(1)
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=enriched.device), diagonal=1)
        attn_out, attn_w = self.attention(enriched, enriched, enriched, mask)
        decoded = self.post_attn_norm(enriched + attn_out)
        summary = self.ctx_proj(decoded).mean(dim=1, dtype=torch.float32)
        decoded = self.position_wise(decoded, summary[:, None])
        horizon = x_fut.size(1)
        return TFTOutput(self.quantile_head(decoded[:, -horizon:]), attn_w, static_w, scale)


def quantile_loss(pred, target, quantiles):
    errors = target.unsqueeze(-1) - pred
    q = torch.tensor(quantiles, device=pred.device, dtype=pred.dtype)
    return torch.max((q - 1) * errors, q * errors).mean()


def train_epoch(model, loader, optimizer, scaler, cfg, device):
    model.train()
    for batch in loader:
        x_static = batch["static"].to(device).half()  # expect: AMP001
        x_hist, x_fut = batch["hist"].to(device), batch["future"].to(device)
        y = batch["target"].to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x_static, x_hist, x_fut)
        loss = quantile_loss(out.quantiles, y / out.scale, cfg.quantiles)  # expect: AMP002
        optimizer.zero_grad(set_to_none=True)
        loss = scaler.scale(loss)
        loss.backward()
        optimizer.step()  # expect: AMP006


@torch.no_grad()
def evaluate(model, loader, cfg, device):
    model.eval()
    total, n = 0.0, 0
    for batch in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(batch["static"].to(device), batch["hist"].to(device), batch["future"].to(device))
        y = batch["target"].to(device) / out.scale.float()
        total += quantile_loss(out.quantiles.float(), y, cfg.quantiles).item() * y.size(0)
        n += y.size(0)
    model.train()
    return total / n


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/electricity_tft.pt")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=50)
    args = p.parse_args()
    device = torch.device("cuda")
    cfg = TFTConfig()
    train_loader, val_loader = torch.load(args.data)
    model = TemporalFusionTransformer(cfg)
    model.to(device)
    model = torch.compile(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler("cuda")
    best = float("inf")
    for epoch in range(args.epochs):
        train_epoch(model, train_loader, optimizer, scaler, cfg, device)
        val = evaluate(model, val_loader, cfg, device)
        if val < best:
            best = val
            torch.save(model.state_dict(), "tft_best.pt")
        print(f"epoch {epoch} val q-loss {val:.4f} (best {best:.4f})")


if __name__ == "__main__":
    main()
