"""Informer (ProbSparse attention + distilling) for intermittent demand with a zero-inflated
Gaussian head; layout follows Informer2020 / Time-Series-Library.  Run: --data demand.csv --use_amp"""
import argparse
import math

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


class DataEmbedding(nn.Module):
    def __init__(self, c_in, d_model, n_time_feats=4, max_len=5000, dropout=0.05):
        super().__init__()
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len).float().unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * -(math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0))
        self.value_embedding = nn.Conv1d(c_in, d_model, 3, padding=1, padding_mode="circular")
        self.temporal_embedding = nn.Linear(n_time_feats, d_model, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, x_mark):
        x = self.value_embedding(x.permute(0, 2, 1)).transpose(1, 2)
        x = x + self.pe[:, : x.size(1)] + self.temporal_embedding(x_mark)
        return self.dropout(x)


class SparseAttentionBase(nn.Module):
    """Shared ProbSparse driver; subclasses provide the context initialisation/update."""

    def __init__(self, mask_flag=True, factor=5, scale=None, attention_dropout=0.1):
        super().__init__()
        self.factor, self.scale, self.mask_flag = factor, scale, mask_flag

    def _prob_QK(self, Q, K, sample_k, n_top):
        B, H, L_K, E = K.shape
        L_Q = Q.shape[2]
        K_expand = K.unsqueeze(-3).expand(B, H, L_Q, L_K, E)
        index_sample = torch.randint(L_K, (L_Q, sample_k))
        K_sample = K_expand[:, :, torch.arange(L_Q).unsqueeze(1), index_sample, :]
        Q_K_sample = torch.matmul(Q.unsqueeze(-2), K_sample.transpose(-2, -1)).squeeze(-2)
        M = Q_K_sample.max(-1)[0] - torch.div(Q_K_sample.sum(-1), L_K)
        M_top = M.topk(n_top, sorted=False)[1]
        Q_reduce = Q[torch.arange(B)[:, None, None], torch.arange(H)[None, :, None], M_top, :]
        return torch.matmul(Q_reduce, K.transpose(-2, -1)), M_top

    def forward(self, queries, keys, values, attn_mask):
        B, L_Q, H, D = queries.shape
        L_K = keys.shape[1]
        queries, keys, values = queries.transpose(2, 1), keys.transpose(2, 1), values.transpose(2, 1)
        U_part = min(self.factor * int(np.ceil(np.log(L_K))), L_K)
        u = min(self.factor * int(np.ceil(np.log(L_Q))), L_Q)
        scores_top, index = self._prob_QK(queries, keys, sample_k=U_part, n_top=u)
        scores_top = scores_top * (self.scale or 1.0 / math.sqrt(D))
        context = self._get_initial_context(values, L_Q)
        context = self._update_context(context, values, scores_top, index, L_Q, attn_mask)
        return context.transpose(2, 1).contiguous()


class ProbAttention(SparseAttentionBase):
    def _get_initial_context(self, V, L_Q):
        B, H, L_V, D = V.shape
        if not self.mask_flag:
            V_sum = V.mean(dim=-2)  # expect: AMP004
            return V_sum.unsqueeze(-2).expand(B, H, L_Q, V_sum.shape[-1]).clone()
        assert L_Q == L_V
        return V.cumsum(dim=-2)

    def _update_context(self, context_in, V, scores, index, L_Q, attn_mask):
        B, H = V.shape[:2]
        if self.mask_flag:
            causal = torch.ones(L_Q, scores.shape[-1], dtype=torch.bool, device=V.device).triu(1)
            scores.masked_fill_(causal[index], -np.inf)
        attn = torch.softmax(scores, dim=-1)
        context_in[torch.arange(B)[:, None, None], torch.arange(H)[None, :, None], index, :] = \
            torch.matmul(attn, V).type_as(context_in)
        return context_in


class FullAttention(nn.Module):
    def __init__(self, mask_flag=True, factor=5, scale=None, attention_dropout=0.1):
        super().__init__()
        self.scale, self.mask_flag = scale, mask_flag
        self.dropout = nn.Dropout(attention_dropout)

    def forward(self, queries, keys, values, attn_mask):
        B, L, H, E = queries.shape
        scores = torch.einsum("blhe,bshe->bhls", queries, keys)
        if self.mask_flag:
            causal = torch.triu(torch.ones(L, keys.shape[1], dtype=torch.bool, device=queries.device), 1)
            scores.masked_fill_(causal if attn_mask is None else attn_mask, -np.inf)
        A = self.dropout(torch.softmax((self.scale or 1.0 / math.sqrt(E)) * scores, dim=-1))
        return torch.einsum("bhls,bshd->blhd", A, values).contiguous()


class AttentionLayer(nn.Module):
    def __init__(self, attn_type, mask_flag, d_model, n_heads, factor=5, dropout=0.1):
        super().__init__()
        d_k = d_model // n_heads
        self.inner_attention = (ProbAttention(mask_flag, factor, attention_dropout=dropout)
                                if attn_type == "prob"
                                else FullAttention(mask_flag, factor, attention_dropout=dropout))
        self.query_projection = nn.Linear(d_model, d_k * n_heads)
        self.key_projection = nn.Linear(d_model, d_k * n_heads)
        self.value_projection = nn.Linear(d_model, d_k * n_heads)
        self.out_projection = nn.Linear(d_k * n_heads, d_model)
        self.n_heads = n_heads

    def forward(self, queries, keys, values, attn_mask=None):
        B, L, _ = queries.shape
        S, H = keys.shape[1], self.n_heads
        q = self.query_projection(queries).view(B, L, H, -1)
        k = self.key_projection(keys).view(B, S, H, -1)
        v = self.value_projection(values).view(B, S, H, -1)
        out = self.inner_attention(q, k, v, attn_mask)
        return self.out_projection(out.view(B, L, -1))


class ConvLayer(nn.Module):
    def __init__(self, c_in):
        super().__init__()
        self.downConv = nn.Conv1d(c_in, c_in, 3, padding=1, padding_mode="circular")
        self.norm = nn.BatchNorm1d(c_in)
        self.maxPool = nn.MaxPool1d(kernel_size=3, stride=2, padding=1)

    def forward(self, x):
        x = F.elu(self.norm(self.downConv(x.permute(0, 2, 1))))
        return self.maxPool(x).transpose(1, 2)


class EncoderLayer(nn.Module):
    def __init__(self, attention, d_model, d_ff, dropout=0.1):
        super().__init__()
        self.attention = attention
        self.conv1 = nn.Conv1d(d_model, d_ff, 1)
        self.conv2 = nn.Conv1d(d_ff, d_model, 1)
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, attn_mask=None):
        x = self.norm1(x + self.dropout(self.attention(x, x, x, attn_mask)))
        y = self.dropout(F.gelu(self.conv1(x.transpose(-1, 1))))
        y = self.dropout(self.conv2(y).transpose(-1, 1))
        return self.norm2(x + y)


class DecoderLayer(nn.Module):
    def __init__(self, self_attention, cross_attention, d_model, d_ff, dropout=0.1):
        super().__init__()
        self.self_attention, self.cross_attention = self_attention, cross_attention
        self.ff = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Dropout(dropout),
                                nn.Linear(d_ff, d_model))
        self.norm1, self.norm2, self.norm3 = (nn.LayerNorm(d_model) for _ in range(3))

    def forward(self, x, cross):
        x = self.norm1(x + self.self_attention(x, x, x))
        x = self.norm2(x + self.cross_attention(x, cross, cross))
        return self.norm3(x + self.ff(x))


def zero_inflated_nll(p_zero, mu, sigma, y):
    is_zero = (y == 0).float()
    gauss = -0.5 * ((y - mu) / sigma) ** 2 - torch.log(sigma) - 0.5 * math.log(2 * math.pi)
    ll_zero = torch.log(p_zero + 1e-8)  # expect: AMP011
    ll_nonzero = torch.log(1.0 - p_zero + 1e-8) + gauss  # expect: AMP011
    return -(is_zero * ll_zero + (1.0 - is_zero) * ll_nonzero).mean()


class Informer(nn.Module):
    def __init__(self, enc_in, dec_in, c_out, pred_len, d_model=512, n_heads=8, e_layers=3,
                 d_layers=2, d_ff=2048, attn="prob", factor=5, dropout=0.05):
        super().__init__()
        self.pred_len = pred_len
        self.enc_embedding = DataEmbedding(enc_in, d_model, dropout=dropout)
        self.dec_embedding = DataEmbedding(dec_in, d_model, dropout=dropout)
        self.encoder = nn.ModuleList([
            EncoderLayer(AttentionLayer(attn, False, d_model, n_heads, factor, dropout),
                         d_model, d_ff, dropout) for _ in range(e_layers)])
        self.distil = nn.ModuleList([ConvLayer(d_model) for _ in range(e_layers - 1)])
        self.enc_norm = nn.LayerNorm(d_model)
        self.decoder = nn.ModuleList([
            DecoderLayer(AttentionLayer("full", True, d_model, n_heads, factor, dropout),
                         AttentionLayer("full", False, d_model, n_heads, factor, dropout),
                         d_model, d_ff, dropout) for _ in range(d_layers)])
        self.projection = nn.Linear(d_model, c_out)
        self.sigma_proj = nn.Linear(d_model, c_out)
        self.zero_proj = nn.Linear(d_model, c_out)

    def forward(self, x_enc, x_mark_enc, x_dec, x_mark_dec, y_true=None):
        # RevIN-style instance normalisation of the raw series (Non-stationary Transformer)
        means = x_enc.mean(1, keepdim=True).detach()
        stdev = torch.sqrt(torch.var(x_enc, dim=1, keepdim=True, unbiased=False) + 1e-5).detach()
        x_enc, x_dec = (x_enc - means) / stdev, (x_dec - means) / stdev
        enc_out = self.enc_embedding(x_enc, x_mark_enc)
        for layer, conv in zip(self.encoder[:-1], self.distil):
            enc_out = conv(layer(enc_out))
        enc_out = self.enc_norm(self.encoder[-1](enc_out))
        dec_out = self.dec_embedding(x_dec, x_mark_dec)
        for layer in self.decoder:
            dec_out = layer(dec_out, enc_out)
        dec_out = dec_out[:, -self.pred_len:]
        mu = self.projection(dec_out) * stdev + means
        if y_true is None:
            return mu, None
        sigma = F.softplus(self.sigma_proj(dec_out)) + 1e-3
        p_zero = torch.sigmoid(self.zero_proj(dec_out))
        return mu, zero_inflated_nll(p_zero, mu, sigma, y_true)


class DemandDataset(Dataset):
    def __init__(self, path, seq_len, label_len, pred_len):
        df = pd.read_csv(path, parse_dates=["date"])
        values = df.drop(columns=["date"]).values.astype(np.float32)
        self.scale = values.std(0) + 1e-8
        self.data = values / self.scale
        d = df["date"].dt
        self.stamp = np.stack([d.month / 12.0, d.day / 31.0, d.weekday / 6.0, d.hour / 23.0], 1).astype(np.float32) - 0.5
        self.seq_len, self.label_len, self.pred_len = seq_len, label_len, pred_len

    def __len__(self):
        return len(self.data) - self.seq_len - self.pred_len + 1

    def __getitem__(self, i):
        s_end = i + self.seq_len
        r_begin, r_end = s_end - self.label_len, s_end + self.pred_len
        return (self.data[i:s_end], self.data[r_begin:r_end],
                self.stamp[i:s_end], self.stamp[r_begin:r_end])


class ExpInformer:
    def __init__(self, args):
        self.args = args
        self.device = torch.device("cuda")
        self.model = Informer(args.enc_in, args.enc_in, args.enc_in, args.pred_len,
                              attn=args.attn).to(self.device)

    def _decoder_input(self, batch_y):
        dec_inp = torch.zeros_like(batch_y[:, -self.args.pred_len:, :])
        return torch.cat([batch_y[:, : self.args.label_len, :], dec_inp], dim=1)

    def vali(self, loader):
        self.model.eval()
        errs = []
        with torch.no_grad():
            for batch_x, batch_y, x_mark, y_mark in loader:
                batch_x, batch_y = batch_x.to(self.device), batch_y.to(self.device)
                mu, _ = self.model(batch_x, x_mark.to(self.device), self._decoder_input(batch_y),
                                   y_mark.to(self.device))
                true = batch_y[:, -self.args.pred_len:]
                errs.append(torch.abs(mu - true).mean().item())
        self.model.train()
        return float(np.mean(errs))

    def train(self):
        args = self.args
        train_loader = DataLoader(DemandDataset(args.data, args.seq_len, args.label_len, args.pred_len),
                                  batch_size=args.batch_size, shuffle=True, drop_last=True)
        model_optim = torch.optim.Adam(self.model.parameters(), lr=args.learning_rate)
        criterion = nn.MSELoss()
        if args.use_amp:
            scaler = torch.cuda.amp.GradScaler()  # expect: AMP009
        for epoch in range(args.train_epochs):
            for batch_x, batch_y, x_mark, y_mark in train_loader:
                model_optim.zero_grad()
                batch_x, batch_y = batch_x.to(self.device), batch_y.to(self.device)
                x_mark, y_mark = x_mark.to(self.device), y_mark.to(self.device)
                dec_inp = self._decoder_input(batch_y)
                true = batch_y[:, -args.pred_len:]
                if args.use_amp:
                    with torch.cuda.amp.autocast():  # expect: AMP009
                        mu, nll = self.model(batch_x, x_mark, dec_inp, y_mark, y_true=true)
                        loss = criterion(mu, true) + args.zi_weight * nll
                    scaler.scale(loss).backward()
                    scaler.step(model_optim)
                    scaler.update()
                else:
                    mu, nll = self.model(batch_x, x_mark, dec_inp, y_mark, y_true=true)
                    loss = criterion(mu, true) + args.zi_weight * nll
                    loss.backward()
                    model_optim.step()
            for group in model_optim.param_groups:
                group["lr"] = args.learning_rate * (0.5 ** (epoch + 1))
            print(f"epoch {epoch + 1} train loss {loss.item():.5f} vali mae {self.vali(train_loader):.5f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--attn", default="prob", choices=["prob", "full"])
    p.add_argument("--use_amp", action="store_true")
    for name, default in [("enc_in", 7), ("seq_len", 96), ("label_len", 48), ("pred_len", 24),
                          ("batch_size", 32), ("learning_rate", 1e-4), ("train_epochs", 6),
                          ("zi_weight", 0.5)]:
        p.add_argument(f"--{name}", type=type(default), default=default)
    ExpInformer(p.parse_args()).train()
