"""Face-recognition metric learning: ArcFace margin head + center loss + batch-hard triplet term (insightface-like trainer)."""
import copy
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import clip_grad_value_ as clip_value


class ArcMarginProduct(nn.Module):
    def __init__(self, in_features, out_features, s=64.0, m=0.50, easy_margin=False):
        super().__init__()
        self.s, self.m = s, m
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        nn.init.xavier_uniform_(self.weight)
        self.easy_margin = easy_margin
        self.cos_m, self.sin_m = math.cos(m), math.sin(m)
        self.th = math.cos(math.pi - m)
        self.mm = math.sin(math.pi - m) * m

    def forward(self, x, label):
        cosine = F.linear(F.normalize(x), F.normalize(self.weight))
        sine = torch.sqrt((1.0 - torch.pow(cosine, 2)).clamp(0, 1))
        phi = cosine * self.cos_m - sine * self.sin_m
        if self.easy_margin:
            phi = torch.where(cosine > 0, phi, cosine)
        else:
            phi = torch.where(cosine > self.th, phi, cosine - self.mm)
        one_hot = torch.zeros_like(cosine)
        one_hot.scatter_(1, label.view(-1, 1).long(), 1)
        return ((one_hot * phi) + ((1.0 - one_hot) * cosine)) * self.s


class CenterLoss(nn.Module):
    def __init__(self, num_classes, feat_dim):
        super().__init__()
        self.num_classes = num_classes
        self.centers = nn.Parameter(torch.randn(num_classes, feat_dim))

    def forward(self, x, labels):
        batch_size = x.size(0)
        distmat = torch.pow(x, 2).sum(dim=1, keepdim=True).expand(batch_size, self.num_classes) + \
            torch.pow(self.centers, 2).sum(dim=1, keepdim=True).expand(self.num_classes, batch_size).t()
        distmat.addmm_(x, self.centers.t(), beta=1, alpha=-2)
        classes = torch.arange(self.num_classes, device=x.device)
        mask = labels.unsqueeze(1).expand(batch_size, self.num_classes).eq(classes.expand(batch_size, self.num_classes))
        dist = distmat * mask.float()
        return dist.clamp(min=1e-12, max=1e12).sum() / batch_size


class FaceTrainer:
    def __init__(self, cfg, backbone, num_ids, scaler=torch.cuda.amp.GradScaler()):  # expect: AMP009
        self.cfg = cfg
        self.backbone = backbone.cuda()
        self.head = ArcMarginProduct(cfg.embedding_size, num_ids, s=64.0, m=0.5).cuda().half()  # expect: AMP001
        self.center = CenterLoss(num_ids, cfg.embedding_size).cuda()
        self.criterion = nn.CrossEntropyLoss()
        self.optimizer = torch.optim.SGD(
            [{"params": self.backbone.parameters()}, {"params": self.head.parameters(), "weight_decay": 5e-4}],
            lr=cfg.lr, momentum=0.9, weight_decay=5e-4,
        )
        self.optimizer_center = torch.optim.SGD(self.center.parameters(), lr=0.5)
        self.scaler = scaler
        self.center_weight = cfg.center_weight
        self.margin = cfg.triplet_margin

    def train_step(self, images, labels):
        self.backbone.train()
        with torch.autocast("cuda", dtype=torch.float16):
            emb = self.backbone(images)
            logits = self.head(emb, labels)
            sim = emb @ emb.t()
            pos_mask = labels[:, None] == labels[None, :]
            hardest_pos = sim.masked_fill(~pos_mask, 1e4).min(dim=1)[0]
            hardest_neg = sim.masked_fill(pos_mask, -1e5).max(dim=1)[0]  # expect: AMP007
            triplet = F.relu(hardest_neg - hardest_pos + self.margin).mean()  # expect: AMP004
        loss = self.criterion(logits, labels) + self.center_weight * self.center(emb, labels)  # expect: AMP002
        loss = loss + self.cfg.triplet_weight * triplet

        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_center.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        clip_value(self.backbone.parameters(), 5.0)  # expect: AMP005
        for p in self.center.parameters():
            p.grad.data *= 1.0 / self.center_weight
        self.optimizer_center.step()  # expect: AMP006
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss.item()

    @torch.no_grad()
    def verify(self, pairs_loader, threshold=0.3):
        self.backbone.eval()
        scores, issame = [], []
        for img1, img2, same in pairs_loader:
            with torch.autocast("cuda", dtype=torch.float16):
                e1 = F.normalize(self.backbone(img1.cuda()))
                e2 = F.normalize(self.backbone(img2.cuda()))
            scores.append((e1 * e2).sum(dim=1).float().cpu())
            issame.append(same)
        scores, issame = torch.cat(scores).numpy(), torch.cat(issame).numpy()
        return float(np.mean((scores > threshold) == issame))

    def export_embedder(self, path):
        model = copy.deepcopy(self.backbone).eval().half()
        example = torch.randn(1, 3, 112, 112, device="cuda", dtype=torch.float16)
        traced = torch.jit.trace(model, example)
        traced.save(path)


def main(cfg, backbone, train_loader, pairs_loader, num_ids):
    trainer = FaceTrainer(cfg, backbone, num_ids)
    best = 0.0
    for epoch in range(cfg.epochs):
        for step, (images, labels) in enumerate(train_loader):
            loss = trainer.train_step(images.cuda(non_blocking=True), labels.cuda(non_blocking=True))
            if step % 100 == 0:
                print(f"epoch {epoch} step {step} loss {loss:.4f} scale {trainer.scaler.get_scale():.0f}")
        acc = trainer.verify(pairs_loader)
        if acc > best:
            best = acc
            trainer.export_embedder(f"{cfg.output}/embedder_best.pt")
    return best
