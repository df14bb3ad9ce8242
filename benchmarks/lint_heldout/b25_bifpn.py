"""EfficientDet-D0-style detector: a BiFPN neck with fast normalized fusion and a
shared class/box head, trained with CUDA mixed precision."""
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class SeparableConvBlock(nn.Module):
    def __init__(self, channels, act=True):
        super().__init__()
        self.depthwise = nn.Conv2d(channels, channels, 3, padding=1, groups=channels, bias=False)
        self.pointwise = nn.Conv2d(channels, channels, 1)
        self.bn = nn.BatchNorm2d(channels, momentum=0.01, eps=1e-3)
        self.act = nn.SiLU() if act else nn.Identity()

    def forward(self, x):
        return self.act(self.bn(self.pointwise(self.depthwise(x))))


class FastFusion(nn.Module):
    """out = conv(sum_i w_i * x_i / (eps + sum_j w_j)), with w = relu(param)."""

    def __init__(self, n_inputs, channels):
        super().__init__()
        self.weights = nn.Parameter(torch.ones(n_inputs, dtype=torch.float32))
        self.conv = SeparableConvBlock(channels)

    def forward(self, inputs):
        w = F.relu(self.weights)
        # fast normalized fusion (EfficientDet, section 3.3)
        w = w / (w.sum(dim=0) + 1e-8)
        fused = sum(w[i] * x for i, x in enumerate(inputs))
        return self.conv(F.silu(fused))


class BiFPNLayer(nn.Module):
    def __init__(self, channels, num_levels=5):
        super().__init__()
        self.num_levels = num_levels
        self.td_fuse = nn.ModuleList([FastFusion(2, channels) for _ in range(num_levels - 1)])
        self.bu_fuse = nn.ModuleList(
            [FastFusion(3, channels) for _ in range(num_levels - 2)] + [FastFusion(2, channels)]
        )

    def forward(self, feats):
        td = list(feats)
        for i in range(self.num_levels - 2, -1, -1):
            up = F.interpolate(td[i + 1], size=feats[i].shape[-2:], mode="nearest")
            td[i] = self.td_fuse[i]([feats[i], up])
        out = [td[0]]
        for i in range(1, self.num_levels):
            down = F.adaptive_max_pool2d(out[-1], feats[i].shape[-2:])
            if i < self.num_levels - 1:
                out.append(self.bu_fuse[i - 1]([feats[i], td[i], down]))
            else:
                out.append(self.bu_fuse[i - 1]([feats[i], down]))
        return out


class ScaleAttention(nn.Module):
    """Squeeze-and-excitation applied per pyramid level before the head tower."""

    def __init__(self, channels, reduction=4):
        super().__init__()
        self.fc1 = nn.Conv2d(channels, channels // reduction, 1)
        self.fc2 = nn.Conv2d(channels // reduction, channels, 1)

    def forward(self, x):
        s = x.mean(dim=(2, 3), keepdim=True)  # expect: AMP004
        s = torch.sigmoid(self.fc2(F.silu(self.fc1(s))))
        return x * s


class DetectionHead(nn.Module):
    def __init__(self, channels, num_anchors, num_classes, depth=3):
        super().__init__()
        self.num_classes = num_classes
        self.stem = nn.Conv2d(channels, channels, 3, padding=1)
        self.se = ScaleAttention(channels)
        self.tower = nn.Sequential(*[SeparableConvBlock(channels) for _ in range(depth)])
        self.cls_out = nn.Conv2d(channels, num_anchors * num_classes, 3, padding=1)
        self.box_out = nn.Conv2d(channels, num_anchors * 4, 3, padding=1)
        prior = 0.01
        nn.init.constant_(self.cls_out.bias, -math.log((1 - prior) / prior))

    def forward(self, feats, valid_masks):
        cls_all, box_all = [], []
        for feat, valid in zip(feats, valid_masks):
            n = feat.shape[0]
            h = self.tower(self.se(self.stem(feat)))
            cls = self.cls_out(h).permute(0, 2, 3, 1).reshape(n, -1, self.num_classes)
            # anchors that fall on the zero padding of the batch never score
            cls = cls.masked_fill(~valid[..., None], -1e9)  # expect: AMP007
            box = F.relu(self.box_out(h)).permute(0, 2, 3, 1).reshape(n, -1, 4)
            cls_all.append(cls)
            box_all.append(box)
        return torch.cat(cls_all, dim=1), torch.cat(box_all, dim=1)


class EfficientDetLite(nn.Module):
    def __init__(self, num_classes=20, channels=64, num_anchors=9, repeats=3):
        super().__init__()
        self.backbone = nn.ModuleList(
            [nn.Conv2d(3 if i == 0 else channels, channels, 3, stride=2, padding=1) for i in range(7)]
        )
        self.bifpn = nn.Sequential(*[BiFPNLayer(channels) for _ in range(repeats)])
        self.head = DetectionHead(channels, num_anchors, num_classes)

    def forward(self, images, valid_masks):
        x, feats = images, []
        for i, conv in enumerate(self.backbone):
            x = F.silu(conv(x))
            if i >= 2:
                feats.append(x)
        feats = self.bifpn(feats)
        return self.head(feats, valid_masks)


class DetectionLoss(nn.Module):
    """Sigmoid focal loss + CIoU on ltrb distances of the positive anchors."""

    def __init__(self, alpha=0.25, gamma=1.5, box_weight=50.0):
        super().__init__()
        self.alpha, self.gamma, self.box_weight = alpha, gamma, box_weight
        self.bce = nn.BCELoss(reduction="none")

    def forward(self, cls_logits, box_pred, cls_target, box_target, pos_mask):
        p = torch.sigmoid(cls_logits)
        ce = self.bce(p, cls_target)  # expect: AMP003
        p_t = p * cls_target + (1 - p) * (1 - cls_target)
        alpha_t = self.alpha * cls_target + (1 - self.alpha) * (1 - cls_target)
        num_pos = pos_mask.sum().clamp(min=1).float()
        cls_loss = (alpha_t * (1.0 - p_t) ** self.gamma * ce).sum() / num_pos

        pb, tb = box_pred[pos_mask], box_target[pos_mask]
        inter_w = torch.min(pb[:, 0], tb[:, 0]) + torch.min(pb[:, 2], tb[:, 2])
        inter_h = torch.min(pb[:, 1], tb[:, 1]) + torch.min(pb[:, 3], tb[:, 3])
        inter = inter_w * inter_h
        area_p = (pb[:, 0] + pb[:, 2]) * (pb[:, 1] + pb[:, 3])
        area_t = (tb[:, 0] + tb[:, 2]) * (tb[:, 1] + tb[:, 3])
        iou = inter / (area_p + area_t - inter + 1e-7)
        ar_p = torch.atan((pb[:, 0] + pb[:, 2]) / (pb[:, 1] + pb[:, 3] + 1e-9))  # expect: AMP011
        ar_t = torch.atan((tb[:, 0] + tb[:, 2]) / (tb[:, 1] + tb[:, 3] + 1e-9))
        v = (4 / math.pi ** 2) * (ar_t - ar_p) ** 2
        with torch.no_grad():
            alpha_v = v / (1 - iou + v + 1e-7)
        box_loss = (1 - iou + alpha_v * v).sum() / num_pos
        return cls_loss + self.box_weight * box_loss


def train(model, loader, epochs, lr=0.08, device="cuda"):
    criterion = DetectionLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=4e-5)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, epochs * len(loader))
    scaler = torch.amp.GradScaler("cuda")
    best_loss = 1e9
    for epoch in range(epochs):
        model.train()
        running = 0.0
        for images, valid_masks, cls_t, box_t, pos in loader:
            images = images.to(device, non_blocking=True)
            valid_masks = [m.to(device) for m in valid_masks]
            cls_t, box_t, pos = cls_t.to(device), box_t.to(device), pos.to(device)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                cls_out, box_out = model(images, valid_masks)
                loss = criterion(cls_out, box_out, cls_t, box_t, pos)
            scaler.scale(loss).backward()
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), 10.0)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            running += loss.item()
        epoch_loss = running / max(len(loader), 1)
        if epoch_loss < best_loss:
            best_loss = epoch_loss
            torch.save(model.state_dict(), "effdet_best.pt")
        print(f"epoch {epoch} loss {epoch_loss:.4f} grad_norm {float(grad_norm):.2f}")
    return model


@torch.inference_mode()
def export_half(model, path="effdet_fp16.pt"):
    serving = copy.deepcopy(model).half().eval()
    torch.save(serving.state_dict(), path)


@torch.no_grad()
def evaluate(model, loader, device="cuda"):
    model.eval()
    scores = []
    for images, valid_masks, *_ in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            cls_out, _ = model(images.to(device), [m.to(device) for m in valid_masks])
        scores.append(cls_out.float().sigmoid().amax(dim=-1).mean().item())
    return sum(scores) / max(len(scores), 1)


def main():
    model = EfficientDetLite(num_classes=20).cuda()
    loader = torch.load("voc_anchor_targets.pt")
    train(model, loader, epochs=30)
    print("val score", evaluate(model, loader))
    export_half(model)


if __name__ == "__main__":
    main()
