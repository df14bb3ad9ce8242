# AMP011 through module calls: epsilons added to the output of a module built in this file.
import torch
import torch.nn as nn


class Encoder(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))

    def forward(self, x):
        return self.body(x)


class NormedEncoder(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        return self.norm(self.fc(x))


def fp16_scale(x):
    enc = Encoder(64).cuda()
    with torch.autocast("cuda", dtype=torch.float16):
        h = enc(x)
        return h / (h.abs().amax(dim=-1, keepdim=True) + 1e-8)  # AMP011


def bf16_scale(x):
    enc = Encoder(64).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        h = enc(x)
        return h / (h.abs().amax(dim=-1, keepdim=True) + 1e-8)


def layer_norm_output_is_fp32(x):
    enc = NormedEncoder(64).cuda()
    with torch.autocast("cuda", dtype=torch.float16):
        h = enc(x)
        return h / (h.abs().amax(dim=-1, keepdim=True) + 1e-8)


def outside_autocast(x):
    enc = Encoder(64).cuda()
    h = enc(x)
    return h / (h.abs().amax(dim=-1, keepdim=True) + 1e-8)


class FocalHead(nn.Module):
    def __init__(self, dim, classes):
        super().__init__()
        self.fc_cls = nn.Linear(dim, classes)
        self.fc_obj = nn.Linear(dim, 1)

    def forward(self, x):
        return self.fc_cls(x), self.fc_obj(x)

    def loss(self, feats, labels):
        cls_score, _ = self(feats)
        p = torch.sigmoid(cls_score)
        return -torch.log(p + 1e-12).mean()  # AMP011

    def loss_upcast(self, feats, labels):
        cls_score, _ = self(feats)
        p = torch.sigmoid(cls_score.float())
        return -torch.log(p + 1e-12).mean()


def train_focal_head(head, feats, labels, optimizer, scaler):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = head.loss(feats, labels) + head.loss_upcast(feats, labels)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def run_focal_head(feats, labels, optimizer, scaler):
    train_focal_head(FocalHead(64, 10).cuda(), feats, labels, optimizer, scaler)


def pairwise_distance(src, dst):
    dist = -2 * torch.matmul(src, dst.transpose(1, 2))
    dist += src.pow(2).sum(-1, keepdim=True)
    return dist


def inverse_distance_weights(src, dst):
    with torch.autocast("cuda", dtype=torch.float16):
        dist = pairwise_distance(src, dst)
        return 1.0 / (dist.clamp_min(0) + 1e-8)  # AMP011


def inverse_distance_weights_fp32(src, dst):
    with torch.autocast("cuda", dtype=torch.float16):
        dist = pairwise_distance(src, dst)
        return 1.0 / (dist.float().clamp_min(0) + 1e-8)


def inverse_distance_weights_out_of_place(src, dst):
    dist = src.new_zeros(src.shape[:2]).float()
    dist += src.pow(2).sum(-1)
    return 1.0 / (dist + 1e-8)


def focal_where(logits, target):
    with torch.autocast("cuda", dtype=torch.float16):
        p = torch.sigmoid(nn.functional.linear(logits, logits))
        pt = torch.where(target == 1, p, 1 - p)
        return -torch.log(pt + 1e-12).mean()  # AMP011


def focal_where_fp32_branch(logits, target, fallback):
    with torch.autocast("cuda", dtype=torch.float16):
        p = torch.sigmoid(nn.functional.linear(logits, logits))
        pt = torch.where(target == 1, p, fallback.float())
        return -torch.log(pt + 1e-12).mean()


# A Dirichlet head's trigamma terms: torch.polygamma(n, x) keeps x's dtype.
class DirichletHead(nn.Module):
    def __init__(self, dim, classes):
        super().__init__()
        self.fc = nn.Linear(dim, classes)

    def forward(self, x):
        alpha = torch.relu(self.fc(x)) + 1.0
        trigamma = torch.polygamma(1, alpha)
        log_det = torch.log(trigamma + 1e-10).sum(-1)  # AMP011
        log_det32 = torch.log(torch.polygamma(1, alpha.float()) + 1e-10).sum(-1)
        return log_det + log_det32


def train_dirichlet(loader, optimizer, scaler):
    model = DirichletHead(8, 4).cuda()
    for x in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
