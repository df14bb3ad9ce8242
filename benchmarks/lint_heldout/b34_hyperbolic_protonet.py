"""Hyperbolic prototypical networks for few-shot classification.

Embeddings are mapped onto the unit Poincare ball and queries are classified by
their geodesic distance to the class prototypes (Khrulkov et al., 2020,
"Hyperbolic Image Embeddings").

    python b34_hyperbolic_protonet.py --data miniimagenet.pt --way 5 --shot 1 --amp
"""
import argparse
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class Artanh(torch.autograd.Function):
    @staticmethod
    @torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)  # expect: AMP009
    def forward(ctx, x):
        x = x.clamp(-1 + 1e-5, 1 - 1e-5)
        ctx.save_for_backward(x)
        return 0.5 * (torch.log1p(x) - torch.log1p(-x))

    @staticmethod
    @torch.cuda.amp.custom_bwd  # expect: AMP009
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        return grad_output / (1 - x ** 2)


artanh = Artanh.apply


def project(x, max_norm=1 - 1e-3):
    """Pull points that left the ball (numerically) back inside it."""
    norm = x.norm(dim=-1, keepdim=True).clamp_min(1e-5)  # expect: AMP004
    return x / (norm / max_norm).clamp(min=1.0)


def expmap0(u):
    """Exponential map at the origin of the unit ball (curvature -1)."""
    u_norm = u.norm(dim=-1, keepdim=True) + 1e-15  # expect: AMP004, AMP011
    return project(torch.tanh(u_norm) * u / u_norm)


def mobius_add_batch(x, y):
    """Pairwise Mobius addition: x (B, D), y (C, D) -> (B, C, D)."""
    xy = x @ y.t()
    x2 = (x * x).sum(dim=-1, keepdim=True)  # expect: AMP004
    y2 = (y * y).sum(dim=-1, keepdim=True)  # expect: AMP004
    num = (1 + 2 * xy + y2.t()).unsqueeze(2) * x.unsqueeze(1) + (1 - x2).unsqueeze(2) * y.unsqueeze(0)
    denom = 1 + 2 * xy + x2 * y2.t()
    return num / (denom.unsqueeze(2) + 1e-15)  # expect: AMP011


def dist_matrix(x, y):
    """Geodesic distances between every row of x and every row of y."""
    return 2.0 * artanh(mobius_add_batch(-x, y).norm(dim=-1))  # expect: AMP004


def origin_distance(z):
    """Distance to the origin; large means a confident, specific embedding."""
    with torch.autocast("cuda", enabled=False):
        z = z.float()
        return 2.0 * artanh(z.norm(dim=-1).clamp(max=1 - 1e-5))


def conv_block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(), nn.MaxPool2d(2))


class HypProtoNet(nn.Module):
    def __init__(self, hid=64, dim=64, temperature=1.0, image_size=84):
        super().__init__()
        self.encoder = nn.Sequential(conv_block(3, hid), conv_block(hid, hid), conv_block(hid, hid), conv_block(hid, hid))
        self.fc = nn.Linear(hid * (image_size // 16) ** 2, dim)
        self.temperature = temperature

    def embed(self, x):
        return self.fc(self.encoder(x).flatten(1))

    def forward(self, support, query, n_way, n_shot):
        zs = self.embed(support)
        zq = self.embed(query)
        # prototypes are averaged in the tangent space at the origin
        protos = zs.view(n_way, n_shot, -1).mean(dim=1)  # expect: AMP004
        # hyperbolic geometry is fragile in half precision: leave autocast for it
        with torch.autocast("cuda", enabled=False):
            protos_h = expmap0(protos)
            zq_h = expmap0(zq)
            logits = -dist_matrix(zq_h, protos_h) / self.temperature
        return logits, zq_h


class EpisodeSampler:
    """N-way K-shot episodes from a dict {class name: uint8 tensor (n, 3, H, W)}."""

    def __init__(self, data, way, shot, query):
        self.data, self.classes = data, sorted(data)
        self.way, self.shot, self.query = way, shot, query

    def sample(self):
        classes = random.sample(self.classes, self.way)
        support, query = [], []
        for c in classes:
            imgs = self.data[c]
            idx = torch.randperm(len(imgs))[: self.shot + self.query]
            support.append(imgs[idx[: self.shot]])
            query.append(imgs[idx[self.shot:]])
        support = torch.cat(support).float().div_(255.0)
        query = torch.cat(query).float().div_(255.0)
        labels = torch.arange(self.way).repeat_interleave(self.query)
        return support, query, labels


def train(args, train_sampler, val_sampler):
    device = torch.device("cuda")
    model = HypProtoNet(args.hid, args.dim, args.temperature).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=args.step_size, gamma=0.5)
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)

    best = 0.0
    for episode in range(1, args.episodes + 1):
        model.train()
        support, query, labels = train_sampler.sample()
        support, query, labels = support.to(device), query.to(device), labels.to(device)
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            logits, zq_h = model(support, query, args.way, args.shot)
            loss = F.cross_entropy(logits, labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()

        if episode % args.log_every == 0:
            radius = origin_distance(zq_h.detach()).mean().item()
            acc = (logits.argmax(-1) == labels).float().mean().item()
            print(f"episode {episode}: loss {loss.item():.4f} acc {acc:.3f} mean radius {radius:.3f}")
        if episode % args.eval_every == 0:
            mean_acc, ci = evaluate(model, val_sampler, args, device)
            print(f"  val acc {100 * mean_acc:.2f} +- {100 * ci:.2f}")
            if mean_acc > best:
                best = mean_acc
                torch.save(model.state_dict(), args.out)


@torch.no_grad()
def evaluate(model, sampler, args, device, n_episodes=600):
    model.eval()
    accs = []
    for _ in range(n_episodes):
        support, query, labels = sampler.sample()
        logits, _ = model(support.to(device), query.to(device), args.way, args.shot)
        accs.append((logits.argmax(-1).cpu() == labels).float().mean().item())
    accs = np.array(accs)
    return accs.mean(), 1.96 * accs.std() / np.sqrt(len(accs))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--way", type=int, default=5)
    parser.add_argument("--shot", type=int, default=1)
    parser.add_argument("--query", type=int, default=15)
    parser.add_argument("--hid", type=int, default=64)
    parser.add_argument("--dim", type=int, default=1600)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--step-size", type=int, default=20000)
    parser.add_argument("--grad-clip", type=float, default=10.0)
    parser.add_argument("--episodes", type=int, default=60000)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=2000)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="hyp_protonet.pt")
    args = parser.parse_args()
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    splits = torch.load(args.data)
    train_sampler = EpisodeSampler(splits["train"], args.way, args.shot, args.query)
    val_sampler = EpisodeSampler(splits["val"], args.way, args.shot, args.query)
    train(args, train_sampler, val_sampler)


if __name__ == "__main__":
    main()
