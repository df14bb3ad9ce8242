"""AlphaZero-style self-play for free-style Gomoku.

Residual policy/value network with KataGo-style global pooling blocks, PUCT Monte
Carlo tree search on numpy arrays, a replay buffer with 8-fold symmetry
augmentation and periodic arena evaluation against the best network so far.
"""
import argparse
import copy
import math
import os
import random
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Config:
    board_size: int = 15
    in_planes: int = 4
    channels: int = 128
    blocks: int = 10
    c_puct: float = 1.5
    num_simulations: int = 400
    dirichlet_alpha: float = 0.05
    dirichlet_frac: float = 0.25
    temp_moves: int = 12
    buffer_size: int = 300_000
    batch_size: int = 512
    train_steps: int = 500
    lr: float = 2e-3
    weight_decay: float = 1e-4
    value_weight: float = 1.0
    max_grad_norm: float = 5.0
    amp: bool = True


class ResBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(out)))


class GlobalPoolingBias(nn.Module):
    def __init__(self, c, cg=32):
        super().__init__()
        self.conv_x = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.conv_g = nn.Conv2d(c, cg, 3, padding=1)
        self.fc = nn.Linear(3 * cg, c)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x, board_scale):
        out = self.conv_x(x)
        g = F.relu(self.conv_g(x))
        g_mean = g.mean(dim=(2, 3))  # expect: AMP004
        g_max = g.amax(dim=(2, 3))
        pooled = torch.cat([g_mean, g_mean * board_scale, g_max], dim=1)
        out = self.bn(out + self.fc(pooled)[:, :, None, None])
        return F.relu(out + x)


class PolicyValueNet(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        c, n = cfg.channels, cfg.board_size
        self.board_scale = (n - 14) / 10.0
        self.stem = nn.Sequential(nn.Conv2d(cfg.in_planes, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.trunk = nn.ModuleList(
            [GlobalPoolingBias(c) if i % 3 == 2 else ResBlock(c) for i in range(cfg.blocks)]
        )
        self.policy_conv = nn.Conv2d(c, 2, 1, bias=False)
        self.policy_bn = nn.BatchNorm2d(2)
        self.policy_fc = nn.Linear(2 * n * n, n * n)
        self.value_conv = nn.Conv2d(c, 1, 1, bias=False)
        self.value_bn = nn.BatchNorm2d(1)
        self.value_fc1 = nn.Linear(n * n, 256)
        self.value_fc2 = nn.Linear(256, 1)

    def forward(self, x, legal_mask=None):
        x = self.stem(x)
        for block in self.trunk:
            x = block(x, self.board_scale) if isinstance(block, GlobalPoolingBias) else block(x)
        p = F.relu(self.policy_bn(self.policy_conv(x)))
        logits = self.policy_fc(p.flatten(1))
        if legal_mask is not None:
            logits = logits.masked_fill(~legal_mask, -1e9)  # expect: AMP007
        log_p = F.log_softmax(logits, dim=1)
        v = F.relu(self.value_bn(self.value_conv(x)))
        v = torch.tanh(self.value_fc2(F.relu(self.value_fc1(v.flatten(1)))))
        return log_p, v


class Gomoku:
    def __init__(self, n=15, k=5):
        self.n, self.k = n, k
        self.board = np.zeros((n, n), dtype=np.int8)
        self.to_play = 1
        self.last = None
        self.moves = 0

    def clone(self):
        return copy.deepcopy(self)

    def legal(self):
        return (self.board == 0).reshape(-1)

    def play(self, a):
        r, c = divmod(a, self.n)
        self.board[r, c] = self.to_play
        self.last = (r, c)
        self.to_play = -self.to_play
        self.moves += 1

    def winner(self):
        if self.last is None:
            return None
        r, c = self.last
        p = self.board[r, c]
        for dr, dc in ((0, 1), (1, 0), (1, 1), (1, -1)):
            count = 1
            for sign in (1, -1):
                rr, cc = r + sign * dr, c + sign * dc
                while 0 <= rr < self.n and 0 <= cc < self.n and self.board[rr, cc] == p:
                    count += 1
                    rr, cc = rr + sign * dr, cc + sign * dc
            if count >= self.k:
                return int(p)
        return 0 if self.moves == self.n * self.n else None

    def planes(self):
        me, opp = (self.board == self.to_play), (self.board == -self.to_play)
        last = np.zeros_like(me)
        if self.last is not None:
            last[self.last] = True
        color = np.full_like(me, self.to_play == 1)
        return np.stack([me, opp, last, color]).astype(np.float32)


class BatchedInference:
    def __init__(self, net, device, half=True):
        self.net = copy.deepcopy(net).to(device).eval()
        if half:
            self.net.half()
        self.device, self.half = device, half

    @torch.inference_mode()
    def __call__(self, planes, legal):
        x = torch.from_numpy(planes).to(self.device)[None]
        x = x.half() if self.half else x
        mask = torch.from_numpy(legal).to(self.device)[None]
        log_p, v = self.net(x, mask)
        return log_p.float().exp()[0].cpu().numpy(), float(v.float().item())


class Node:
    def __init__(self, priors, legal):
        self.P, self.legal = priors, legal
        self.N = np.zeros_like(priors)
        self.W = np.zeros_like(priors)
        self.children = {}

    def select(self, c_puct):
        q = np.where(self.N > 0, self.W / np.maximum(self.N, 1), 0.0)
        u = c_puct * self.P * math.sqrt(self.N.sum() + 1) / (1 + self.N)
        scores = q + u
        scores[~self.legal] = -1e9
        return int(np.argmax(scores))


def run_mcts(game, evaluate, cfg, add_noise=True):
    priors, _ = evaluate(game.planes(), game.legal())
    root = Node(priors, game.legal())
    if add_noise:
        noise = np.random.dirichlet([cfg.dirichlet_alpha] * len(priors))
        root.P = (1 - cfg.dirichlet_frac) * root.P + cfg.dirichlet_frac * noise
    for _ in range(cfg.num_simulations):
        node, sim, path = root, game.clone(), []
        while True:
            a = node.select(cfg.c_puct)
            path.append((node, a))
            sim.play(a)
            result = sim.winner()
            if result is not None:
                value = float(abs(result))
                break
            if a not in node.children:
                p, value = evaluate(sim.planes(), sim.legal())
                node.children[a] = Node(p, sim.legal())
                value = -value
                break
            node = node.children[a]
        for node, a in reversed(path):
            node.N[a] += 1
            node.W[a] += value
            value = -value
    return root.N


def self_play_game(evaluate, cfg):
    game, history = Gomoku(cfg.board_size), []
    while game.winner() is None:
        counts = run_mcts(game, evaluate, cfg)
        temp = 1.0 if game.moves < cfg.temp_moves else 0.25
        pi = counts ** (1.0 / temp)
        pi = pi / (pi.sum() + 1e-10)
        history.append((game.planes(), pi.astype(np.float32), game.to_play))
        game.play(int(np.random.choice(len(pi), p=pi)))
    w = game.winner()
    return [(s, p, np.float32(w * player)) for s, p, player in history]


def augment(planes, pis, n):
    k, flip = random.randrange(4), random.random() < 0.5
    planes = np.rot90(planes, k, axes=(2, 3))
    pis = np.rot90(pis.reshape(-1, n, n), k, axes=(1, 2))
    if flip:
        planes, pis = planes[..., ::-1], pis[..., ::-1]
    return np.ascontiguousarray(planes), np.ascontiguousarray(pis.reshape(len(pis), -1))


def make_scaler(enabled):
    try:
        return torch.amp.GradScaler("cuda", enabled=enabled)
    except (AttributeError, TypeError):
        return torch.cuda.amp.GradScaler(enabled=enabled)


def train_network(net, buffer, optimizer, scaler, cfg, device):
    net.train()
    stats = []
    for _ in range(cfg.train_steps):
        planes, target_pi, target_z = map(np.stack, zip(*random.sample(buffer, cfg.batch_size)))
        planes, target_pi = augment(planes, target_pi, cfg.board_size)
        x = torch.from_numpy(planes).to(device, non_blocking=True)
        pi = torch.from_numpy(target_pi).to(device, non_blocking=True)
        z = torch.from_numpy(target_z).to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=cfg.amp):
            log_p, v = net(x)
        policy_loss = -(pi * log_p).sum(dim=1).mean()
        value_loss = F.mse_loss(v.view(-1), z)  # expect: AMP002
        loss = policy_loss + cfg.value_weight * value_loss
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(net.parameters(), cfg.max_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        stats.append((policy_loss.item(), value_loss.item()))
    return np.mean(stats, axis=0)


@torch.no_grad()
def arena(candidate, best, cfg, device, games=40):
    a, b = BatchedInference(candidate, device), BatchedInference(best, device)
    score = 0.0
    for g in range(games):
        game, players = Gomoku(cfg.board_size), ((a, b) if g % 2 == 0 else (b, a))
        while game.winner() is None:
            evaluate = players[0] if game.to_play == 1 else players[1]
            game.play(int(np.argmax(run_mcts(game, evaluate, cfg, add_noise=False))))
        w = game.winner()
        score += 0.5 if w == 0 else float((w == 1) == (g % 2 == 0))
    return score / games


def save_checkpoint(net, path):
    torch.save({k: v.half() if v.is_floating_point() else v for k, v in net.state_dict().items()}, path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--games-per-iter", type=int, default=100)
    parser.add_argument("--out", default="runs/gomoku")
    args = parser.parse_args()
    cfg, device = Config(), torch.device("cuda")
    net = PolicyValueNet(cfg).to(device)
    best = copy.deepcopy(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=cfg.lr, momentum=0.9, weight_decay=cfg.weight_decay)
    scaler = make_scaler(cfg.amp)
    buffer = deque(maxlen=cfg.buffer_size)
    best_winrate = -1e9
    os.makedirs(args.out, exist_ok=True)
    for it in range(args.iterations):
        actor = BatchedInference(best, device)
        for _ in range(args.games_per_iter):
            buffer.extend(self_play_game(actor, cfg))
        if len(buffer) < cfg.batch_size * 4:
            continue
        p_loss, v_loss = train_network(net, buffer, optimizer, scaler, cfg, device)
        winrate = arena(net, best, cfg, device)
        print(f"iter {it}: policy {p_loss:.3f} value {v_loss:.3f} winrate {winrate:.2f} buffer {len(buffer)}")
        if winrate >= 0.55:
            best.load_state_dict(net.state_dict())
            save_checkpoint(best, os.path.join(args.out, f"best_{it:04d}.pt"))
        best_winrate = max(best_winrate, winrate)


if __name__ == "__main__":
    main()
