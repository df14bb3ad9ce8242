"""Detectron2-style SimpleTrainer/AMPTrainer hierarchy driving a small FCOS-like detector defined in the same file."""
import logging
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.cuda.amp import GradScaler
from torchvision.ops import generalized_box_iou_loss, sigmoid_focal_loss

INF = 100000000
logger = logging.getLogger(__name__)


class TinyBackbone(nn.Module):
    def __init__(self, width=128):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 4, 3), nn.ReLU())
        self.c3 = nn.Sequential(nn.Conv2d(width, width, 3, 2, 1), nn.ReLU())
        self.c4 = nn.Sequential(nn.Conv2d(width, width, 3, 2, 1), nn.ReLU())
        self.c5 = nn.Sequential(nn.Conv2d(width, width, 3, 2, 1), nn.ReLU())

    def forward(self, x):
        c3 = self.c3(self.stem(x))
        c4 = self.c4(c3)
        return [c3, c4, self.c5(c4)]


class FCOSHead(nn.Module):
    def __init__(self, in_channels, num_classes, num_convs=2):
        super().__init__()
        def tower():
            layers = []
            for _ in range(num_convs):
                layers += [nn.Conv2d(in_channels, in_channels, 3, padding=1), nn.GroupNorm(32, in_channels), nn.ReLU()]
            return nn.Sequential(*layers)
        self.cls_tower, self.bbox_tower = tower(), tower()
        self.cls_logits = nn.Conv2d(in_channels, num_classes, 3, padding=1)
        self.bbox_pred = nn.Conv2d(in_channels, 4, 3, padding=1)
        self.centerness = nn.Conv2d(in_channels, 1, 3, padding=1)
        self.centerness_loss = nn.BCELoss(reduction="sum")


def compute_ctrness_targets(reg_targets):
    lr, tb = reg_targets[:, [0, 2]], reg_targets[:, [1, 3]]
    ctr = (lr.min(dim=-1)[0] / lr.max(dim=-1)[0]) * (tb.min(dim=-1)[0] / tb.max(dim=-1)[0])
    return torch.sqrt(ctr)


class TinyFCOS(nn.Module):
    def __init__(self, num_classes=80, strides=(8, 16, 32), width=128):
        super().__init__()
        self.num_classes = num_classes
        self.strides = strides
        self.backbone = TinyBackbone(width)
        self.head = FCOSHead(width, num_classes)
        self.register_buffer("pixel_mean", torch.tensor([103.53, 116.28, 123.675]).view(-1, 1, 1), False)
        self.register_buffer("pixel_std", torch.tensor([57.375, 57.12, 58.395]).view(-1, 1, 1), False)

    def locations(self, features):
        locs = []
        for feat, s in zip(features, self.strides):
            h, w = feat.shape[-2:]
            ys, xs = torch.meshgrid(torch.arange(h, device=feat.device), torch.arange(w, device=feat.device), indexing="ij")
            locs.append(torch.stack([xs.reshape(-1), ys.reshape(-1)], dim=1).float() * s + s // 2)
        return torch.cat(locs)

    def forward(self, batched_inputs):
        images = torch.stack([x["image"].to(self.pixel_mean.device) for x in batched_inputs])
        images = (images - self.pixel_mean) / self.pixel_std
        features = self.backbone(images)
        logits, bbox_reg, ctrness = [], [], []
        for feat in features:
            t = self.head.cls_tower(feat)
            b = self.head.bbox_tower(feat)
            logits.append(self.head.cls_logits(t).flatten(2))
            bbox_reg.append(F.relu(self.head.bbox_pred(b)).flatten(2))
            ctrness.append(self.head.centerness(b).flatten(2))
        cls_logits = torch.cat(logits, dim=2).transpose(1, 2)
        bbox_reg = torch.cat(bbox_reg, dim=2).transpose(1, 2)
        ctrness = torch.cat(ctrness, dim=2).transpose(1, 2).squeeze(-1)
        locations = self.locations(features)
        valid = torch.stack([(locations[:, 0] < x["width"]) & (locations[:, 1] < x["height"]) for x in batched_inputs])
        cls_logits = torch.where(valid[..., None], cls_logits, torch.tensor(-1e9, device=cls_logits.device))  # expect: AMP007
        if self.training:
            targets = self.compute_targets(locations, [x["instances"] for x in batched_inputs])
            return self.losses(cls_logits, bbox_reg, ctrness, targets)
        return cls_logits.sigmoid(), bbox_reg, ctrness.sigmoid()

    @torch.no_grad()
    def compute_targets(self, locations, gt_instances):
        labels, reg_targets = [], []
        xs, ys = locations[:, 0], locations[:, 1]
        for inst in gt_instances:
            boxes = inst["boxes"]
            reg = torch.stack([xs[:, None] - boxes[:, 0], ys[:, None] - boxes[:, 1],
                               boxes[:, 2] - xs[:, None], boxes[:, 3] - ys[:, None]], dim=2)
            is_in_boxes = reg.min(dim=2).values > 0
            areas = ((boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]))[None].repeat(len(locations), 1)
            areas[~is_in_boxes] = INF
            min_area, idx = areas.min(dim=1)
            lab = inst["classes"][idx]
            lab[min_area == INF] = self.num_classes
            labels.append(lab)
            reg_targets.append(reg[torch.arange(len(locations)), idx])
        return torch.stack(labels), torch.stack(reg_targets)

    def losses(self, cls_logits, bbox_reg, ctrness, targets):
        labels, reg_targets = targets
        pos = labels != self.num_classes
        num_pos = max(pos.sum().item(), 1.0)
        gt = F.one_hot(labels, self.num_classes + 1)[..., :-1].to(cls_logits.dtype)
        loss_cls = sigmoid_focal_loss(cls_logits, gt, alpha=0.25, gamma=2.0, reduction="sum") / num_pos
        ctr_prob = torch.sigmoid(ctrness[pos])
        loss_ctr = self.head.centerness_loss(ctr_prob, compute_ctrness_targets(reg_targets[pos])) / num_pos  # expect: AMP003
        loss_box = generalized_box_iou_loss(bbox_reg[pos], reg_targets[pos], reduction="sum") / num_pos
        return {"loss_cls": loss_cls, "loss_box_reg": loss_box, "loss_centerness": loss_ctr}


class TrainerBase:
    def __init__(self):
        self.iter = 0
        self.max_iter = 0

    def train(self, start_iter, max_iter):
        self.max_iter = max_iter
        logger.info("Starting training from iteration %d", start_iter)
        for self.iter in range(start_iter, max_iter):
            self.run_step()

    def run_step(self):
        raise NotImplementedError


class SimpleTrainer(TrainerBase):
    def __init__(self, model, data_loader, optimizer, clip_norm=0.0):
        super().__init__()
        model.train()
        self.model = model
        self.data_loader = data_loader
        self._data_loader_iter = iter(data_loader)
        self.optimizer = optimizer
        self.clip_norm = clip_norm

    def _clip_grads(self):
        if self.clip_norm <= 0:
            return None
        params = [p for p in self.model.parameters() if p.requires_grad and p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm=self.clip_norm)

    def run_step(self):
        start = time.perf_counter()
        data = next(self._data_loader_iter)
        data_time = time.perf_counter() - start
        loss_dict = self.model(data)
        losses = sum(loss_dict.values())
        self.optimizer.zero_grad()
        losses.backward()
        self._clip_grads()
        self.optimizer.step()
        self._write_metrics(loss_dict, data_time)

    def _write_metrics(self, loss_dict, data_time):
        if self.iter % 20 == 0:
            metrics = {k: v.detach().float().item() for k, v in loss_dict.items()}
            logger.info("iter %d: %s data_time=%.3f", self.iter, metrics, data_time)


class AMPTrainer(SimpleTrainer):
    """Like SimpleTrainer, but uses autocast and a GradScaler (historically torch.cuda.amp.GradScaler)."""

    def __init__(self, model, data_loader, optimizer, clip_norm=0.0, grad_scaler=None, precision=torch.float16):
        super().__init__(model, data_loader, optimizer, clip_norm)
        if grad_scaler is None:
            grad_scaler = GradScaler()  # expect: AMP009
        self.grad_scaler = grad_scaler
        self.precision = precision

    def run_step(self):
        assert self.model.training, "[AMPTrainer] model was changed to eval mode!"
        start = time.perf_counter()
        data = next(self._data_loader_iter)
        data_time = time.perf_counter() - start
        with torch.autocast("cuda", dtype=self.precision):
            loss_dict = self.model(data)
            losses = sum(loss_dict.values())
        self.optimizer.zero_grad()
        self.grad_scaler.scale(losses).backward()
        self._clip_grads()  # expect: AMP005
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()
        self._write_metrics(loss_dict, data_time)

    def state_dict(self):
        return {"iteration": self.iter, "grad_scaler": self.grad_scaler.state_dict()}

    def load_state_dict(self, state_dict):
        if isinstance(self.grad_scaler, GradScaler) and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])


class AccumAMPTrainer(AMPTrainer):
    """Gradient accumulation over `accum_steps` iterations, for high-resolution configs."""

    def __init__(self, *args, accum_steps=2, **kwargs):
        super().__init__(*args, **kwargs)
        self.accum_steps = accum_steps

    def run_step(self):
        data = next(self._data_loader_iter)
        with torch.autocast("cuda", dtype=self.precision):
            loss_dict = self.model(data)
            losses = sum(loss_dict.values()) / self.accum_steps
            torch.autograd.backward(self.grad_scaler.scale(losses))  # expect: AMP008
        if (self.iter + 1) % self.accum_steps == 0:
            self.optimizer.step()  # expect: AMP006
            self.optimizer.zero_grad()
        self._write_metrics(loss_dict, 0.0)


def main(cfg, data_loader):
    model = TinyFCOS(num_classes=cfg["num_classes"]).cuda()
    norm_params, other = [], []
    for m in model.modules():
        for p in m.parameters(recurse=False):
            (norm_params if isinstance(m, nn.GroupNorm) else other).append(p)
    optimizer = torch.optim.SGD([{"params": other, "weight_decay": 1e-4}, {"params": norm_params, "weight_decay": 0.0}],
                                lr=cfg["base_lr"], momentum=0.9)
    if cfg["accum_steps"] > 1:
        trainer = AccumAMPTrainer(model, data_loader, optimizer, clip_norm=cfg["clip_norm"], accum_steps=cfg["accum_steps"])
    elif cfg["amp"]:
        trainer = AMPTrainer(model, data_loader, optimizer, clip_norm=cfg["clip_norm"])
    else:
        trainer = SimpleTrainer(model, data_loader, optimizer, clip_norm=cfg["clip_norm"])
    trainer.train(0, cfg["max_iter"])
    torch.save({"model": model.state_dict(), "iteration": trainer.iter}, "model_final.pth")
