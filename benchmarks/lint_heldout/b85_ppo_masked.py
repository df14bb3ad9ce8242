"""PPO with invalid-action masking, separate actor and critic networks.

    python ppo_masked.py --env-id MiniGrid-DoorKey-8x8-v0 --num-envs 16 --total-steps 5_000_000
"""
import argparse
import time
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributions import Categorical
from torch.utils.tensorboard import SummaryWriter


@dataclass
class PPOConfig:
    num_steps: int = 128
    gamma: float = 0.99
    gae_lambda: float = 0.95
    update_epochs: int = 4
    minibatch_size: int = 512
    clip_coef: float = 0.2
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    norm_adv: bool = True
    lr: float = 2.5e-4


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias_const)
    return layer


class Actor(nn.Module):
    def __init__(self, obs_dim, n_actions, hidden=256):
        super().__init__()
        self.net = nn.Sequential(
            layer_init(nn.Linear(obs_dim, hidden)), nn.Tanh(),
            layer_init(nn.Linear(hidden, hidden)), nn.Tanh(),
            layer_init(nn.Linear(hidden, n_actions), std=0.01),
        )

    def forward(self, obs, action_mask):
        logits = self.net(obs)
        return logits.masked_fill(~action_mask, -1e8)  # expect: AMP007


class Critic(nn.Module):
    def __init__(self, obs_dim, hidden=256):
        super().__init__()
        self.net = nn.Sequential(
            layer_init(nn.Linear(obs_dim, hidden)), nn.Tanh(),
            layer_init(nn.Linear(hidden, hidden)), nn.Tanh(),
            layer_init(nn.Linear(hidden, 1), std=1.0),
        )

    def forward(self, obs):
        return self.net(obs).squeeze(-1)


class PPOAgent:
    def __init__(self, obs_dim, n_actions, cfg, device):
        self.cfg = cfg
        self.device = device
        self.actor = Actor(obs_dim, n_actions).to(device)
        self.critic = Critic(obs_dim).to(device)
        self.actor_opt = torch.optim.Adam(self.actor.parameters(), lr=cfg.lr, eps=1e-5)
        self.critic_opt = torch.optim.Adam(self.critic.parameters(), lr=cfg.lr, eps=1e-5)
        self.scaler = torch.cuda.amp.GradScaler()  # expect: AMP009

    @torch.no_grad()
    def collect_rollout(self, envs, obs, mask):
        cfg, n_envs = self.cfg, envs.num_envs
        buf = {k: [] for k in ("obs", "masks", "actions", "logp", "values", "rewards", "dones")}
        for _ in range(cfg.num_steps):
            obs_t = torch.as_tensor(obs, dtype=torch.float32, device=self.device)
            mask_t = torch.as_tensor(mask, dtype=torch.bool, device=self.device)
            dist = Categorical(logits=self.actor(obs_t, mask_t))
            action = dist.sample()
            value = self.critic(obs_t)
            next_obs, reward, term, trunc, info = envs.step(action.cpu().numpy())
            for key, val in (("obs", obs), ("masks", mask), ("actions", action.cpu().numpy()),
                             ("logp", dist.log_prob(action).cpu().numpy()), ("values", value.cpu().numpy()),
                             ("rewards", reward), ("dones", np.logical_or(term, trunc))):
                buf[key].append(val)
            obs, mask = next_obs, info["action_mask"]
        last_value = self.critic(torch.as_tensor(obs, dtype=torch.float32, device=self.device)).cpu().numpy()
        data = {k: np.stack(v) for k, v in buf.items()}
        advantages = np.zeros((cfg.num_steps, n_envs), dtype=np.float32)
        last_gae = np.zeros(n_envs, dtype=np.float32)
        for t in reversed(range(cfg.num_steps)):
            next_v = last_value if t == cfg.num_steps - 1 else data["values"][t + 1]
            not_done = 1.0 - data["dones"][t]
            delta = data["rewards"][t] + cfg.gamma * next_v * not_done - data["values"][t]
            last_gae = delta + cfg.gamma * cfg.gae_lambda * not_done * last_gae
            advantages[t] = last_gae
        data["advantages"] = advantages
        data["returns"] = advantages + data["values"]
        flat = {k: torch.as_tensor(v.reshape(cfg.num_steps * n_envs, *v.shape[2:]), device=self.device) for k, v in data.items()}
        return flat, obs, mask

    def update(self, batch):
        cfg = self.cfg
        n = batch["obs"].shape[0]
        stats = {"policy_loss": 0.0, "value_loss": 0.0, "entropy": 0.0}
        for _ in range(cfg.update_epochs):
            perm = torch.randperm(n, device=self.device)
            for start in range(0, n, cfg.minibatch_size):
                idx = perm[start:start + cfg.minibatch_size]
                obs, masks = batch["obs"][idx].float(), batch["masks"][idx].bool()
                actions, old_logp = batch["actions"][idx], batch["logp"][idx].float()
                returns = batch["returns"][idx].float()
                adv = batch["advantages"][idx].float()
                if cfg.norm_adv:
                    adv = (adv - adv.mean()) / (adv.std() + 1e-8)

                self.actor_opt.zero_grad(set_to_none=True)
                with torch.autocast("cuda", dtype=torch.float16):
                    dist = Categorical(logits=self.actor(obs, masks).float())
                    entropy = dist.entropy().mean()
                    ratio = (dist.log_prob(actions) - old_logp).exp()
                    pg1 = -adv * ratio
                    pg2 = -adv * torch.clamp(ratio, 1 - cfg.clip_coef, 1 + cfg.clip_coef)
                    policy_loss = torch.max(pg1, pg2).mean() - cfg.ent_coef * entropy
                    self.scaler.scale(policy_loss).backward()  # expect: AMP008
                self.scaler.unscale_(self.actor_opt)
                nn.utils.clip_grad_norm_(self.actor.parameters(), cfg.max_grad_norm)
                self.scaler.step(self.actor_opt)

                self.critic_opt.zero_grad(set_to_none=True)
                with torch.autocast("cuda", dtype=torch.float16):
                    values = self.critic(obs)
                value_loss = F.mse_loss(values, returns)  # expect: AMP002
                self.scaler.scale(cfg.vf_coef * value_loss).backward()
                self.critic_opt.step()  # expect: AMP006
                self.scaler.update()

                stats["policy_loss"] += policy_loss.item()
                stats["value_loss"] += value_loss.item()
                stats["entropy"] += entropy.item()
        n_updates = cfg.update_epochs * ((n + cfg.minibatch_size - 1) // cfg.minibatch_size)
        return {k: v / n_updates for k, v in stats.items()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--env-id", default="MiniGrid-DoorKey-8x8-v0")
    p.add_argument("--num-envs", type=int, default=16)
    p.add_argument("--total-steps", type=int, default=5_000_000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--logdir", default="runs/ppo")
    args = p.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device("cuda")
    envs = gym.make_vec(args.env_id, num_envs=args.num_envs, vectorization_mode="sync")
    obs, info = envs.reset(seed=args.seed)
    cfg = PPOConfig()
    agent = PPOAgent(envs.single_observation_space.shape[0], envs.single_action_space.n, cfg, device)
    writer = SummaryWriter(args.logdir)

    global_step, t0 = 0, time.time()
    mask = info["action_mask"]
    while global_step < args.total_steps:
        batch, obs, mask = agent.collect_rollout(envs, obs, mask)
        global_step += cfg.num_steps * args.num_envs
        for key, val in agent.update(batch).items():
            writer.add_scalar(f"losses/{key}", val, global_step)
        writer.add_scalar("charts/sps", global_step / (time.time() - t0), global_step)
        writer.add_scalar("charts/loss_scale", agent.scaler.get_scale(), global_step)
    envs.close()
    writer.close()


if __name__ == "__main__":
    main()
