"""Efficient-attention encoders for long-sequence classification (LRA-style).

The attention variant is picked by ``cfg.attention``; all variants share the
projection / head-splitting code in :class:`LinearAttentionBase` and only
implement ``attend``.
"""
import argparse
import logging
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lra.data import build_lra_loaders
from lra.utils import AverageMeter, cosine_schedule_with_warmup

logger = logging.getLogger(__name__)
PAD_ID = 0


@dataclass
class EncoderConfig:
    vocab_size: int = 256
    seq_len: int = 1024
    dim: int = 256
    depth: int = 4
    heads: int = 4
    ff_mult: int = 4
    dropout: float = 0.1
    attention: str = "performer"
    nb_features: int = 128
    proj_len: int = 256
    num_landmarks: int = 64
    norm_heads: bool = False
    pool: str = "mean"
    num_classes: int = 10
    amp: bool = True
    clip_grad: float = 1.0
    label_smoothing: float = 0.0
    redraw_interval: int = 1000


def gaussian_orthogonal_random_matrix(nb_rows, nb_columns, device=None):
    blocks = []
    for _ in range(math.ceil(nb_rows / nb_columns)):
        q, _ = torch.linalg.qr(torch.randn(nb_columns, nb_columns), mode="reduced")
        blocks.append(q.t())
    matrix = torch.cat(blocks)[:nb_rows].to(device)
    multiplier = torch.randn((nb_rows, nb_columns), device=device).norm(dim=1)
    return torch.diag(multiplier) @ matrix


def softmax_kernel(data, projection_matrix, is_query):
    """Positive random features for the softmax kernel (FAVOR+)."""
    d = data.shape[-1]
    data_normalizer = d ** -0.25
    ratio = projection_matrix.shape[0] ** -0.5
    projection = projection_matrix.to(data.dtype)
    data_dash = torch.matmul(data_normalizer * data, projection.t())
    diag_data = (data ** 2).sum(dim=-1, keepdim=True) * (0.5 * data_normalizer ** 2)
    if is_query:
        stab = data_dash.amax(dim=-1, keepdim=True).detach()
    else:
        stab = data_dash.amax(dim=(-1, -2), keepdim=True).detach()
    data_dash = ratio * (torch.exp(data_dash - diag_data - stab) + 1e-8)
    return data_dash.to(data.dtype)


class FeedForward(nn.Sequential):
    def __init__(self, dim, mult=4, dropout=0.0):
        super().__init__(
            nn.Linear(dim, dim * mult),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(dim * mult, dim),
            nn.Dropout(dropout),
        )


class LinearAttentionBase(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        assert cfg.dim % cfg.heads == 0
        self.heads = cfg.heads
        self.head_dim = cfg.dim // cfg.heads
        self.scale = self.head_dim ** -0.5
        self.norm_heads = cfg.norm_heads
        self.eps = 1e-5
        self.to_qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.to_out = nn.Sequential(nn.Linear(cfg.dim, cfg.dim), nn.Dropout(cfg.dropout))

    def _split_heads(self, t):
        b, n, _ = t.shape
        return t.view(b, n, self.heads, self.head_dim).transpose(1, 2)

    def _normalize_heads(self, out):
        # NormAttention (TransNormer): a per-head norm replaces the softmax denominator
        mu = out.mean(dim=-1, keepdim=True)  # expect: AMP004
        var = out.var(dim=-1, keepdim=True, unbiased=False)  # expect: AMP004
        return (out - mu) * torch.rsqrt(var + self.eps)

    def attend(self, q, k, v, key_mask):
        raise NotImplementedError

    def forward(self, x, key_mask=None):
        b, n, _ = x.shape
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        q = self._split_heads(q)
        k = self._split_heads(k)
        v = self._split_heads(v)
        out = self.attend(q, k, v, key_mask)
        if self.norm_heads:
            out = self._normalize_heads(out)
        out = out.transpose(1, 2).reshape(b, n, -1)
        return self.to_out(out)


class SoftmaxAttention(LinearAttentionBase):
    """Quadratic baseline, used for the short-sequence tasks."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.attn_drop = nn.Dropout(cfg.dropout)

    def attend(self, q, k, v, key_mask):
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.scale
        if key_mask is not None:
            scores = scores.masked_fill(~key_mask[:, None, None, :], -1e9)  # expect: AMP007
        attn = self.attn_drop(F.softmax(scores, dim=-1))
        return torch.matmul(attn, v)


class LocalWindowAttention(LinearAttentionBase):
    def __init__(self, cfg, window=128):
        super().__init__(cfg)
        self.window = window

    def attend(self, q, k, v, key_mask):
        n = q.size(2)
        pos = torch.arange(n, device=q.device)
        band = (pos[None, :] - pos[:, None]).abs() <= self.window // 2
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.scale
        scores = scores.masked_fill(~band, -1e9 if scores.dtype == torch.float32 else -1e4)
        if key_mask is not None:
            scores = scores.masked_fill(~key_mask[:, None, None, :], torch.finfo(scores.dtype).min)
        return torch.matmul(scores.softmax(dim=-1), v)


class PerformerAttention(LinearAttentionBase):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.nb_features = cfg.nb_features
        self.register_buffer(
            "projection_matrix",
            gaussian_orthogonal_random_matrix(cfg.nb_features, self.head_dim),
            persistent=False,
        )

    @torch.no_grad()
    def redraw_projection(self):
        device = self.projection_matrix.device
        self.projection_matrix.copy_(gaussian_orthogonal_random_matrix(self.nb_features, self.head_dim, device))

    def attend(self, q, k, v, key_mask):
        q_prime = softmax_kernel(q, self.projection_matrix, is_query=True)
        k_prime = softmax_kernel(k, self.projection_matrix, is_query=False)
        if key_mask is not None:
            k_prime = k_prime.masked_fill(~key_mask[:, None, :, None], 0.0)
        k_sum = k_prime.sum(dim=-2)
        denom = torch.matmul(q_prime, k_sum.unsqueeze(-1).to(q_prime.dtype))
        context = torch.matmul(k_prime.transpose(-2, -1), v)
        return torch.matmul(q_prime, context) / denom


class LinformerAttention(LinearAttentionBase):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.proj_k = nn.Linear(cfg.seq_len, cfg.proj_len, bias=False)
        self.proj_v = nn.Linear(cfg.seq_len, cfg.proj_len, bias=False)
        self.attn_drop = nn.Dropout(cfg.dropout)

    def attend(self, q, k, v, key_mask):
        if key_mask is not None:
            k = k.masked_fill(~key_mask[:, None, :, None], 0.0)
            v = v.masked_fill(~key_mask[:, None, :, None], 0.0)
        k = self.proj_k(k.transpose(-2, -1)).transpose(-2, -1)
        v = self.proj_v(v.transpose(-2, -1)).transpose(-2, -1)
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.scale
        attn = self.attn_drop(scores.softmax(dim=-1))
        return torch.matmul(attn, v)


class CosformerAttention(LinearAttentionBase):
    """ReLU feature map with cos-based re-weighting (Qin et al., 2022)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.max_len = cfg.seq_len

    def attend(self, q, k, v, key_mask):
        q = F.relu(q)
        k = F.relu(k)
        if key_mask is not None:
            k = k.masked_fill(~key_mask[:, None, :, None], 0.0)
        n = q.size(2)
        idx = torch.arange(1, n + 1, device=q.device, dtype=torch.float32)
        angle = (math.pi / (2 * self.max_len)) * idx
        sin = torch.sin(angle).to(q.dtype)[:, None]
        cos = torch.cos(angle).to(q.dtype)[:, None]
        q_ = torch.cat([q * sin, q * cos], dim=-1)
        k_ = torch.cat([k * sin, k * cos], dim=-1)
        kv = torch.matmul(k_.transpose(-2, -1), v)
        k_sum = k_.sum(dim=2, keepdim=True)
        denom = torch.matmul(q_, k_sum.transpose(-2, -1))
        return torch.matmul(q_, kv) / (denom + 1e-8)  # expect: AMP011


class NystromAttention(LinearAttentionBase):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.num_landmarks = cfg.num_landmarks
        self.pinv_iterations = 6

    def _pinv(self, mat):
        eye = torch.eye(mat.size(-1), device=mat.device, dtype=mat.dtype)
        z = mat.transpose(-1, -2) / (
            torch.max(torch.sum(torch.abs(mat), dim=-2)) * torch.max(torch.sum(torch.abs(mat), dim=-1))
        )
        for _ in range(self.pinv_iterations):
            kz = torch.matmul(mat, z)
            z = 0.25 * torch.matmul(z, 13 * eye - torch.matmul(kz, 15 * eye - torch.matmul(kz, 7 * eye - kz)))
        return z

    def attend(self, q, k, v, key_mask):
        b, h, n, d = q.shape
        m = self.num_landmarks
        if key_mask is not None:
            keep = key_mask[:, None, :, None]
            q, k, v = q.masked_fill(~keep, 0.0), k.masked_fill(~keep, 0.0), v.masked_fill(~keep, 0.0)
        q = q * self.scale
        q_land = q.reshape(b, h, m, n // m, d).mean(dim=-2)  # expect: AMP004
        k_land = k.reshape(b, h, m, n // m, d).sum(dim=-2) / (n // m)
        kernel_1 = F.softmax(torch.matmul(q, k_land.transpose(-1, -2)), dim=-1)
        kernel_2 = F.softmax(torch.matmul(q_land, k_land.transpose(-1, -2)), dim=-1)
        kernel_3 = F.softmax(torch.matmul(q_land, k.transpose(-1, -2)), dim=-1)
        return torch.matmul(torch.matmul(kernel_1, self._pinv(kernel_2)), torch.matmul(kernel_3, v))


ATTENTION_TYPES = {
    "softmax": SoftmaxAttention,
    "local": LocalWindowAttention,
    "performer": PerformerAttention,
    "linformer": LinformerAttention,
    "cosformer": CosformerAttention,
    "nystrom": NystromAttention,
}


class AttentionPool(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.score = nn.Linear(dim, 1)

    def forward(self, h, mask=None):
        w = self.score(h).squeeze(-1)
        if mask is not None:
            w = w.masked_fill(~mask, float("-inf"))
        w = w.softmax(dim=-1)
        return torch.bmm(w.unsqueeze(1).to(h.dtype), h).squeeze(1)


class EncoderBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.attn = ATTENTION_TYPES[cfg.attention](cfg)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.ff = FeedForward(cfg.dim, cfg.ff_mult, cfg.dropout)

    def forward(self, x, key_mask=None):
        x = x + self.attn(self.norm1(x), key_mask)
        return x + self.ff(self.norm2(x))


class LinearTransformerClassifier(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.token_emb = nn.Embedding(cfg.vocab_size, cfg.dim, padding_idx=PAD_ID)
        self.pos_emb = nn.Parameter(torch.zeros(1, cfg.seq_len, cfg.dim))
        self.blocks = nn.ModuleList([EncoderBlock(cfg) for _ in range(cfg.depth)])
        self.norm = nn.LayerNorm(cfg.dim)
        self.pool = AttentionPool(cfg.dim) if cfg.pool == "attention" else None
        self.pre_head = nn.Sequential(nn.Linear(cfg.dim, cfg.dim), nn.GELU())
        self.head = nn.Linear(cfg.dim, cfg.num_classes)
        nn.init.trunc_normal_(self.pos_emb, std=0.02)

    def forward(self, tokens, key_mask=None):
        x = self.token_emb(tokens) + self.pos_emb[:, : tokens.size(1)]
        for block in self.blocks:
            x = block(x, key_mask)
        h = self.pre_head(self.norm(x))
        if self.pool is not None:
            pooled = self.pool(h, key_mask)
        elif key_mask is not None:
            m = key_mask.unsqueeze(-1).to(h.dtype)
            pooled = (h * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
        else:
            pooled = h.mean(dim=1)  # expect: AMP004
        return self.head(pooled)


def build_model(cfg):
    return LinearTransformerClassifier(cfg)


def redraw_performer_features(model):
    for module in model.modules():
        if isinstance(module, PerformerAttention):
            module.redraw_projection()


def train_one_epoch(model, loader, optimizer, scheduler, scaler, cfg, epoch, global_step):
    model.train()
    loss_meter = AverageMeter()
    for tokens, labels in loader:
        tokens, labels = tokens.cuda(non_blocking=True), labels.cuda(non_blocking=True)
        key_mask = tokens != PAD_ID
        with torch.autocast("cuda", dtype=torch.float16, enabled=cfg.amp):
            logits = model(tokens, key_mask)
            loss = F.cross_entropy(logits, labels, label_smoothing=cfg.label_smoothing)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if cfg.clip_grad > 0:
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        global_step += 1
        if cfg.redraw_interval and global_step % cfg.redraw_interval == 0:
            redraw_performer_features(model)
        loss_meter.update(loss.item(), tokens.size(0))
        if global_step % 100 == 0:
            logger.info("epoch %d step %d loss %.4f scale %.0f", epoch, global_step, loss_meter.avg, scaler.get_scale())
    return global_step


@torch.no_grad()
def evaluate(model, loader, cfg):
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    for tokens, labels in loader:
        tokens, labels = tokens.cuda(), labels.cuda()
        with torch.autocast("cuda", dtype=torch.float16, enabled=cfg.amp):
            logits = model(tokens, tokens != PAD_ID)
        loss_sum += F.cross_entropy(logits.float(), labels, reduction="sum").item()
        correct += (logits.argmax(dim=-1) == labels).sum().item()
        total += labels.numel()
    return loss_sum / total, correct / total


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", default="listops")
    parser.add_argument("--attention", default="performer", choices=sorted(ATTENTION_TYPES))
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--no-amp", action="store_true")
    parser.add_argument("--out", default="checkpoints")
    args = parser.parse_args()

    cfg = EncoderConfig(attention=args.attention, amp=not args.no_amp)
    train_loader, val_loader = build_lra_loaders(args.task, cfg.seq_len, args.batch_size)
    model = build_model(cfg).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = cosine_schedule_with_warmup(optimizer, 1000, args.epochs * len(train_loader))
    scaler = torch.amp.GradScaler("cuda", enabled=cfg.amp)

    best_val_loss = 1e9
    global_step = 0
    os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        global_step = train_one_epoch(model, train_loader, optimizer, scheduler, scaler, cfg, epoch, global_step)
        val_loss, val_acc = evaluate(model, val_loader, cfg)
        logger.info("epoch %d val_loss %.4f val_acc %.4f", epoch, val_loss, val_acc)
        if val_loss < best_val_loss:
            best_val_loss = val_loss
            torch.save(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(), "cfg": cfg},
                os.path.join(args.out, f"{args.task}_{args.attention}.pt"),
            )


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main()
