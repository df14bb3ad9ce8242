"""EfficientDet-style detector: NF-EfficientNet backbone, BiFPN with fast normalized
fusion, shared class/box heads, focal + GIoU losses. fp16 autocast on one GPU."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

CFG = {
    "stages": [  # (out_channels, num_blocks, stride, expand_ratio, use_se)
        (24, 2, 2, 1, True),
        (40, 2, 2, 6, True),
        (80, 3, 2, 6, True),
        (112, 3, 1, 6, False),
        (192, 4, 2, 6, True),
    ],
    "fpn_channels": 88,
    "fpn_repeats": 4,
    "head_depth": 3,
    "num_classes": 90,
    "num_anchors": 9,
    "fusion": "fast",
    "lr": 0.08,
    "epochs": 300,
    "clip": 10.0,
}


class ScaledStdConv2d(nn.Conv2d):
    """Weight-standardised conv (NFNet); the standardisation runs on the fp32 weights."""

    def __init__(self, *args, gain_init=1.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.gain = nn.Parameter(torch.full((self.out_channels, 1, 1, 1), gain_init))
        self.fan_in = self.weight[0].numel()

    def forward(self, x):
        w = self.weight
        w = (w - w.mean(dim=(1, 2, 3), keepdim=True)) / (w.std(dim=(1, 2, 3), keepdim=True) * math.sqrt(self.fan_in) + 1e-10)
        return F.conv2d(x, w * self.gain, self.bias, self.stride, self.padding, self.dilation, self.groups)


class EvoNorm2dS0(nn.Module):
    def __init__(self, channels, groups=8):
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.ones(1, channels, 1, 1))
        self.bias = nn.Parameter(torch.zeros(1, channels, 1, 1))
        self.v = nn.Parameter(torch.ones(1, channels, 1, 1))

    def forward(self, x):
        b, c, h, w = x.shape
        xg = x.reshape(b, self.groups, -1)
        std = (xg.var(dim=-1, keepdim=True, unbiased=False) + 1e-5).sqrt()  # expect: AMP004
        std = std.expand(-1, -1, c // self.groups * h * w).reshape(b, c, h, w)
        return x * torch.sigmoid(self.v * x) / std * self.weight + self.bias


class SqueezeExcite(nn.Module):
    def __init__(self, channels, rd_channels):
        super().__init__()
        self.reduce = nn.Conv2d(channels, rd_channels, 1)
        self.expand = nn.Conv2d(rd_channels, channels, 1)

    def forward(self, x):
        s = x.mean((2, 3), keepdim=True)  # expect: AMP004
        s = self.expand(F.silu(self.reduce(s)))
        return x * torch.sigmoid(s)


class MBConv(nn.Module):
    def __init__(self, cin, cout, stride, expand, use_se):
        super().__init__()
        mid = cin * expand
        self.pw = ScaledStdConv2d(cin, mid, 1) if expand != 1 else nn.Identity()
        self.dw = ScaledStdConv2d(mid, mid, 3, stride=stride, padding=1, groups=mid)
        self.se = SqueezeExcite(mid, max(8, cin // 4)) if use_se else nn.Identity()
        self.project = ScaledStdConv2d(mid, cout, 1)
        self.norm = EvoNorm2dS0(cout)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        h = F.silu(self.pw(x))
        h = self.se(F.silu(self.dw(h)))
        h = self.norm(self.project(h))
        return x + h if self.residual else h


def make_backbone(stages, stem=32):
    layers = [ScaledStdConv2d(3, stem, 3, stride=2, padding=1), nn.SiLU()]
    out_stages, cin = nn.ModuleList([nn.Sequential(*layers)]), stem
    for cout, n, stride, expand, use_se in stages:
        blocks = [MBConv(cin if i == 0 else cout, cout, stride if i == 0 else 1, expand, use_se) for i in range(n)]
        out_stages.append(nn.Sequential(*blocks))
        cin = cout
    return out_stages


class SeparableConv(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.dw = nn.Conv2d(channels, channels, 3, padding=1, groups=channels, bias=False)
        self.pw = nn.Conv2d(channels, channels, 1)
        self.bn = nn.BatchNorm2d(channels, momentum=0.01, eps=1e-3)

    def forward(self, x):
        return self.bn(self.pw(self.dw(x)))


class FastFusion(nn.Module):
    """w_i = relu(w_i) / (sum_j relu(w_j) + eps); the weights are fp32 parameters."""

    def __init__(self, n_inputs, channels, mode="fast"):
        super().__init__()
        self.mode = mode
        self.w = nn.Parameter(torch.ones(n_inputs))
        self.conv = SeparableConv(channels)

    def forward(self, inputs):
        if self.mode == "fast":
            w = F.relu(self.w)
            w = w / (w.sum() + 1e-8)
        else:
            w = torch.softmax(self.w, dim=0)
        fused = sum(w[i] * x for i, x in enumerate(inputs))
        return self.conv(F.silu(fused))


class BiFPNLayer(nn.Module):
    def __init__(self, channels, levels=5):
        super().__init__()
        self.levels = levels
        self.td = nn.ModuleList([FastFusion(2, channels) for _ in range(levels - 1)])
        self.bu = nn.ModuleList([FastFusion(3, channels) for _ in range(levels - 2)] + [FastFusion(2, channels)])

    def forward(self, feats):
        td = [feats[-1]]
        for i in range(self.levels - 2, -1, -1):
            up = F.interpolate(td[0], size=feats[i].shape[-2:], mode="nearest")
            td.insert(0, self.td[i]([feats[i], up]))
        outs = [td[0]]
        for i in range(1, self.levels):
            down = F.max_pool2d(outs[-1], 3, stride=2, padding=1)
            inputs = [feats[i], td[i], down] if i < self.levels - 1 else [feats[i], down]
            outs.append(self.bu[i - 1](inputs))
        return outs


class Head(nn.Module):
    def __init__(self, channels, n_out, depth):
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv2d(channels, channels, 3, padding=1) for _ in range(depth)])
        self.norms = nn.ModuleList([nn.GroupNorm(8, channels) for _ in range(depth)])
        self.scale_fc = nn.Conv2d(channels, channels, 1)
        self.pred = nn.Conv2d(channels, n_out, 3, padding=1)

    def forward(self, feats):
        outs = []
        for f in feats:
            h = f
            for conv, norm in zip(self.convs, self.norms):
                h = F.silu(norm(conv(h)))
            s = h.mean(dim=(2, 3), keepdim=True)
            h = h * torch.sigmoid(self.scale_fc(s))
            outs.append(self.pred(h))
        return outs


class EfficientDet(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.backbone = make_backbone(cfg["stages"])
        self.out_idx = (2, 4, 5)  # strides 8, 16, 32
        chans = [cfg["stages"][i - 1][0] for i in self.out_idx]
        c = cfg["fpn_channels"]
        self.lateral = nn.ModuleList([nn.Conv2d(ch, c, 1) for ch in chans])
        self.p6 = nn.Conv2d(chans[-1], c, 3, stride=2, padding=1)
        self.bifpn = nn.Sequential(*[BiFPNLayer(c) for _ in range(cfg["fpn_repeats"])])
        self.num_classes = cfg["num_classes"]
        self.cls_head = Head(c, cfg["num_anchors"] * cfg["num_classes"], cfg["head_depth"])
        self.box_head = Head(c, cfg["num_anchors"] * 4, cfg["head_depth"])

    def forward(self, images):
        x, feats = images, []
        for i, stage in enumerate(self.backbone):
            x = stage(x)
            if i in self.out_idx:
                feats.append(x)
        pyramid = [lat(f) for lat, f in zip(self.lateral, feats)]
        pyramid.append(self.p6(feats[-1]))
        pyramid.append(F.max_pool2d(pyramid[-1], 3, stride=2, padding=1))
        pyramid = self.bifpn(pyramid)
        b = images.shape[0]
        cls = torch.cat([o.permute(0, 2, 3, 1).reshape(b, -1, self.num_classes) for o in self.cls_head(pyramid)], 1)
        box = torch.cat([o.permute(0, 2, 3, 1).reshape(b, -1, 4) for o in self.box_head(pyramid)], 1)
        return cls, box


class FocalLoss(nn.Module):
    def __init__(self, alpha=0.25, gamma=2.0):
        super().__init__()
        self.alpha, self.gamma = alpha, gamma

    def forward(self, cls_logits, targets, num_pos):
        p = torch.sigmoid(cls_logits)
        log_p = torch.log(p + 1e-8)  # expect: AMP011
        log_1mp = torch.log(1 - p + 1e-8)  # expect: AMP011
        ce = -(targets * log_p + (1 - targets) * log_1mp)
        p_t = p * targets + (1 - p) * (1 - targets)
        alpha_t = self.alpha * targets + (1 - self.alpha) * (1 - targets)
        loss = alpha_t * ce * (1 - p_t) ** self.gamma
        return loss.sum() / num_pos.clamp(min=1.0)


def decode_boxes(deltas, anchors):
    wa, ha = anchors[:, 2] - anchors[:, 0], anchors[:, 3] - anchors[:, 1]
    cxa, cya = anchors[:, 0] + 0.5 * wa, anchors[:, 1] + 0.5 * ha
    cx, cy = cxa + deltas[..., 0] * wa, cya + deltas[..., 1] * ha
    w, h = wa * deltas[..., 2].clamp(max=4.0).exp(), ha * deltas[..., 3].clamp(max=4.0).exp()
    return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], dim=-1)


def giou_loss(pred, target):
    lt, rb = torch.max(pred[..., :2], target[..., :2]), torch.min(pred[..., 2:], target[..., 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    area_p = (pred[..., 2:] - pred[..., :2]).clamp(min=0).prod(-1)
    area_t = (target[..., 2:] - target[..., :2]).prod(-1)
    union = area_p + area_t - inter
    iou = inter / (union + 1e-9)
    enclose = (torch.max(pred[..., 2:], target[..., 2:]) - torch.min(pred[..., :2], target[..., :2])).prod(-1)
    return 1.0 - iou + (enclose - union) / (enclose + 1e-9)


class Trainer:
    def __init__(self, model, anchors, cfg):
        self.model = model.cuda()
        self.anchors = anchors.cuda()
        self.cfg = cfg
        self.focal = FocalLoss()
        self.opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9, weight_decay=4e-5, nesterov=True)
        self.scaler = torch.amp.GradScaler("cuda")

    def compute_loss(self, images, cls_t, box_t, pos_mask):
        with torch.autocast("cuda", dtype=torch.float16):
            cls_out, box_out = self.model(images)
            num_pos = pos_mask.sum().float()
            cls_loss = self.focal(cls_out, cls_t, num_pos)
            boxes = decode_boxes(box_out, self.anchors)
            box_loss = giou_loss(boxes[pos_mask], box_t[pos_mask]).sum() / num_pos.clamp(min=1.0)
        return cls_loss + box_loss, cls_loss.detach(), box_loss.detach()

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def step(self):
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg["clip"])  # expect: AMP005
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)

    def fit(self, loader):
        for epoch in range(self.cfg["epochs"]):
            self.model.train()
            for it, (images, cls_t, box_t, pos_mask) in enumerate(loader):
                images = images.cuda(non_blocking=True)
                cls_t, box_t, pos_mask = cls_t.cuda(), box_t.cuda(), pos_mask.cuda()
                loss, cls_l, box_l = self.compute_loss(images, cls_t, box_t, pos_mask)
                self.backward(loss)
                self.step()
                if it % 50 == 0:
                    print(f"ep {epoch} it {it} cls {cls_l.item():.4f} box {box_l.item():.4f}")


def main(loader, anchors):
    model = EfficientDet(CFG)
    Trainer(model, anchors, CFG).fit(loader)
