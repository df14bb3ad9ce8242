"""PPO with separate actor / critic optimizers and invalid-action masking.

    python b45_ppo_actor_critic.py --env-id MicroRTS-v0 --total-steps 5_000_000
"""
import argparse
import copy
import time
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class PPOConfig:
    num_envs: int = 16
    rollout_len: int = 256
    update_epochs: int = 4
    minibatch_size: int = 1024
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip_coef: float = 0.2
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    actor_lr: float = 2.5e-4
    critic_lr: float = 1e-3
    max_grad_norm: float = 0.5


def layer_init(layer, std=np.sqrt(2), bias=0.0):
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias)
    return layer


class ActorCritic(nn.Module):
    def __init__(self, obs_dim, n_actions, hidden=256):
        super().__init__()
        self.actor = nn.Sequential(layer_init(nn.Linear(obs_dim, hidden)), nn.Tanh(),
                                   layer_init(nn.Linear(hidden, hidden)), nn.Tanh(),
                                   layer_init(nn.Linear(hidden, n_actions), std=0.01))
        self.critic = nn.Sequential(layer_init(nn.Linear(obs_dim, hidden)), nn.Tanh(),
                                    layer_init(nn.Linear(hidden, hidden)), nn.Tanh(),
                                    layer_init(nn.Linear(hidden, 1), std=1.0))

    def forward(self, obs, action_mask):
        logits = self.actor(obs)
        logits = logits.masked_fill(~action_mask, -1e9)  # expect: AMP007
        return logits, self.critic(obs).squeeze(-1)


class RolloutBuffer:
    def __init__(self, cfg, obs_dim, n_actions, device):
        shape = (cfg.rollout_len, cfg.num_envs)
        self.obs = torch.zeros(shape + (obs_dim,), device=device)
        self.masks = torch.zeros(shape + (n_actions,), dtype=torch.bool, device=device)
        self.actions = torch.zeros(shape, dtype=torch.long, device=device)
        self.logp = torch.zeros(shape, device=device)
        self.rewards = torch.zeros(shape, device=device)
        self.dones = torch.zeros(shape, device=device)
        self.values = torch.zeros(shape, device=device)
        self.cfg = cfg

    def compute_gae(self, last_value, last_done):
        adv = torch.zeros_like(self.rewards)
        gae = torch.zeros_like(last_value)
        for t in reversed(range(self.cfg.rollout_len)):
            next_nonterminal = 1.0 - (last_done if t == self.cfg.rollout_len - 1 else self.dones[t + 1])
            next_value = last_value if t == self.cfg.rollout_len - 1 else self.values[t + 1]
            delta = self.rewards[t] + self.cfg.gamma * next_value * next_nonterminal - self.values[t]
            gae = delta + self.cfg.gamma * self.cfg.gae_lambda * next_nonterminal * gae
            adv[t] = gae
        self.advantages, self.returns = adv, adv + self.values

    def minibatches(self, size):
        flat = {k: getattr(self, k).flatten(0, 1) for k in ("obs", "masks", "actions", "logp", "advantages", "returns")}
        idx = torch.randperm(flat["obs"].size(0), device=flat["obs"].device)
        for start in range(0, idx.numel(), size):
            yield {k: v[idx[start:start + size]] for k, v in flat.items()}


@torch.no_grad()
def collect_rollout(envs, agent, buffer, obs, done, device, amp_ctx=torch.cuda.amp.autocast):  # expect: AMP009
    for t in range(buffer.cfg.rollout_len):
        mask = torch.as_tensor(np.stack(envs.call("action_masks")), dtype=torch.bool, device=device)
        with amp_ctx():
            logits, value = agent(obs, mask)
        probs = F.softmax(logits.float(), dim=-1)
        action = torch.multinomial(probs, 1).squeeze(-1)
        buffer.obs[t], buffer.masks[t], buffer.actions[t], buffer.dones[t] = obs, mask, action, done
        buffer.logp[t] = torch.log(probs.gather(-1, action[:, None]).squeeze(-1))
        buffer.values[t] = value.float()
        next_obs, reward, term, trunc, _ = envs.step(action.cpu().numpy())
        buffer.rewards[t] = torch.as_tensor(reward, device=device)
        obs = torch.as_tensor(next_obs, dtype=torch.float32, device=device)
        done = torch.as_tensor(np.logical_or(term, trunc), dtype=torch.float32, device=device)
    _, last_value = agent(obs, torch.ones_like(buffer.masks[0]))
    buffer.compute_gae(last_value.float(), done)
    return obs, done


def warmstart_critic(agent, demo_loader, device, epochs=5):
    """Regress the critic on Monte-Carlo returns of scripted-bot games before PPO starts."""
    optimizer = torch.optim.Adam(agent.critic.parameters(), lr=1e-4)
    for _ in range(epochs):
        for obs, returns in demo_loader:
            obs, returns = obs.to(device), returns.to(device)
            with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
                pred = agent.critic(obs).squeeze(-1)
                loss = F.mse_loss(pred, returns)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()


class PPOTrainer:
    def __init__(self, agent, cfg):
        self.agent, self.cfg = agent, cfg
        self.actor_opt = torch.optim.Adam(agent.actor.parameters(), lr=cfg.actor_lr, eps=1e-5)
        self.critic_opt = torch.optim.Adam(agent.critic.parameters(), lr=cfg.critic_lr, eps=1e-5)
        self.scaler = torch.amp.GradScaler("cuda")

    def update(self, buffer):
        cfg, stats = self.cfg, []
        for _ in range(cfg.update_epochs):
            for mb in buffer.minibatches(cfg.minibatch_size):
                adv = mb["advantages"]
                adv = (adv - adv.mean()) / (adv.std() + 1e-8)
                with torch.autocast("cuda", dtype=torch.float16):
                    logits, values = self.agent(mb["obs"], mb["masks"])
                    logp_all = F.log_softmax(logits, dim=-1)
                    logp = logp_all.gather(-1, mb["actions"][:, None]).squeeze(-1)
                    ratio = torch.exp(logp - mb["logp"])
                    clipped = torch.clamp(ratio, 1 - cfg.clip_coef, 1 + cfg.clip_coef)
                    pg_loss = -torch.min(ratio * adv, clipped * adv).mean()
                    entropy = -(logp_all.exp() * logp_all).sum(-1).mean()
                v_loss = F.mse_loss(values, mb["returns"])  # expect: AMP002
                loss = pg_loss - cfg.ent_coef * entropy + cfg.vf_coef * v_loss
                self.actor_opt.zero_grad(set_to_none=True)
                self.critic_opt.zero_grad(set_to_none=True)
                self.scaler.scale(loss).backward()
                self.scaler.unscale_(self.actor_opt)
                nn.utils.clip_grad_norm_(self.agent.actor.parameters(), cfg.max_grad_norm)
                self.scaler.step(self.actor_opt)
                self.critic_opt.step()  # expect: AMP006
                self.scaler.update()
                stats.append((pg_loss.item(), v_loss.item(), entropy.item()))
        return np.mean(stats, axis=0)

    def state_dict(self):
        return {"agent": self.agent.state_dict(), "actor_opt": self.actor_opt.state_dict(),
                "critic_opt": self.critic_opt.state_dict(), "scaler": self.scaler.state_dict()}


def export_policy(agent, path):
    policy = copy.deepcopy(agent.actor).half().eval()
    torch.save(policy.state_dict(), path)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--env-id", dest="env_id", default="MicroRTS-v0")
    p.add_argument("--total-steps", dest="total_steps", type=int, default=5_000_000)
    p.add_argument("--demos", default="")
    args = p.parse_args()
    cfg, device = PPOConfig(), torch.device("cuda")
    envs = gym.vector.SyncVectorEnv([lambda: gym.make(args.env_id) for _ in range(cfg.num_envs)])
    obs_dim, n_actions = envs.single_observation_space.shape[0], envs.single_action_space.n
    agent = ActorCritic(obs_dim, n_actions).to(device)
    if args.demos:
        demos = torch.load(args.demos)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(demos["obs"], demos["returns"]),
                                             batch_size=512, shuffle=True)
        warmstart_critic(agent, loader, device)
    trainer = PPOTrainer(agent, cfg)
    buffer = RolloutBuffer(cfg, obs_dim, n_actions, device)
    obs = torch.as_tensor(envs.reset(seed=0)[0], dtype=torch.float32, device=device)
    done = torch.zeros(cfg.num_envs, device=device)
    global_step, t0 = 0, time.time()
    while global_step < args.total_steps:
        obs, done = collect_rollout(envs, agent, buffer, obs, done, device)
        global_step += cfg.rollout_len * cfg.num_envs
        pg, vf, ent = trainer.update(buffer)
        print(f"{global_step} sps={global_step / (time.time() - t0):.0f} pg={pg:.3f} vf={vf:.3f} ent={ent:.3f}")
        if global_step % 500_000 < cfg.rollout_len * cfg.num_envs:
            torch.save(trainer.state_dict(), f"ppo_{global_step}.pt")
    export_policy(agent, "policy_fp16.pt")


if __name__ == "__main__":
    main()
