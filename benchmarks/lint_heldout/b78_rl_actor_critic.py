"""PPO with separate actor / critic networks and optimizers, bf16 autocast.

    python ppo_masked.py --env-id MicroRTS-v0 --num-envs 32 --total-steps 50_000_000

Invalid actions are masked in the policy logits (Huang & Ontañón, 2020).  The critic
is the large network here (it sees the full observation), so it is the one we try to
keep cheap.
"""
import argparse
import logging
import os
import time
from dataclasses import asdict, dataclass

import gymnasium as gym
import numpy as np
import torch as th
import torch.nn.functional as F
from torch import nn
from torch.distributions import Categorical
from torch.utils.tensorboard import SummaryWriter

from rl_common.envs import make_vec_env
from rl_common.demos import load_demonstrations

log = logging.getLogger(__name__)


@dataclass
class PPOConfig:
    env_id: str = "MicroRTS-v0"
    num_envs: int = 32
    num_steps: int = 128
    total_steps: int = 50_000_000
    actor_lr: float = 2.5e-4
    critic_lr: float = 1e-3
    gamma: float = 0.99
    gae_lambda: float = 0.95
    num_minibatches: int = 4
    update_epochs: int = 4
    clip_coef: float = 0.1
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    hidden: int = 512
    use_amp: bool = True
    bc_epochs: int = 0
    seed: int = 1


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias_const)
    return layer


class Actor(nn.Module):
    def __init__(self, obs_dim: int, n_actions: int, hidden: int):
        super().__init__()
        self.net = nn.Sequential(
            layer_init(nn.Linear(obs_dim, hidden)), nn.Tanh(),
            layer_init(nn.Linear(hidden, hidden)), nn.Tanh(),
            layer_init(nn.Linear(hidden, n_actions), std=0.01),
        )

    def forward(self, obs, action_mask=None):
        logits = self.net(obs)
        if action_mask is not None:
            logits = logits.masked_fill(~action_mask, th.finfo(logits.dtype).min)
        return logits


class Critic(nn.Module):
    def __init__(self, obs_dim: int, hidden: int):
        super().__init__()
        self.net = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 2 * hidden)), nn.Tanh(),
            layer_init(nn.Linear(2 * hidden, 2 * hidden)), nn.Tanh(),
            layer_init(nn.Linear(2 * hidden, hidden)), nn.Tanh(),
            layer_init(nn.Linear(hidden, 1), std=1.0),
        )

    def forward(self, obs):
        return self.net(obs).squeeze(-1)


class RolloutBuffer:
    def __init__(self, num_steps, num_envs, obs_dim, n_actions, device):
        shape = (num_steps, num_envs)
        self.obs = th.zeros(shape + (obs_dim,), device=device)
        self.masks = th.zeros(shape + (n_actions,), dtype=th.bool, device=device)
        self.actions = th.zeros(shape, dtype=th.long, device=device)
        self.logprobs = th.zeros(shape, device=device)
        self.rewards = th.zeros(shape, device=device)
        self.dones = th.zeros(shape, device=device)
        self.values = th.zeros(shape, device=device)
        self.advantages = th.zeros(shape, device=device)
        self.returns = th.zeros(shape, device=device)

    def compute_gae(self, next_value, next_done, gamma, gae_lambda):
        lastgaelam = 0
        num_steps = self.rewards.size(0)
        for t in reversed(range(num_steps)):
            if t == num_steps - 1:
                nextnonterminal, nextvalues = 1.0 - next_done, next_value
            else:
                nextnonterminal, nextvalues = 1.0 - self.dones[t + 1], self.values[t + 1]
            delta = self.rewards[t] + gamma * nextvalues * nextnonterminal - self.values[t]
            lastgaelam = delta + gamma * gae_lambda * nextnonterminal * lastgaelam
            self.advantages[t] = lastgaelam
        self.returns = self.advantages + self.values

    def flatten(self):
        n = self.rewards.numel()
        return (self.obs.reshape(n, -1), self.masks.reshape(n, -1), self.actions.reshape(-1),
                self.logprobs.reshape(-1), self.advantages.reshape(-1), self.returns.reshape(-1))


class PPOAgent:
    def __init__(self, actor: Actor, critic: Critic, cfg: PPOConfig, device: th.device):
        self.cfg = cfg
        self.device = device
        self.use_amp = cfg.use_amp and th.cuda.is_bf16_supported()
        self.actor = actor.to(device)
        self.critic = critic.to(device, dtype=th.bfloat16)  # expect: AMP001
        self.actor_opt = th.optim.Adam(self.actor.parameters(), lr=cfg.actor_lr, eps=1e-5)
        self.critic_opt = th.optim.Adam(self.critic.parameters(), lr=cfg.critic_lr, eps=1e-5)
        self.scaler = th.amp.GradScaler("cuda", enabled=self.use_amp)  # expect: AMP010

    @th.inference_mode()
    def act(self, obs, mask):
        with th.autocast("cuda", dtype=th.bfloat16, enabled=self.use_amp):
            logits = self.actor(obs, mask)
            value = self.critic(obs)
        dist = Categorical(logits=logits.float())
        action = dist.sample()
        return action, dist.log_prob(action), value.float()

    def update(self, buf: RolloutBuffer):
        cfg = self.cfg
        b_obs, b_masks, b_actions, b_logprobs, b_adv, b_returns = buf.flatten()
        b_adv = (b_adv - b_adv.mean()) / (b_adv.std() + 1e-8)
        batch_size = b_obs.size(0)
        mb_size = batch_size // cfg.num_minibatches
        stats = {"v_loss": 0.0, "pg_loss": 0.0, "entropy": 0.0, "approx_kl": 0.0}
        for _ in range(cfg.update_epochs):
            perm = th.randperm(batch_size, device=self.device)
            for start in range(0, batch_size, mb_size):
                mb = perm[start:start + mb_size]

                with th.autocast("cuda", dtype=th.bfloat16, enabled=self.use_amp):
                    new_values = self.critic(b_obs[mb])
                    v_loss = F.mse_loss(new_values, b_returns[mb])
                self.critic_opt.zero_grad(set_to_none=True)
                self.scaler.scale(v_loss * cfg.vf_coef).backward()
                self.scaler.unscale_(self.critic_opt)
                nn.utils.clip_grad_norm_(self.critic.parameters(), cfg.max_grad_norm)
                self.scaler.step(self.critic_opt)

                with th.autocast("cuda", dtype=th.bfloat16, enabled=self.use_amp):
                    logits = self.actor(b_obs[mb], b_masks[mb])
                    dist = Categorical(logits=logits.float())
                    new_logp = dist.log_prob(b_actions[mb])
                    entropy = dist.entropy().mean()
                    logratio = new_logp - b_logprobs[mb]
                    ratio = logratio.exp()
                    adv = b_adv[mb]
                    pg_loss = th.max(-adv * ratio, -adv * th.clamp(ratio, 1 - cfg.clip_coef, 1 + cfg.clip_coef)).mean()
                    actor_loss = pg_loss - cfg.ent_coef * entropy
                    self.actor_opt.zero_grad(set_to_none=True)
                    self.scaler.scale(actor_loss).backward()  # expect: AMP008
                self.scaler.unscale_(self.actor_opt)
                nn.utils.clip_grad_norm_(self.actor.parameters(), cfg.max_grad_norm)
                self.scaler.step(self.actor_opt)
                self.scaler.update()

                with th.no_grad():
                    stats["approx_kl"] = ((ratio - 1) - logratio).mean().item()
                stats["v_loss"] = v_loss.item()
                stats["pg_loss"] = pg_loss.item()
                stats["entropy"] = entropy.item()
        return stats

    def state_dict(self):
        return {
            "actor": self.actor.state_dict(),
            "critic": self.critic.state_dict(),
            "actor_opt": self.actor_opt.state_dict(),
            "critic_opt": self.critic_opt.state_dict(),
            "scaler": self.scaler.state_dict(),
        }

    def load_state_dict(self, state):
        self.actor.load_state_dict(state["actor"])
        self.critic.load_state_dict(state["critic"])
        self.actor_opt.load_state_dict(state["actor_opt"])
        self.critic_opt.load_state_dict(state["critic_opt"])
        self.scaler.load_state_dict(state["scaler"])


def pretrain_actor_bc(actor: Actor, demos, cfg: PPOConfig, device, batch_size: int = 512):
    """Warm-start the policy on scripted-bot demonstrations (behaviour cloning)."""
    opt = th.optim.Adam(actor.parameters(), lr=1e-3)
    loader = th.utils.data.DataLoader(demos, batch_size=batch_size, shuffle=True, drop_last=True)
    actor.train()
    for epoch in range(cfg.bc_epochs):
        total, seen = 0.0, 0
        for obs, expert_actions, masks in loader:
            obs, expert_actions, masks = obs.to(device), expert_actions.to(device), masks.to(device)
            with th.autocast("cuda", dtype=th.bfloat16, enabled=cfg.use_amp):
                logits = actor(obs, masks)
            loss = F.cross_entropy(logits, expert_actions)  # expect: AMP002
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.item() * obs.size(0)
            seen += obs.size(0)
        log.info("bc epoch %d: loss %.4f", epoch, total / max(seen, 1))


@th.inference_mode()
def evaluate(agent: PPOAgent, env_id: str, episodes: int = 10, seed: int = 0):
    env = gym.make(env_id)
    returns = []
    for ep in range(episodes):
        obs, info = env.reset(seed=seed + ep)
        done, ep_ret = False, 0.0
        while not done:
            obs_t = th.as_tensor(obs, dtype=th.float32, device=agent.device).unsqueeze(0)
            mask_t = th.as_tensor(info["action_mask"], dtype=th.bool, device=agent.device).unsqueeze(0)
            action = agent.actor(obs_t, mask_t).argmax(-1).item()
            obs, reward, terminated, truncated, info = env.step(action)
            ep_ret += reward
            done = terminated or truncated
        returns.append(ep_ret)
    env.close()
    return float(np.mean(returns)), float(np.std(returns))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--env-id", default=PPOConfig.env_id)
    p.add_argument("--num-envs", type=int, default=PPOConfig.num_envs)
    p.add_argument("--total-steps", type=int, default=PPOConfig.total_steps)
    p.add_argument("--no-amp", action="store_true")
    p.add_argument("--bc-epochs", type=int, default=0)
    p.add_argument("--resume", default="")
    p.add_argument("--run-dir", default="runs/ppo")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()

    cfg = PPOConfig(env_id=args.env_id, num_envs=args.num_envs, total_steps=args.total_steps,
                    use_amp=not args.no_amp, bc_epochs=args.bc_epochs, seed=args.seed)
    th.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    device = th.device("cuda" if th.cuda.is_available() else "cpu")
    writer = SummaryWriter(args.run_dir)
    writer.add_text("config", str(asdict(cfg)))

    envs = make_vec_env(cfg.env_id, cfg.num_envs, seed=cfg.seed)
    obs_dim = int(np.prod(envs.single_observation_space.shape))
    n_actions = envs.single_action_space.n
    agent = PPOAgent(Actor(obs_dim, n_actions, cfg.hidden), Critic(obs_dim, cfg.hidden), cfg, device)
    if args.resume:
        agent.load_state_dict(th.load(args.resume, map_location=device))
    if cfg.bc_epochs > 0:
        pretrain_actor_bc(agent.actor, load_demonstrations(cfg.env_id), cfg, device)

    buf = RolloutBuffer(cfg.num_steps, cfg.num_envs, obs_dim, n_actions, device)
    obs, info = envs.reset(seed=cfg.seed)
    next_obs = th.as_tensor(obs, dtype=th.float32, device=device)
    next_mask = th.as_tensor(info["action_mask"], dtype=th.bool, device=device)
    next_done = th.zeros(cfg.num_envs, device=device)
    global_step, best_return = 0, -float("inf")
    num_updates = cfg.total_steps // (cfg.num_envs * cfg.num_steps)
    t0 = time.time()
    for update in range(1, num_updates + 1):
        for step in range(cfg.num_steps):
            global_step += cfg.num_envs
            buf.obs[step], buf.masks[step], buf.dones[step] = next_obs, next_mask, next_done
            action, logprob, value = agent.act(next_obs, next_mask)
            buf.actions[step], buf.logprobs[step], buf.values[step] = action, logprob, value
            obs, reward, term, trunc, info = envs.step(action.cpu().numpy())
            buf.rewards[step] = th.as_tensor(reward, dtype=th.float32, device=device)
            next_obs = th.as_tensor(obs, dtype=th.float32, device=device)
            next_mask = th.as_tensor(info["action_mask"], dtype=th.bool, device=device)
            next_done = th.as_tensor(np.logical_or(term, trunc), dtype=th.float32, device=device)
        _, _, next_value = agent.act(next_obs, next_mask)
        buf.compute_gae(next_value, next_done, cfg.gamma, cfg.gae_lambda)
        stats = agent.update(buf)
        for k, v in stats.items():
            writer.add_scalar(f"losses/{k}", v, global_step)
        writer.add_scalar("charts/SPS", global_step / (time.time() - t0), global_step)
        if update % 50 == 0:
            mean_ret, std_ret = evaluate(agent, cfg.env_id)
            writer.add_scalar("eval/return", mean_ret, global_step)
            log.info("update %d step %d eval return %.2f +- %.2f", update, global_step, mean_ret, std_ret)
            if mean_ret > best_return:
                best_return = mean_ret
                th.save(agent.state_dict(), os.path.join(args.run_dir, "best.pt"))
            th.save(agent.state_dict(), os.path.join(args.run_dir, "last.pt"))
    envs.close()
    writer.close()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main()
