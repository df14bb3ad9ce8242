"""Informer: long-sequence time-series forecasting with ProbSparse self-attention.

Zhou et al., AAAI 2021.  Model and experiment runner for ETTh1 / ETTm1 /
Weather, with optional reversible instance normalisation.
"""
import argparse
import math
import os

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.preprocessing import StandardScaler
from torch.utils.data import DataLoader, Dataset


class TriangularCausalMask:
    def __init__(self, B, L, device="cpu"):
        with torch.no_grad():
            self._mask = torch.triu(torch.ones([B, 1, L, L], dtype=torch.bool), diagonal=1).to(device)

    @property
    def mask(self):
        return self._mask


class ProbMask:
    def __init__(self, B, H, L, index, scores, device="cpu"):
        _mask = torch.ones(L, scores.shape[-1], dtype=torch.bool).to(device).triu(1)
        _mask_ex = _mask[None, None, :].expand(B, H, L, scores.shape[-1])
        indicator = _mask_ex[torch.arange(B)[:, None, None], torch.arange(H)[None, :, None], index, :].to(device)
        self._mask = indicator.view(scores.shape).to(device)

    @property
    def mask(self):
        return self._mask


class FullAttention(nn.Module):
    def __init__(self, mask_flag=True, factor=5, scale=None, attention_dropout=0.1):
        super().__init__()
        self.scale, self.mask_flag = scale, mask_flag
        self.dropout = nn.Dropout(attention_dropout)

    def forward(self, queries, keys, values, attn_mask):
        B, L, H, E = queries.shape
        scale = self.scale or 1.0 / math.sqrt(E)
        scores = torch.einsum("blhe,bshe->bhls", queries, keys)
        if self.mask_flag:
            if attn_mask is None:
                attn_mask = TriangularCausalMask(B, L, device=queries.device)
            scores.masked_fill_(attn_mask.mask, -1e9)  # expect: AMP007
        A = self.dropout(torch.softmax(scale * scores, dim=-1))
        return torch.einsum("bhls,bshd->blhd", A, values).contiguous()


class ProbAttention(nn.Module):
    def __init__(self, mask_flag=True, factor=5, scale=None, attention_dropout=0.1):
        super().__init__()
        self.factor, self.scale, self.mask_flag = factor, scale, mask_flag
        self.dropout = nn.Dropout(attention_dropout)

    def _prob_QK(self, Q, K, sample_k, n_top):
        B, H, L_K, E = K.shape
        _, _, L_Q, _ = Q.shape
        K_expand = K.unsqueeze(-3).expand(B, H, L_Q, L_K, E)
        index_sample = torch.randint(L_K, (L_Q, sample_k))
        K_sample = K_expand[:, :, torch.arange(L_Q).unsqueeze(1), index_sample, :]
        Q_K_sample = torch.matmul(Q.unsqueeze(-2), K_sample.transpose(-2, -1)).squeeze(-2)
        # sparsity measurement: max minus mean of the sampled scores
        M = Q_K_sample.max(-1)[0] - torch.div(Q_K_sample.sum(-1), L_K)
        M_top = M.topk(n_top, sorted=False)[1]
        Q_reduce = Q[torch.arange(B)[:, None, None], torch.arange(H)[None, :, None], M_top, :]
        return torch.matmul(Q_reduce, K.transpose(-2, -1)), M_top

    def _get_initial_context(self, V, L_Q):
        B, H, L_V, D = V.shape
        if not self.mask_flag:
            V_sum = V.mean(dim=-2)  # expect: AMP004
            return V_sum.unsqueeze(-2).expand(B, H, L_Q, V_sum.shape[-1]).clone()
        assert L_Q == L_V, "self-attention with a causal mask needs L_Q == L_V"
        return V.cumsum(dim=-2)

    def _update_context(self, context_in, V, scores, index, L_Q):
        B, H, L_V, D = V.shape
        if self.mask_flag:
            attn_mask = ProbMask(B, H, L_Q, index, scores, device=V.device)
            scores.masked_fill_(attn_mask.mask, -1e9)  # expect: AMP007
        attn = torch.softmax(scores, dim=-1)
        context_in[torch.arange(B)[:, None, None], torch.arange(H)[None, :, None], index, :] = torch.matmul(attn, V).type_as(context_in)
        return context_in

    def forward(self, queries, keys, values, attn_mask):
        B, L_Q, H, D = queries.shape
        L_K = keys.shape[1]
        queries, keys, values = queries.transpose(2, 1), keys.transpose(2, 1), values.transpose(2, 1)
        U_part = min(self.factor * int(np.ceil(np.log(L_K))), L_K)
        u = min(self.factor * int(np.ceil(np.log(L_Q))), L_Q)
        scores_top, index = self._prob_QK(queries, keys, sample_k=U_part, n_top=u)
        scores_top = scores_top * (self.scale or 1.0 / math.sqrt(D))
        context = self._get_initial_context(values, L_Q)
        context = self._update_context(context, values, scores_top, index, L_Q)
        return context.transpose(2, 1).contiguous()


class AttentionLayer(nn.Module):
    def __init__(self, attn, mask_flag, d_model, n_heads, factor=5, dropout=0.1, mix=False):
        super().__init__()
        d_keys = d_model // n_heads
        if attn == "prob":
            self.inner_attention = ProbAttention(mask_flag, factor, attention_dropout=dropout)
        else:
            self.inner_attention = FullAttention(mask_flag, factor, attention_dropout=dropout)
        self.query_projection = nn.Linear(d_model, d_keys * n_heads)
        self.key_projection = nn.Linear(d_model, d_keys * n_heads)
        self.value_projection = nn.Linear(d_model, d_keys * n_heads)
        self.out_projection = nn.Linear(d_keys * n_heads, d_model)
        self.n_heads, self.mix = n_heads, mix

    def forward(self, queries, keys, values, attn_mask):
        B, L, _ = queries.shape
        S, H = keys.shape[1], self.n_heads
        queries = self.query_projection(queries).view(B, L, H, -1)
        keys = self.key_projection(keys).view(B, S, H, -1)
        values = self.value_projection(values).view(B, S, H, -1)
        out = self.inner_attention(queries, keys, values, attn_mask)
        if self.mix:
            out = out.transpose(2, 1).contiguous()
        return self.out_projection(out.view(B, L, -1))


class DataEmbedding(nn.Module):
    def __init__(self, c_in, d_model, n_time_feats=4, dropout=0.1, max_len=5000):
        super().__init__()
        self.value_embedding = nn.Conv1d(c_in, d_model, kernel_size=3, padding=1, padding_mode="circular")
        self.temporal_embedding = nn.Linear(n_time_feats, d_model)
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len).float().unsqueeze(1)
        div_term = (torch.arange(0, d_model, 2).float() * -(math.log(10000.0) / d_model)).exp()
        pe[:, 0::2], pe[:, 1::2] = torch.sin(position * div_term), torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, x_mark):
        x = self.value_embedding(x.permute(0, 2, 1)).transpose(1, 2)
        return self.dropout(x + self.pe[:, : x.size(1)] + self.temporal_embedding(x_mark))


class RevIN(nn.Module):
    def __init__(self, num_features, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.affine_weight = nn.Parameter(torch.ones(num_features))
        self.affine_bias = nn.Parameter(torch.zeros(num_features))

    def forward(self, x, mode):
        if mode == "norm":
            self.mean = torch.mean(x, dim=1, keepdim=True).detach()
            self.stdev = torch.sqrt(torch.var(x, dim=1, keepdim=True, unbiased=False) + self.eps).detach()
            return (x - self.mean) / self.stdev * self.affine_weight + self.affine_bias
        x = (x - self.affine_bias) / (self.affine_weight + self.eps * self.eps)
        return x * self.stdev + self.mean


class EncoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attention = AttentionLayer(cfg.attn, False, cfg.d_model, cfg.n_heads, cfg.factor, cfg.dropout)
        self.conv1 = nn.Conv1d(cfg.d_model, cfg.d_ff, 1)
        self.conv2 = nn.Conv1d(cfg.d_ff, cfg.d_model, 1)
        self.norm1, self.norm2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, attn_mask=None):
        x = self.norm1(x + self.dropout(self.attention(x, x, x, attn_mask)))
        y = self.dropout(F.gelu(self.conv1(x.transpose(-1, 1))))
        y = self.dropout(self.conv2(y).transpose(-1, 1))
        return self.norm2(x + y)


class DecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.self_attention = AttentionLayer(cfg.attn, True, cfg.d_model, cfg.n_heads, cfg.factor, cfg.dropout, mix=True)
        self.cross_attention = AttentionLayer("full", False, cfg.d_model, cfg.n_heads, cfg.factor, cfg.dropout)
        self.ff = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_ff), nn.GELU(), nn.Dropout(cfg.dropout), nn.Linear(cfg.d_ff, cfg.d_model))
        self.norms = nn.ModuleList([nn.LayerNorm(cfg.d_model) for _ in range(3)])
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, cross):
        x = self.norms[0](x + self.dropout(self.self_attention(x, x, x, None)))
        x = self.norms[1](x + self.dropout(self.cross_attention(x, cross, cross, None)))
        return self.norms[2](x + self.dropout(self.ff(x)))


class Informer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.pred_len = cfg.pred_len
        self.revin = RevIN(cfg.enc_in) if cfg.revin else None
        self.enc_embedding = DataEmbedding(cfg.enc_in, cfg.d_model, dropout=cfg.dropout)
        self.dec_embedding = DataEmbedding(cfg.dec_in, cfg.d_model, dropout=cfg.dropout)
        self.encoder = nn.ModuleList([EncoderLayer(cfg) for _ in range(cfg.e_layers)])
        self.decoder = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.d_layers)])
        self.enc_norm, self.dec_norm = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.projection = nn.Linear(cfg.d_model, cfg.c_out)

    def forward(self, x_enc, x_mark_enc, x_dec, x_mark_dec):
        if self.revin is not None:
            x_enc = self.revin(x_enc, "norm")
        enc_out = self.enc_embedding(x_enc, x_mark_enc)
        for layer in self.encoder:
            enc_out = layer(enc_out)
        enc_out = self.enc_norm(enc_out)
        dec_out = self.dec_embedding(x_dec, x_mark_dec)
        for layer in self.decoder:
            dec_out = layer(dec_out, enc_out)
        dec_out = self.projection(self.dec_norm(dec_out))
        if self.revin is not None:
            dec_out = self.revin(dec_out, "denorm")
        return dec_out[:, -self.pred_len:, :]


class ETTHour(Dataset):
    def __init__(self, path, flag, seq_len, label_len, pred_len, target="OT"):
        df = pd.read_csv(path)
        borders = {"train": (0, 12 * 30 * 24), "val": (12 * 30 * 24 - seq_len, 16 * 30 * 24), "test": (16 * 30 * 24 - seq_len, 20 * 30 * 24)}
        b0, b1 = borders[flag]
        values = df[df.columns[1:]].values
        self.scaler = StandardScaler().fit(values[: 12 * 30 * 24])
        self.data = self.scaler.transform(values)[b0:b1].astype(np.float32)
        stamp = pd.to_datetime(df["date"][b0:b1])
        self.stamp = np.stack([stamp.dt.month, stamp.dt.day, stamp.dt.weekday, stamp.dt.hour], 1).astype(np.float32)
        self.seq_len, self.label_len, self.pred_len = seq_len, label_len, pred_len

    def __len__(self):
        return len(self.data) - self.seq_len - self.pred_len + 1

    def __getitem__(self, i):
        s_end = i + self.seq_len
        r_begin, r_end = s_end - self.label_len, s_end + self.pred_len
        return self.data[i:s_end], self.data[r_begin:r_end], self.stamp[i:s_end], self.stamp[r_begin:r_end]


class ExpInformer:
    def __init__(self, args):
        self.args = args
        self.device = torch.device(f"cuda:{args.gpu}" if torch.cuda.is_available() else "cpu")
        self.model = Informer(args).to(self.device)

    def _loader(self, flag):
        a = self.args
        ds = ETTHour(os.path.join(a.root_path, a.data_path), flag, a.seq_len, a.label_len, a.pred_len)
        return DataLoader(ds, batch_size=a.batch_size, shuffle=flag == "train", num_workers=a.num_workers, drop_last=flag == "train")

    def _decoder_input(self, batch_y):
        dec_inp = torch.zeros_like(batch_y[:, -self.args.pred_len:, :])
        return torch.cat([batch_y[:, : self.args.label_len, :], dec_inp], dim=1).to(self.device)

    def vali(self, vali_loader, criterion):
        self.model.eval()
        total_loss = []
        f_dim = -1 if self.args.features == "MS" else 0
        with torch.no_grad():
            for batch_x, batch_y, batch_x_mark, batch_y_mark in vali_loader:
                dec_inp = self._decoder_input(batch_y)
                with torch.cuda.amp.autocast(enabled=self.args.use_amp):  # expect: AMP009
                    outputs = self.model(batch_x.to(self.device), batch_x_mark.to(self.device), dec_inp, batch_y_mark.to(self.device))
                pred = outputs[:, -self.args.pred_len:, f_dim:].float().cpu()
                true = batch_y[:, -self.args.pred_len:, f_dim:]
                total_loss.append(criterion(pred, true).item())
        self.model.train()
        return float(np.average(total_loss))

    def train(self, setting):
        train_loader, vali_loader = self._loader("train"), self._loader("val")
        path = os.path.join(self.args.checkpoints, setting)
        os.makedirs(path, exist_ok=True)
        model_optim = torch.optim.Adam(self.model.parameters(), lr=self.args.learning_rate)
        criterion = nn.MSELoss()
        if self.args.use_amp:
            scaler = torch.cuda.amp.GradScaler()  # expect: AMP009
        best_vali, bad_epochs = np.inf, 0
        f_dim = -1 if self.args.features == "MS" else 0
        for epoch in range(self.args.train_epochs):
            self.model.train()
            train_loss = []
            for i, (batch_x, batch_y, batch_x_mark, batch_y_mark) in enumerate(train_loader):
                model_optim.zero_grad()
                dec_inp = self._decoder_input(batch_y)
                with torch.cuda.amp.autocast(enabled=self.args.use_amp):  # expect: AMP009
                    outputs = self.model(batch_x.to(self.device), batch_x_mark.to(self.device), dec_inp, batch_y_mark.to(self.device))
                outputs = outputs[:, -self.args.pred_len:, f_dim:]
                batch_y = batch_y[:, -self.args.pred_len:, f_dim:].to(self.device)
                loss = criterion(outputs, batch_y)  # expect: AMP002
                train_loss.append(loss.item())
                if self.args.use_amp:
                    scaler.scale(loss).backward()
                    scaler.step(model_optim)
                    scaler.update()
                else:
                    loss.backward()
                model_optim.step()  # expect: AMP006
            vali_loss = self.vali(vali_loader, criterion)
            print(f"Epoch {epoch + 1} | Train Loss {np.average(train_loss):.7f} Vali Loss {vali_loss:.7f}")
            if vali_loss < best_vali:
                best_vali, bad_epochs = vali_loss, 0
                torch.save(self.model.state_dict(), os.path.join(path, "checkpoint.pth"))
            else:
                bad_epochs += 1
                if bad_epochs >= self.args.patience:
                    print("Early stopping")
                    break
            for group in model_optim.param_groups:
                group["lr"] = self.args.learning_rate * (0.5 ** epoch)
        self.model.load_state_dict(torch.load(os.path.join(path, "checkpoint.pth")))
        return self.model


def metric(pred, true):
    mae = np.mean(np.abs(pred - true))
    mse = np.mean((pred - true) ** 2)
    mape = np.mean(np.abs((pred - true) / (true + 1e-8)))
    return mae, mse, np.sqrt(mse), mape


def main():
    p = argparse.ArgumentParser(description="[Informer] Long Sequences Forecasting")
    p.add_argument("--root_path", default="./data/ETT/")
    p.add_argument("--data_path", default="ETTh1.csv")
    p.add_argument("--features", default="M", choices=["M", "S", "MS"])
    p.add_argument("--attn", default="prob", choices=["prob", "full"])
    p.add_argument("--revin", action="store_true")
    p.add_argument("--use_amp", action="store_true", help="use automatic mixed precision training")
    for name, default in (("seq_len", 96), ("label_len", 48), ("pred_len", 24), ("enc_in", 7), ("dec_in", 7), ("c_out", 7), ("d_model", 512),
                          ("n_heads", 8), ("e_layers", 2), ("d_layers", 1), ("d_ff", 2048), ("factor", 5), ("batch_size", 32),
                          ("train_epochs", 6), ("patience", 3), ("num_workers", 0), ("gpu", 0)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--dropout", type=float, default=0.05)
    p.add_argument("--learning_rate", type=float, default=1e-4)
    p.add_argument("--checkpoints", default="./checkpoints/")
    args = p.parse_args()
    setting = f"informer_{args.data_path[:-4]}_ft{args.features}_sl{args.seq_len}_ll{args.label_len}_pl{args.pred_len}_{args.attn}"
    ExpInformer(args).train(setting)


if __name__ == "__main__":
    main()
