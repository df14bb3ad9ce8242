"""Capsule networks (MNIST / smallNORB) and a mixture-density trajectory model.

Both experiments live in one file because they share the training utilities
in ``common``; pick one with ``--task``.
"""
import argparse
import logging
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from common.data import capsule_loaders, trajectory_loaders
from common.utils import AverageMeter, set_seed

logger = logging.getLogger(__name__)
LOG_2PI = math.log(2.0 * math.pi)


def squash(s, dim=-1):
    sq_norm = (s ** 2).sum(dim=dim, keepdim=True)
    scale = sq_norm / (1.0 + sq_norm)
    return scale * s / torch.sqrt(sq_norm + 1e-8)


class PrimaryCapsules(nn.Module):
    def __init__(self, in_channels=256, num_maps=32, caps_dim=8, kernel_size=9, stride=2):
        super().__init__()
        self.caps_dim = caps_dim
        self.conv = nn.Conv2d(in_channels, num_maps * caps_dim, kernel_size, stride)

    def forward(self, x):
        u = self.conv(x)
        b = u.size(0)
        u = u.view(b, -1, self.caps_dim, u.size(-2), u.size(-1)).permute(0, 1, 3, 4, 2)
        return squash(u.reshape(b, -1, self.caps_dim))


class RoutingCapsBase(nn.Module):
    def __init__(self, in_caps, in_dim, out_caps, out_dim, iterations=3):
        super().__init__()
        self.iterations = iterations
        self.W = nn.Parameter(0.01 * torch.randn(1, in_caps, out_caps, out_dim, in_dim))

    def predictions(self, u):
        # u: (b, in_caps, in_dim) -> u_hat: (b, in_caps, out_caps, out_dim)
        return torch.matmul(self.W, u[:, :, None, :, None]).squeeze(-1)

    def route(self, u_hat):
        raise NotImplementedError

    def forward(self, u):
        return self.route(self.predictions(u))


class DynamicRoutingCaps(RoutingCapsBase):
    """Routing-by-agreement (Sabour et al., 2017)."""

    def route(self, u_hat):
        u_hat_detached = u_hat.detach()
        b = u_hat.new_zeros(u_hat.shape[:3])
        for i in range(self.iterations):
            c = F.softmax(b, dim=2)
            if i == self.iterations - 1:
                return squash((c.unsqueeze(-1) * u_hat).sum(dim=1))
            v = squash((c.unsqueeze(-1) * u_hat_detached).sum(dim=1))
            b = b + (u_hat_detached * v.unsqueeze(1)).sum(dim=-1)


class KMeansRoutingCaps(RoutingCapsBase):
    """Routing as soft k-means over the prediction vectors."""

    def route(self, u_hat):
        v = squash(u_hat.mean(dim=1))  # expect: AMP004
        for _ in range(self.iterations):
            agreement = (u_hat * v.unsqueeze(1)).sum(dim=-1)
            c = F.softmax(agreement, dim=2)
            v = squash((c.unsqueeze(-1) * u_hat).sum(dim=1))
        return v


ROUTERS = {"dynamic": DynamicRoutingCaps, "kmeans": KMeansRoutingCaps}


class CapsNet(nn.Module):
    def __init__(self, routing="dynamic", num_classes=10, image_size=28, in_channels=1):
        super().__init__()
        grid = ((image_size - 8) - 9) // 2 + 1
        self.num_classes = num_classes
        self.conv1 = nn.Conv2d(in_channels, 256, kernel_size=9)
        self.primary = PrimaryCapsules()
        self.digits = ROUTERS[routing](32 * grid * grid, 8, num_classes, 16)
        self.decoder = nn.Sequential(
            nn.Linear(16 * num_classes, 512), nn.ReLU(inplace=True),
            nn.Linear(512, 1024), nn.ReLU(inplace=True),
            nn.Linear(1024, in_channels * image_size * image_size), nn.Sigmoid(),
        )

    def forward(self, images, labels=None):
        u = self.primary(F.relu(self.conv1(images)))
        v = self.digits(u)
        lengths = torch.sqrt((v ** 2).sum(dim=-1) + 1e-9)
        if labels is None:
            labels = lengths.argmax(dim=1)
        mask = F.one_hot(labels, self.num_classes).to(v.dtype)
        recon = self.decoder((v * mask.unsqueeze(-1)).flatten(1))
        return lengths, recon


def margin_loss(lengths, labels, m_pos=0.9, m_neg=0.1, lam=0.5):
    t = F.one_hot(labels, lengths.size(1)).float()
    pos = t * F.relu(m_pos - lengths) ** 2
    neg = lam * (1.0 - t) * F.relu(lengths - m_neg) ** 2
    return (pos + neg).sum(dim=1).mean()


def reconstruction_loss(recon, images):
    return F.mse_loss(recon, images.flatten(1), reduction="none").sum(dim=1).mean()


class SetAttentionPool(nn.Module):
    """Pooling by multi-head attention with one learned seed (Set Transformer)."""

    def __init__(self, dim, heads=4):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.seed = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.to_q = nn.Linear(dim, dim)
        self.to_kv = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, h, mask):
        b, n, d = h.shape
        q = self.to_q(self.seed).expand(b, -1, -1).reshape(b, 1, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.to_kv(h).chunk(2, dim=-1)
        k = k.reshape(b, n, self.heads, self.head_dim).transpose(1, 2)
        v = v.reshape(b, n, self.heads, self.head_dim).transpose(1, 2)
        logits = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        logits = logits.masked_fill(~mask[:, None, None, :], -1e10)  # expect: AMP007
        out = torch.matmul(logits.softmax(dim=-1), v)
        return self.out(out.transpose(1, 2).reshape(b, d))


class MDNHead(nn.Module):
    def __init__(self, in_dim, out_dim, num_components):
        super().__init__()
        self.k, self.d = num_components, out_dim
        self.pi = nn.Linear(in_dim, num_components)
        self.mu = nn.Linear(in_dim, num_components * out_dim)
        self.sigma = nn.Linear(in_dim, num_components * out_dim)

    def forward(self, h):
        pi_logits = self.pi(h)
        mu = self.mu(h).view(-1, self.k, self.d)
        sigma = (F.elu(self.sigma(h)) + 1 + 1e-15).view(-1, self.k, self.d)  # expect: AMP011
        return pi_logits, mu, sigma


class TrajectoryMDN(nn.Module):
    def __init__(self, in_dim=4, out_dim=2, hidden=256, num_components=8, context_dim=3):
        super().__init__()
        self.rnn = nn.GRU(in_dim, hidden, num_layers=2, batch_first=True, dropout=0.1)
        self.proj = nn.Linear(hidden, hidden)
        self.point_embed = nn.Sequential(nn.Linear(context_dim, hidden), nn.GELU(), nn.Linear(hidden, hidden))
        self.context = SetAttentionPool(hidden)
        self.fuse = nn.Linear(2 * hidden, hidden)
        self.head = MDNHead(hidden, out_dim, num_components)

    def forward(self, history, ctx_points, ctx_mask):
        out, _ = self.rnn(history)
        feats = self.proj(out)
        pooled = feats.mean(dim=1)  # expect: AMP004
        ctx = self.context(self.point_embed(ctx_points), ctx_mask)
        h = F.gelu(self.fuse(torch.cat([pooled, ctx], dim=-1)))
        return self.head(h)


def mdn_nll(pi_logits, mu, sigma, target):
    # the mixture likelihood is evaluated in fp32
    log_pi = F.log_softmax(pi_logits.float(), dim=-1)
    mu, sigma = mu.float(), sigma.float()
    z = (target.unsqueeze(1) - mu) / sigma
    log_prob = (-0.5 * z.pow(2) - torch.log(sigma) - 0.5 * LOG_2PI).sum(dim=-1)
    return -torch.logsumexp(log_pi + log_prob, dim=-1).mean()


@torch.no_grad()
def mdn_sample(model, history, ctx_points, ctx_mask, temperature=1.0):
    model.eval()
    pi_logits, mu, sigma = model(history, ctx_points, ctx_mask)
    pi = F.softmax(pi_logits.float() / temperature, dim=-1)
    idx = torch.multinomial(pi, 1).squeeze(-1)
    rows = torch.arange(mu.size(0), device=mu.device)
    return mu[rows, idx].float() + sigma[rows, idx].float() * math.sqrt(temperature) * torch.randn_like(mu[rows, idx].float())


def train_capsnet(model, loader, optimizer, scaler, epoch, args):
    model.train()
    meter = AverageMeter()
    for i, (images, labels) in enumerate(loader):
        images, labels = images.cuda(non_blocking=True), labels.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            lengths, recon = model(images, labels)
            loss = margin_loss(lengths, labels) + args.recon_weight * reconstruction_loss(recon, images)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()  # expect: AMP008
        scaler.step(optimizer)
        scaler.update()
        meter.update(loss.item(), images.size(0))
        if i % args.log_every == 0:
            logger.info("capsnet epoch %d [%d/%d] loss %.4f", epoch, i, len(loader), meter.avg)


@torch.no_grad()
def evaluate_capsnet(model, loader, args):
    model.eval()
    correct, total = 0, 0
    for images, labels in loader:
        images, labels = images.cuda(), labels.cuda()
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            lengths, _ = model(images)
        correct += (lengths.argmax(dim=1) == labels).sum().item()
        total += labels.numel()
    return correct / total


def train_mdn(model, loader, optimizer, scaler, epoch, args):
    model.train()
    meter = AverageMeter()
    for i, (history, ctx_points, ctx_mask, target) in enumerate(loader):
        history, target = history.cuda(non_blocking=True), target.cuda(non_blocking=True)
        ctx_points, ctx_mask = ctx_points.cuda(non_blocking=True), ctx_mask.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            pi_logits, mu, sigma = model(history, ctx_points, ctx_mask)
            loss = mdn_nll(pi_logits, mu, sigma, target)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()
        meter.update(loss.item(), history.size(0))
        if i % args.log_every == 0:
            logger.info("mdn epoch %d [%d/%d] nll %.4f scale %.0f", epoch, i, len(loader), meter.avg, scaler.get_scale())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", choices=["capsnet", "mdn"], default="capsnet")
    parser.add_argument("--routing", choices=sorted(ROUTERS), default="dynamic")
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--recon-weight", type=float, default=0.0005)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--components", type=int, default=8)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs")
    args = parser.parse_args()
    set_seed(args.seed)
    os.makedirs(args.out, exist_ok=True)
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)

    if args.task == "capsnet":
        train_loader, test_loader = capsule_loaders(args.batch_size)
        model = CapsNet(routing=args.routing).cuda()
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
        scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.96)
        best_acc = 0.0
        for epoch in range(args.epochs):
            train_capsnet(model, train_loader, optimizer, scaler, epoch, args)
            scheduler.step()
            acc = evaluate_capsnet(model, test_loader, args)
            if acc > best_acc:
                best_acc = acc
                torch.save(model.state_dict(), os.path.join(args.out, f"capsnet_{args.routing}.pt"))
            logger.info("epoch %d test acc %.4f (best %.4f)", epoch, acc, best_acc)
    else:
        train_loader, val_loader = trajectory_loaders(args.batch_size)
        model = TrajectoryMDN(num_components=args.components).cuda()
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
        for epoch in range(args.epochs):
            train_mdn(model, train_loader, optimizer, scaler, epoch, args)
            torch.save({"model": model.state_dict(), "epoch": epoch}, os.path.join(args.out, "mdn_last.pt"))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main()
