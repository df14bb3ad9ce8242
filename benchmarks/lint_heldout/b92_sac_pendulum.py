"""Soft Actor-Critic for continuous control (Pendulum / HalfCheetah).

Optional behaviour-cloning warm start from a demo buffer (--demos path.npz).
"""
import argparse
import copy

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributions import Normal

LOG_STD_MIN, LOG_STD_MAX = -5, 2


def mlp(in_dim, out_dim, hidden=256):
    return nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, out_dim))


class Actor(nn.Module):
    def __init__(self, obs_dim, act_dim, act_scale):
        super().__init__()
        self.net = mlp(obs_dim, 2 * act_dim)
        self.register_buffer("act_scale", torch.as_tensor(act_scale, dtype=torch.float32))

    def forward(self, obs):
        mu, log_std = self.net(obs).float().chunk(2, dim=-1)
        log_std = torch.tanh(log_std)
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1)
        return mu, log_std

    def sample(self, obs):
        mu, log_std = self(obs)
        dist = Normal(mu, log_std.exp())
        x_t = dist.rsample()
        y_t = torch.tanh(x_t)
        action = y_t * self.act_scale
        log_prob = dist.log_prob(x_t) - torch.log(self.act_scale * (1 - y_t.pow(2)) + 1e-6)
        return action, log_prob.sum(-1, keepdim=True), torch.tanh(mu) * self.act_scale


class Critic(nn.Module):
    def __init__(self, obs_dim, act_dim):
        super().__init__()
        self.q1 = mlp(obs_dim + act_dim, 1)
        self.q2 = mlp(obs_dim + act_dim, 1)

    def forward(self, obs, act):
        x = torch.cat([obs, act], dim=-1)
        return self.q1(x).float(), self.q2(x).float()


class SAC:
    def __init__(self, obs_dim, act_dim, act_scale, device, lr=3e-4, gamma=0.99, tau=0.005,
                 max_grad_norm=None):
        self.device = device
        self.actor = Actor(obs_dim, act_dim, act_scale).to(device)
        self.critic = Critic(obs_dim, act_dim).to(device)
        self.critic_target = copy.deepcopy(self.critic).requires_grad_(False)
        self.actor_opt = torch.optim.Adam(self.actor.parameters(), lr=lr)
        self.critic_opt = torch.optim.Adam(self.critic.parameters(), lr=lr)
        self.log_alpha = torch.zeros(1, device=device, requires_grad=True)
        self.alpha_opt = torch.optim.Adam([self.log_alpha], lr=lr)
        self.target_entropy = -float(act_dim)
        self.gamma, self.tau, self.max_grad_norm = gamma, tau, max_grad_norm
        self.scaler = torch.cuda.amp.GradScaler()  # expect: AMP009

    @property
    def alpha(self):
        return self.log_alpha.exp().detach()

    def pretrain_bc(self, demo_obs, demo_act, steps=2000, batch_size=256):
        opt = torch.optim.Adam(self.actor.parameters(), lr=1e-3)
        for step in range(steps):
            idx = torch.randint(0, demo_obs.shape[0], (batch_size,), device=self.device)
            with torch.autocast(device_type="cuda", dtype=torch.float16):  # expect: AMP010
                _, _, mean_action = self.actor.sample(demo_obs[idx])
                bc_loss = F.mse_loss(mean_action, demo_act[idx])
            opt.zero_grad(set_to_none=True)
            bc_loss.backward()
            opt.step()
            if step % 500 == 0:
                print(f"bc step {step}: {bc_loss.item():.4f}")

    def update(self, obs, act, rew, next_obs, done):
        with torch.no_grad():
            next_a, next_logp, _ = self.actor.sample(next_obs)
            tq1, tq2 = self.critic_target(next_obs, next_a)
            target_q = rew + self.gamma * (1 - done) * (torch.min(tq1, tq2) - self.alpha * next_logp)

        with torch.autocast(device_type="cuda", dtype=torch.float16):
            q1, q2 = self.critic(obs, act)
            critic_loss = F.mse_loss(q1, target_q) + F.mse_loss(q2, target_q)
        self.critic_opt.zero_grad(set_to_none=True)
        self.scaler.scale(critic_loss).backward()
        if self.max_grad_norm is not None:
            nn.utils.clip_grad_norm_(self.critic.parameters(), self.max_grad_norm)  # expect: AMP005
        self.scaler.step(self.critic_opt)

        with torch.autocast(device_type="cuda", dtype=torch.float16):
            pi, logp, _ = self.actor.sample(obs)
            q1_pi, q2_pi = self.critic(obs, pi)
            actor_loss = (self.alpha * logp - torch.min(q1_pi, q2_pi)).mean()
        self.actor_opt.zero_grad(set_to_none=True)
        self.scaler.scale(actor_loss).backward()
        self.actor_opt.step()  # expect: AMP006
        self.scaler.update()

        alpha_loss = self.update_alpha(obs)
        self.soft_update()
        return critic_loss.item(), actor_loss.item(), alpha_loss

    def update_alpha(self, obs):
        with torch.no_grad():
            _, logp, _ = self.actor.sample(obs)
        alpha_loss = -(self.log_alpha * (logp + self.target_entropy)).mean()
        self.alpha_opt.zero_grad(set_to_none=True)
        alpha_loss.backward()
        self.alpha_opt.step()
        return alpha_loss.item()

    @torch.no_grad()
    def soft_update(self):
        for p, tp in zip(self.critic.parameters(), self.critic_target.parameters()):
            tp.data.mul_(1 - self.tau).add_(self.tau * p.data)


class ReplayBuffer:
    def __init__(self, obs_dim, act_dim, size, device):
        self.obs = np.zeros((size, obs_dim), np.float32)
        self.act = np.zeros((size, act_dim), np.float32)
        self.rew = np.zeros((size, 1), np.float32)
        self.next_obs = np.zeros((size, obs_dim), np.float32)
        self.done = np.zeros((size, 1), np.float32)
        self.ptr, self.full, self.size, self.device = 0, False, size, device

    def add(self, o, a, r, o2, d):
        self.obs[self.ptr], self.act[self.ptr], self.rew[self.ptr] = o, a, r
        self.next_obs[self.ptr], self.done[self.ptr] = o2, d
        self.ptr = (self.ptr + 1) % self.size
        self.full = self.full or self.ptr == 0

    def sample(self, n):
        idx = np.random.randint(0, self.size if self.full else self.ptr, n)
        return tuple(torch.as_tensor(x[idx], device=self.device)
                     for x in (self.obs, self.act, self.rew, self.next_obs, self.done))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--env", default="Pendulum-v1")
    ap.add_argument("--steps", type=int, default=200_000)
    ap.add_argument("--start-steps", type=int, default=5000)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--max-grad-norm", type=float, default=None)
    ap.add_argument("--demos", default=None)
    args = ap.parse_args()

    device = torch.device("cuda")
    env = gym.make(args.env)
    obs_dim, act_dim = env.observation_space.shape[0], env.action_space.shape[0]
    agent = SAC(obs_dim, act_dim, env.action_space.high, device, max_grad_norm=args.max_grad_norm)
    buf = ReplayBuffer(obs_dim, act_dim, 1_000_000, device)
    if args.demos:
        demos = np.load(args.demos)
        agent.pretrain_bc(torch.as_tensor(demos["obs"], device=device),
                          torch.as_tensor(demos["act"], device=device))

    o, _ = env.reset(seed=0)
    ep_ret = 0.0
    for t in range(args.steps):
        if t < args.start_steps:
            a = env.action_space.sample()
        else:
            with torch.no_grad():
                a, _, _ = agent.actor.sample(torch.as_tensor(o, device=device).unsqueeze(0))
            a = a.squeeze(0).cpu().numpy()
        o2, r, term, trunc, _ = env.step(a)
        buf.add(o, a, r, o2, float(term))
        o, ep_ret = o2, ep_ret + r
        if term or trunc:
            print(f"t={t} return={ep_ret:.1f}")
            o, _ = env.reset()
            ep_ret = 0.0
        if t >= args.start_steps:
            agent.update(*buf.sample(args.batch_size))


if __name__ == "__main__":
    main()
