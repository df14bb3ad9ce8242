"""UNETR for multi-organ 3-D CT segmentation with deep supervision.

A ViT encoder over 16^3 patches feeds a convolutional decoder through skip
connections taken from intermediate transformer layers.  Extra heads: deep
supervision logits at three decoder scales, an organ-boundary map and an
organ-presence classifier.

Training: CUDA fp16 autocast + GradScaler passed into train(); flip-TTA
inference under inference_mode.
"""
import argparse
from dataclasses import dataclass
from typing import List

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class SegOutput:
    logits: torch.Tensor
    aux: List[torch.Tensor]
    boundary: torch.Tensor
    presence: torch.Tensor


class PatchEmbed3d(nn.Module):
    def __init__(self, in_ch, dim, patch, img_size):
        super().__init__()
        self.proj = nn.Conv3d(in_ch, dim, patch, stride=patch)
        self.pos = nn.Parameter(torch.zeros(1, (img_size // patch) ** 3, dim))
        nn.init.trunc_normal_(self.pos, std=0.02)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2) + self.pos


class ViTBlock(nn.Module):
    def __init__(self, dim, heads, mlp_ratio=4):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim))

    def forward(self, x):
        b, n, d = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.norm2(x))


class SqueezeExcite3d(nn.Module):
    def __init__(self, ch, r=8):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(ch, ch // r), nn.ReLU(inplace=True), nn.Linear(ch // r, ch), nn.Sigmoid())

    def forward(self, x):
        w = self.fc(x.mean(dim=(2, 3, 4)))  # expect: AMP004
        return x * w[:, :, None, None, None]


def conv_block(cin, cout, use_se):
    return nn.Sequential(
        nn.Conv3d(cin, cout, 3, padding=1, bias=False),
        nn.InstanceNorm3d(cout, affine=True),
        nn.LeakyReLU(0.01, inplace=True),
        nn.Conv3d(cout, cout, 3, padding=1, bias=False),
        SqueezeExcite3d(cout) if use_se else nn.Identity(),
        nn.InstanceNorm3d(cout, affine=True),
        nn.LeakyReLU(0.01, inplace=True),
    )


class ProjectionUp(nn.Module):
    """Transformer tokens (as a volume) upsampled n_up times to a skip feature map."""

    def __init__(self, dim, cout, n_up):
        super().__init__()
        layers = [nn.ConvTranspose3d(dim, cout, 2, stride=2)]
        for _ in range(n_up - 1):
            layers += [conv_block(cout, cout, use_se=False), nn.ConvTranspose3d(cout, cout, 2, stride=2)]
        self.up = nn.Sequential(*layers)

    def forward(self, x):
        return self.up(x)


class UpBlock(nn.Module):
    def __init__(self, cin, cskip, cout, use_se):
        super().__init__()
        self.up = nn.ConvTranspose3d(cin, cout, 2, stride=2)
        self.conv = conv_block(cout + cskip, cout, use_se)

    def forward(self, x, skip):
        return self.conv(torch.cat([self.up(x), skip], dim=1))


class UNETR(nn.Module):
    def __init__(self, in_ch=1, n_classes=14, img_size=96, patch=16, dim=768, depth=12, heads=12, use_se=True):
        super().__init__()
        self.grid = img_size // patch
        self.taps = (2, 5, 8)
        self.patch = PatchEmbed3d(in_ch, dim, patch, img_size)
        self.blocks = nn.ModuleList(ViTBlock(dim, heads) for _ in range(depth))
        self.enc0 = conv_block(in_ch, 32, use_se=False)
        self.enc1 = ProjectionUp(dim, 64, 3)
        self.enc2 = ProjectionUp(dim, 128, 2)
        self.enc3 = ProjectionUp(dim, 256, 1)
        self.dec3 = UpBlock(dim, 256, 256, use_se)
        self.dec2 = UpBlock(256, 128, 128, use_se)
        self.dec1 = UpBlock(128, 64, 64, use_se)
        self.dec0 = UpBlock(64, 32, 32, use_se)
        self.head = nn.Conv3d(32, n_classes, 1)
        self.ds_heads = nn.ModuleList(nn.Conv3d(c, n_classes, 1) for c in (256, 128, 64))
        self.boundary_head = nn.Conv3d(32, 1, 1)
        self.presence_proj = nn.Conv3d(dim, 256, 1)
        self.presence_head = nn.Linear(256, n_classes)

    def _to_volume(self, tokens):
        b, n, d = tokens.shape
        return tokens.transpose(1, 2).reshape(b, d, self.grid, self.grid, self.grid)

    def forward(self, img):
        x = self.patch(img)
        taps = []
        for i, blk in enumerate(self.blocks):
            x = blk(x)
            if i in self.taps:
                taps.append(self._to_volume(x))
        top = self._to_volume(x)
        presence = self.presence_head(self.presence_proj(top).mean(dim=(2, 3, 4)))  # expect: AMP004
        d3 = self.dec3(top, self.enc3(taps[2]))
        d2 = self.dec2(d3, self.enc2(taps[1]))
        d1 = self.dec1(d2, self.enc1(taps[0]))
        d0 = self.dec0(d1, self.enc0(img))
        aux = [head(f) for head, f in zip(self.ds_heads, (d3, d2, d1))]
        return SegOutput(logits=self.head(d0), aux=aux, boundary=self.boundary_head(d0), presence=presence)


class DiceCELoss(nn.Module):
    def __init__(self, smooth=1e-5):
        super().__init__()
        self.smooth = smooth
        self.ce = nn.CrossEntropyLoss()

    def forward(self, logits, target):
        ce = self.ce(logits, target)
        probs = logits.softmax(dim=1)
        onehot = F.one_hot(target, logits.size(1)).permute(0, 4, 1, 2, 3).to(probs.dtype)
        dims = (0, 2, 3, 4)
        inter = (probs * onehot).sum(dims)
        card = probs.sum(dims) + onehot.sum(dims)
        dice = (2.0 * inter + self.smooth) / (card + self.smooth)
        return ce + (1.0 - dice.mean())


class BoundaryLoss(nn.Module):
    def __init__(self, gamma=2.0, bce_weight=1.0):
        super().__init__()
        self.bce = nn.BCELoss()
        self.gamma = gamma
        self.bce_weight = bce_weight

    def forward(self, boundary_logit, edge):
        prob = torch.sigmoid(boundary_logit)
        bce = self.bce(prob, edge)  # expect: AMP003
        focal = -((1.0 - prob) ** self.gamma) * torch.log(prob + 1e-8)  # expect: AMP011
        return self.bce_weight * bce + (focal * edge).sum() / edge.sum().clamp(min=1.0)


def deep_supervision_loss(aux_logits, target, criterion, weights=(0.5, 0.25, 0.125)):
    total = 0.0
    for w, logits in zip(weights, aux_logits):
        t = F.interpolate(target[:, None].float(), size=logits.shape[2:], mode="nearest")[:, 0].long()
        total = total + w * criterion(logits, t)
    return total


def clip_gradients(model, max_norm):
    params = [p for p in model.parameters() if p.grad is not None]
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def train(model, loader, optimizer, scaler, epochs, args):
    dice_ce = DiceCELoss()
    boundary_loss = BoundaryLoss(gamma=2.0, bce_weight=0.5)
    for epoch in range(epochs):
        model.train()
        for step, batch in enumerate(loader):
            img = batch["image"].cuda(non_blocking=True)
            seg = batch["label"].cuda(non_blocking=True)
            edge = batch["edge"].cuda(non_blocking=True)
            present = F.one_hot(seg.flatten(1), args.n_classes).amax(1).float()
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(img)
                main_loss = dice_ce(out.logits, seg)
                b_loss = boundary_loss(out.boundary, edge)
                p_loss = F.binary_cross_entropy_with_logits(out.presence, present)
            ds_loss = deep_supervision_loss(out.aux, seg, dice_ce)  # expect: AMP002
            loss = main_loss + ds_loss + b_loss + 0.1 * p_loss
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            grad_norm = clip_gradients(model, args.clip)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
            if step % 20 == 0:
                print(f"ep {epoch} it {step} loss {loss.item():.4f} gnorm {float(grad_norm):.2f}")


@torch.inference_mode()
def predict_volume(model, volume):
    model.eval()
    views = [volume, volume.flip(2), volume.flip(3), volume.flip(4)]
    logits = []
    with torch.autocast("cuda", dtype=torch.float16):
        for i, v in enumerate(views):
            out = model(v).logits
            logits.append(out.flip(i + 1) if i else out)
    return torch.stack(logits).mean(dim=0).argmax(dim=1)


def dice_per_class(pred, label, n_classes):
    scores = []
    for c in range(1, n_classes):
        p, g = (pred == c).float(), (label == c).float()
        denom = p.sum() + g.sum()
        scores.append((2 * (p * g).sum() / denom).item() if denom > 0 else float("nan"))
    return scores


def synthetic_loader(n, roi, n_classes, batch_size=1):
    for _ in range(n):
        label = torch.randint(0, n_classes, (batch_size, roi, roi, roi))
        dilated = F.max_pool3d(label[:, None].float(), 3, 1, 1)[:, 0]
        edge = (dilated != label.float()).float()[:, None]
        yield {"image": torch.randn(batch_size, 1, roi, roi, roi), "label": label, "edge": edge}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--roi", type=int, default=96)
    p.add_argument("--n-classes", dest="n_classes", type=int, default=14)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--clip", type=float, default=12.0)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--no-se", dest="no_se", action="store_true")
    args = p.parse_args()

    model = UNETR(in_ch=1, n_classes=args.n_classes, img_size=args.roi, use_se=not args.no_se)
    model.to("cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    scaler = torch.amp.GradScaler("cuda")
    for epoch in range(args.epochs):
        train(model, synthetic_loader(20, args.roi, args.n_classes), optimizer, scaler, 1, args)
        if epoch % 10 == 0:
            batch = next(synthetic_loader(1, args.roi, args.n_classes))
            pred = predict_volume(model, batch["image"].cuda())
            print("val dice", dice_per_class(pred.cpu(), batch["label"], args.n_classes))
            model.train()


if __name__ == "__main__":
    main()
