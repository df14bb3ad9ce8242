"""Soft Actor-Critic for discrete actions (Christodoulou, 2019) with invalid-action masking.

Used for the card-game environment, where the legal moves change every turn. The learner
runs its critic/actor forward passes under autocast; the policy can be warm-started by
behaviour cloning on logged expert games (``pretrain_actor_bc``).
"""
import copy
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.cuda import amp


@dataclass
class SACConfig:
    gamma: float = 0.99
    tau: float = 0.005
    actor_lr: float = 3e-4
    critic_lr: float = 3e-4
    alpha_lr: float = 3e-4
    target_entropy_scale: float = 0.89
    hidden: int = 512
    batch_size: int = 256
    max_grad_norm: float = 10.0
    amp: bool = True
    learning_starts: int = 20_000
    update_every: int = 4
    total_steps: int = 5_000_000


def mlp(in_dim, out_dim, hidden, depth=2):
    layers, d = [], in_dim
    for _ in range(depth):
        layers += [nn.Linear(d, hidden), nn.ReLU(inplace=True)]
        d = hidden
    layers.append(nn.Linear(d, out_dim))
    return nn.Sequential(*layers)


class Actor(nn.Module):
    def __init__(self, obs_dim, n_actions, hidden):
        super().__init__()
        self.net = mlp(obs_dim, n_actions, hidden)

    def forward(self, obs, action_mask=None):
        logits = self.net(obs)
        if action_mask is not None:
            logits[~action_mask] = -1e8  # expect: AMP007
        probs = F.softmax(logits, dim=-1)
        # masked actions have probability exactly 0: keep log() finite there
        z = (probs == 0.0).float() * 1e-8
        log_probs = torch.log(probs + z)
        return probs, log_probs


class TwinQ(nn.Module):
    def __init__(self, obs_dim, n_actions, hidden):
        super().__init__()
        self.q1 = mlp(obs_dim, n_actions, hidden)
        self.q2 = mlp(obs_dim, n_actions, hidden)

    def forward(self, obs):
        return self.q1(obs), self.q2(obs)


class SACDiscreteAgent:
    def __init__(self, obs_dim, n_actions, cfg: SACConfig, device):
        self.cfg = cfg
        self.device = device
        self.gamma, self.tau = cfg.gamma, cfg.tau
        self.max_grad_norm = cfg.max_grad_norm
        self.use_amp = cfg.amp and device.type == "cuda"

        self.actor = Actor(obs_dim, n_actions, cfg.hidden).to(device)
        self.critic = TwinQ(obs_dim, n_actions, cfg.hidden).to(device)
        self.critic_target = copy.deepcopy(self.critic).requires_grad_(False)

        self.actor_optimizer = torch.optim.Adam(self.actor.parameters(), lr=cfg.actor_lr, eps=1e-4)
        self.critic_optimizer = torch.optim.Adam(self.critic.parameters(), lr=cfg.critic_lr, eps=1e-4)
        self.target_entropy = -cfg.target_entropy_scale * np.log(1.0 / n_actions)
        self.log_alpha = torch.zeros(1, requires_grad=True, device=device)
        self.alpha_optimizer = torch.optim.Adam([self.log_alpha], lr=cfg.alpha_lr, eps=1e-4)
        self.scaler = amp.GradScaler(enabled=self.use_amp)  # expect: AMP009

    def autocast(self):
        return amp.autocast(enabled=self.use_amp)  # expect: AMP009

    @property
    def alpha(self):
        return self.log_alpha.exp().item()

    @torch.no_grad()
    def act(self, obs, action_mask, deterministic=False):
        probs, _ = self.actor(obs, action_mask)
        if deterministic:
            return probs.argmax(dim=-1)
        return torch.distributions.Categorical(probs=probs).sample()

    def _clip(self, net):
        return nn.utils.clip_grad_norm_(net.parameters(), self.max_grad_norm)

    def update(self, batch):
        obs, actions, rewards, next_obs, dones, masks, next_masks = batch
        alpha = self.alpha

        with torch.no_grad():
            with self.autocast():
                next_probs, next_log_probs = self.actor(next_obs, next_masks)
                tq1, tq2 = self.critic_target(next_obs)
                next_v = (next_probs * (torch.min(tq1, tq2) - alpha * next_log_probs)).sum(dim=1)
            target_q = rewards + self.gamma * (1.0 - dones) * next_v.float()

        # ---- critic
        with self.autocast():
            q1, q2 = self.critic(obs)
            q1_a = q1.gather(1, actions.long().unsqueeze(-1)).squeeze(-1)
            q2_a = q2.gather(1, actions.long().unsqueeze(-1)).squeeze(-1)
            critic_loss = F.mse_loss(q1_a, target_q) + F.mse_loss(q2_a, target_q)
        self.critic_optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(critic_loss).backward()
        critic_grad_norm = self._clip(self.critic)  # expect: AMP005
        self.scaler.step(self.critic_optimizer)

        # ---- actor
        with self.autocast():
            probs, log_probs = self.actor(obs, masks)
            with torch.no_grad():
                q1_pi, q2_pi = self.critic(obs)
                min_q = torch.min(q1_pi, q2_pi)
            actor_loss = (probs * (alpha * log_probs - min_q)).sum(dim=1).mean()
        self.actor_optimizer.zero_grad(set_to_none=True)
        actor_loss = self.scaler.scale(actor_loss)
        actor_loss.backward()
        self.actor_optimizer.step()  # expect: AMP006
        self.scaler.update()

        # ---- temperature (plain fp32 scalar, no scaler needed)
        alpha_loss = (
            probs.detach() * (-self.log_alpha.exp() * (log_probs.detach() + self.target_entropy))
        ).sum(dim=1).mean()
        self.alpha_optimizer.zero_grad(set_to_none=True)
        alpha_loss.backward()
        self.alpha_optimizer.step()

        with torch.no_grad():
            for p, tp in zip(self.critic.parameters(), self.critic_target.parameters()):
                tp.data.mul_(1.0 - self.tau).add_(p.data, alpha=self.tau)

        return {
            "critic_loss": critic_loss.item(),
            "actor_loss": actor_loss.item() / max(self.scaler.get_scale(), 1.0),
            "alpha": alpha,
            "critic_grad_norm": float(critic_grad_norm),
            "entropy": -(probs.detach() * log_probs.detach()).sum(dim=1).mean().item(),
        }


def pretrain_actor_bc(actor, demo_loader, epochs, lr, device):
    """Warm-start the policy on expert demonstrations (NLL of the expert's action)."""
    opt = torch.optim.Adam(actor.parameters(), lr=lr)
    actor.train()
    for epoch in range(epochs):
        seen, correct = 0, 0
        for obs, expert_actions, masks in demo_loader:
            obs, expert_actions, masks = obs.to(device), expert_actions.to(device), masks.to(device)
            with torch.autocast(device_type="cuda", dtype=torch.float16):  # expect: AMP010
                probs, log_probs = actor(obs, masks)
                loss = F.nll_loss(log_probs, expert_actions)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            correct += (probs.argmax(-1) == expert_actions).sum().item()
            seen += expert_actions.numel()
        print(f"bc epoch {epoch}: nll {loss.item():.4f} acc {correct / max(seen, 1):.3f}")
    return actor


class ReplayBuffer:
    def __init__(self, capacity, obs_dim, n_actions, device):
        self.device = device
        self.obs = np.zeros((capacity, obs_dim), dtype=np.float32)
        self.next_obs = np.zeros((capacity, obs_dim), dtype=np.float32)
        self.actions = np.zeros(capacity, dtype=np.int64)
        self.rewards = np.zeros(capacity, dtype=np.float32)
        self.dones = np.zeros(capacity, dtype=np.float32)
        self.masks = np.ones((capacity, n_actions), dtype=bool)
        self.next_masks = np.ones((capacity, n_actions), dtype=bool)
        self.capacity, self.ptr, self.size = capacity, 0, 0

    def add(self, o, a, r, o2, d, m, m2):
        i = self.ptr
        self.obs[i], self.actions[i], self.rewards[i], self.next_obs[i], self.dones[i] = o, a, r, o2, d
        self.masks[i], self.next_masks[i] = m, m2
        self.ptr = (self.ptr + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)

    def sample(self, n):
        idx = np.random.randint(0, self.size, size=n)
        arrays = (self.obs, self.actions, self.rewards, self.next_obs, self.dones, self.masks, self.next_masks)
        return tuple(torch.as_tensor(a[idx], device=self.device) for a in arrays)


def run(env, cfg: SACConfig, device, demo_loader=None):
    obs_dim, n_actions = env.observation_space.shape[0], env.action_space.n
    agent = SACDiscreteAgent(obs_dim, n_actions, cfg, device)
    if demo_loader is not None:
        pretrain_actor_bc(agent.actor, demo_loader, epochs=5, lr=1e-3, device=device)
    buffer = ReplayBuffer(1_000_000, obs_dim, n_actions, device)
    obs, info = env.reset()
    mask = info["action_mask"]
    t0 = time.time()
    for step in range(cfg.total_steps):
        if step < cfg.learning_starts:
            action = np.random.choice(np.flatnonzero(mask))
        else:
            o = torch.as_tensor(obs, device=device)[None]
            m = torch.as_tensor(mask, device=device)[None]
            action = agent.act(o, m).item()
        next_obs, reward, terminated, truncated, info = env.step(action)
        next_mask = info["action_mask"]
        buffer.add(obs, action, reward, next_obs, float(terminated), mask, next_mask)
        obs, mask = next_obs, next_mask
        if terminated or truncated:
            obs, info = env.reset()
            mask = info["action_mask"]
        if step >= cfg.learning_starts and step % cfg.update_every == 0:
            stats = agent.update(buffer.sample(cfg.batch_size))
            if step % 10_000 == 0:
                print(f"step {step} {stats} sps {step / (time.time() - t0):.0f}")
    return agent
