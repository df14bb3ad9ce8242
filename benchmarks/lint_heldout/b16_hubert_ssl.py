"""HuBERT-Base pre-training (iteration 1: targets from k-means on MFCC features).

Masked prediction over frames; cosine-similarity logits against label embeddings.
"""
import argparse
import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class HubertConfig:
    conv_layers: list = field(default_factory=lambda: [(512, 10, 5)] + [(512, 3, 2)] * 4 + [(512, 2, 2)] * 2)
    embed_dim: int = 768
    layers: int = 12
    heads: int = 12
    ffn_dim: int = 3072
    num_classes: int = 100
    final_dim: int = 256
    logit_temp: float = 0.1
    mask_prob: float = 0.8
    mask_length: int = 10
    feature_grad_mult: float = 0.1
    lr: float = 5e-4
    warmup: int = 32000
    max_steps: int = 400000
    clip_norm: float = 10.0
    log_every: int = 200


class Fp32GroupNorm(nn.GroupNorm):
    def forward(self, x):
        out = F.group_norm(x.float(), self.num_groups, self.weight.float(), self.bias.float(), self.eps)
        return out.type_as(x)


class ChannelNorm(nn.Module):
    """Per-frame normalisation over channels, cheaper than LayerNorm with transposes."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        mean = x.mean(dim=1, keepdim=True)  # expect: AMP004
        var = x.var(dim=1, keepdim=True, unbiased=False)  # expect: AMP004
        x = (x - mean) * torch.rsqrt(var + self.eps)
        return x * self.weight[:, None] + self.bias[:, None]


class ConvLayer(nn.Module):
    def __init__(self, in_ch, out_ch, k, stride, first):
        super().__init__()
        self.conv = nn.Conv1d(in_ch, out_ch, k, stride, bias=False)
        self.group_norm = Fp32GroupNorm(out_ch, out_ch) if first else None
        self.channel_norm = None if first else ChannelNorm(out_ch)

    def forward(self, x):
        x = self.conv(x)
        if self.group_norm is not None:
            x = self.group_norm(x)
        else:
            x = self.channel_norm(x)
        return F.gelu(x)


class ConvFeatureExtractor(nn.Module):
    def __init__(self, conv_layers):
        super().__init__()
        layers, in_ch = [], 1
        for i, (dim, k, s) in enumerate(conv_layers):
            layers.append(ConvLayer(in_ch, dim, k, s, first=i == 0))
            in_ch = dim
        self.layers = nn.ModuleList(layers)

    def forward(self, wav):
        x = wav.unsqueeze(1)
        for layer in self.layers:
            x = layer(x)
        return x


class EncoderLayer(nn.Module):
    def __init__(self, dim, heads, ffn_dim, dropout=0.1):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.out = nn.Linear(dim, dim)
        self.ln1 = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, ffn_dim), nn.GELU(), nn.Dropout(dropout), nn.Linear(ffn_dim, dim))
        self.ln2 = nn.LayerNorm(dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, pad_mask):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        bias = torch.zeros(b, 1, 1, t, device=x.device, dtype=q.dtype)
        if pad_mask is not None:
            bias = bias.masked_fill(pad_mask[:, None, None, :], torch.finfo(q.dtype).min)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=0.1 if self.training else 0.0)
        x = self.ln1(x + self.drop(self.out(attn.transpose(1, 2).reshape(b, t, c))))
        return self.ln2(x + self.drop(self.ff(x)))


class HubertModel(nn.Module):
    def __init__(self, cfg: HubertConfig):
        super().__init__()
        self.cfg = cfg
        self.feature_extractor = ConvFeatureExtractor(cfg.conv_layers)
        self.layer_norm = nn.LayerNorm(512)
        self.post_extract_proj = nn.Linear(512, cfg.embed_dim)
        self.mask_emb = nn.Parameter(torch.empty(cfg.embed_dim).uniform_())
        self.pos_conv = nn.Conv1d(cfg.embed_dim, cfg.embed_dim, 128, padding=64, groups=16)
        self.layers = nn.ModuleList([EncoderLayer(cfg.embed_dim, cfg.heads, cfg.ffn_dim) for _ in range(cfg.layers)])
        self.final_proj = nn.Linear(cfg.embed_dim, cfg.final_dim)
        self.label_embs = nn.Parameter(torch.randn(cfg.num_classes, cfg.final_dim) * 0.02)

    def compute_mask(self, b, t, device):
        mask = torch.zeros(b, t, dtype=torch.bool, device=device)
        n_spans = int(self.cfg.mask_prob * t / self.cfg.mask_length + np.random.rand())
        for i in range(b):
            starts = torch.randperm(t - self.cfg.mask_length, device=device)[:n_spans]
            for s in starts.tolist():
                mask[i, s : s + self.cfg.mask_length] = True
        return mask

    def forward(self, wav, padding_mask, targets):
        features = self.feature_extractor(wav)
        if self.cfg.feature_grad_mult != 1.0:
            features = features * self.cfg.feature_grad_mult + features.detach() * (1 - self.cfg.feature_grad_mult)
        features = features.transpose(1, 2)
        features_pen = features.float().pow(2).mean()
        features = self.layer_norm(features)
        t = features.size(1)
        pad = padding_mask[:, :: padding_mask.size(1) // t][:, :t] if padding_mask is not None else None
        x = self.post_extract_proj(features)
        mask = self.compute_mask(x.size(0), t, x.device)
        x = torch.where(mask.unsqueeze(-1), self.mask_emb.to(x.dtype), x)
        x = x + F.gelu(self.pos_conv(x.transpose(1, 2))[..., :-1]).transpose(1, 2)
        for layer in self.layers:
            x = layer(x, pad)
        proj = self.final_proj(x[mask])
        logits = torch.cosine_similarity(proj.float().unsqueeze(1), self.label_embs.float().unsqueeze(0), dim=-1)
        logits = logits / self.cfg.logit_temp
        tgt = targets[:, :t][mask]
        loss = F.cross_entropy(logits, tgt, reduction="sum") / max(tgt.numel(), 1) + 10.0 * features_pen
        with torch.no_grad():
            acc = (logits.argmax(-1) == tgt).float().mean()
        return loss, {"acc_m": acc.item(), "pen": features_pen.item()}


def normalize_wave(wav):
    return (wav - wav.mean(dim=-1, keepdim=True)) / (wav.std(dim=-1, keepdim=True) + 1e-8)  # expect: AMP004 AMP011


def optimizer_step(model, optimizer, scaler, max_norm):
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # expect: AMP005
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def tri_stage_lr(step, cfg):
    if step < cfg.warmup:
        return step / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.max_steps - cfg.warmup)
    return 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    accs = []
    for wav, padding_mask, targets in loader:
        wav = normalize_wave(wav.to(device, dtype=torch.float16))
        with torch.autocast("cuda", dtype=torch.float16):
            _, logs = model(wav, padding_mask.to(device), targets.to(device))
        accs.append(logs["acc_m"])
    model.train()
    return float(np.mean(accs)) if accs else 0.0


def pretrain(cfg, model, train_loader, valid_loader, device):
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: tri_stage_lr(s, cfg))
    scaler = torch.amp.GradScaler("cuda")
    step = 0
    model.train()
    while step < cfg.max_steps:
        for wav, padding_mask, targets in train_loader:
            wav = wav.to(device, non_blocking=True, dtype=torch.float16)  # expect: AMP001
            wav = normalize_wave(wav)
            padding_mask, targets = padding_mask.to(device), targets.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                loss, logs = model(wav, padding_mask, targets)
                scaler.scale(loss).backward()  # expect: AMP008
            grad_norm = optimizer_step(model, optimizer, scaler, cfg.clip_norm)
            scheduler.step()
            step += 1
            if step % cfg.log_every == 0:
                print(f"step {step} loss {loss.item():.3f} acc_m {logs['acc_m']:.3f} gnorm {grad_norm:.2f} scale {scaler.get_scale():.0f}")
            if step % 10000 == 0:
                print(f"valid acc_m {validate(model, valid_loader, device):.4f}")
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(), "step": step}, f"checkpoints/hubert_{step}.pt")
            if step >= cfg.max_steps:
                break


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--manifest", required=True)
    p.add_argument("--label-dir", required=True, help="k-means labels (.km) per utterance")
    p.add_argument("--max-steps", type=int, default=400000)
    args = p.parse_args()
    cfg = HubertConfig(max_steps=args.max_steps)
    device = torch.device("cuda")
    model = HubertModel(cfg).to(device)
    from hubert_data import build_loaders  # project-local: wav manifest + .km labels, 16 kHz, 50 Hz labels

    train_loader, valid_loader = build_loaders(args.manifest, args.label_dir)
    pretrain(cfg, model, train_loader, valid_loader, device)


if __name__ == "__main__":
    main()
