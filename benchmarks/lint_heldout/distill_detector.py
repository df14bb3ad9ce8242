"""Knowledge distillation for a detector: big teacher -> small student."""
import copy
from typing import List

import torch
import torch.nn as nn
import torch.nn.functional as F

from det.models import build_detector
from det.losses import DetectionLoss
from det.data import build_train_loader


class Distiller:
    def __init__(self, cfg):
        self.cfg = cfg
        self.teacher = build_detector(cfg.teacher).cuda()
        self.teacher.load_state_dict(torch.load(cfg.teacher_ckpt, map_location="cpu"))
        # the teacher only runs forward: keep it in fp16 to save memory
        self.teacher = self.teacher.half().eval()
        for p in self.teacher.parameters():
            p.requires_grad_(False)
        self.student = build_detector(cfg.student).cuda()
        self.det_loss = DetectionLoss(cfg)
        self.optimizer = torch.optim.SGD(self.student.parameters(), lr=cfg.lr, momentum=0.9, weight_decay=5e-4)
        self.scaler = torch.amp.GradScaler("cuda")
        self.ema = copy.deepcopy(self.student).eval()

    @torch.no_grad()
    def teacher_features(self, images: torch.Tensor) -> List[torch.Tensor]:
        return self.teacher.backbone(images.half())

    def feature_kd(self, s_feats, t_feats):
        return sum(F.mse_loss(s, t.float()) for s, t in zip(s_feats, t_feats)) / len(s_feats)

    def train_step(self, images, targets):
        t_feats = self.teacher_features(images)
        with torch.autocast("cuda", dtype=torch.float16):
            s_feats = self.student.backbone(images)
            preds = self.student.head(s_feats)
            loss = self.det_loss(preds, targets) + self.cfg.kd_weight * self.feature_kd(s_feats, t_feats)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self._update_ema()
        return loss.detach()

    @torch.no_grad()
    def _update_ema(self, decay=0.9998):
        for e, s in zip(self.ema.state_dict().values(), self.student.state_dict().values()):
            if e.dtype.is_floating_point:
                e.mul_(decay).add_(s.detach(), alpha=1 - decay)

    def export(self, path):
        deploy = copy.deepcopy(self.ema).half()
        torch.save(deploy.state_dict(), path)


def self_distill_round(model: nn.Module, loader, rounds: int = 3, lr: float = 0.01):
    """Born-again networks: each generation learns from the previous one."""
    for r in range(rounds):
        teacher = model.eval()
        student = copy.deepcopy(model).half().train()  # expect: AMP001
        opt = torch.optim.SGD(student.parameters(), lr=lr, momentum=0.9)
        for images, targets in loader:
            images = images.cuda().type(torch.cuda.HalfTensor)  # expect: AMP001
            with torch.no_grad():
                soft = teacher(images.float()).softmax(-1)
            logits = student(images)
            loss = F.kl_div(logits.float().log_softmax(-1), soft, reduction="batchmean")
            opt.zero_grad()
            loss.backward()
            opt.step()
        model = student


def train(cfg):
    distiller = Distiller(cfg)
    loader = build_train_loader(cfg)
    for epoch in range(cfg.epochs):
        for images, targets in loader:
            images = images.cuda(non_blocking=True)
            targets = [{k: v.cuda() for k, v in t.items()} for t in targets]
            distiller.train_step(images, targets)
        distiller.export(f"student_ep{epoch}_fp16.pth")
