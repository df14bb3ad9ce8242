"""Single-stage detector in the mmdet layout: components registered by name, built from config dicts."""
import copy
import inspect
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

INF = 1e8


class Registry:
    def __init__(self, name):
        self._name = name
        self._module_dict = {}

    def get(self, key):
        return self._module_dict.get(key)

    def register_module(self, name=None, force=False):
        def _register(cls):
            key = name or cls.__name__
            if not force and key in self._module_dict:
                raise KeyError(f"{key} is already registered in {self._name}")
            self._module_dict[key] = cls
            return cls
        return _register


def build_from_cfg(cfg, registry, default_args=None):
    args = copy.deepcopy(cfg)
    obj_type = args.pop("type")
    obj_cls = registry.get(obj_type) if isinstance(obj_type, str) else obj_type
    if obj_cls is None or not inspect.isclass(obj_cls):
        raise KeyError(f"{obj_type} is not in the {registry._name} registry")
    for k, v in (default_args or {}).items():
        args.setdefault(k, v)
    return obj_cls(**args)


BACKBONES = Registry("backbone")
NECKS = Registry("neck")
HEADS = Registry("head")
DETECTORS = Registry("detector")

norm_cfg_to_layer = {"BN": nn.BatchNorm2d, "GN": partial(nn.GroupNorm, 32)}


class ConvModule(nn.Module):
    def __init__(self, cin, cout, k=3, stride=1, norm="BN", act=True):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, k, stride, k // 2, bias=norm is None)
        self.norm = norm_cfg_to_layer[norm](cout) if norm else nn.Identity()
        self.act = nn.ReLU(inplace=True) if act else nn.Identity()

    def forward(self, x):
        return self.act(self.norm(self.conv(x)))


@BACKBONES.register_module()
class TinyResNet(nn.Module):
    def __init__(self, depth=18, base=64, out_indices=(1, 2, 3)):
        super().__init__()
        self.stem = ConvModule(3, base, 7, stride=2)
        self.out_indices = out_indices
        chans = [base, base * 2, base * 4, base * 8]
        cin = base
        for i, c in enumerate(chans):
            layer = nn.Sequential(ConvModule(cin, c, stride=1 if i == 0 else 2), ConvModule(c, c))
            self.add_module(f"layer{i + 1}", layer)
            cin = c
        self.out_channels = [chans[i] for i in out_indices]

    def forward(self, x):
        x = F.max_pool2d(self.stem(x), 3, 2, 1)
        outs = []
        for i in range(4):
            x = getattr(self, f"layer{i + 1}")(x)
            if i in self.out_indices:
                outs.append(x)
        return tuple(outs)


@NECKS.register_module()
class FPN(nn.Module):
    def __init__(self, in_channels, out_channels=256):
        super().__init__()
        self.lateral_convs = nn.ModuleList(ConvModule(c, out_channels, 1, norm=None, act=False) for c in in_channels)
        self.fpn_convs = nn.ModuleList(ConvModule(out_channels, out_channels, norm=None, act=False) for _ in in_channels)

    def forward(self, inputs):
        laterals = [conv(x) for conv, x in zip(self.lateral_convs, inputs)]
        for i in range(len(laterals) - 1, 0, -1):
            laterals[i - 1] = laterals[i - 1] + F.interpolate(laterals[i], size=laterals[i - 1].shape[-2:], mode="nearest")
        return tuple(conv(x) for conv, x in zip(self.fpn_convs, laterals))


@NECKS.register_module()
class TokenMixerNeck(FPN):
    """FPN followed by one global self-attention over the coarsest level (padding aware)."""

    def __init__(self, in_channels, out_channels=256, num_heads=8):
        super().__init__(in_channels, out_channels)
        self.num_heads = num_heads
        self.scale = (out_channels // num_heads) ** -0.5
        self.qkv = nn.Linear(out_channels, out_channels * 3)
        self.proj = nn.Linear(out_channels, out_channels)
        self.norm = nn.LayerNorm(out_channels)

    def forward(self, inputs, pad_mask=None):
        outs = list(super().forward(inputs))
        x = outs[-1]
        b, c, h, w = x.shape
        tokens = self.norm(x.flatten(2).transpose(1, 2))
        q, k, v = self.qkv(tokens).reshape(b, h * w, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1)) * self.scale
        if pad_mask is not None:
            key_pad = F.interpolate(pad_mask[:, None].float(), size=(h, w)).flatten(1).bool()
            attn = attn.masked_fill(key_pad[:, None, None, :], -1e9)  # expect: AMP007
        attn = attn.softmax(dim=-1)
        out = (attn @ v).transpose(1, 2).reshape(b, h * w, c)
        outs[-1] = x + self.proj(out).transpose(1, 2).reshape(b, c, h, w)
        return tuple(outs)


@HEADS.register_module()
class FCOSLiteHead(nn.Module):
    def __init__(self, num_classes, in_channels=256, stacked_convs=2, strides=(8, 16, 32), present_classes=None):
        super().__init__()
        self.num_classes = num_classes
        self.strides = strides
        self.cls_convs = nn.Sequential(*[ConvModule(in_channels, in_channels, norm="GN") for _ in range(stacked_convs)])
        self.reg_convs = nn.Sequential(*[ConvModule(in_channels, in_channels, norm="GN") for _ in range(stacked_convs)])
        self.conv_cls = nn.Conv2d(in_channels, num_classes, 3, padding=1)
        self.conv_reg = nn.Conv2d(in_channels, 4, 3, padding=1)
        mask = torch.ones(num_classes, dtype=torch.bool)
        if present_classes is not None:
            mask.zero_()
            mask[list(present_classes)] = True
        self.register_buffer("class_mask", mask, persistent=False)

    def forward_single(self, x):
        cls_score = self.conv_cls(self.cls_convs(x))
        # classes this dataset never annotates must never win the top-k
        cls_score = torch.where(self.class_mask.view(1, -1, 1, 1), cls_score, torch.tensor(-1e9, device=cls_score.device))  # expect: AMP007
        bbox_pred = F.relu(self.conv_reg(self.reg_convs(x)))
        return cls_score, bbox_pred

    def forward(self, feats):
        return tuple(map(list, zip(*[self.forward_single(f) for f in feats])))

    def prior_points(self, cls_scores):
        points = []
        for score, stride in zip(cls_scores, self.strides):
            h, w = score.shape[-2:]
            ys, xs = torch.meshgrid(torch.arange(h, device=score.device), torch.arange(w, device=score.device), indexing="ij")
            points.append(torch.stack((xs.reshape(-1), ys.reshape(-1)), -1).float() * stride + stride // 2)
        return torch.cat(points)

    @torch.no_grad()
    def get_targets(self, points, gt_bboxes, gt_labels):
        xs, ys = points[:, 0][:, None], points[:, 1][:, None]
        left, top = xs - gt_bboxes[:, 0], ys - gt_bboxes[:, 1]
        right, bottom = gt_bboxes[:, 2] - xs, gt_bboxes[:, 3] - ys
        bbox_targets = torch.stack((left, top, right, bottom), -1)
        areas = (gt_bboxes[:, 2] - gt_bboxes[:, 0]) * (gt_bboxes[:, 3] - gt_bboxes[:, 1])
        areas = areas[None].repeat(points.size(0), 1)
        areas[bbox_targets.min(-1).values <= 0] = INF
        min_area, min_area_inds = areas.min(dim=1)
        labels = gt_labels[min_area_inds]
        labels[min_area == INF] = self.num_classes
        return labels, bbox_targets[range(points.size(0)), min_area_inds]

    def loss(self, feats, batch_gt):
        cls_scores, bbox_preds = self(feats)
        flat_cls = torch.cat([s.permute(0, 2, 3, 1).reshape(-1, self.num_classes) for s in cls_scores])
        points = self.prior_points(cls_scores)
        labels = torch.cat([self.get_targets(points, t["bboxes"], t["labels"])[0] for t in batch_gt])
        onehot = F.one_hot(labels.clamp(max=self.num_classes), self.num_classes + 1)[:, :-1].to(flat_cls.dtype)
        ce = F.binary_cross_entropy_with_logits(flat_cls, onehot, reduction="none")
        p = flat_cls.sigmoid()
        p_t = p * onehot + (1 - p) * (1 - onehot)
        num_pos = max(float((labels < self.num_classes).sum()), 1.0)
        loss_cls = (ce * (1 - p_t).pow(2.0)).sum() / num_pos
        loss_bbox = sum(F.smooth_l1_loss(b, torch.zeros_like(b), reduction="sum") for b in bbox_preds) / num_pos
        return {"loss_cls": loss_cls, "loss_bbox": loss_bbox}


class AuxSaliencyMixin:
    """Adds a class-agnostic foreground map supervised from instance masks."""

    def aux_saliency_loss(self, seg_logits, gt_masks):
        prob = seg_logits.sigmoid()
        target = F.interpolate(gt_masks[:, None].float(), size=prob.shape[-2:], mode="nearest")
        losses = {}
        if self.aux_loss_type == "bce":
            losses["loss_aux_bce"] = F.binary_cross_entropy(prob, target)  # expect: AMP003
        else:
            log_p = torch.log(prob + 1e-12)  # expect: AMP011
            log_1mp = torch.log(1.0 - prob + 1e-12)  # expect: AMP011
            focal = -(target * (1.0 - prob).pow(2) * log_p + (1.0 - target) * prob.pow(2) * log_1mp)
            losses["loss_aux_focal"] = focal.mean()
        inter = (prob * target).flatten(1).sum(-1)
        union = prob.flatten(1).sum(-1) + target.flatten(1).sum(-1)
        losses["loss_aux_dice"] = (1 - (2 * inter + 1.0) / (union + 1.0)).mean()
        # keep the map decisive: penalise p * (1 - p)
        losses["loss_aux_conf"] = 0.1 * (prob * (1.0 - prob)).mean()  # expect: AMP004
        return losses


class BaseDetector(nn.Module):
    def __init__(self, init_cfg=None, fp16_enabled=True):
        super().__init__()
        self.init_cfg = init_cfg
        self.fp16_enabled = fp16_enabled

    def forward(self, inputs, data_samples=None, mode="tensor"):
        with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=self.fp16_enabled):
            if mode == "loss":
                return self.loss(inputs, data_samples)
            if mode == "predict":
                return self.predict(inputs, data_samples)
            return self._forward(inputs)

    def loss(self, inputs, data_samples):
        raise NotImplementedError


@DETECTORS.register_module()
class SingleStageDetector(AuxSaliencyMixin, BaseDetector):
    def __init__(self, backbone, neck, bbox_head, aux_channels=0, aux_loss_type="focal", init_cfg=None):
        super().__init__(init_cfg)
        self.aux_loss_type = aux_loss_type
        self.backbone = build_from_cfg(backbone, BACKBONES)
        neck = dict(neck, in_channels=self.backbone.out_channels)
        self.neck = build_from_cfg(neck, NECKS)
        self.bbox_head = build_from_cfg(bbox_head, HEADS)
        self.with_aux = aux_channels > 0
        if self.with_aux:
            self.aux_head = nn.Sequential(ConvModule(256, aux_channels), nn.Conv2d(aux_channels, 1, 1))

    def extract_feat(self, inputs, pad_mask=None):
        feats = self.backbone(inputs)
        return self.neck(feats, pad_mask) if pad_mask is not None else self.neck(feats)

    def loss(self, inputs, data_samples):
        pad_mask = data_samples[0].get("pad_mask") if data_samples else None
        x = self.extract_feat(inputs, pad_mask)
        losses = self.bbox_head.loss(x, data_samples)
        if self.with_aux:
            seg_logits = self.aux_head(x[0])
            gt_masks = torch.stack([s["fg_mask"] for s in data_samples])
            losses.update(self.aux_saliency_loss(seg_logits, gt_masks))
        return losses

    def predict(self, inputs, data_samples):
        cls_scores, bbox_preds = self.bbox_head(self.extract_feat(inputs))
        return [s.sigmoid().flatten(2).max(dim=1) for s in cls_scores], bbox_preds

    def _forward(self, inputs):
        return self.bbox_head(self.extract_feat(inputs))


def parse_losses(losses):
    log_vars = {}
    for name, value in losses.items():
        log_vars[name] = value.mean() if isinstance(value, torch.Tensor) else sum(v.mean() for v in value)
    loss = sum(v for k, v in log_vars.items() if "loss" in k)
    log_vars["loss"] = loss
    return loss, {k: float(v) for k, v in log_vars.items()}


model_cfg = dict(
    type="SingleStageDetector",
    backbone=dict(type="TinyResNet", depth=18),
    neck=dict(type="TokenMixerNeck", out_channels=256),
    bbox_head=dict(type="FCOSLiteHead", num_classes=80),
    aux_channels=64,
)


def build_detector(cfg):
    return build_from_cfg(cfg, DETECTORS)


def train_detector(cfg, data_loader, max_epochs=12):
    model = build_detector(cfg["model"])
    model.cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    scaler = torch.cuda.amp.GradScaler(enabled=cfg.get("fp16", True))  # expect: AMP009
    best_map = -1e9
    for epoch in range(max_epochs):
        model.train()
        for it, data in enumerate(data_loader):
            losses = model(data["inputs"].cuda(non_blocking=True), data["data_samples"], mode="loss")
            loss, log_vars = parse_losses(losses)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if cfg.get("grad_clip"):
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(model.parameters(), **cfg["grad_clip"])
            scaler.step(optimizer)
            scaler.update()
            if it % 50 == 0:
                print(epoch, it, log_vars)
        best_map = max(best_map, evaluate(model, data_loader))
    return model, best_map


@torch.no_grad()
def evaluate(model, data_loader):
    model.eval()
    hits = 0.0
    for data in data_loader:
        scores, _ = model(data["inputs"].cuda(), data["data_samples"], mode="predict")
        hits += sum(s.values.mean().item() for s in scores)
    return hits / max(len(data_loader), 1)
