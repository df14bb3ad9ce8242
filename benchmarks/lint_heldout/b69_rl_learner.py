"""Learners for the on-policy (PPO), off-policy (SAC) and IMPALA agents.

Actors collect experience elsewhere (``rl.actors``); the learners here only consume
batches and update parameters.  fp16 autocast + GradScaler is used on the V100 boxes.
"""
import copy
import logging
import time
from dataclasses import dataclass
from functools import partial
from typing import Dict

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Categorical

from rl.buffers import ReplayBuffer, RolloutBuffer
from rl.networks import ActorCritic, ImpalaNet, SquashedGaussianActor, TwinQ
from rl import vtrace

log = logging.getLogger(__name__)


def make_scaler(enabled: bool):
    try:
        return torch.amp.GradScaler("cuda", enabled=enabled)
    except (AttributeError, TypeError):  # torch < 2.3
        return torch.cuda.amp.GradScaler(enabled=enabled)


@dataclass
class PPOConfig:
    lr: float = 2.5e-4
    clip_coef: float = 0.2
    vf_coef: float = 0.5
    ent_coef: float = 0.01
    update_epochs: int = 4
    minibatch_size: int = 256
    max_grad_norm: float = 0.5
    amp: bool = True


class PPOLearner:
    def __init__(self, model: ActorCritic, cfg: PPOConfig, device="cuda"):
        self.model = model.to(device)
        self.cfg = cfg
        self.device = device
        self.optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, eps=1e-5)
        self.scaler = make_scaler(cfg.amp)
        self.autocast = partial(torch.autocast, device_type="cuda", dtype=torch.float16, enabled=cfg.amp)

    def update(self, buffer: RolloutBuffer) -> Dict[str, float]:
        cfg = self.cfg
        adv = buffer.advantages
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        stats = {"pg_loss": 0.0, "v_loss": 0.0, "entropy": 0.0, "approx_kl": 0.0}
        n_updates = 0
        for _ in range(cfg.update_epochs):
            for idx in buffer.minibatch_indices(cfg.minibatch_size):
                obs, actions = buffer.obs[idx], buffer.actions[idx]
                old_logp, returns = buffer.logprobs[idx], buffer.returns[idx]
                mb_adv = adv[idx]

                with self.autocast():
                    logits, values = self.model(obs)
                    dist = Categorical(logits=logits.float())
                    new_logp = dist.log_prob(actions)
                    entropy = dist.entropy().mean()
                    log_ratio = new_logp - old_logp
                    ratio = log_ratio.exp()
                    pg_loss = torch.max(-mb_adv * ratio,
                                        -mb_adv * ratio.clamp(1 - cfg.clip_coef, 1 + cfg.clip_coef)).mean()
                v_loss = 0.5 * F.mse_loss(values.squeeze(-1), returns)  # expect: AMP002
                loss = pg_loss + cfg.vf_coef * v_loss - cfg.ent_coef * entropy

                self.optimizer.zero_grad(set_to_none=True)
                self.scaler.scale(loss).backward()
                self.scaler.unscale_(self.optimizer)
                nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
                self.scaler.step(self.optimizer)
                self.scaler.update()

                with torch.no_grad():
                    stats["approx_kl"] += ((ratio - 1) - log_ratio).mean().item()
                stats["pg_loss"] += pg_loss.item()
                stats["v_loss"] += v_loss.item()
                stats["entropy"] += entropy.item()
                n_updates += 1
        return {k: v / max(n_updates, 1) for k, v in stats.items()}


class SACLearner:
    def __init__(self, obs_dim, act_dim, device="cuda", lr=3e-4, gamma=0.99, tau=0.005,
                 max_grad_norm=10.0, amp=True):
        self.device = device
        self.gamma = gamma
        self.tau = tau
        self.max_grad_norm = max_grad_norm
        self.actor = SquashedGaussianActor(obs_dim, act_dim).to(device)
        self.critic = TwinQ(obs_dim, act_dim).to(device)
        self.critic_target = copy.deepcopy(self.critic).requires_grad_(False)
        self.log_alpha = torch.zeros(1, device=device, requires_grad=True)
        self.target_entropy = -float(act_dim)
        self.actor_opt = torch.optim.Adam(self.actor.parameters(), lr=lr)
        self.critic_opt = torch.optim.Adam(self.critic.parameters(), lr=lr)
        self.alpha_opt = torch.optim.Adam([self.log_alpha], lr=lr)
        self.scaler = torch.amp.GradScaler("cuda", enabled=amp)
        self.autocast = partial(torch.autocast, "cuda", dtype=torch.float16, enabled=amp)

    @property
    def alpha(self):
        return self.log_alpha.exp()

    def update(self, batch) -> Dict[str, float]:
        obs, act, rew, next_obs, done = (batch[k] for k in ("obs", "act", "rew", "next_obs", "done"))
        alpha = self.alpha.detach()

        with torch.no_grad(), self.autocast():
            next_act, next_logp = self.actor.sample(next_obs)
            tq1, tq2 = self.critic_target(next_obs, next_act)
            next_v = torch.min(tq1, tq2).float() - alpha * next_logp.float()
            target_q = rew + self.gamma * (1.0 - done) * next_v

        # critic
        with self.autocast():
            q1, q2 = self.critic(obs, act)
            critic_loss = F.mse_loss(q1.float(), target_q) + F.mse_loss(q2.float(), target_q)
        self.critic_opt.zero_grad(set_to_none=True)
        self.scaler.scale(critic_loss).backward()
        nn.utils.clip_grad_norm_(self.critic.parameters(), self.max_grad_norm)  # expect: AMP005
        self.scaler.step(self.critic_opt)

        # actor
        with self.autocast():
            pi, logp = self.actor.sample(obs)
            q1_pi, q2_pi = self.critic(obs, pi)
            actor_loss = (alpha * logp.float() - torch.min(q1_pi, q2_pi).float()).mean()
        self.actor_opt.zero_grad(set_to_none=True)
        self.scaler.scale(actor_loss).backward()
        self.actor_opt.step()  # expect: AMP006
        self.scaler.update()

        # temperature (fp32, tiny graph)
        alpha_loss = -(self.log_alpha * (logp.detach().float() + self.target_entropy)).mean()
        self.alpha_opt.zero_grad(set_to_none=True)
        alpha_loss.backward()
        self.alpha_opt.step()

        with torch.no_grad():
            for p, tp in zip(self.critic.parameters(), self.critic_target.parameters()):
                tp.lerp_(p, self.tau)
        return {"critic_loss": critic_loss.item(), "actor_loss": actor_loss.item(),
                "alpha": alpha.item(), "scale": self.scaler.get_scale()}

    def state_dict(self):
        return {"actor": self.actor.state_dict(), "critic": self.critic.state_dict(),
                "critic_target": self.critic_target.state_dict(), "log_alpha": self.log_alpha.detach(),
                "scaler": self.scaler.state_dict()}


def train_sac(env_fn, total_steps=1_000_000, batch_size=256, start_steps=10_000, device="cuda"):
    env = env_fn()
    learner = SACLearner(env.observation_space.shape[0], env.action_space.shape[0], device=device)
    buffer = ReplayBuffer(env.observation_space.shape, env.action_space.shape, size=1_000_000, device=device)
    obs, _ = env.reset()
    for t in range(total_steps):
        if t < start_steps:
            action = env.action_space.sample()
        else:
            with torch.no_grad():
                action = learner.actor.act(torch.as_tensor(obs, device=device).unsqueeze(0)).cpu().numpy()[0]
        next_obs, reward, terminated, truncated, _ = env.step(action)
        buffer.add(obs, action, reward, next_obs, terminated)
        obs = env.reset()[0] if terminated or truncated else next_obs
        if t >= start_steps:
            stats = learner.update(buffer.sample(batch_size))
            if t % 5000 == 0:
                log.info("t=%d %s", t, stats)
    return learner


def train_impala(cfg, batch_queue, param_server):
    """Single-GPU IMPALA learner; actors pull weights from ``param_server``."""
    device = torch.device("cuda")
    model = ImpalaNet(cfg.obs_shape, cfg.num_actions).to(device)
    # halves learner memory so the unroll batch fits on one card
    model = model.half()  # expect: AMP001
    optimizer = torch.optim.RMSprop(model.parameters(), lr=cfg.lr, momentum=0.0, eps=0.01, alpha=0.99)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - min(s * cfg.unroll * cfg.batch_size, cfg.total_frames) / cfg.total_frames)

    step, start = 0, time.time()
    while step * cfg.unroll * cfg.batch_size < cfg.total_frames:
        batch = batch_queue.get()
        batch = {k: v.to(device, non_blocking=True).half() if v.is_floating_point() else v.to(device, non_blocking=True)  # expect: AMP001
                 for k, v in batch.items()}
        logits, baseline = model(batch["obs"])
        logits, baseline = logits.float(), baseline.float()
        bootstrap = baseline[-1]
        logits, baseline = logits[:-1], baseline[:-1]

        target_logp = -F.cross_entropy(logits.flatten(0, 1), batch["action"][1:].flatten(), reduction="none")
        target_logp = target_logp.view_as(batch["action"][1:])
        vt = vtrace.from_logits(
            behavior_logits=batch["policy_logits"][1:].float(), target_logits=logits.detach(),
            actions=batch["action"][1:], discounts=(~batch["done"][1:]).float() * cfg.discount,
            rewards=batch["reward"][1:].float().clamp(-1, 1), values=baseline.detach(), bootstrap_value=bootstrap.detach())

        pg_loss = -(target_logp * vt.pg_advantages).sum()
        baseline_loss = cfg.baseline_cost * 0.5 * (vt.vs - baseline).pow(2).sum()
        entropy_loss = cfg.entropy_cost * (F.softmax(logits, -1) * F.log_softmax(logits, -1)).sum()
        loss = pg_loss + baseline_loss + entropy_loss

        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_norm_clipping)
        optimizer.step()
        scheduler.step()
        param_server.publish({k: v.detach().float().cpu() for k, v in model.state_dict().items()})

        step += 1
        if step % 100 == 0:
            sps = step * cfg.unroll * cfg.batch_size / (time.time() - start)
            log.info("step %d loss %.3f pg %.3f v %.3f sps %.0f", step, loss.item(), pg_loss.item(),
                     baseline_loss.item(), sps)
    return model


@torch.no_grad()
def evaluate_policy(model, env_fn, episodes=10, device="cuda"):
    env = env_fn()
    policy = copy.deepcopy(model).eval()
    returns = []
    for _ in range(episodes):
        obs, _ = env.reset()
        done, ep_ret = False, 0.0
        while not done:
            with torch.autocast("cuda", dtype=torch.float16):
                logits, _ = policy(torch.as_tensor(obs, device=device).unsqueeze(0))
            action = logits.float().argmax(-1).item()
            obs, r, term, trunc, _ = env.step(action)
            ep_ret += r
            done = term or trunc
        returns.append(ep_ret)
    return sum(returns) / len(returns)
