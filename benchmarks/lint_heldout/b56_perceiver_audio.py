"""Perceiver-style latent transformer for multi-label audio tagging.

Log-mel clips of variable length are encoded by a small conv frontend, concatenated with
Fourier position features and read by a fixed array of latents through cross-attention.
Trained with fp16 autocast and a GradScaler on a single GPU.
"""
import math
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

CFG = {
    "n_mels": 128,
    "frontend_channels": 256,
    "latent_len": 256,
    "latent_dim": 512,
    "cross_heads": 1,
    "self_heads": 8,
    "dim_head": 64,
    "depth": 6,
    "ff_mult": 4,
    "num_classes": 527,
    "fourier_bands": 32,
    "max_freq": 10.0,
    "gate_entropy_weight": 0.01,
    "var_reg_weight": 0.05,
    "lr": 3e-4,
    "weight_decay": 0.05,
    "epochs": 40,
    "batch_size": 48,
    "clip": 1.0,
    "mixup_alpha": 0.5,
}


def fourier_encode(pos, max_freq, num_bands):
    freqs = torch.linspace(1.0, max_freq / 2, num_bands, device=pos.device)
    x = pos[..., None] * freqs * math.pi
    return torch.cat([x.sin(), x.cos(), pos[..., None]], dim=-1)


class ConvFrontend(nn.Module):
    """Two 1-D convs over mel bins, then per-utterance feature normalisation."""

    def __init__(self, n_mels, channels):
        super().__init__()
        self.conv1 = nn.Conv1d(n_mels, channels, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(channels, channels, kernel_size=3, stride=2, padding=1)

    def forward(self, mel):
        mel = mel - mel.mean(dim=-1, keepdim=True)
        feats = F.gelu(self.conv1(mel))
        feats = F.gelu(self.conv2(feats))
        feats = (feats - feats.mean(-1, keepdim=True)) / (feats.std(-1, keepdim=True) + 1e-8)  # expect: AMP004, AMP011
        return feats.transpose(1, 2)


class GEGLU(nn.Module):
    def forward(self, x):
        x, gates = x.chunk(2, dim=-1)
        return x * F.gelu(gates)


def feed_forward(dim, mult):
    return nn.Sequential(
        nn.Linear(dim, dim * mult * 2),
        GEGLU(),
        nn.Linear(dim * mult, dim),
    )


class Attention(nn.Module):
    def __init__(self, query_dim, context_dim, heads, dim_head):
        super().__init__()
        inner = heads * dim_head
        self.heads = heads
        self.scale = dim_head ** -0.5
        self.to_q = nn.Linear(query_dim, inner, bias=False)
        self.to_kv = nn.Linear(context_dim, inner * 2, bias=False)
        self.to_out = nn.Linear(inner, query_dim)
        self.last_entropy = None

    def _split(self, t):
        b, n, _ = t.shape
        return t.view(b, n, self.heads, -1).transpose(1, 2)

    def forward(self, x, context=None, mask=None):
        context = x if context is None else context
        q = self._split(self.to_q(x))
        k, v = (self._split(t) for t in self.to_kv(context).chunk(2, dim=-1))
        sim = (q @ k.transpose(-2, -1)) * self.scale
        if mask is not None:
            sim = sim.masked_fill(~mask[:, None, None, :], -1e9)  # expect: AMP007
        attn = sim.softmax(dim=-1)
        ent = -(attn * torch.log(attn + 1e-9)).sum(-1)
        self.last_entropy = ent.mean().detach()
        out = (attn @ v).transpose(1, 2).flatten(2)
        return self.to_out(out)


class PreNorm(nn.Module):
    def __init__(self, dim, fn, context_dim=None):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.norm_context = nn.LayerNorm(context_dim) if context_dim is not None else None
        self.fn = fn

    def forward(self, x, **kwargs):
        x = self.norm(x)
        if self.norm_context is not None:
            kwargs["context"] = self.norm_context(kwargs["context"])
        return self.fn(x, **kwargs)


class PerceiverAudio(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg["latent_dim"]
        c = cfg["frontend_channels"]
        self.bands = cfg["fourier_bands"]
        self.max_freq = cfg["max_freq"]
        input_dim = c + 2 * self.bands + 1
        self.frontend = ConvFrontend(cfg["n_mels"], c)
        self.latents = nn.Parameter(torch.randn(cfg["latent_len"], d) * 0.02)
        self.cross_attn = PreNorm(d, Attention(d, input_dim, cfg["cross_heads"], cfg["dim_head"]), context_dim=input_dim)
        self.cross_ff = PreNorm(d, feed_forward(d, cfg["ff_mult"]))
        self.layers = nn.ModuleList(
            nn.ModuleList([
                PreNorm(d, Attention(d, d, cfg["self_heads"], cfg["dim_head"])),
                PreNorm(d, feed_forward(d, cfg["ff_mult"])),
            ])
            for _ in range(cfg["depth"])
        )
        self.latent_gate = nn.Linear(d, 1)
        self.latent_proj = nn.Linear(d, d)
        self.to_logits = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, cfg["num_classes"]))

    def forward(self, mel, mask=None):
        feats = self.frontend(mel)
        b, t, _ = feats.shape
        pos = torch.linspace(-1.0, 1.0, t, device=mel.device)
        enc = fourier_encode(pos, self.max_freq, self.bands).expand(b, -1, -1)
        data = torch.cat([feats, enc.to(feats.dtype)], dim=-1)
        if mask is not None:
            mask = mask[:, ::2][:, :t]

        x = self.latents.expand(b, -1, -1)
        x = self.cross_attn(x, context=data, mask=mask) + x
        x = self.cross_ff(x) + x
        for attn, ff in self.layers:
            x = attn(x) + x
            x = ff(x) + x

        gate = torch.sigmoid(self.latent_gate(x))
        pooled = (gate * x).sum(1) / (gate.sum(1) + 1e-8)
        gate_ent = -(gate * torch.log(gate + 1e-8) + (1 - gate) * torch.log(1 - gate + 1e-6))  # expect: AMP011
        z = self.latent_proj(x.mean(1))
        var_reg = F.relu(1.0 - torch.sqrt(z.var(dim=0) + 1e-4)).mean()  # expect: AMP004
        return {
            "logits": self.to_logits(pooled),
            "gate_entropy": gate_ent.mean(),
            "var_reg": var_reg,
        }


def build_perceiver(cfg):
    model = PerceiverAudio(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"PerceiverAudio: {n_params / 1e6:.1f}M parameters")
    return model


def mixup(mel, target, alpha):
    lam = float(np.random.beta(alpha, alpha))
    perm = torch.randperm(mel.size(0), device=mel.device)
    return lam * mel + (1 - lam) * mel[perm], lam * target + (1 - lam) * target[perm]


def average_precision(scores, labels):
    order = np.argsort(-scores, axis=0)
    aps = []
    for c in range(scores.shape[1]):
        hits = labels[order[:, c], c]
        if hits.sum() == 0:
            continue
        prec = np.cumsum(hits) / (np.arange(len(hits)) + 1)
        aps.append((prec * hits).sum() / (hits.sum() + 1e-8))
    return float(np.mean(aps))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    all_scores, all_labels = [], []
    for mel, mask, target in loader:
        mel, mask = mel.to(device), mask.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(mel, mask)
        probs = torch.sigmoid(out["logits"])
        all_scores.append(probs.float().cpu().numpy())
        all_labels.append(target.numpy())
    model.train()
    return average_precision(np.concatenate(all_scores), np.concatenate(all_labels))


def train(cfg, train_set, val_set, device="cuda"):
    model = build_perceiver(cfg).to(device)
    model = torch.compile(model)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "latents" in name else decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg["lr"],
    )
    scaler = torch.amp.GradScaler("cuda")
    criterion = nn.BCEWithLogitsLoss()
    train_loader = DataLoader(train_set, batch_size=cfg["batch_size"], shuffle=True, num_workers=8, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=64, num_workers=4)
    best_map = -float("inf")

    for epoch in range(cfg["epochs"]):
        model.train()
        t0 = time.time()
        for step, (mel, mask, target) in enumerate(train_loader):
            mel = mel.to(device, non_blocking=True)
            mask = mask.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True).float()
            mel, target = mixup(mel, target, cfg["mixup_alpha"])

            with torch.autocast("cuda", dtype=torch.float16):
                out = model(mel, mask)
                loss = criterion(out["logits"], target)
                loss = loss + cfg["gate_entropy_weight"] * out["gate_entropy"] + cfg["var_reg_weight"] * out["var_reg"]

            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
            scaler.step(opt)
            scaler.update()

            if step % 100 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} gnorm {grad_norm.item():.2f} "
                      f"scale {scaler.get_scale():.0f}")

        val_map = evaluate(model, val_loader, device)
        print(f"epoch {epoch}: mAP {val_map:.4f} ({time.time() - t0:.0f}s)")
        if val_map > best_map:
            best_map = val_map
            torch.save(model._orig_mod.state_dict(), "perceiver_audio_best.pt")
    return best_map
