"""Continuous sign-language recognition: keypoint + appearance features per frame,
a temporal transformer encoder and a CTC gloss head (Phoenix-2014T style).
"""
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class SLRConfig:
    in_dim: int = 1024
    kp_dim: int = 133 * 3
    dim: int = 512
    depth: int = 6
    heads: int = 8
    num_glosses: int = 1232
    max_len: int = 400
    amp: bool = True
    lr: float = 3e-4
    clip: float = 1.0
    epochs: int = 40
    aux_weight: float = 0.2


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        ms = x.pow(2).mean(-1, keepdim=True)
        return (x * torch.rsqrt(ms + self.eps)).type_as(x) * self.weight


class MotionEncoder(nn.Module):
    """Encodes keypoints plus log-magnitude of their frame-to-frame velocity."""

    def __init__(self, kp_dim: int, dim: int):
        super().__init__()
        self.proj = nn.Linear(kp_dim, dim)
        self.vel_proj = nn.Linear(dim, dim)

    def forward(self, kps):
        x = self.proj(kps)
        vel = x[:, 1:] - x[:, :-1]
        vel = F.pad(vel, (0, 0, 1, 0))
        logmag = torch.log(vel.abs() + 1e-10)  # expect: AMP011
        return x + self.vel_proj(logmag)


class TemporalDownsample(nn.Module):
    def __init__(self, dim: int, stride: int = 2):
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, kernel_size=5, stride=stride, padding=2)
        self.stride = stride

    def forward(self, x, lengths):
        h = self.conv(x.transpose(1, 2)).transpose(1, 2)
        mu = h.mean(dim=1, keepdim=True)  # expect: AMP004
        sd = h.float().std(dim=1, keepdim=True).to(h.dtype)
        h = (h - mu) / (sd + 1e-3)
        return F.gelu(h), torch.div(lengths + self.stride - 1, self.stride, rounding_mode="floor")


class MHSA(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, pad_mask: Optional[torch.Tensor], rel_bias: Optional[torch.Tensor] = None):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.size(-1))
        if rel_bias is not None:
            attn = attn + rel_bias.to(attn.dtype)
        if pad_mask is not None:
            attn = attn.masked_fill(pad_mask[:, None, None, :], -1e9)  # expect: AMP007
        attn = F.softmax(attn, dim=-1)
        y = torch.einsum("bhqk,bhkd->bhqd", attn, v)
        return self.out(y.transpose(1, 2).reshape(b, t, c))


class LocalWindowBias(nn.Module):
    def __init__(self, window: int = 16):
        super().__init__()
        self.window = window

    def forward(self, t: int, device):
        idx = torch.arange(t, device=device)
        far = (idx[None, :] - idx[:, None]).abs() > self.window
        bias = torch.zeros(t, t, device=device, dtype=torch.float32)
        bias = bias.masked_fill(far, -1e9)
        return bias


class EncoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.n1 = RMSNorm(dim)
        self.attn = MHSA(dim, heads)
        self.n2 = RMSNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, pad_mask, rel_bias):
        x = x + self.attn(self.n1(x), pad_mask, rel_bias)
        return x + self.ff(self.n2(x))


def sequence_variability(h: torch.Tensor) -> torch.Tensor:
    return h.var(dim=1)  # expect: AMP004


class CTCHead(nn.Module):
    def __init__(self, dim: int, num_glosses: int):
        super().__init__()
        self.fc = nn.Linear(dim, num_glosses)

    def forward(self, h):
        logits = self.fc(h)
        return F.pad(logits, (1, 0), value=-1e9)  # expect: AMP007


class SignTransformer(nn.Module):
    def __init__(self, cfg: SLRConfig):
        super().__init__()
        self.rgb_proj = nn.Linear(cfg.in_dim, cfg.dim)
        self.motion = MotionEncoder(cfg.kp_dim, cfg.dim)
        self.down = TemporalDownsample(cfg.dim)
        self.window = LocalWindowBias()
        self.layers = nn.ModuleList([EncoderLayer(cfg.dim, cfg.heads) for _ in range(cfg.depth)])
        self.style = nn.Linear(cfg.dim, cfg.dim)
        self.head = CTCHead(cfg.dim, cfg.num_glosses)
        self.aux_head = nn.Linear(cfg.dim, cfg.num_glosses)

    def forward(self, rgb, kps, lengths) -> Dict[str, torch.Tensor]:
        x = self.rgb_proj(rgb) + self.motion(kps)
        x, lengths = self.down(x, lengths)
        t = x.size(1)
        pad_mask = torch.arange(t, device=x.device)[None, :] >= lengths[:, None]
        bias = self.window(t, x.device)
        for layer in self.layers:
            x = layer(x, pad_mask, bias)
        keep = (~pad_mask).unsqueeze(-1).to(x.dtype)
        pooled = (x * keep).sum(1) / keep.sum(1).clamp(min=1.0)
        style = self.style(sequence_variability(x))
        return {
            "logits": self.head(x + style[:, None]),
            "aux_logits": self.aux_head(pooled),
            "lengths": lengths,
        }


ARCHS = {"sign_tf": SignTransformer}


class SLRModel(nn.Module):
    """Wraps the backbone and computes the training objective in forward."""

    def __init__(self, cfg: SLRConfig):
        super().__init__()
        self.cfg = cfg
        self.net = ARCHS["sign_tf"](cfg)

    def forward(self, batch) -> Tuple[Dict[str, torch.Tensor], torch.Tensor]:
        out = self.net(batch["rgb"], batch["kps"], batch["lengths"])
        log_probs = out["logits"].float().log_softmax(-1).transpose(0, 1)
        ctc = F.ctc_loss(log_probs, batch["glosses"], out["lengths"], batch["gloss_lengths"],
                         blank=0, zero_infinity=True)
        aux = F.cross_entropy(out["aux_logits"], batch["first_gloss"])
        return out, ctc + self.cfg.aux_weight * aux


class SLRTrainer:
    def __init__(self, cfg: SLRConfig, train_loader, device="cuda"):
        self.cfg = cfg
        self.loader = train_loader
        self.device = device
        self.model = SLRModel(cfg).to(device)
        decay, no_decay = [], []
        for n, p in self.model.named_parameters():
            (no_decay if p.ndim < 2 or n.endswith(".weight") and "n1" in n else decay).append(p)
        self.optim = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, eps=1e-8,
        )
        self.scaler = torch.amp.GradScaler("cuda", enabled=cfg.amp)

    def train_epoch(self, epoch: int):
        self.model.train()
        running = 0.0
        for step, batch in enumerate(self.loader):
            batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16, enabled=self.cfg.amp):
                _, loss = self.model(batch)
            self.optim.zero_grad(set_to_none=True)
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.optim)
            gnorm = nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip)
            self.scaler.step(self.optim)
            self.scaler.update()
            running += loss.item()
            if step % 100 == 0:
                print(f"epoch {epoch} step {step} loss {running / (step + 1):.4f} gnorm {gnorm:.2f}")
        return running / max(len(self.loader), 1)

    @torch.no_grad()
    def decode(self, batch) -> List[List[int]]:
        self.model.eval()
        out = self.model.net(batch["rgb"], batch["kps"], batch["lengths"])
        best = out["logits"].argmax(-1)
        hyps = []
        for seq, n in zip(best.tolist(), out["lengths"].tolist()):
            collapsed = [g for i, g in enumerate(seq[:n]) if g != 0 and (i == 0 or g != seq[i - 1])]
            hyps.append(collapsed)
        return hyps

    def fit(self):
        for epoch in range(self.cfg.epochs):
            self.train_epoch(epoch)
            torch.save(self.model.state_dict(), f"slr_ep{epoch}.pt")
