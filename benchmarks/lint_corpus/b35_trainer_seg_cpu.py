"""Semantic segmentation on CPU nodes with bf16 autocast (ported from a CUDA fp16 recipe).

The model has a token-mixer encoder whose neck ends in LayerNorm, a segmentation
decoder, an edge head and an image-level "classes present" head.  Task weights are
learned (uncertainty weighting) with their own optimizer.
"""
from dataclasses import dataclass, field
from typing import List, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class SegConfig:
    arch: str = "mixseg_s"
    in_chans: int = 3
    num_classes: int = 19
    dims: List[int] = field(default_factory=lambda: [64, 128, 256])
    depths: List[int] = field(default_factory=lambda: [2, 2, 6])
    embed_dim: int = 256
    ignore_index: int = 255
    lr: float = 6e-4
    accum_steps: int = 2
    max_norm: float = 1.0
    epochs: int = 80
    compile: bool = False


class SegOutput(NamedTuple):
    logits: torch.Tensor
    edge_logits: torch.Tensor
    cls_logits: torch.Tensor


class MixerBlock(nn.Module):
    """Depthwise-conv token mixer + channel MLP (ConvMixer / PoolFormer family)."""

    def __init__(self, dim, mlp_ratio=4):
        super().__init__()
        self.norm1 = nn.GroupNorm(1, dim)
        self.token_mixer = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm2 = nn.GroupNorm(1, dim)
        self.mlp = nn.Sequential(nn.Conv2d(dim, dim * mlp_ratio, 1), nn.GELU(), nn.Conv2d(dim * mlp_ratio, dim, 1))

    def forward(self, x):
        x = x + self.token_mixer(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class SegEncoder(nn.Module):
    def __init__(self, cfg: SegConfig):
        super().__init__()
        self.stem = nn.Conv2d(cfg.in_chans, cfg.dims[0], kernel_size=4, stride=4)
        stages, cin = [], cfg.dims[0]
        for dim, depth in zip(cfg.dims, cfg.depths):
            down = nn.Conv2d(cin, dim, 2, stride=2) if dim != cin else nn.Identity()
            stages.append(nn.Sequential(down, *[MixerBlock(dim) for _ in range(depth)]))
            cin = dim
        self.stages = nn.ModuleList(stages)
        self.neck = nn.Linear(cin, cfg.embed_dim)
        self.norm = nn.LayerNorm(cfg.embed_dim)

    def forward(self, x):
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
        return self.norm(self.neck(x.permute(0, 2, 3, 1)))


class SegModel(nn.Module):
    def __init__(self, cfg: SegConfig):
        super().__init__()
        self.encoder = SegEncoder(cfg)
        c = cfg.embed_dim
        self.decode = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.GELU(), nn.Upsample(scale_factor=4, mode="bilinear"))
        self.classifier = nn.Conv2d(c, cfg.num_classes, 1)
        self.edge_head = nn.Conv2d(c, 1, 1)
        self.cls_head = nn.Linear(c, cfg.num_classes)
        self.out_stride = 4 * 2 ** (len(cfg.dims) - 1)

    def forward(self, images) -> SegOutput:
        feats = self.encoder(images)
        cls_logits = self.cls_head(feats.mean(dim=(1, 2)))  # expect: AMP004
        x = self.decode(feats.permute(0, 3, 1, 2))
        x = F.interpolate(x, size=images.shape[-2:], mode="bilinear", align_corners=False)
        return SegOutput(logits=self.classifier(x), edge_logits=self.edge_head(x), cls_logits=cls_logits)


SEG_MODELS = {"mixseg_s": SegModel, "mixseg_m": lambda cfg: SegModel(SegConfig(depths=[3, 3, 9], num_classes=cfg.num_classes))}


def reduce_loss(loss, reduction):
    if reduction == "mean":
        return loss.mean()
    return loss.sum() if reduction == "sum" else loss


class DiceLoss(nn.Module):
    def __init__(self, num_classes, smooth=1.0, ignore_index=255, reduction="mean"):
        super().__init__()
        self.num_classes, self.smooth = num_classes, smooth
        self.ignore_index, self.reduction = ignore_index, reduction

    def forward(self, logits, target):
        probs = logits.softmax(dim=1)
        valid = (target != self.ignore_index).unsqueeze(1)
        onehot = F.one_hot(target.clamp(max=self.num_classes - 1), self.num_classes).permute(0, 3, 1, 2).float() * valid
        probs = probs * valid.to(probs.dtype)
        inter = (probs * onehot.to(probs.dtype)).sum(dim=(2, 3))  # expect: AMP004
        p_sum = probs.sum(dim=(2, 3))  # expect: AMP004
        t_sum = onehot.sum(dim=(2, 3))
        dice = (2.0 * inter.float() + self.smooth) / (p_sum.float() + t_sum + self.smooth)
        return reduce_loss(1.0 - dice, self.reduction)


def boundary_loss(edge_logits, edge_gt, pos_weight=None):
    prob = torch.sigmoid(edge_logits)
    return F.binary_cross_entropy(prob, edge_gt.float(), weight=pos_weight)  # expect: AMP003


class SegCriterion(nn.Module):
    def __init__(self, num_classes, ignore_index=255):
        super().__init__()
        self.ignore_index = ignore_index
        self.dice = DiceLoss(num_classes, ignore_index=ignore_index)

    def forward(self, logits, edge_logits, masks, edges):
        ce = F.cross_entropy(logits, masks, ignore_index=self.ignore_index)
        return ce, self.dice(logits, masks), boundary_loss(edge_logits, edges)


class Trainer:
    def __init__(self, cfg: SegConfig, train_loader, val_loader):
        self.cfg, self.train_loader, self.val_loader = cfg, train_loader, val_loader
        self.micro_step = 0
        self.stats = {}

    def setup(self):
        cfg = self.cfg
        self.device = torch.device("cpu")
        torch.set_num_threads(32)
        self.model = SEG_MODELS[cfg.arch](cfg).to(self.device)
        if cfg.compile:
            self.model = torch.compile(self.model)
        self.criterion = SegCriterion(cfg.num_classes, cfg.ignore_index)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=0.01)
        self.log_vars = nn.Parameter(torch.zeros(4, device=self.device))
        self.weight_optimizer = torch.optim.SGD([self.log_vars], lr=cfg.lr * 10)
        self.scaler = torch.amp.GradScaler("cpu")  # expect: AMP010

    def train_step(self, batch):
        cfg = self.cfg
        images, masks, edges = batch
        images = images.to(self.device, dtype=torch.bfloat16)  # expect: AMP001
        masks, edges = masks.to(self.device), edges.to(self.device)
        present = F.one_hot(masks.clamp(max=cfg.num_classes - 1), cfg.num_classes).flatten(1, 2).amax(dim=1).float()
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            out = self.model(images)
            ce, dice, edge = self.criterion(out.logits, out.edge_logits, masks, edges)
            cls = F.binary_cross_entropy_with_logits(out.cls_logits, present)
            parts = (ce, dice, edge, cls)
            loss = sum(torch.exp(-lv) * part + lv for lv, part in zip(self.log_vars, parts))
        self.scaler.scale(loss / cfg.accum_steps).backward()
        with torch.no_grad():
            self.stats["edge_density"] = out.edge_logits.sigmoid().mean()  # expect: AMP004
        self.micro_step += 1
        if self.micro_step % cfg.accum_steps != 0:
            return loss.detach()
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.weight_optimizer.step()  # expect: AMP006
        self.optimizer.zero_grad(set_to_none=True)
        self.weight_optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    @torch.no_grad()
    def validate(self):
        self.model.eval()
        inter = torch.zeros(self.cfg.num_classes)
        union = torch.zeros(self.cfg.num_classes)
        confidence = []
        for images, masks, _ in self.val_loader:
            with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
                out = self.model(images)
            probs = out.logits.softmax(dim=1)
            confidence.append(probs.amax(dim=1).mean().item())
            pred = probs.argmax(dim=1)
            for c in range(self.cfg.num_classes):
                p, t = pred == c, masks == c
                inter[c] += (p & t).sum()
                union[c] += (p | t).sum()
        self.model.train()
        return (inter / union.clamp(min=1)).mean().item(), sum(confidence) / max(len(confidence), 1)

    def fit(self):
        self.setup()
        for epoch in range(self.cfg.epochs):
            for batch in self.train_loader:
                loss = self.train_step(batch)
            miou, conf = self.validate()
            weights = torch.exp(-self.log_vars.detach()).tolist()
            print(f"epoch {epoch}: loss {loss.item():.4f} mIoU {miou:.3f} conf {conf:.3f} task weights {weights}")
