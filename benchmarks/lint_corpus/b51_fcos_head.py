"""FCOS (anchor-free, one-stage) with a DyHead-style attention stack in front of the towers.
Detectron2-flavoured: the model returns a loss dict in training, an AMP trainer drives it.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.amp import GradScaler, autocast

INF = 100000000


def conv_bn_relu(cin, cout, stride=1):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class TinyBackbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(conv_bn_relu(3, 32, 2), conv_bn_relu(32, 64, 2))
        self.c3 = nn.Sequential(conv_bn_relu(64, 128, 2), conv_bn_relu(128, 128))
        self.c4 = nn.Sequential(conv_bn_relu(128, 256, 2), conv_bn_relu(256, 256))
        self.c5 = nn.Sequential(conv_bn_relu(256, 512, 2), conv_bn_relu(512, 512))

    def forward(self, x):
        c3 = self.c3(self.stem(x))
        c4 = self.c4(c3)
        return c3, c4, self.c5(c4)


class L2Norm(nn.Module):
    """SSD-style channel L2 normalisation with a learned per-channel scale."""

    def __init__(self, channels, scale=20.0):
        super().__init__()
        self.weight = nn.Parameter(torch.full((channels,), scale))

    def forward(self, x):
        norm = x.pow(2).sum(dim=1, keepdim=True).sqrt() + 1e-10
        return self.weight[None, :, None, None] * x / norm


class FPN(nn.Module):
    def __init__(self, in_channels=(128, 256, 512), out_channels=256):
        super().__init__()
        self.c3_norm = L2Norm(in_channels[0])
        self.lateral = nn.ModuleList([nn.Conv2d(c, out_channels, 1) for c in in_channels])
        self.output = nn.ModuleList([nn.Conv2d(out_channels, out_channels, 3, 1, 1)
                                     for _ in in_channels])
        self.p6 = nn.Conv2d(out_channels, out_channels, 3, 2, 1)
        self.p7 = nn.Conv2d(out_channels, out_channels, 3, 2, 1)

    def forward(self, feats):
        c3, c4, c5 = feats
        laterals = [lat(f) for lat, f in zip(self.lateral, (self.c3_norm(c3), c4, c5))]
        for i in range(len(laterals) - 1, 0, -1):
            laterals[i - 1] = laterals[i - 1] + F.interpolate(laterals[i], scale_factor=2.0,
                                                              mode="nearest")
        outs = [conv(lat) for conv, lat in zip(self.output, laterals)]
        # Libra R-CNN balanced feature pyramid: integrate at the P4 size, redistribute residually
        size = outs[1].shape[-2:]
        bsf = torch.stack([F.interpolate(o, size=size, mode="nearest") for o in outs], dim=0).mean(dim=0)  # expect: AMP004
        outs = [o + F.interpolate(bsf, size=o.shape[-2:], mode="nearest") for o in outs]
        p6 = self.p6(outs[-1])
        return outs + [p6, self.p7(F.relu(p6))]


class ScaleAwareAttention(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.fc = nn.Conv2d(channels, 1, 1)

    def forward(self, x):
        ctx = x.mean(dim=(2, 3), keepdim=True)  # expect: AMP004
        return x * F.hardsigmoid(self.fc(F.relu(ctx)))


class TaskAwareAttention(nn.Module):
    """Dynamic ReLU (DyReLU-B) as used in DyHead's task-aware branch."""

    def __init__(self, channels, reduction=4):
        super().__init__()
        self.fc1 = nn.Linear(channels, channels // reduction)
        self.fc2 = nn.Linear(channels // reduction, 4 * channels)
        self.register_buffer("init_v", torch.tensor([1.0, 0.0, 0.0, 0.0]))

    def forward(self, x):
        b, c = x.shape[:2]
        pooled = x.mean(dim=(2, 3))  # expect: AMP004
        theta = 2.0 * torch.sigmoid(self.fc2(F.relu(self.fc1(pooled)))) - 1.0
        coefs = theta.view(b, c, 4) * 0.5 + self.init_v
        a1, b1, a2, b2 = (coefs[..., i, None, None] for i in range(4))
        return torch.max(x * a1 + b1, x * a2 + b2)


class DenseHeadBase(nn.Module):
    """Runs `_forward_level` on every FPN level and collects the outputs."""

    def forward(self, features):
        logits, bbox_reg, ctrness = [], [], []
        for level, feat in enumerate(features):
            cls_l, reg_l, ctr_l = self._forward_level(feat, level)
            logits.append(cls_l)
            bbox_reg.append(reg_l)
            ctrness.append(ctr_l)
        return logits, bbox_reg, ctrness


class FCOSHead(DenseHeadBase):
    def __init__(self, num_classes, channels=256, num_convs=4, strides=(8, 16, 32, 64, 128),
                 prior_weight=0.5):
        super().__init__()
        self.strides = strides
        self.prior_weight = prior_weight
        self.scale_attn = nn.ModuleList([ScaleAwareAttention(channels) for _ in strides])
        self.task_attn = TaskAwareAttention(channels)

        def tower():
            layers = []
            for _ in range(num_convs):
                layers += [nn.Conv2d(channels, channels, 3, 1, 1), nn.GroupNorm(32, channels),
                           nn.ReLU(inplace=True)]
            return nn.Sequential(*layers)

        self.cls_tower, self.bbox_tower = tower(), tower()
        self.cls_logits = nn.Conv2d(channels, num_classes, 3, 1, 1)
        self.bbox_pred = nn.Conv2d(channels, 4, 3, 1, 1)
        self.ctrness = nn.Conv2d(channels, 1, 3, 1, 1)
        nn.init.constant_(self.cls_logits.bias, -math.log((1 - 0.01) / 0.01))

    def _forward_level(self, feat, level):
        feat = self.task_attn(self.scale_attn[level](feat))
        cls_t, box_t = self.cls_tower(feat), self.bbox_tower(feat)
        reg = F.relu(self.bbox_pred(box_t))  # normalised by the level's stride
        lr, tb = reg[:, 0::2], reg[:, 1::2]
        ctr_prior = torch.sqrt(lr.amin(1) / (lr.amax(1) + 1e-8) * (tb.amin(1) / (tb.amax(1) + 1e-8)))  # expect: AMP011
        ctr = self.ctrness(box_t) + self.prior_weight * ctr_prior.unsqueeze(1)
        return self.cls_logits(cls_t), reg, ctr


def sigmoid_focal_loss(inputs, targets, alpha=0.25, gamma=2.0):
    p = torch.sigmoid(inputs)
    ce_loss = F.binary_cross_entropy_with_logits(inputs, targets, reduction="none")
    p_t = p * targets + (1 - p) * (1 - targets)
    loss = ce_loss * ((1 - p_t) ** gamma)
    alpha_t = alpha * targets + (1 - alpha) * (1 - targets)
    return (alpha_t * loss).sum()


def giou_loss(pred, target, weight):
    pl, pt, pr, pb = pred.unbind(-1)
    tl, tt, tr, tb = target.unbind(-1)
    target_area = (tl + tr) * (tt + tb)
    pred_area = (pl + pr) * (pt + pb)
    w_i, h_i = torch.min(pl, tl) + torch.min(pr, tr), torch.min(pb, tb) + torch.min(pt, tt)
    g_w, g_h = torch.max(pl, tl) + torch.max(pr, tr), torch.max(pb, tb) + torch.max(pt, tt)
    area_i = w_i * h_i
    area_u = target_area + pred_area - area_i
    ious = (area_i + 1.0) / (area_u + 1.0)
    enclose = g_w * g_h + 1e-7
    gious = ious - (enclose - area_u) / enclose
    return ((1.0 - gious) * weight).sum()


class FCOS(nn.Module):
    def __init__(self, num_classes=80, strides=(8, 16, 32, 64, 128)):
        super().__init__()
        self.backbone = TinyBackbone()
        self.fpn = FPN()
        self.head = FCOSHead(num_classes, strides=strides)
        self.strides = strides
        self.num_classes = num_classes
        self.sizes = [[-1, 64], [64, 128], [128, 256], [256, 512], [512, INF]]

    def locations(self, features):
        locs = []
        for stride, f in zip(self.strides, features):
            h, w = f.shape[-2:]
            ys, xs = torch.meshgrid(torch.arange(h, device=f.device), torch.arange(w, device=f.device),
                                    indexing="ij")
            locs.append(torch.stack([xs.reshape(-1), ys.reshape(-1)], 1).float() * stride + stride // 2)
        return locs

    @torch.no_grad()
    def compute_targets(self, locs, boxes, labels):
        sizes = torch.cat([loc.new_tensor(s).expand(len(loc), 2) for loc, s in zip(locs, self.sizes)])
        strides = torch.cat([loc.new_full((len(loc),), s) for loc, s in zip(locs, self.strides)])
        xs, ys = torch.cat(locs).unbind(1)
        l = xs[:, None] - boxes[:, 0][None]
        t = ys[:, None] - boxes[:, 1][None]
        r = boxes[:, 2][None] - xs[:, None]
        b = boxes[:, 3][None] - ys[:, None]
        reg = torch.stack([l, t, r, b], dim=2)
        in_box = reg.min(dim=2).values > 0
        max_reg = reg.max(dim=2).values
        in_level = (max_reg >= sizes[:, [0]]) & (max_reg <= sizes[:, [1]])
        areas = ((boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]))[None].repeat(len(xs), 1)
        areas[~in_box] = INF
        areas[~in_level] = INF
        min_area, inds = areas.min(dim=1)
        cls_t = labels[inds]
        cls_t[min_area == INF] = self.num_classes
        return cls_t, reg[torch.arange(len(xs)), inds] / strides[:, None]

    def forward(self, images, targets=None):
        features = self.fpn(self.backbone(images))
        logits, bbox_reg, ctrness = self.head(features)
        if not self.training:
            return self.inference(logits, bbox_reg, ctrness, features)
        locs = self.locations(features)
        flat = lambda xs, c: torch.cat([x.permute(0, 2, 3, 1).reshape(x.shape[0], -1, c) for x in xs], 1)
        cls_p, reg_p, ctr_p = flat(logits, self.num_classes), flat(bbox_reg, 4), flat(ctrness, 1)
        cls_loss, reg_loss, ctr_loss, num_pos = 0.0, 0.0, 0.0, 0
        for i, (boxes, labels) in enumerate(targets):
            cls_t, reg_t = self.compute_targets(locs, boxes, labels)
            pos = cls_t != self.num_classes
            onehot = F.one_hot(cls_t, self.num_classes + 1)[:, : self.num_classes].float()
            cls_loss = cls_loss + sigmoid_focal_loss(cls_p[i], onehot)
            lr, tb = reg_t[pos][:, 0::2], reg_t[pos][:, 1::2]
            ctr_t = torch.sqrt((lr.min(-1).values / lr.max(-1).values)
                               * (tb.min(-1).values / tb.max(-1).values))
            reg_loss = reg_loss + giou_loss(reg_p[i][pos], reg_t[pos], ctr_t) / (ctr_t.sum() + 1e-6)
            ctr_loss = ctr_loss + F.binary_cross_entropy_with_logits(ctr_p[i][pos, 0], ctr_t, reduction="sum")
            num_pos += int(pos.sum())
        num_pos = max(float(num_pos), 1.0)
        return {"loss_cls": cls_loss / num_pos, "loss_box": reg_loss, "loss_ctr": ctr_loss / num_pos}

    @torch.no_grad()
    def inference(self, logits, bbox_reg, ctrness, features, thresh=0.05):
        results = []
        for cls_l, reg_l, ctr_l, stride in zip(logits, bbox_reg, ctrness, self.strides):
            scores = torch.sqrt(cls_l.sigmoid() * ctr_l.sigmoid())
            results.append((scores.flatten(2), reg_l.flatten(2) * stride))
        return results


class AMPTrainer:
    def __init__(self, model, data_loader, optimizer, max_iter):
        self.model, self.optimizer, self.max_iter = model, optimizer, max_iter
        self.data_loader = data_loader
        self._data_loader_iter = iter(data_loader)
        self.grad_scaler = GradScaler("cuda")

    def run_step(self):
        images, targets = next(self._data_loader_iter)
        with autocast("cuda", dtype=torch.float16):
            loss_dict = self.model(images.cuda(non_blocking=True), targets)
            losses = sum(loss_dict.values())
            self.optimizer.zero_grad()
            self.grad_scaler.scale(losses).backward()  # expect: AMP008
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()
        return {k: v.detach().item() for k, v in loss_dict.items()}

    def train(self):
        self.model.train()
        for it in range(self.max_iter):
            metrics = self.run_step()
            if it % 20 == 0:
                print(it, " ".join(f"{k}={v:.3f}" for k, v in metrics.items()))


def build_trainer(data_loader, max_iter=90000, base_lr=0.01):
    model = FCOS().cuda()
    params = [{"params": [p for n, p in model.named_parameters() if "norm" not in n]},
              {"params": [p for n, p in model.named_parameters() if "norm" in n], "weight_decay": 0.0}]
    optimizer = torch.optim.SGD(params, lr=base_lr, momentum=0.9, weight_decay=1e-4)
    return AMPTrainer(model, data_loader, optimizer, max_iter)
