"""Few-shot classification on miniImageNet: Prototypical Networks and (first/second-order) MAML.

    python b16_protonet_maml.py --method protonet --n-way 5 --n-shot 5
    python b16_protonet_maml.py --method maml --n-way 5 --n-shot 1 --inner-steps 5
"""
import argparse
import copy
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call


@dataclass
class FewShotConfig:
    method: str = "protonet"
    n_way: int = 5
    n_shot: int = 5
    n_query: int = 15
    episodes: int = 60000
    lr: float = 1e-3
    meta_lr: float = 1e-3
    inner_lr: float = 0.01
    inner_steps: int = 5
    first_order: bool = False
    meta_batch: int = 4
    accum: int = 4
    clip: float = 5.0
    metric: str = "euclidean"
    eval_every: int = 2000
    seed: int = 0


def conv_block(in_ch, out_ch):
    return nn.Sequential(nn.Conv2d(in_ch, out_ch, 3, padding=1), nn.BatchNorm2d(out_ch), nn.ReLU(), nn.MaxPool2d(2))


class Conv4Encoder(nn.Module):
    def __init__(self, hidden=64, out_dim=1600):
        super().__init__()
        self.blocks = nn.Sequential(conv_block(3, hidden), conv_block(hidden, hidden), conv_block(hidden, hidden), conv_block(hidden, hidden))
        self.fc = nn.Linear(hidden * 25, out_dim)

    def forward(self, x):
        return self.fc(self.blocks(x).flatten(1))


class ProtoNet(nn.Module):
    def __init__(self, encoder, metric="euclidean"):
        super().__init__()
        self.encoder = encoder
        self.metric = metric

    def forward(self, x_support, x_query, n_way, n_shot):
        z = self.encoder(torch.cat([x_support, x_query], dim=0))
        z_support = z[: n_way * n_shot].view(n_way, n_shot, -1)
        z_query = z[n_way * n_shot :]
        protos = z_support.mean(dim=1)  # expect: AMP004
        diff = z_query.unsqueeze(1) - protos.unsqueeze(0)
        if self.metric == "mahalanobis_diag":
            scale = z_support.var(dim=1).mean(dim=0)  # expect: AMP004
            dists = (diff.pow(2) / (scale + 1e-8)).sum(-1)  # expect: AMP011
        else:
            dists = diff.pow(2).sum(-1)
        return -dists


class ConvLearner(nn.Module):
    """Conv4 with a linear head; MAML adapts all weights through functional_call."""

    def __init__(self, n_way, hidden=32):
        super().__init__()
        self.features = nn.Sequential(conv_block(3, hidden), conv_block(hidden, hidden), conv_block(hidden, hidden), conv_block(hidden, hidden))
        self.head = nn.Linear(hidden * 25, n_way)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def episode_labels(n_way, n_per_class, device):
    return torch.arange(n_way, device=device).repeat_interleave(n_per_class)


def train_protonet(cfg, sampler, val_sampler, device):
    model = ProtoNet(Conv4Encoder(), cfg.metric).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20000, gamma=0.5)
    scaler = torch.amp.GradScaler("cuda")
    y_query = episode_labels(cfg.n_way, cfg.n_query, device)
    best = 0.0
    for episode in range(cfg.episodes):
        x_s, x_q = sampler.sample(cfg.n_way, cfg.n_shot, cfg.n_query)
        x_s, x_q = x_s.to(device, non_blocking=True), x_q.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(x_s, x_q, cfg.n_way, cfg.n_shot)
            loss = F.cross_entropy(logits, y_query) / cfg.accum
        scaler.scale(loss).backward()
        if (episode + 1) % cfg.accum == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=cfg.clip)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
        if (episode + 1) % cfg.eval_every == 0:
            acc, ci = evaluate_protonet(model, val_sampler, cfg, device)
            print(f"episode {episode + 1} loss {loss.item() * cfg.accum:.4f} val {acc:.2f} +- {ci:.2f}")
            if acc > best:
                best = acc
                torch.save({"model": model.state_dict(), "episode": episode + 1}, "protonet_best.pt")
    return model


@torch.no_grad()
def evaluate_protonet(model, sampler, cfg, device, episodes=600):
    eval_model = copy.deepcopy(model).half().eval()
    y_query = episode_labels(cfg.n_way, cfg.n_query, device)
    accs = []
    for _ in range(episodes):
        x_s, x_q = sampler.sample(cfg.n_way, cfg.n_shot, cfg.n_query)
        logits = eval_model(x_s.to(device).half(), x_q.to(device).half(), cfg.n_way, cfg.n_shot)
        accs.append((logits.argmax(1) == y_query).float().mean().item() * 100)
    return float(np.mean(accs)), 1.96 * float(np.std(accs)) / np.sqrt(episodes)


def inner_adapt(learner, params, x, y, steps, lr, first_order):
    for _ in range(steps):
        loss = F.cross_entropy(functional_call(learner, params, (x,)), y)
        grads = torch.autograd.grad(loss, list(params.values()), create_graph=not first_order)
        params = {name: p - lr * g for (name, p), g in zip(params.items(), grads)}
    return params


def train_maml(cfg, sampler, device):
    learner = ConvLearner(cfg.n_way).to(device)
    learner = learner.half()  # expect: AMP001
    meta_opt = torch.optim.Adam(learner.parameters(), lr=cfg.meta_lr)  # expect: AMP011
    y_s = episode_labels(cfg.n_way, cfg.n_shot, device)
    y_q = episode_labels(cfg.n_way, cfg.n_query, device)
    for it in range(cfg.episodes // cfg.meta_batch):
        meta_opt.zero_grad(set_to_none=True)
        task_losses, task_accs = [], []
        for _ in range(cfg.meta_batch):
            x_s, x_q = sampler.sample(cfg.n_way, cfg.n_shot, cfg.n_query)
            x_s = x_s.to(device).half()  # expect: AMP001
            x_q = x_q.to(device).half()  # expect: AMP001
            fast = inner_adapt(learner, dict(learner.named_parameters()), x_s, y_s, cfg.inner_steps, cfg.inner_lr, cfg.first_order)
            logits = functional_call(learner, fast, (x_q,))
            task_losses.append(F.cross_entropy(logits.float(), y_q))
            task_accs.append((logits.argmax(1) == y_q).float().mean().item())
        meta_loss = sum(task_losses) / len(task_losses)
        meta_loss.backward()
        meta_opt.step()
        if it % 100 == 0:
            print(f"meta-iter {it} loss {meta_loss.item():.4f} acc {100 * sum(task_accs) / len(task_accs):.2f}")
        if it % 5000 == 0:
            torch.save({"learner": learner.state_dict(), "meta_opt": meta_opt.state_dict(), "iter": it}, f"maml_{it}.pt")
    return learner


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--method", choices=["protonet", "maml"], default="protonet")
    p.add_argument("--data-root", default="data/miniImagenet")
    p.add_argument("--n-way", type=int, default=5)
    p.add_argument("--n-shot", type=int, default=5)
    p.add_argument("--n-query", type=int, default=15)
    p.add_argument("--episodes", type=int, default=60000)
    p.add_argument("--inner-steps", type=int, default=5)
    p.add_argument("--first-order", action="store_true")
    p.add_argument("--metric", default="euclidean", choices=["euclidean", "mahalanobis_diag"])
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    return a, FewShotConfig(method=a.method, n_way=a.n_way, n_shot=a.n_shot, n_query=a.n_query, episodes=a.episodes, inner_steps=a.inner_steps, first_order=a.first_order, metric=a.metric, seed=a.seed)


def main():
    args, cfg = parse_args()
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = torch.device("cuda")
    from episodes import EpisodeSampler  # project-local: samples N-way K-shot episodes from the split

    train_sampler = EpisodeSampler(args.data_root, "train")
    val_sampler = EpisodeSampler(args.data_root, "val")
    if cfg.method == "protonet":
        train_protonet(cfg, train_sampler, val_sampler, device)
    else:
        train_maml(cfg, train_sampler, device)


if __name__ == "__main__":
    main()
