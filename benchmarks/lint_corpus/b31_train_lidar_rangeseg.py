"""LiDAR semantic segmentation on spherical range images (SemanticKITTI).

Mixed precision: bf16 autocast on Ampere+; older scripts used
``torch.cuda.amp.GradScaler`` here, which fp16 needs and bf16 does not.
"""
import argparse
import copy
import math
import os
from typing import Dict, List, Tuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

NUM_CLASSES = 20


def project_scan(points: np.ndarray, H: int = 64, W: int = 2048, fov_up: float = 3.0, fov_down: float = -25.0):
    fov_up, fov_down = math.radians(fov_up), math.radians(fov_down)
    depth = np.linalg.norm(points[:, :3], axis=1)
    yaw = -np.arctan2(points[:, 1], points[:, 0])
    pitch = np.arcsin(points[:, 2] / (depth + 1e-8))
    u = np.clip(np.floor(0.5 * (yaw / np.pi + 1.0) * W), 0, W - 1).astype(np.int64)
    v = np.clip(np.floor((1.0 - (pitch - fov_down) / (fov_up - fov_down)) * H), 0, H - 1).astype(np.int64)
    depth_buf = np.full((H, W), 1e9, dtype=np.float32)
    order = np.argsort(depth)[::-1]
    depth_buf[v[order], u[order]] = depth[order]
    img = np.zeros((5, H, W), dtype=np.float32)
    img[0] = np.where(depth_buf < 1e9, depth_buf, -1.0)
    img[1:4, v[order], u[order]] = points[order, :3].T
    img[4, v[order], u[order]] = points[order, 3]
    return img, v, u


class ChannelNorm(nn.Module):
    def __init__(self, c: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(1, c, 1, 1))
        self.bias = nn.Parameter(torch.zeros(1, c, 1, 1))

    def forward(self, x):
        xf = x.float()
        mu = xf.mean(1, keepdim=True)
        var = xf.var(1, keepdim=True, unbiased=False)
        return ((xf - mu) * torch.rsqrt(var + self.eps) * self.weight + self.bias).to(x.dtype)


def global_context(feat: torch.Tensor) -> torch.Tensor:
    return feat.mean(dim=(2, 3), keepdim=True)  # expect: AMP004


class ContextBlock(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.norm = ChannelNorm(c)
        self.gate = nn.Conv2d(c, c, 1)

    def forward(self, x):
        h = F.leaky_relu(self.norm(self.conv(x)), 0.1)
        g = torch.sigmoid(self.gate(global_context(h)))
        energy = h.pow(2).mean(dim=1, keepdim=True)
        return x + h * g * torch.rsqrt(energy + 1e-6)


class RangeEncoder(nn.Module):
    def __init__(self, in_ch: int = 5, widths: Tuple[int, ...] = (32, 64, 128, 256)):
        super().__init__()
        layers: List[nn.Module] = []
        c = in_ch
        for w in widths:
            layers += [nn.Conv2d(c, w, 3, stride=(1, 2), padding=1), ContextBlock(w)]
            c = w
        self.body = nn.Sequential(*layers)
        self.out_ch = c

    def forward(self, x):
        return self.body(x)


class TokenMixer(nn.Module):
    def __init__(self, c: int, heads: int = 4):
        super().__init__()
        self.ln = nn.LayerNorm(c)
        self.attn = nn.MultiheadAttention(c, heads, batch_first=True)

    def forward(self, x):
        b, c, h, w = x.shape
        tokens = self.ln(x.flatten(2).transpose(1, 2))
        summary = tokens.mean(1, keepdim=True)
        mixed, _ = self.attn(tokens, tokens, tokens, need_weights=False)
        return x + (mixed + summary).transpose(1, 2).reshape(b, c, h, w).to(x.dtype)


class RangeSegNet(nn.Module):
    def __init__(self, num_classes: int = NUM_CLASSES, emb_dim: int = 64):
        super().__init__()
        self.encoder = RangeEncoder()
        self.mixer = TokenMixer(self.encoder.out_ch)
        self.up = nn.Upsample(scale_factor=(1, 16), mode="bilinear", align_corners=False)
        self.head = nn.Conv2d(self.encoder.out_ch, num_classes, 1)
        self.emb = nn.Conv2d(self.encoder.out_ch, emb_dim, 1)

    def forward(self, img) -> Dict[str, torch.Tensor]:
        f = self.mixer(self.encoder(img))
        f = self.up(f)
        return {"logits": self.head(f), "emb": F.normalize(self.emb(f), dim=1)}

    @torch.no_grad()
    def knn_refine(self, logits, xyz, k: int = 5):
        pred = logits.argmax(1)
        dist = torch.cdist(xyz.float(), xyz.float())
        valid = pred[:, None, :] == pred[:, :, None]
        dist = dist.masked_fill(~valid, 1e9)
        idx = dist.topk(k, largest=False).indices
        return torch.mode(pred.gather(1, idx.flatten(1)).view_as(idx), dim=-1).values


def lovasz_softmax(probs: torch.Tensor, labels: torch.Tensor, ignore: int = 0) -> torch.Tensor:
    probs = probs.permute(0, 2, 3, 1).reshape(-1, probs.size(1))
    labels = labels.reshape(-1)
    keep = labels != ignore
    probs, labels = probs[keep], labels[keep]
    losses = []
    for c in range(1, probs.size(1)):
        fg = (labels == c).float()
        if fg.sum() == 0:
            continue
        errors = (fg - probs[:, c]).abs()
        errors_sorted, perm = torch.sort(errors, descending=True)
        gt_sorted = fg[perm]
        inter = gt_sorted.sum() - gt_sorted.cumsum(0)
        union = gt_sorted.sum() + (1.0 - gt_sorted).cumsum(0)
        jac = 1.0 - inter / union
        jac[1:] = jac[1:] - jac[:-1]
        losses.append((errors_sorted * jac).sum())
    return torch.stack(losses).mean() if losses else probs.sum() * 0.0


def train(args):
    device = "cuda"
    from kitti_range import build_dataloaders
    train_loader, val_loader, class_freq = build_dataloaders(args.data, args.batch_size)
    weight = torch.as_tensor(1.0 / (np.asarray(class_freq) + 1e-8), dtype=torch.float32, device=device)
    weight[0] = 0.0
    model = RangeSegNet().to(device).to(memory_format=torch.channels_last)
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4, eps=1e-8)
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)  # expect: AMP010
    best_miou = -1e9
    for epoch in range(args.epochs):
        model.train()
        for it, (img, label) in enumerate(train_loader):
            img = img.to(device, non_blocking=True).to(memory_format=torch.channels_last)
            label = label.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.amp):
                out = model(img)
                ce = F.cross_entropy(out["logits"], label, weight=weight, ignore_index=0)
                lz = lovasz_softmax(F.softmax(out["logits"], dim=1, dtype=torch.float32), label)
                loss = ce + args.lovasz_w * lz
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if args.clip > 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            scaler.step(optimizer)
            scaler.update()
            with torch.no_grad():
                for pe, pm in zip(ema.parameters(), model.parameters()):
                    pe.lerp_(pm, 1.0 - args.ema)
            if it % 50 == 0:
                print(f"ep {epoch} it {it} ce {ce.item():.3f} lovasz {lz.item():.3f}")
        miou = evaluate(ema, val_loader, device)
        if miou > best_miou:
            best_miou = miou
            torch.save(ema.state_dict(), os.path.join(args.out, "ema_best.pth"))


@torch.no_grad()
def evaluate(model, loader, device) -> float:
    model.eval()
    conf = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.long, device=device)
    for img, label in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(img.to(device))["logits"].argmax(1)
        idx = label.to(device).flatten() * NUM_CLASSES + pred.flatten()
        conf += torch.bincount(idx, minlength=NUM_CLASSES ** 2).view(NUM_CLASSES, NUM_CLASSES)
    iou = conf.diag().float() / (conf.sum(0) + conf.sum(1) - conf.diag()).float().clamp(min=1)
    return iou[1:].mean().item()


@torch.inference_mode()
def infer_sequence(model, scans: List[np.ndarray], device="cuda"):
    net = model.to(device).eval().half()
    preds = []
    for pts in scans:
        img, v, u = project_scan(pts)
        x = torch.from_numpy(img)[None].to(device).half()
        logits = net(x)["logits"][0]
        preds.append(logits.argmax(0)[v, u].cpu().numpy())
    return preds


def export_onnx(model, path, H=64, W=2048):
    m = copy.deepcopy(model).cpu().eval().half()
    torch.onnx.export(m, torch.zeros(1, 5, H, W, dtype=torch.float16), path, opset_version=17)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/semantickitti")
    ap.add_argument("--out", default="runs/rangeseg")
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--clip", type=float, default=5.0)
    ap.add_argument("--ema", type=float, default=0.999)
    ap.add_argument("--lovasz-w", type=float, default=1.0)
    ap.add_argument("--amp", action="store_true", help="bf16 mixed precision")
    train(ap.parse_args())
