"""Embedding heads and objectives for metric / self-supervised learning.

Supervised re-identification uses a margin head (ArcFace or CosFace) plus a
batch-hard triplet term; self-supervised pre-training uses SimCLR, VICReg,
Barlow Twins or DINO. Backbones come from ``reid.backbones``.
"""
import argparse
import logging
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModel

from reid.backbones import build_backbone
from reid.data import build_ssl_loader, build_reid_loader
from reid.utils import cosine_scheduler, save_on_master

logger = logging.getLogger("reid")


class ProjectionHead(nn.Module):
    def __init__(self, in_dim, hidden_dim=2048, out_dim=256, num_layers=3, last_bn=False):
        super().__init__()
        layers = []
        dim = in_dim
        for _ in range(num_layers - 1):
            layers += [nn.Linear(dim, hidden_dim, bias=False), nn.BatchNorm1d(hidden_dim), nn.ReLU(inplace=True)]
            dim = hidden_dim
        layers.append(nn.Linear(dim, out_dim, bias=not last_bn))
        if last_bn:
            layers.append(nn.BatchNorm1d(out_dim, affine=False))
        self.mlp = nn.Sequential(*layers)

    def forward(self, x):
        return self.mlp(x)


class ArcMarginProduct(nn.Module):
    def __init__(self, in_features, num_classes, s=30.0, m=0.50, easy_margin=False):
        super().__init__()
        self.s = s
        self.easy_margin = easy_margin
        self.weight = nn.Parameter(torch.empty(num_classes, in_features))
        nn.init.xavier_uniform_(self.weight)
        self.cos_m, self.sin_m = math.cos(m), math.sin(m)
        self.th = math.cos(math.pi - m)
        self.mm = math.sin(math.pi - m) * m

    def forward(self, emb, labels=None):
        cosine = F.linear(F.normalize(emb), F.normalize(self.weight))
        if labels is None:
            return cosine * self.s
        sine = torch.sqrt((1.0 - cosine.pow(2)).clamp(0, 1))
        phi = cosine * self.cos_m - sine * self.sin_m
        if self.easy_margin:
            phi = torch.where(cosine > 0, phi, cosine)
        else:
            phi = torch.where(cosine > self.th, phi, cosine - self.mm)
        one_hot = F.one_hot(labels, cosine.size(1)).to(phi.dtype)
        return (one_hot * phi + (1.0 - one_hot) * cosine) * self.s


class CosFaceHead(nn.Module):
    """Large-margin cosine head (Wang et al., 2018)."""

    def __init__(self, in_features, num_classes, s=30.0, m=0.35):
        super().__init__()
        self.s, self.m = s, m
        self.weight = nn.Parameter(torch.empty(num_classes, in_features))
        nn.init.normal_(self.weight, std=0.01)

    def forward(self, emb, labels=None):
        emb_norm = emb.norm(p=2, dim=1, keepdim=True)
        w_norm = self.weight.norm(p=2, dim=1, keepdim=True)
        cosine = torch.mm(emb, self.weight.t()) / (torch.mm(emb_norm, w_norm.t()) + 1e-8)  # expect: AMP011
        if labels is None:
            return self.s * cosine
        one_hot = torch.zeros_like(cosine).scatter_(1, labels.view(-1, 1), 1.0)
        return self.s * (cosine - one_hot * self.m)


class BatchHardTripletLoss(nn.Module):
    def __init__(self, margin=0.3):
        super().__init__()
        self.ranking = nn.MarginRankingLoss(margin=margin)

    def forward(self, emb, labels):
        emb = emb.float()
        dist = torch.cdist(emb, emb, p=2)
        same = labels.unsqueeze(0) == labels.unsqueeze(1)
        dist_ap = dist.masked_fill(~same, 0.0).amax(dim=1)
        dist_an = dist.masked_fill(same, 1e9).amin(dim=1)
        return self.ranking(dist_an, dist_ap, torch.ones_like(dist_an))


class NTXentLoss(nn.Module):
    def __init__(self, temperature=0.1):
        super().__init__()
        self.temperature = temperature

    def forward(self, z1, z2):
        n = z1.size(0)
        z = F.normalize(torch.cat([z1, z2], dim=0), dim=1)
        sim = torch.matmul(z, z.t()) / self.temperature
        self_mask = torch.eye(2 * n, dtype=torch.bool, device=sim.device)
        sim = sim.masked_fill(self_mask, -9e15)  # expect: AMP007
        targets = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]).to(sim.device)
        return F.cross_entropy(sim, targets)


def off_diagonal(x):
    n, m = x.shape
    assert n == m
    return x.flatten()[:-1].view(n - 1, n + 1)[:, 1:].flatten()


class VICRegLoss(nn.Module):
    def __init__(self, sim_coeff=25.0, std_coeff=25.0, cov_coeff=1.0):
        super().__init__()
        self.sim_coeff, self.std_coeff, self.cov_coeff = sim_coeff, std_coeff, cov_coeff

    def forward(self, x, y):
        n, d = x.shape
        repr_loss = F.mse_loss(x, y)
        x = x - x.mean(dim=0)  # expect: AMP004
        y = y - y.mean(dim=0)  # expect: AMP004
        std_x = torch.sqrt(x.float().var(dim=0) + 1e-4)
        std_y = torch.sqrt(y.float().var(dim=0) + 1e-4)
        std_loss = torch.mean(F.relu(1 - std_x)) / 2 + torch.mean(F.relu(1 - std_y)) / 2
        cov_x = (x.T @ x) / (n - 1)
        cov_y = (y.T @ y) / (n - 1)
        cov_loss = off_diagonal(cov_x).pow_(2).sum().div(d) + off_diagonal(cov_y).pow_(2).sum().div(d)
        return self.sim_coeff * repr_loss + self.std_coeff * std_loss + self.cov_coeff * cov_loss


class BarlowTwinsLoss(nn.Module):
    def __init__(self, dim, lambd=0.0051):
        super().__init__()
        self.lambd = lambd
        self.bn = nn.BatchNorm1d(dim, affine=False)

    def forward(self, z1, z2):
        c = self.bn(z1).T @ self.bn(z2)
        c.div_(z1.size(0))
        on_diag = torch.diagonal(c).add_(-1).pow_(2).sum()
        off_diag = off_diagonal(c).pow_(2).sum()
        return on_diag + self.lambd * off_diag


SSL_LOSSES = {
    "simclr": lambda args: NTXentLoss(args.temperature),
    "vicreg": lambda args: VICRegLoss(),
    "barlow": lambda args: BarlowTwinsLoss(args.proj_dim),
}


class DINOHead(nn.Module):
    def __init__(self, in_dim, out_dim, hidden_dim=2048, bottleneck_dim=256):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(in_dim, hidden_dim), nn.GELU(),
            nn.Linear(hidden_dim, hidden_dim), nn.GELU(),
            nn.Linear(hidden_dim, bottleneck_dim),
        )
        self.last_layer = nn.Linear(bottleneck_dim, out_dim, bias=False)

    def forward(self, x):
        x = self.mlp(x)
        x = F.normalize(x, dim=-1, p=2)
        return self.last_layer(x)


class MultiCropWrapper(nn.Module):
    def __init__(self, backbone, head):
        super().__init__()
        self.backbone = backbone
        self.head = head

    def forward(self, crops):
        feats = torch.cat([self.backbone(c) for c in crops])
        return self.head(feats)


class DINOLoss(nn.Module):
    def __init__(self, out_dim, ncrops, warmup_teacher_temp, teacher_temp, warmup_epochs, nepochs,
                 student_temp=0.1, center_momentum=0.9):
        super().__init__()
        self.student_temp = student_temp
        self.center_momentum = center_momentum
        self.ncrops = ncrops
        self.register_buffer("center", torch.zeros(1, out_dim))
        self.teacher_temp_schedule = np.concatenate((
            np.linspace(warmup_teacher_temp, teacher_temp, warmup_epochs),
            np.ones(nepochs - warmup_epochs) * teacher_temp,
        ))

    def forward(self, student_output, teacher_output, epoch):
        student_out = (student_output / self.student_temp).chunk(self.ncrops)
        temp = self.teacher_temp_schedule[epoch]
        teacher_out = F.softmax((teacher_output - self.center) / temp, dim=-1).detach().chunk(2)
        total_loss, n_terms = 0.0, 0
        for iq, q in enumerate(teacher_out):
            for v in range(len(student_out)):
                if v == iq:
                    continue
                loss = torch.sum(-q * F.log_softmax(student_out[v], dim=-1), dim=-1)
                total_loss += loss.mean()
                n_terms += 1
        self.update_center(teacher_output)
        return total_loss / n_terms

    @torch.no_grad()
    def update_center(self, teacher_output):
        batch_center = teacher_output.mean(dim=0, keepdim=True)  # expect: AMP004
        self.center = self.center * self.center_momentum + batch_center * (1 - self.center_momentum)


def build_text_tower(args):
    """Text encoder + its optimizer for the image-text alignment stage (see train_align.py)."""
    text_encoder = AutoModel.from_pretrained(args.text_model, torch_dtype=torch.float16)  # expect: AMP001
    decay = [p for n, p in text_encoder.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in text_encoder.named_parameters() if p.ndim < 2]
    text_optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=args.text_lr)  # expect: AMP011
    return text_encoder, text_optimizer


def train_reid_epoch(backbone, neck, margin_head, triplet, loader, optimizer, scaler, args):
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    backbone.train()
    for it, (images, labels) in enumerate(loader):
        images, labels = images.cuda(non_blocking=True), labels.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            emb = neck(backbone(images))
            logits = margin_head(emb, labels)
            tri_loss = triplet(emb, labels)
        id_loss = criterion(logits, labels)  # expect: AMP002
        loss = id_loss + args.triplet_weight * tri_loss
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(list(backbone.parameters()) + list(neck.parameters()), args.clip_grad)
        scaler.step(optimizer)
        scaler.update()
        if it % args.print_freq == 0:
            acc = (logits.argmax(1) == labels).float().mean().item()
            logger.info("it %d id %.3f tri %.3f acc %.3f", it, id_loss.item(), tri_loss.item(), acc)


def train_ssl_epoch(backbone, projector, criterion, loader, optimizer, scaler, args):
    for it, ((x1, x2), _) in enumerate(loader):
        x1, x2 = x1.cuda(non_blocking=True), x2.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            z1 = projector(backbone(x1))
            z2 = projector(backbone(x2))
            loss = criterion(z1, z2)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if it % args.print_freq == 0:
            logger.info("it %d %s loss %.4f", it, args.method, loss.item())


def train_dino_epoch(student, teacher, dino_loss, loader, optimizer, scaler, momentum_schedule, epoch, args):
    for it, (crops, _) in enumerate(loader):
        crops = [c.cuda(non_blocking=True) for c in crops]
        with torch.autocast("cuda", dtype=torch.float16, enabled=scaler is not None):
            teacher_output = teacher(crops[:2])
            student_output = student(crops)
            loss = dino_loss(student_output, teacher_output, epoch)
        optimizer.zero_grad()
        if scaler is None:
            loss.backward()
            nn.utils.clip_grad_norm_(student.parameters(), args.clip_grad)
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            if args.clip_grad:
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(student.parameters(), args.clip_grad)
            scaler.step(optimizer)
            scaler.update()
        with torch.no_grad():
            m = momentum_schedule[epoch * len(loader) + it]
            for ps, pt in zip(student.parameters(), teacher.parameters()):
                pt.data.mul_(m).add_((1 - m) * ps.detach().data)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", choices=["reid", "dino"] + sorted(SSL_LOSSES), default="reid")
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--margin-head", choices=["arcface", "cosface"], default="arcface")
    parser.add_argument("--num-classes", type=int, default=751)
    parser.add_argument("--proj-dim", type=int, default=8192)
    parser.add_argument("--temperature", type=float, default=0.1)
    parser.add_argument("--epochs", type=int, default=120)
    parser.add_argument("--lr", type=float, default=3.5e-4)
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--label-smoothing", type=float, default=0.1)
    parser.add_argument("--triplet-weight", type=float, default=1.0)
    parser.add_argument("--clip-grad", type=float, default=3.0)
    parser.add_argument("--print-freq", type=int, default=50)
    parser.add_argument("--no-amp", dest="amp", action="store_false")
    args = parser.parse_args()

    backbone, feat_dim = build_backbone(args.arch)
    backbone = backbone.cuda()
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)

    if args.method == "reid":
        loader = build_reid_loader(args)
        neck = ProjectionHead(feat_dim, 1024, 512, num_layers=2).cuda()
        head_cls = ArcMarginProduct if args.margin_head == "arcface" else CosFaceHead
        margin_head = head_cls(512, args.num_classes).cuda()
        params = list(backbone.parameters()) + list(neck.parameters()) + list(margin_head.parameters())
        optimizer = torch.optim.Adam(params, lr=args.lr, weight_decay=args.weight_decay)
        for epoch in range(args.epochs):
            train_reid_epoch(backbone, neck, margin_head, BatchHardTripletLoss(0.3), loader, optimizer, scaler, args)
            save_on_master({"backbone": backbone.state_dict(), "neck": neck.state_dict(), "epoch": epoch}, "reid.pth")
    elif args.method == "dino":
        loader = build_ssl_loader(args, multi_crop=True)
        student = MultiCropWrapper(backbone, DINOHead(feat_dim, 65536)).cuda()
        teacher_backbone, _ = build_backbone(args.arch)
        teacher = MultiCropWrapper(teacher_backbone, DINOHead(feat_dim, 65536)).cuda()
        teacher.load_state_dict(student.state_dict())
        for p in teacher.parameters():
            p.requires_grad = False
        dino_loss = DINOLoss(65536, 10, 0.04, 0.07, 30, args.epochs).cuda()
        optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr)
        momentum_schedule = cosine_scheduler(0.996, 1.0, args.epochs, len(loader))
        for epoch in range(args.epochs):
            train_dino_epoch(student, teacher, dino_loss, loader, optimizer, scaler, momentum_schedule, epoch, args)
    else:
        loader = build_ssl_loader(args, multi_crop=False)
        projector = ProjectionHead(feat_dim, args.proj_dim, args.proj_dim).cuda()
        criterion = SSL_LOSSES[args.method](args).cuda()
        optimizer = torch.optim.SGD(list(backbone.parameters()) + list(projector.parameters()), lr=args.lr, momentum=0.9)
        for epoch in range(args.epochs):
            train_ssl_epoch(backbone, projector, criterion, loader, optimizer, scaler, args)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main()
