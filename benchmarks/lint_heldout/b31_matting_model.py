"""Trimap-free portrait matting: semantic branch, detail branch and fusion head.

Layout loosely follows MODNet / MatteFormer style repositories.
"""
import copy
import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class MattingConfig:
    arch: str = "modnet_lite"
    in_ch: int = 3
    widths: Tuple[int, ...] = (32, 64, 128, 256)
    heads: int = 4
    lr: float = 2e-4
    max_norm: float = 1.0
    epochs: int = 20
    device: str = "cuda"
    loss_weights: Dict[str, float] = field(
        default_factory=lambda: {"alpha": 1.0, "comp": 0.5, "lap": 0.5, "grad": 0.2}
    )


class LayerNorm2d(nn.Module):
    def __init__(self, channels: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.eps = eps

    def forward(self, x):
        u = x.mean(1, keepdim=True)  # expect: AMP004
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, reduction: int = 4):
        super().__init__()
        self.fc1 = nn.Conv2d(channels, channels // reduction, 1)
        self.fc2 = nn.Conv2d(channels // reduction, channels, 1)

    def forward(self, x):
        w = x.mean((2, 3), keepdim=True)  # expect: AMP004
        w = torch.sigmoid(self.fc2(F.relu(self.fc1(w))))
        return x * w


class ConvBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1, use_se: bool = True):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.norm = LayerNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.se = SqueezeExcite(cout) if use_se else nn.Identity()
        self.act = nn.GELU()

    def forward(self, x):
        x = self.act(self.norm(self.conv1(x)))
        x = self.conv2(x)
        return self.act(self.se(x))


def soft_edge(feat: torch.Tensor) -> torch.Tensor:
    mag = feat.abs()
    return torch.log(mag + 1e-8)  # expect: AMP011


def stable_log(feat: torch.Tensor) -> torch.Tensor:
    return torch.log(feat.float().abs() + 1e-8)


class GuidedAttention(nn.Module):
    """Attention restricted to the unknown region of a predicted trimap."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x, unknown: Optional[torch.Tensor] = None):
        b, c, h, w = x.shape
        q, k, v = self.qkv(x).reshape(b, 3, self.heads, c // self.heads, h * w).unbind(1)
        attn = (q.transpose(-2, -1) @ k) * self.scale
        if unknown is not None:
            keep = unknown.flatten(1)[:, None, None, :] > 0.5
            attn = attn.masked_fill(~keep, -1e9)  # expect: AMP007
        attn = attn.softmax(dim=-1)
        out = (v @ attn.transpose(-2, -1)).reshape(b, c, h, w)
        return self.proj(out)


class GlobalContext(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.key = nn.Conv2d(dim, 1, 1)
        self.value = nn.Conv2d(dim, dim, 1)

    def forward(self, x, valid: Optional[torch.Tensor] = None):
        logits = self.key(x).flatten(2)
        if valid is not None:
            logits = logits.masked_fill(~valid.flatten(1)[:, None], torch.finfo(logits.dtype).min)
        weights = F.softmax(logits.float(), dim=-1).to(x.dtype)
        ctx = (self.value(x).flatten(2) * weights).sum(-1, keepdim=True)
        return x + ctx.unsqueeze(-1)


class MattingNet(nn.Module):
    def __init__(self, cfg: MattingConfig):
        super().__init__()
        widths = cfg.widths
        stages = []
        cin = cfg.in_ch
        for i, w in enumerate(widths):
            stages.append(ConvBlock(cin, w, stride=2 if i else 1, use_se=i > 0))
            cin = w
        self.encoder = nn.ModuleList(stages)
        self.context = GlobalContext(widths[-1])
        self.semantic = nn.Conv2d(widths[-1], 1, 1)
        self.detail_in = nn.Conv2d(widths[0] + 1, widths[0], 3, 1, 1)
        self.detail_attn = GuidedAttention(widths[0], cfg.heads)
        self.fuse = nn.Conv2d(widths[0] * 2, widths[0], 3, 1, 1)
        self.alpha_head = nn.Conv2d(widths[0], 1, 1)

    def forward(self, img) -> Dict[str, torch.Tensor]:
        feats = []
        x = img
        for stage in self.encoder:
            x = stage(x)
            feats.append(x)
        x = self.context(x)
        sem_logits = self.semantic(x)
        sem = F.interpolate(sem_logits, size=feats[0].shape[-2:], mode="bilinear", align_corners=False)
        unknown = (torch.sigmoid(sem) - 0.5).abs() < 0.45
        det = self.detail_in(torch.cat([feats[0], sem], dim=1))
        det = det + self.detail_attn(det, unknown)
        edge = soft_edge(det)
        fused = self.fuse(torch.cat([det, edge], dim=1))
        scale = fused.std(dim=(2, 3), keepdim=True)  # expect: AMP004
        energy = fused.sum(dim=1, keepdim=True)
        fused = fused / (scale + 1e-3) + 0.1 * energy.sigmoid()
        alpha = torch.sigmoid(self.alpha_head(fused))
        return {"alpha": alpha, "semantic": sem_logits, "detail": det}


MODELS = {"modnet_lite": MattingNet}


def build_model(cfg: MattingConfig) -> nn.Module:
    return MODELS[cfg.arch](cfg)


class LaplacianLoss(nn.Module):
    def __init__(self, levels: int = 4):
        super().__init__()
        k = torch.tensor([1.0, 4.0, 6.0, 4.0, 1.0])
        k = torch.outer(k, k)
        self.register_buffer("kernel", (k / k.sum())[None, None])
        self.levels = levels

    def _pyramid(self, img):
        out = []
        cur = img
        for _ in range(self.levels):
            blur = F.conv2d(F.pad(cur, (2, 2, 2, 2), mode="reflect"), self.kernel.to(cur.dtype))
            down = blur[..., ::2, ::2]
            up = F.interpolate(down, size=cur.shape[-2:], mode="bilinear", align_corners=False)
            out.append(cur - up)
            cur = down
        return out

    def forward(self, pred, gt):
        return sum(F.l1_loss(a, b) * (2 ** i) for i, (a, b) in enumerate(zip(self._pyramid(pred), self._pyramid(gt))))


class MattingCriterion(nn.Module):
    def __init__(self, weights: Dict[str, float]):
        super().__init__()
        self.weights = weights
        self.lap = LaplacianLoss()

    def forward(self, out, batch):
        pred, gt = out["alpha"], batch["alpha"]
        diff = pred - gt
        alpha_l = torch.sqrt(diff ** 2 + 1e-12).mean()
        comp = pred * batch["fg"] + (1.0 - pred) * batch["bg"]
        comp_l = F.l1_loss(comp, batch["image"])
        gx, gy = pred[..., :, 1:] - pred[..., :, :-1], pred[..., 1:, :] - pred[..., :-1, :]
        tx, ty = gt[..., :, 1:] - gt[..., :, :-1], gt[..., 1:, :] - gt[..., :-1, :]
        grad_l = F.l1_loss(gx, tx) + F.l1_loss(gy, ty)
        sem_l = F.binary_cross_entropy_with_logits(out["semantic"], batch["trimap_fg"])
        losses = {"alpha": alpha_l, "comp": comp_l, "lap": self.lap(pred, gt), "grad": grad_l}
        total = sem_l + sum(self.weights[k] * v for k, v in losses.items())
        losses["total"] = total
        return losses


class MattingTrainer:
    def __init__(self, cfg: MattingConfig, loader):
        self.cfg = cfg
        self.loader = loader
        self.model = build_model(cfg).to(cfg.device)
        self.criterion = MattingCriterion(cfg.loss_weights)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=0.01)
        self.scaler = torch.amp.GradScaler("cuda")
        self.best = 1e9

    def forward_backward(self, batch):
        with torch.autocast("cuda", dtype=torch.float16):
            out = self.model(batch["image"])
            losses = self.criterion(out, batch)
        self.scaler.scale(losses["total"]).backward()
        return {k: v.detach() for k, v in losses.items()}

    def step(self):
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_norm)  # expect: AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def evaluate(self, val_loader):
        self.model.eval()
        sad = 0.0
        for batch in val_loader:
            with torch.autocast("cuda", dtype=torch.float16):
                alpha = self.model(batch["image"])["alpha"]
            sad += (alpha.float() - batch["alpha"]).abs().sum().item() / 1000.0
        self.model.train()
        return sad / max(len(val_loader), 1)

    def fit(self, val_loader=None):
        for epoch in range(self.cfg.epochs):
            for it, batch in enumerate(self.loader):
                batch = {k: v.to(self.cfg.device, non_blocking=True) for k, v in batch.items()}
                logs = self.forward_backward(batch)
                self.step()
                if it % 50 == 0:
                    print(f"ep {epoch} it {it} " + " ".join(f"{k}={v.item():.4f}" for k, v in logs.items()))
            if val_loader is not None:
                sad = self.evaluate(val_loader)
                if sad < self.best:
                    self.best = sad
                    torch.save(self.model.state_dict(), "best_matting.pth")


def export_onnx(model: nn.Module, path: str, size: int = 512):
    deploy = copy.deepcopy(model).eval().half()
    dummy = torch.randn(1, 3, size, size, device="cuda", dtype=torch.float16)
    torch.onnx.export(deploy, dummy, path, opset_version=17, input_names=["image"])
