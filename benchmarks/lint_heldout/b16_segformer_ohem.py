"""SegFormer-B0 style semantic segmentation with OHEM cross-entropy and a boundary branch.

Trains on Cityscapes-format data (19 classes, ignore label 255).
"""
import argparse
import copy
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import clip_grad_value_
from torch.utils.data import DataLoader


# ----------------------------------------------------------------------------- backbone
class OverlapPatchEmbed(nn.Module):
    def __init__(self, in_ch, dim, patch=7, stride=4):
        super().__init__()
        self.proj = nn.Conv2d(in_ch, dim, patch, stride, patch // 2)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        x = self.proj(x)
        _, _, h, w = x.shape
        x = x.flatten(2).transpose(1, 2)
        return self.norm(x), h, w


class EfficientSelfAttention(nn.Module):
    def __init__(self, dim, heads, sr_ratio):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, dim * 2)
        self.proj = nn.Linear(dim, dim)
        self.sr_ratio = sr_ratio
        if sr_ratio > 1:
            self.sr = nn.Conv2d(dim, dim, sr_ratio, sr_ratio)
            self.sr_norm = nn.LayerNorm(dim)

    def forward(self, x, h, w):
        b, n, c = x.shape
        q = self.q(x).reshape(b, n, self.heads, c // self.heads).transpose(1, 2)
        if self.sr_ratio > 1:
            x_ = x.transpose(1, 2).reshape(b, c, h, w)
            x_ = self.sr(x_).flatten(2).transpose(1, 2)
            x_ = self.sr_norm(x_)
        else:
            x_ = x
        kv = self.kv(x_).reshape(b, -1, 2, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        k, v = kv[0], kv[1]
        attn = (q @ k.transpose(-2, -1)) * self.scale
        attn = attn.softmax(dim=-1)
        out = (attn @ v).transpose(1, 2).reshape(b, n, c)
        return self.proj(out)


class MixFFN(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.dw = nn.Conv2d(hidden, hidden, 3, 1, 1, groups=hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x, h, w):
        x = self.fc1(x)
        b, n, c = x.shape
        x = self.dw(x.transpose(1, 2).reshape(b, c, h, w)).flatten(2).transpose(1, 2)
        return self.fc2(F.gelu(x))


class Block(nn.Module):
    def __init__(self, dim, heads, sr_ratio, mlp_ratio=4):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = EfficientSelfAttention(dim, heads, sr_ratio)
        self.norm2 = nn.LayerNorm(dim)
        self.ffn = MixFFN(dim, dim * mlp_ratio)

    def forward(self, x, h, w):
        x = x + self.attn(self.norm1(x), h, w)
        return x + self.ffn(self.norm2(x), h, w)


class MiT(nn.Module):
    def __init__(self, dims=(32, 64, 160, 256), heads=(1, 2, 5, 8), srs=(8, 4, 2, 1), depths=(2, 2, 2, 2)):
        super().__init__()
        self.embeds = nn.ModuleList()
        self.stages = nn.ModuleList()
        self.norms = nn.ModuleList()
        in_ch = 3
        for i, dim in enumerate(dims):
            self.embeds.append(OverlapPatchEmbed(in_ch, dim, 7 if i == 0 else 3, 4 if i == 0 else 2))
            self.stages.append(nn.ModuleList([Block(dim, heads[i], srs[i]) for _ in range(depths[i])]))
            self.norms.append(nn.LayerNorm(dim))
            in_ch = dim

    def forward(self, x):
        outs = []
        for embed, blocks, norm in zip(self.embeds, self.stages, self.norms):
            x, h, w = embed(x)
            for blk in blocks:
                x = blk(x, h, w)
            x = norm(x).transpose(1, 2).reshape(x.size(0), -1, h, w)
            outs.append(x)
        return outs


class SegFormerHead(nn.Module):
    def __init__(self, in_dims, embed_dim, num_classes):
        super().__init__()
        self.mlps = nn.ModuleList([nn.Linear(d, embed_dim) for d in in_dims])
        self.linear_fuse = nn.Conv2d(embed_dim * len(in_dims), embed_dim, 1, bias=False)
        self.bn = nn.BatchNorm2d(embed_dim)
        self.ctx_proj = nn.Conv2d(embed_dim, embed_dim, 1)
        self.cls = nn.Conv2d(embed_dim, num_classes, 1)
        self.edge = nn.Conv2d(embed_dim, 1, 3, padding=1)

    def forward(self, feats):
        size = feats[0].shape[2:]
        ups = []
        for f, mlp in zip(feats, self.mlps):
            b, c, h, w = f.shape
            f = mlp(f.flatten(2).transpose(1, 2)).transpose(1, 2).reshape(b, -1, h, w)
            ups.append(F.interpolate(f, size=size, mode="bilinear", align_corners=False))
        fused = self.linear_fuse(torch.cat(ups[::-1], dim=1))
        ctx = fused.mean(dim=(2, 3), keepdim=True)  # expect: AMP004
        fused = F.relu(self.bn(fused)) + self.ctx_proj(ctx)
        return self.cls(fused), self.edge(fused)


class SegFormer(nn.Module):
    def __init__(self, num_classes=19, embed_dim=256):
        super().__init__()
        self.backbone = MiT()
        self.head = SegFormerHead((32, 64, 160, 256), embed_dim, num_classes)

    def forward(self, x):
        seg, edge = self.head(self.backbone(x))
        seg = F.interpolate(seg, size=x.shape[2:], mode="bilinear", align_corners=False)
        edge = F.interpolate(edge, size=x.shape[2:], mode="bilinear", align_corners=False)
        return seg, edge


# ----------------------------------------------------------------------------- losses
class OhemCrossEntropy(nn.Module):
    def __init__(self, ignore_label=255, thresh=0.7, min_kept=100000):
        super().__init__()
        self.ignore_label = ignore_label
        self.thresh = thresh
        self.min_kept = max(1, min_kept)

    def forward(self, logits, target):
        pixel_losses = F.cross_entropy(logits, target, ignore_index=self.ignore_label, reduction="none").view(-1)
        with torch.no_grad():
            prob = F.softmax(logits, dim=1)
            valid = target.view(-1) != self.ignore_label
            tmp_target = target.clone()
            tmp_target[tmp_target == self.ignore_label] = 0
            prob = prob.gather(1, tmp_target.unsqueeze(1)).view(-1)[valid]
            sorted_prob, _ = prob.sort()
            idx = min(sorted_prob.numel() - 1, self.min_kept)
            threshold = max(sorted_prob[idx].item(), self.thresh) if sorted_prob.numel() else self.thresh
        pixel_losses = pixel_losses[valid]
        kept = pixel_losses[prob < threshold]
        return kept.mean() if kept.numel() else pixel_losses.mean()


class BoundaryFocalLoss(nn.Module):
    """Sigmoid focal loss for the thin boundary map (positives are ~2% of pixels)."""

    def __init__(self, alpha=0.25, gamma=2.0):
        super().__init__()
        self.alpha = alpha
        self.gamma = gamma

    def forward(self, edge_logits, edge_target):
        p = torch.sigmoid(edge_logits)
        pos = -self.alpha * (1 - p) ** self.gamma * torch.log(p + 1e-8) * edge_target  # expect: AMP011
        neg = -(1 - self.alpha) * p ** self.gamma * torch.log(1 - p + 1e-8) * (1 - edge_target)  # expect: AMP011
        return (pos + neg).mean()


def edge_bce(edge_logits, edge_target):
    return F.binary_cross_entropy_with_logits(edge_logits, edge_target, pos_weight=torch.tensor(10.0, device=edge_logits.device))


# ----------------------------------------------------------------------------- train / eval
def poly_lr(optimizer, base_lr, it, max_it, power=1.0):
    lr = base_lr * (1 - it / max_it) ** power
    for g in optimizer.param_groups:
        g["lr"] = lr * g.get("lr_mult", 1.0)
    return lr


@torch.no_grad()
def evaluate(model, loader, num_classes, device, amp=True):
    model.eval()
    hist = torch.zeros(num_classes, num_classes, dtype=torch.long, device=device)
    for images, labels, _ in loader:
        images, labels = images.to(device), labels.to(device)
        with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
            seg, _ = model(images)
        pred = seg.float().argmax(1)
        k = labels != 255
        hist += torch.bincount(num_classes * labels[k] + pred[k], minlength=num_classes ** 2).view(num_classes, num_classes)
    iou = hist.diag().float() / (hist.sum(0) + hist.sum(1) - hist.diag()).float().clamp(min=1)
    model.train()
    return iou.mean().item()


def export_onnx(model, path, size=(1024, 2048)):
    deploy = copy.deepcopy(model).half().eval()
    dummy = torch.randn(1, 3, *size, device=next(deploy.parameters()).device, dtype=torch.float16)
    torch.onnx.export(deploy, dummy, path, opset_version=17, input_names=["image"], output_names=["seg", "edge"])


def train(cfg, train_loader, val_loader, device):
    model = SegFormer(num_classes=cfg.num_classes).to(device)
    backbone = [p for n, p in model.named_parameters() if n.startswith("backbone")]
    head = [p for n, p in model.named_parameters() if not n.startswith("backbone")]
    optimizer = torch.optim.AdamW([{"params": backbone}, {"params": head, "lr_mult": 10.0}], lr=cfg.lr, weight_decay=0.01)
    scaler = torch.cuda.amp.GradScaler(enabled=cfg.amp)  # expect: AMP009
    ohem = OhemCrossEntropy(thresh=cfg.ohem_thresh, min_kept=cfg.ohem_min_kept)
    boundary = BoundaryFocalLoss()
    max_it = cfg.epochs * len(train_loader)
    it, best_miou = 0, -1e9
    for epoch in range(cfg.epochs):
        t0 = time.time()
        for images, labels, edges in train_loader:
            images = images.to(device, dtype=torch.float16, non_blocking=True)  # expect: AMP001
            labels = labels.to(device, non_blocking=True)
            edges = edges.to(device, non_blocking=True).float()
            lr = poly_lr(optimizer, cfg.lr, it, max_it)
            with torch.autocast("cuda", dtype=torch.float16, enabled=cfg.amp):
                seg, edge = model(images)
                loss_seg = ohem(seg, labels)
                loss_edge = boundary(edge, edges) + 0.5 * edge_bce(edge, edges)
                loss = loss_seg + cfg.edge_weight * loss_edge
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            clip_grad_value_(model.parameters(), cfg.clip_value)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
            if it % cfg.log_every == 0:
                print(f"ep {epoch} it {it} lr {lr:.2e} loss {loss.item():.4f} seg {loss_seg.item():.4f}")
            it += 1
        miou = evaluate(model, val_loader, cfg.num_classes, device, cfg.amp)
        print(f"epoch {epoch} mIoU {miou:.4f} ({time.time() - t0:.0f}s)")
        if miou > best_miou:
            best_miou = miou
            torch.save({"model": model.state_dict(), "epoch": epoch, "miou": miou}, os.path.join(cfg.out, "best.pth"))
    return model


def parse_args():
    p = argparse.ArgumentParser("segformer-ohem")
    p.add_argument("--data", default="data/cityscapes")
    p.add_argument("--out", default="work_dirs/segformer_b0")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=6e-5)
    p.add_argument("--num-classes", type=int, default=19)
    p.add_argument("--ohem-thresh", type=float, default=0.7)
    p.add_argument("--ohem-min-kept", type=int, default=100000)
    p.add_argument("--edge-weight", type=float, default=0.4)
    p.add_argument("--clip-value", type=float, default=1.0)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--export", default="")
    return p.parse_args()


def main():
    cfg = parse_args()
    os.makedirs(cfg.out, exist_ok=True)
    device = torch.device("cuda")
    from datasets import CityscapesEdges  # project-local dataset

    train_set = CityscapesEdges(cfg.data, "train", crop=(1024, 1024))
    val_set = CityscapesEdges(cfg.data, "val")
    train_loader = DataLoader(train_set, cfg.batch_size, shuffle=True, num_workers=8, drop_last=True, pin_memory=True)
    val_loader = DataLoader(val_set, 1, num_workers=4)
    model = train(cfg, train_loader, val_loader, device)
    if cfg.export:
        export_onnx(model, cfg.export)


if __name__ == "__main__":
    main()
