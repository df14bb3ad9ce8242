"""Soft Actor-Critic from pixels (SAC-AE style) for DeepMind Control tasks.

Mixed precision is used for the conv encoder / MLP heads; the temperature and
the target computation stay in fp32.

    python train_sac.py --env cheetah_run --amp --steps 500000
"""
import argparse
import copy
import logging
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, asdict

import numpy as np
import torch as th
from torch import nn
import torch.nn.functional as F

from rl_utils.envs import make_dmc_env
from rl_utils.logger import MetricLogger

log = logging.getLogger("sac")

LOG_STD_MIN, LOG_STD_MAX = -10.0, 2.0


@dataclass
class SACConfig:
    env: str = "cheetah_run"
    seed: int = 1
    steps: int = 500_000
    init_steps: int = 1000
    batch_size: int = 128
    buffer_size: int = 100_000
    gamma: float = 0.99
    tau: float = 0.01
    actor_lr: float = 1e-3
    critic_lr: float = 1e-3
    alpha_lr: float = 1e-4
    init_temperature: float = 0.1
    feature_dim: int = 50
    hidden_dim: int = 1024
    actor_update_freq: int = 2
    target_update_freq: int = 2
    rollout_sync_freq: int = 1000
    grad_clip: float = 10.0
    amp: bool = False
    bc_steps: int = 0
    demo_path: str = ""
    ae_pretrain_steps: int = 0
    eval_every: int = 10_000
    eval_episodes: int = 10
    work_dir: str = "runs/sac"


class ReplayBuffer:
    """Uint8 frames on the host, sampled batches moved to the device."""

    def __init__(self, obs_shape, action_dim, capacity, device):
        self.capacity, self.device = capacity, device
        self.obses = np.empty((capacity, *obs_shape), dtype=np.uint8)
        self.next_obses = np.empty((capacity, *obs_shape), dtype=np.uint8)
        self.actions = np.empty((capacity, action_dim), dtype=np.float32)
        self.rewards = np.empty((capacity, 1), dtype=np.float32)
        self.not_dones = np.empty((capacity, 1), dtype=np.float32)
        self.idx, self.full = 0, False

    def __len__(self):
        return self.capacity if self.full else self.idx

    def add(self, obs, action, reward, next_obs, done):
        np.copyto(self.obses[self.idx], obs)
        np.copyto(self.actions[self.idx], action)
        np.copyto(self.rewards[self.idx], reward)
        np.copyto(self.next_obses[self.idx], next_obs)
        np.copyto(self.not_dones[self.idx], not done)
        self.idx = (self.idx + 1) % self.capacity
        self.full = self.full or self.idx == 0

    def sample(self, batch_size):
        idxs = np.random.randint(0, len(self), size=batch_size)
        to = lambda a: th.as_tensor(a[idxs], device=self.device)
        return to(self.obses), to(self.actions), to(self.rewards), to(self.next_obses), to(self.not_dones)


def preprocess_obs(obs):
    return obs.float() / 255.0 - 0.5


class PixelEncoder(nn.Module):
    def __init__(self, obs_shape, feature_dim, num_layers=4, num_filters=32):
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv2d(obs_shape[0], num_filters, 3, stride=2)])
        for _ in range(num_layers - 1):
            self.convs.append(nn.Conv2d(num_filters, num_filters, 3, stride=1))
        out_dim = {2: 39, 4: 35, 6: 31}[num_layers]
        self.fc = nn.Linear(num_filters * out_dim * out_dim, feature_dim)
        self.ln = nn.LayerNorm(feature_dim)
        self.feature_dim = feature_dim

    def forward(self, obs, detach=False):
        h = obs / 255.0
        for conv in self.convs:
            h = F.relu(conv(h))
        h = h.flatten(1)
        if detach:
            h = h.detach()
        return th.tanh(self.ln(self.fc(h)))


class PixelDecoder(nn.Module):
    def __init__(self, obs_shape, feature_dim, num_filters=32):
        super().__init__()
        self.fc = nn.Linear(feature_dim, num_filters * 35 * 35)
        self.deconvs = nn.ModuleList([nn.ConvTranspose2d(num_filters, num_filters, 3, stride=1) for _ in range(3)])
        self.out = nn.ConvTranspose2d(num_filters, obs_shape[0], 3, stride=2, output_padding=1)
        self.num_filters = num_filters

    def forward(self, h):
        x = F.relu(self.fc(h)).view(-1, self.num_filters, 35, 35)
        for deconv in self.deconvs:
            x = F.relu(deconv(x))
        return self.out(x)


def mlp(in_dim, hidden_dim, out_dim):
    return nn.Sequential(nn.Linear(in_dim, hidden_dim), nn.ReLU(inplace=True),
                         nn.Linear(hidden_dim, hidden_dim), nn.ReLU(inplace=True),
                         nn.Linear(hidden_dim, out_dim))


def gaussian_logprob(noise, log_std):
    residual = (-0.5 * noise.pow(2) - log_std).sum(-1, keepdim=True)
    return residual - 0.5 * np.log(2 * np.pi) * noise.size(-1)


def squash(mu, pi, log_pi):
    mu, pi = th.tanh(mu), th.tanh(pi)
    if log_pi is not None:
        log_pi = log_pi - th.log(F.relu(1 - pi.pow(2)) + 1e-6).sum(-1, keepdim=True)
    return mu, pi, log_pi


class Actor(nn.Module):
    def __init__(self, obs_shape, action_dim, cfg):
        super().__init__()
        self.encoder = PixelEncoder(obs_shape, cfg.feature_dim)
        self.trunk = mlp(cfg.feature_dim, cfg.hidden_dim, 2 * action_dim)

    def forward(self, obs, compute_pi=True, compute_log_pi=True, detach_encoder=False):
        h = self.encoder(obs, detach=detach_encoder)
        mu, log_std = self.trunk(h).chunk(2, dim=-1)
        log_std = th.tanh(log_std)
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1)
        pi = log_pi = None
        if compute_pi:
            noise = th.randn_like(mu)
            pi = mu + noise * log_std.exp()
            log_pi = gaussian_logprob(noise, log_std) if compute_log_pi else None
        return (*squash(mu, pi, log_pi), log_std)


class Critic(nn.Module):
    def __init__(self, obs_shape, action_dim, cfg):
        super().__init__()
        self.encoder = PixelEncoder(obs_shape, cfg.feature_dim)
        self.q1 = mlp(cfg.feature_dim + action_dim, cfg.hidden_dim, 1)
        self.q2 = mlp(cfg.feature_dim + action_dim, cfg.hidden_dim, 1)

    def forward(self, obs, action, detach_encoder=False):
        h = th.cat([self.encoder(obs, detach=detach_encoder), action], dim=-1)
        return self.q1(h), self.q2(h)


class SACAgent:
    def __init__(self, obs_shape, action_dim, cfg: SACConfig, device):
        self.cfg, self.device = cfg, device
        self.actor = Actor(obs_shape, action_dim, cfg).to(device)
        self.critic = Critic(obs_shape, action_dim, cfg).to(device)
        self.critic_target = copy.deepcopy(self.critic).requires_grad_(False)
        self.log_alpha = th.tensor(math.log(cfg.init_temperature), device=device, requires_grad=True)
        self.target_entropy = -float(action_dim)

        self.actor_opt = th.optim.Adam(self.actor.parameters(), lr=cfg.actor_lr, betas=(0.9, 0.999))
        self.critic_opt = th.optim.Adam(self.critic.parameters(), lr=cfg.critic_lr, betas=(0.9, 0.999))
        self.alpha_opt = th.optim.Adam([self.log_alpha], lr=cfg.alpha_lr, betas=(0.5, 0.999))
        self.scaler = th.amp.GradScaler("cuda", enabled=cfg.amp)
        self.sync_rollout_actor()

    @property
    def alpha(self):
        return self.log_alpha.exp()

    def sync_rollout_actor(self):
        # fp16 copy used only to act in the environment
        self.rollout_actor = copy.deepcopy(self.actor).requires_grad_(False).half().eval()

    def act(self, obs, sample=False):
        with th.no_grad():
            obs = th.as_tensor(obs, device=self.device, dtype=th.float16).unsqueeze(0)
            mu, pi, _, _ = self.rollout_actor(obs, compute_pi=sample, compute_log_pi=False)
            return (pi if sample else mu).float().cpu().numpy()[0]

    def update_critic(self, obs, action, reward, next_obs, not_done):
        with th.no_grad():
            with th.autocast("cuda", dtype=th.float16, enabled=self.cfg.amp):
                _, next_action, next_log_pi, _ = self.actor(next_obs)
                target_q1, target_q2 = self.critic_target(next_obs, next_action)
            target_v = th.min(target_q1, target_q2).float() - self.alpha.detach() * next_log_pi.float()
            target_q = reward + not_done * self.cfg.gamma * target_v

        with th.autocast("cuda", dtype=th.float16, enabled=self.cfg.amp):
            current_q1, current_q2 = self.critic(obs, action)
            critic_loss = F.mse_loss(current_q1, target_q) + F.mse_loss(current_q2, target_q)

        self.critic_opt.zero_grad(set_to_none=True)
        self.scaler.scale(critic_loss).backward()
        self.scaler.unscale_(self.critic_opt)
        th.nn.utils.clip_grad_norm_(self.critic.parameters(), self.cfg.grad_clip)
        self.scaler.step(self.critic_opt)
        self.scaler.update()
        return {"critic_loss": critic_loss.item(), "q1": current_q1.float().mean().item()}

    def update_actor(self, obs):
        with th.autocast("cuda", dtype=th.float16, enabled=self.cfg.amp):
            # the actor never updates the conv encoder
            _, pi, log_pi, log_std = self.actor(obs, detach_encoder=True)
            actor_q1, actor_q2 = self.critic(obs, pi, detach_encoder=True)
            actor_q = th.min(actor_q1, actor_q2)
            actor_loss = (self.alpha.detach() * log_pi - actor_q.float()).mean()

        self.actor_opt.zero_grad(set_to_none=True)
        self.scaler.scale(actor_loss).backward()
        self.actor_opt.step()  # expect: AMP006
        return log_pi.detach().float(), {"actor_loss": actor_loss.item(), "log_std": log_std.float().mean().item()}

    def update_alpha(self, log_pi):
        alpha_loss = (self.alpha * (-log_pi - self.target_entropy)).mean()
        self.alpha_opt.zero_grad(set_to_none=True)
        alpha_loss.backward()
        self.alpha_opt.step()
        return {"alpha_loss": alpha_loss.item(), "alpha": self.alpha.item()}

    @th.no_grad()
    def soft_update_targets(self):
        for p, tp in zip(self.critic.parameters(), self.critic_target.parameters()):
            tp.data.lerp_(p.data, self.cfg.tau)

    def update(self, buffer, step):
        obs, action, reward, next_obs, not_done = buffer.sample(self.cfg.batch_size)
        metrics = self.update_critic(obs, action, reward, next_obs, not_done)
        if step % self.cfg.actor_update_freq == 0:
            log_pi, actor_metrics = self.update_actor(obs)
            metrics.update(actor_metrics)
            metrics.update(self.update_alpha(log_pi))
        if step % self.cfg.target_update_freq == 0:
            self.soft_update_targets()
        if step % self.cfg.rollout_sync_freq == 0:
            self.sync_rollout_actor()
        return metrics

    def state_dict(self):
        return {
            "actor": self.actor.state_dict(),
            "critic": self.critic.state_dict(),
            "critic_target": self.critic_target.state_dict(),
            "log_alpha": self.log_alpha.detach().cpu(),
            "actor_opt": self.actor_opt.state_dict(),
            "critic_opt": self.critic_opt.state_dict(),
            "alpha_opt": self.alpha_opt.state_dict(),
            "scaler": self.scaler.state_dict(),
        }


def pretrain_bc(actor, demos, cfg, device):
    """Behaviour-cloning warm start of the actor from expert demonstrations."""
    opt = th.optim.Adam(actor.parameters(), lr=cfg.actor_lr)
    scaler = th.cuda.amp.GradScaler(enabled=cfg.amp)  # expect: AMP009
    obs_all = th.as_tensor(demos["obs"], device=device)
    act_all = th.as_tensor(demos["actions"], device=device)
    for it in range(cfg.bc_steps):
        idx = th.randint(0, obs_all.shape[0], (cfg.batch_size,), device=device)
        with th.autocast("cuda", dtype=th.float16, enabled=cfg.amp):
            mu, _, _, _ = actor(obs_all[idx], compute_pi=False, compute_log_pi=False)
            bc_loss = F.mse_loss(mu, act_all[idx])
            opt.zero_grad(set_to_none=True)
            scaler.scale(bc_loss).backward()  # expect: AMP008
        scaler.step(opt)
        scaler.update()
        if it % 1000 == 0:
            log.info("bc it %d loss %.4f", it, bc_loss.item())


def pretrain_encoder(encoder, decoder, buffer, cfg):
    """Autoencoder warm-up of the critic's conv encoder on the seed frames."""
    opt = th.optim.Adam(list(encoder.parameters()) + list(decoder.parameters()), lr=1e-3)
    amp_ctx = th.autocast("cuda", dtype=th.float16) if cfg.amp else nullcontext()  # expect: AMP010
    for it in range(cfg.ae_pretrain_steps):
        obs, _, _, _, _ = buffer.sample(cfg.batch_size)
        target = preprocess_obs(obs)
        with amp_ctx:
            h = encoder(obs)
            rec_loss = F.mse_loss(decoder(h), target)
            latent_loss = (0.5 * h.pow(2).sum(1)).mean()
            loss = rec_loss + 1e-6 * latent_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if it % 500 == 0:
            log.info("ae it %d rec %.5f", it, rec_loss.item())


def evaluate(env, agent, num_episodes):
    returns = []
    for _ in range(num_episodes):
        obs, done, ep_ret = env.reset(), False, 0.0
        while not done:
            obs, reward, done, _ = env.step(agent.act(obs, sample=False))
            ep_ret += reward
        returns.append(ep_ret)
    return float(np.mean(returns))


def parse_args():
    parser = argparse.ArgumentParser()
    defaults = SACConfig()
    for name, value in asdict(defaults).items():
        if isinstance(value, bool):
            parser.add_argument(f"--{name.replace('_', '-')}", action="store_true", default=value)
        else:
            parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    return SACConfig(**vars(parser.parse_args()))


def main():
    cfg = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    th.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    device = th.device("cuda" if th.cuda.is_available() else "cpu")
    cfg.amp = cfg.amp and device.type == "cuda"
    os.makedirs(cfg.work_dir, exist_ok=True)

    env = make_dmc_env(cfg.env, seed=cfg.seed, frame_stack=3, image_size=84)
    eval_env = make_dmc_env(cfg.env, seed=cfg.seed + 100, frame_stack=3, image_size=84)
    obs_shape, action_dim = env.observation_space.shape, env.action_space.shape[0]

    agent = SACAgent(obs_shape, action_dim, cfg, device)
    buffer = ReplayBuffer(obs_shape, action_dim, cfg.buffer_size, device)
    logger = MetricLogger(cfg.work_dir)

    if cfg.bc_steps > 0:
        pretrain_bc(agent.actor, np.load(cfg.demo_path), cfg, device)
        agent.sync_rollout_actor()

    obs, episode, ep_ret, t0 = env.reset(), 0, 0.0, time.time()
    for step in range(cfg.steps + 1):
        if step < cfg.init_steps:
            action = env.action_space.sample()
        else:
            action = agent.act(obs, sample=True)
        if step == cfg.init_steps and cfg.ae_pretrain_steps > 0:
            decoder = PixelDecoder(obs_shape, cfg.feature_dim).to(device)
            pretrain_encoder(agent.critic.encoder, decoder, buffer, cfg)
        if step >= cfg.init_steps:
            metrics = agent.update(buffer, step)
            if step % 1000 == 0:
                logger.log(step, metrics)

        next_obs, reward, done, _ = env.step(action)
        buffer.add(obs, action, reward, next_obs, done)
        obs, ep_ret = next_obs, ep_ret + reward
        if done:
            logger.log(step, {"episode": episode, "return": ep_ret, "fps": step / (time.time() - t0)})
            obs, ep_ret, episode = env.reset(), 0.0, episode + 1

        if step > 0 and step % cfg.eval_every == 0:
            eval_return = evaluate(eval_env, agent, cfg.eval_episodes)
            log.info("step %d eval return %.1f", step, eval_return)
            th.save({"step": step, "cfg": asdict(cfg), **agent.state_dict()},
                    os.path.join(cfg.work_dir, f"sac_{step}.pt"))


if __name__ == "__main__":
    main()
