"""PPO update for a vision-based policy (Atari), with optional mixed precision for the CNN torso."""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributions import Categorical


@dataclass
class PPOConfig:
    clip_eps: float = 0.1
    vf_coef: float = 0.5
    ent_coef: float = 0.01
    epochs: int = 4
    minibatch: int = 256
    max_grad_norm: float = 0.5
    amp: bool = True


class AtariPolicy(nn.Module):
    def __init__(self, n_actions: int):
        super().__init__()
        self.torso = nn.Sequential(
            nn.Conv2d(4, 32, 8, 4), nn.ReLU(), nn.Conv2d(32, 64, 4, 2), nn.ReLU(),
            nn.Conv2d(64, 64, 3, 1), nn.ReLU(), nn.Flatten(), nn.Linear(3136, 512), nn.ReLU(),
        )
        self.pi = nn.Linear(512, n_actions)
        self.v = nn.Linear(512, 1)

    def forward(self, obs):
        h = self.torso(obs / 255.0)
        return self.pi(h), self.v(h).squeeze(-1)


def policy_forward(policy, obs):
    with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
        return policy(obs)


def ppo_update(policy, optimizer, rollout, cfg: PPOConfig):
    """The first version: half-precision forward, no loss scaling."""
    n = rollout["obs"].size(0)
    for _ in range(cfg.epochs):
        for idx in torch.randperm(n, device=rollout["obs"].device).split(cfg.minibatch):
            logits, value = policy_forward(policy, rollout["obs"][idx])
            dist = Categorical(logits=logits.float())
            ratio = (dist.log_prob(rollout["actions"][idx]) - rollout["logp"][idx]).exp()
            adv = rollout["adv"][idx]
            pg = -torch.min(ratio * adv, ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps) * adv).mean()
            vf = F.mse_loss(value.float(), rollout["returns"][idx])
            loss = pg + cfg.vf_coef * vf - cfg.ent_coef * dist.entropy().mean()
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
            optimizer.step()


def ppo_update_scaled(policy, optimizer, scaler, rollout, cfg: PPOConfig):
    n = rollout["obs"].size(0)
    for _ in range(cfg.epochs):
        for idx in torch.randperm(n, device=rollout["obs"].device).split(cfg.minibatch):
            with torch.autocast("cuda", dtype=torch.float16, enabled=cfg.amp):
                logits, value = policy(rollout["obs"][idx])
            dist = Categorical(logits=logits.float())
            ratio = (dist.log_prob(rollout["actions"][idx]) - rollout["logp"][idx]).exp()
            adv = rollout["adv"][idx]
            pg = -torch.min(ratio * adv, ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps) * adv).mean()
            vf = F.smooth_l1_loss(value, rollout["returns"][idx])  # expect: AMP002
            loss = pg + cfg.vf_coef * vf - cfg.ent_coef * dist.entropy().mean()
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
