"""Anchor-based 3D detector on a BEV pseudo-image (PointPillars/SECOND style) with focal, IoU and direction losses."""
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def limit_period(val, offset=0.5, period=math.pi):
    return val - torch.floor(val / period + offset) * period


class BEVBackbone(nn.Module):
    """Three strided conv stages, each upsampled back to a common resolution and concatenated."""

    def __init__(self, in_ch=64, layer_nums=(3, 5, 5), strides=(2, 2, 2), filters=(64, 128, 256),
                 up_strides=(1, 2, 4), up_filters=(128, 128, 128)):
        super().__init__()
        self.blocks = nn.ModuleList()
        self.deblocks = nn.ModuleList()
        c_in = in_ch
        for n, s, c, us, uc in zip(layer_nums, strides, filters, up_strides, up_filters):
            layers = [nn.Conv2d(c_in, c, 3, stride=s, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU()]
            for _ in range(n):
                layers += [nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU()]
            self.blocks.append(nn.Sequential(*layers))
            self.deblocks.append(nn.Sequential(
                nn.ConvTranspose2d(c, uc, us, stride=us, bias=False), nn.BatchNorm2d(uc), nn.ReLU()))
            c_in = c
        self.out_channels = sum(up_filters)

    def forward(self, x):
        ups = []
        for block, deblock in zip(self.blocks, self.deblocks):
            x = block(x)
            ups.append(deblock(x))
        return torch.cat(ups, dim=1)


class AnchorHead3D(nn.Module):
    def __init__(self, in_ch, num_classes=3, num_anchors=2, box_dim=7, prior=0.01):
        super().__init__()
        self.num_classes, self.box_dim = num_classes, box_dim
        self.conv_cls = nn.Conv2d(in_ch, num_anchors * num_classes, 1)
        self.conv_box = nn.Conv2d(in_ch, num_anchors * box_dim, 1)
        self.conv_dir = nn.Conv2d(in_ch, num_anchors, 1)
        self.conv_iou = nn.Conv2d(in_ch, num_anchors, 1)
        nn.init.constant_(self.conv_cls.bias, -math.log((1 - prior) / prior))
        nn.init.normal_(self.conv_box.weight, std=0.001)

    def forward(self, feats, bev_valid=None):
        B = feats.shape[0]
        cls = self.conv_cls(feats)
        if bev_valid is not None:
            # cells outside the point-cloud range can never hold an object
            cls[~bev_valid[:, None].expand_as(cls)] = -1e5  # expect: AMP007
        cls = cls.permute(0, 2, 3, 1).reshape(B, -1, self.num_classes)
        box = self.conv_box(feats).permute(0, 2, 3, 1).reshape(B, -1, self.box_dim)
        dir_logits = self.conv_dir(feats).permute(0, 2, 3, 1).reshape(B, -1)
        iou_logits = self.conv_iou(feats).permute(0, 2, 3, 1).reshape(B, -1)
        return cls, box, dir_logits, iou_logits


class PillarDetector(nn.Module):
    def __init__(self, in_ch=64, num_classes=3, num_anchors=2):
        super().__init__()
        self.backbone = BEVBackbone(in_ch)
        self.head = AnchorHead3D(self.backbone.out_channels, num_classes, num_anchors)

    def forward(self, bev, bev_valid=None):
        return self.head(self.backbone(bev), bev_valid)


def decode_boxes(anchors, deltas):
    """SECOND residual coding; boxes are (x, y, z, w, l, h, yaw)."""
    xa, ya, za, wa, la, ha, ra = anchors.unbind(-1)
    xt, yt, zt, wt, lt, ht, rt = deltas.unbind(-1)
    diag = torch.sqrt(wa ** 2 + la ** 2)
    return torch.stack([xt * diag + xa, yt * diag + ya, zt * ha + za,
                        torch.exp(wt) * wa, torch.exp(lt) * la, torch.exp(ht) * ha, rt + ra], dim=-1)


def aligned_iou_3d(pred, target, eps=1e-8):
    p_min, p_max = pred[..., :3] - pred[..., 3:6] / 2, pred[..., :3] + pred[..., 3:6] / 2
    t_min, t_max = target[..., :3] - target[..., 3:6] / 2, target[..., :3] + target[..., 3:6] / 2
    inter = (torch.min(p_max, t_max) - torch.max(p_min, t_min)).clamp(min=0).prod(dim=-1)
    union = pred[..., 3:6].prod(dim=-1) + target[..., 3:6].prod(dim=-1) - inter
    return inter / (union + eps)


class SigmoidFocalLoss(nn.Module):
    def __init__(self, alpha=0.25, gamma=2.0):
        super().__init__()
        self.alpha, self.gamma = alpha, gamma

    def forward(self, logits, targets):
        p = torch.sigmoid(logits)
        ce = -(targets * torch.log(p + 1e-12) + (1 - targets) * torch.log(1 - p + 1e-12))  # expect: AMP011
        p_t = p * targets + (1 - p) * (1 - targets)
        alpha_t = self.alpha * targets + (1 - self.alpha) * (1 - targets)
        return (alpha_t * (1 - p_t) ** self.gamma * ce).sum()


class IoULoss3D(nn.Module):
    def forward(self, pred_boxes, target_boxes):
        return (1.0 - aligned_iou_3d(pred_boxes, target_boxes)).mean()


class DetectionLoss(nn.Module):
    def __init__(self, num_classes, anchors, weights=(1.0, 2.0, 0.2, 1.0), pos_thresh=0.5):
        super().__init__()
        self.num_classes = num_classes
        self.register_buffer("anchors", anchors)
        self.focal = SigmoidFocalLoss()
        self.iou_loss = IoULoss3D()
        self.dir_bce = nn.BCELoss()
        self.w_cls, self.w_box, self.w_dir, self.w_iou = weights
        self.pos_thresh = pos_thresh

    @torch.no_grad()
    def assign(self, gt_boxes, gt_labels):
        """Match anchors to ground truth by BEV centre distance normalised by the anchor diagonal."""
        a, g = self.anchors.float(), gt_boxes.float()
        cost = torch.cdist(a[:, :2], g[:, :2]) / torch.sqrt(a[:, 3] ** 2 + a[:, 4] ** 2)[:, None]
        size_gap = (a[:, None, 3:6] - g[None, :, 3:6]).abs().amax(dim=-1)
        cost[size_gap > 1.0] = 1e8
        best_cost, best_gt = cost.min(dim=1)
        pos = best_cost < self.pos_thresh
        return pos, g[best_gt], gt_labels[best_gt]

    def forward(self, cls_preds, box_preds, dir_preds, iou_preds, gt_boxes, gt_labels):
        total = cls_preds.new_zeros((), dtype=torch.float32)
        stats = {"cls": 0.0, "box": 0.0, "dir": 0.0, "iou": 0.0}
        for b in range(cls_preds.shape[0]):
            pos, matched, labels = self.assign(gt_boxes[b], gt_labels[b])
            cls_t = torch.zeros(cls_preds.shape[1], self.num_classes, device=cls_preds.device)
            cls_t[pos, labels[pos]] = 1.0
            num_pos = pos.sum().clamp(min=1).float()
            loss_cls = self.focal(cls_preds[b], cls_t) / num_pos
            total = total + self.w_cls * loss_cls
            stats["cls"] += loss_cls.item()
            if not pos.any():
                continue
            pred_boxes = decode_boxes(self.anchors[pos], box_preds[b, pos].float())
            loss_box = self.iou_loss(pred_boxes, matched[pos])
            dir_t = (limit_period(matched[pos, 6] - self.anchors[pos, 6], 0.0, 2 * math.pi) > math.pi).float()
            loss_dir = self.dir_bce(torch.sigmoid(dir_preds[b, pos]), dir_t)  # expect: AMP003
            with torch.no_grad():
                iou_t = aligned_iou_3d(pred_boxes, matched[pos]) * 2.0 - 1.0
            loss_iou = F.smooth_l1_loss(torch.tanh(iou_preds[b, pos]).float(), iou_t)
            total = total + self.w_box * loss_box + self.w_dir * loss_dir + self.w_iou * loss_iou
            stats["box"] += loss_box.item()
            stats["dir"] += loss_dir.item()
            stats["iou"] += loss_iou.item()
        return total / cls_preds.shape[0], stats


def make_anchors(grid=(248, 216), pc_range=(0.0, -39.68, 69.12, 39.68), size=(1.6, 3.9, 1.56), z=-1.78):
    xs = torch.linspace(pc_range[0], pc_range[2], grid[1])
    ys = torch.linspace(pc_range[1], pc_range[3], grid[0])
    yy, xx = torch.meshgrid(ys, xs, indexing="ij")
    anchors = []
    for yaw in (0.0, math.pi / 2):
        a = torch.stack([xx, yy, torch.full_like(xx, z), torch.full_like(xx, size[0]),
                         torch.full_like(xx, size[1]), torch.full_like(xx, size[2]), torch.full_like(xx, yaw)], -1)
        anchors.append(a)
    return torch.stack(anchors, dim=2).reshape(-1, 7)


class Trainer:
    def __init__(self, num_classes=3, lr=2e-3, epochs=80, device="cuda"):
        self.device = device
        self.model = PillarDetector(num_classes=num_classes).to(device)
        self.criterion = DetectionLoss(num_classes, make_anchors()).to(device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.01)
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=epochs)
        self.scaler = torch.amp.GradScaler("cuda")
        self.epochs = epochs

    def train_step(self, bev, bev_valid, gt_boxes, gt_labels):
        bev, bev_valid = bev.to(self.device, non_blocking=True), bev_valid.to(self.device)
        gt_boxes = [g.to(self.device) for g in gt_boxes]
        gt_labels = [g.to(self.device) for g in gt_labels]
        with torch.cuda.amp.autocast(dtype=torch.float16):  # expect: AMP009
            cls, box, dir_logits, iou_logits = self.model(bev, bev_valid)
            loss, stats = self.criterion(cls, box, dir_logits, iou_logits, gt_boxes, gt_labels)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=10.0)
        self.scaler.step(self.optimizer)  # expect: AMP006
        return loss.item(), stats

    def fit(self, loader):
        for epoch in range(self.epochs):
            self.model.train()
            for i, (bev, bev_valid, gt_boxes, gt_labels) in enumerate(loader):
                loss, stats = self.train_step(bev, bev_valid, gt_boxes, gt_labels)
                if i % 50 == 0:
                    parts = " ".join(f"{k} {v:.3f}" for k, v in stats.items())
                    print(f"epoch {epoch} iter {i} loss {loss:.4f} {parts}")
            self.scheduler.step()

    def export_half(self, path):
        serving = copy.deepcopy(self.model).eval().half()
        torch.save(serving.state_dict(), path)
