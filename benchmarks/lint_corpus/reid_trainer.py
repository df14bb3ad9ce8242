"""Person re-identification training: ID loss + batch-hard triplet loss, mixed precision."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class CrossEntropyLabelSmooth(nn.Module):
    def __init__(self, num_classes, epsilon=0.1):
        super().__init__()
        self.num_classes = num_classes
        self.epsilon = epsilon
        self.logsoftmax = nn.LogSoftmax(dim=1)

    def forward(self, inputs, targets):
        log_probs = self.logsoftmax(inputs)
        targets = torch.zeros_like(log_probs).scatter_(1, targets.unsqueeze(1), 1)
        targets = (1 - self.epsilon) * targets + self.epsilon / self.num_classes
        return (-targets * log_probs).mean(0).sum()


def euclidean_dist(x, y):
    m, n = x.size(0), y.size(0)
    xx = torch.pow(x, 2).sum(1, keepdim=True).expand(m, n)
    yy = torch.pow(y, 2).sum(1, keepdim=True).expand(n, m).t()
    dist = xx + yy - 2 * torch.matmul(x, y.t())
    return dist.clamp(min=1e-6).sqrt()


class TripletLoss:
    """Batch-hard triplet loss with a soft or hard margin."""

    def __init__(self, margin=None):
        self.margin = margin
        if margin is not None:
            self.ranking_loss = nn.MarginRankingLoss(margin=margin)
        else:
            self.ranking_loss = nn.SoftMarginLoss()

    def __call__(self, global_feat, labels):
        dist_mat = euclidean_dist(global_feat, global_feat)
        n = dist_mat.size(0)
        is_pos = labels.expand(n, n).eq(labels.expand(n, n).t())
        dist_ap = torch.max(dist_mat * is_pos, 1)[0]
        dist_an = torch.min(dist_mat + 1e5 * is_pos, 1)[0]
        y = torch.ones_like(dist_an)
        if self.margin is not None:
            return self.ranking_loss(dist_an, dist_ap, y)
        return self.ranking_loss(dist_an - dist_ap, y)


class CenterLoss(nn.Module):
    def __init__(self, num_classes, feat_dim):
        super().__init__()
        self.centers = nn.Parameter(torch.randn(num_classes, feat_dim))

    def forward(self, x, labels):
        centers = self.centers[labels]
        return (x - centers).pow(2).sum(1).clamp(min=1e-12, max=1e12).mean()


class ReIDTrainer:
    def __init__(self, model, num_classes, optimizer, center_optimizer, cfg):
        self.model = model
        self.cfg = cfg
        self.optimizer = optimizer
        self.center_optimizer = center_optimizer
        self.xent = CrossEntropyLabelSmooth(num_classes)
        self.triplet = TripletLoss(cfg.margin)
        self.center = CenterLoss(num_classes, cfg.feat_dim).cuda()
        self.scaler = torch.amp.GradScaler("cuda")

    def train_epoch(self, loader):
        self.model.train()
        for imgs, pids in loader:
            imgs, pids = imgs.cuda(), pids.cuda()
            with torch.autocast("cuda", dtype=torch.float16):
                score, feat = self.model(imgs)
            id_loss = self.xent(score, pids)  # expect: AMP002
            tri_loss = self.triplet(feat, pids)  # expect: AMP002
            cen_loss = self.center(feat.float(), pids)
            loss = id_loss + tri_loss + self.cfg.center_weight * cen_loss
            self.optimizer.zero_grad()
            self.center_optimizer.zero_grad()
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            for param in self.center.parameters():
                param.grad.data *= 1.0 / self.cfg.center_weight
            self.scaler.step(self.center_optimizer)
            self.scaler.update()

    def train_epoch_in_region(self, loader):
        self.model.train()
        for imgs, pids in loader:
            imgs, pids = imgs.cuda(), pids.cuda()
            with torch.autocast("cuda", dtype=torch.float16):
                score, feat = self.model(imgs)
                loss = self.xent(score, pids) + self.triplet(feat, pids)
            self.optimizer.zero_grad()
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()

    @torch.no_grad()
    def extract(self, loader):
        self.model.eval()
        feats = []
        for imgs, _ in loader:
            with torch.autocast("cuda", dtype=torch.float16):
                _, feat = self.model(imgs.cuda())
            feats.append(F.normalize(feat.float(), dim=1))
        return torch.cat(feats)
