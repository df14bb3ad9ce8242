"""Self-distillation (DINO) with a Barlow-Twins redundancy term and a KoLeo regulariser.

``SSLTrainer.setup`` builds student/teacher, losses, optimizer and scaler;
``train_step`` accumulates gradients over micro-batches of multi-crop views.
The recipe is tuned for fp16 on V100-class GPUs.
"""
import math
import os
from dataclasses import dataclass
from typing import List, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class SSLConfig:
    width: int = 64
    feat_dim: int = 512
    out_dim: int = 65536
    bottleneck_dim: int = 256
    embed_dim: int = 128
    proj_dim: int = 2048
    ncrops: int = 10
    student_temp: float = 0.1
    teacher_temp: float = 0.04
    center_momentum: float = 0.9
    decorr_weight: float = 0.005
    decorr_lambda: float = 5e-3
    koleo_weight: float = 0.1
    lr: float = 5e-4
    clip_grad: float = 3.0
    freeze_last_layer: int = 1
    accum_steps: int = 2
    epochs: int = 100
    momentum_teacher: float = 0.996


class SSLOutput(NamedTuple):
    logits: torch.Tensor
    embedding: torch.Tensor
    projection: torch.Tensor


def conv_bn(cin, cout, stride):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class DINOHead(nn.Module):
    def __init__(self, in_dim, out_dim, hidden_dim=2048, bottleneck_dim=256):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(in_dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, hidden_dim), nn.GELU(),
                                 nn.Linear(hidden_dim, bottleneck_dim))
        self.last_layer = nn.Linear(bottleneck_dim, out_dim, bias=False)

    def forward(self, x):
        x = F.normalize(self.mlp(x), dim=-1, p=2)
        return self.last_layer(x)


class SSLNet(nn.Module):
    def __init__(self, cfg: SSLConfig):
        super().__init__()
        w = cfg.width
        self.backbone = nn.Sequential(conv_bn(3, w, 2), conv_bn(w, 2 * w, 2), conv_bn(2 * w, 4 * w, 2),
                                      conv_bn(4 * w, cfg.feat_dim, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = DINOHead(cfg.feat_dim, cfg.out_dim, bottleneck_dim=cfg.bottleneck_dim)
        self.embed = nn.Linear(cfg.feat_dim, cfg.embed_dim)
        self.projector = nn.Sequential(nn.Linear(cfg.feat_dim, cfg.proj_dim), nn.BatchNorm1d(cfg.proj_dim),
                                       nn.ReLU(inplace=True), nn.Linear(cfg.proj_dim, cfg.proj_dim))

    def forward(self, x) -> SSLOutput:
        feats = self.backbone(x)
        return SSLOutput(logits=self.head(feats), embedding=self.embed(feats), projection=self.projector(feats))


def build_ssl_net(cfg: SSLConfig) -> SSLNet:
    return SSLNet(cfg)


class DINOLoss(nn.Module):
    def __init__(self, out_dim, ncrops, warmup_teacher_temp, teacher_temp, warmup_epochs, nepochs,
                 student_temp=0.1, center_momentum=0.9):
        super().__init__()
        self.student_temp, self.center_momentum, self.ncrops = student_temp, center_momentum, ncrops
        self.register_buffer("center", torch.zeros(1, out_dim))
        self.teacher_temp_schedule = np.concatenate((np.linspace(warmup_teacher_temp, teacher_temp, warmup_epochs),
                                                     np.ones(nepochs - warmup_epochs) * teacher_temp))

    def forward(self, student_output, teacher_output, epoch):
        student_out = (student_output / self.student_temp).chunk(self.ncrops)
        temp = self.teacher_temp_schedule[epoch]
        teacher_out = F.softmax((teacher_output - self.center) / temp, dim=-1).detach().chunk(2)
        total_loss, n_loss_terms = 0.0, 0
        for iq, q in enumerate(teacher_out):
            for v in range(len(student_out)):
                if v == iq:
                    continue
                loss = torch.sum(-q * F.log_softmax(student_out[v], dim=-1), dim=-1)
                total_loss += loss.mean()
                n_loss_terms += 1
        self.update_center(teacher_output)
        return total_loss / n_loss_terms

    @torch.no_grad()
    def update_center(self, teacher_output):
        batch_center = teacher_output.mean(dim=0, keepdim=True)  # expect: AMP004
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(batch_center)
            batch_center = batch_center / dist.get_world_size()
        self.center = self.center * self.center_momentum + batch_center * (1 - self.center_momentum)


def _standardize(z):
    mu = z.mean(dim=0)  # expect: AMP004
    sigma = z.std(dim=0)  # expect: AMP004
    return (z - mu) / (sigma + 1e-8)  # expect: AMP011


def _cross_correlation(z1, z2):
    return _standardize(z1).T @ _standardize(z2) / z1.shape[0]


def _off_diagonal(c):
    n = c.shape[0]
    return c.flatten()[:-1].view(n - 1, n + 1)[:, 1:].flatten()


class DecorrelationLoss(nn.Module):
    """Barlow-Twins redundancy reduction between the two global views."""

    def __init__(self, lambd=5e-3):
        super().__init__()
        self.lambd = lambd

    def forward(self, z1, z2):
        c = _cross_correlation(z1, z2)
        on_diag = (torch.diagonal(c) - 1).pow(2).sum()
        off_diag = _off_diagonal(c).pow(2).sum()
        return on_diag + self.lambd * off_diag


class KoLeoLoss(nn.Module):
    """Kozachenko-Leonenko entropy estimator on the embeddings (DINOv2), outside autocast."""

    def __init__(self):
        super().__init__()
        self.pdist = nn.PairwiseDistance(2, eps=1e-8)

    @staticmethod
    def pairwise_nn_inner(x):
        dots = torch.mm(x, x.t())
        n = x.shape[0]
        dots.view(-1)[:: (n + 1)].fill_(-1)
        return torch.max(dots, dim=1).indices

    def forward(self, student_output):
        with torch.cuda.amp.autocast(enabled=False):  # expect: AMP009
            x = F.normalize(student_output, eps=1e-8, p=2, dim=-1)  # expect: AMP011
            idx = self.pairwise_nn_inner(x.float())
            distances = self.pdist(x.float(), x[idx].float())
            loss = -torch.log(distances + 1e-8).mean()
        return loss


def get_params_groups(model):
    regularized, not_regularized = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (not_regularized if name.endswith(".bias") or param.ndim == 1 else regularized).append(param)
    return [{"params": regularized}, {"params": not_regularized, "weight_decay": 0.0}]


def clip_gradients(model, clip):
    norms = []
    for p in model.parameters():
        if p.grad is not None:
            param_norm = p.grad.data.norm(2)
            norms.append(param_norm.item())
            clip_coef = clip / (param_norm + 1e-6)
            if clip_coef < 1:
                p.grad.data.mul_(clip_coef)
    return norms


def cancel_gradients_last_layer(epoch, model, freeze_last_layer):
    if epoch < freeze_last_layer:
        for p in model.head.last_layer.parameters():
            p.grad = None


class SSLTrainer:
    def __init__(self, cfg: SSLConfig, loader):
        self.cfg, self.loader = cfg, loader
        self.epoch, self.it = 0, 0

    def setup(self):
        cfg = self.cfg
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        self.student = build_ssl_net(cfg).to(self.device)
        self.teacher = build_ssl_net(cfg).to(self.device)
        self.teacher.load_state_dict(self.student.state_dict())
        self.teacher.requires_grad_(False)
        self.dino_loss = DINOLoss(cfg.out_dim, cfg.ncrops, 0.04, cfg.teacher_temp, 30, cfg.epochs,
                                  cfg.student_temp, cfg.center_momentum).to(self.device)
        self.decorr_loss = DecorrelationLoss(cfg.decorr_lambda)
        self.koleo_loss = KoLeoLoss()
        self.optimizer = torch.optim.AdamW(get_params_groups(self.student), lr=cfg.lr, weight_decay=0.04)
        self.scaler = torch.amp.GradScaler("cuda")
        total = cfg.epochs * len(self.loader) // cfg.accum_steps
        self.momentum_schedule = [1 - (1 - cfg.momentum_teacher) * (math.cos(math.pi * i / total) + 1) / 2 for i in range(total)]

    def _backward(self, loss):
        self.scaler.scale(loss / self.cfg.accum_steps).backward()  # expect: AMP008

    def train_step(self, crops: List[torch.Tensor]):
        cfg = self.cfg
        crops = [c.to(self.device, non_blocking=True) for c in crops]
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            with torch.no_grad():
                t_out = self.teacher(torch.cat(crops[:2]))
            s1, s2 = self.student(crops[0]), self.student(crops[1])
            s_local = self.student(torch.cat(crops[2:]))
            student_logits = torch.cat([s1.logits, s2.logits, s_local.logits])
            loss = self.dino_loss(student_logits, t_out.logits, self.epoch)
            loss = loss + cfg.decorr_weight * self.decorr_loss(s1.projection, s2.projection)
            loss = loss + cfg.koleo_weight * (self.koleo_loss(s1.embedding) + self.koleo_loss(s2.embedding))
            self._backward(loss)
        self.it += 1
        if self.it % cfg.accum_steps == 0:
            self.scaler.unscale_(self.optimizer)
            clip_gradients(self.student, cfg.clip_grad)
            cancel_gradients_last_layer(self.epoch, self.student, cfg.freeze_last_layer)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            self._update_teacher(self.it // cfg.accum_steps - 1)
        return loss.detach()

    @torch.no_grad()
    def _update_teacher(self, step):
        m = self.momentum_schedule[min(step, len(self.momentum_schedule) - 1)]
        for ps, pt in zip(self.student.parameters(), self.teacher.parameters()):
            pt.data.mul_(m).add_((1 - m) * ps.detach().data)

    def fit(self):
        self.setup()
        for self.epoch in range(self.cfg.epochs):
            for crops in self.loader:
                loss = self.train_step(crops)
            print(f"epoch {self.epoch}: loss {loss.item():.4f} scale {self.scaler.get_scale():.0f}")
