"""PPO (clipped objective, GAE) for a MultiBinary action space, with optional autocast.

Each action dimension is an independent Bernoulli ("press button i or not");
buttons the environment reports as unavailable are masked out of the policy.
"""
import argparse
import time
from collections import namedtuple
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from envs import make_vec_env  # local gym wrapper

PolicyOutput = namedtuple("PolicyOutput", ["logits", "value", "hidden"])
Minibatch = namedtuple("Minibatch", ["obs", "avail", "actions", "logp", "advantages", "returns", "values"])


def orthogonal_init_(layer, gain=np.sqrt(2), bias=0.0):
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.constant_(layer.bias, bias)


class MLPTorso(nn.Module):
    def __init__(self, obs_dim, hidden=256):
        super().__init__()
        self.fc1 = nn.Linear(obs_dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        orthogonal_init_(self.fc1)
        orthogonal_init_(self.fc2)

    def forward(self, x):
        return torch.tanh(self.fc2(torch.tanh(self.fc1(x))))


class ActorCritic(nn.Module):
    def __init__(self, obs_dim, n_buttons, hidden=256):
        super().__init__()
        self.torso = MLPTorso(obs_dim, hidden)
        self.actor = nn.Linear(hidden, n_buttons)
        self.critic = nn.Linear(hidden, 1)
        orthogonal_init_(self.actor, gain=0.01)
        orthogonal_init_(self.critic, gain=1.0)

    def forward(self, obs, avail=None):
        h = self.torso(obs)
        logits = self.actor(h)
        if avail is not None:
            logits = logits.masked_fill(~avail, -1e8)  # expect: AMP007
        return PolicyOutput(logits, self.critic(h).squeeze(-1), h)


def bernoulli_stats(p, actions):
    """log-prob of a MultiBinary action and the entropy, from button probabilities."""
    log_p1 = torch.log(p + 1e-8)  # expect: AMP011
    log_p0 = torch.log(1 - p + 1e-8)  # expect: AMP011
    log_prob = (actions * log_p1 + (1 - actions) * log_p0).sum(-1)
    entropy = -(p * log_p1 + (1 - p) * log_p0).sum(-1)
    return log_prob, entropy


class RolloutBuffer:
    def __init__(self, num_steps, num_envs, obs_dim, n_buttons, device):
        shape = (num_steps, num_envs)
        self.obs = torch.zeros(shape + (obs_dim,), device=device)
        self.avail = torch.ones(shape + (n_buttons,), dtype=torch.bool, device=device)
        self.actions = torch.zeros(shape + (n_buttons,), device=device)
        self.logp = torch.zeros(shape, device=device)
        self.rewards = torch.zeros(shape, device=device)
        self.dones = torch.zeros(shape, device=device)
        self.values = torch.zeros(shape, device=device)
        self.advantages = torch.zeros(shape, device=device)
        self.returns = torch.zeros(shape, device=device)

    def compute_gae(self, last_value, last_done, gamma, lam):
        last_gae = torch.zeros_like(last_value)
        for t in reversed(range(self.rewards.size(0))):
            next_nonterminal = 1.0 - (last_done if t == self.rewards.size(0) - 1 else self.dones[t + 1])
            next_value = last_value if t == self.rewards.size(0) - 1 else self.values[t + 1]
            delta = self.rewards[t] + gamma * next_value * next_nonterminal - self.values[t]
            last_gae = delta + gamma * lam * next_nonterminal * last_gae
            self.advantages[t] = last_gae
        self.returns = self.advantages + self.values

    def minibatches(self, size):
        flat = [t.flatten(0, 1) for t in (self.obs, self.avail, self.actions, self.logp, self.advantages, self.returns, self.values)]
        idx = torch.randperm(flat[0].size(0), device=flat[0].device)
        for start in range(0, idx.numel(), size):
            mb = idx[start:start + size]
            yield Minibatch(*(t[mb] for t in flat))


@torch.no_grad()
def collect_rollout(envs, agent, buf, obs, done, avail, args, device):
    for t in range(args.num_steps):
        buf.obs[t], buf.dones[t], buf.avail[t] = obs, done, avail
        out = agent(obs, avail)
        p = torch.sigmoid(out.logits.float())
        actions = torch.bernoulli(p)
        buf.logp[t], _ = bernoulli_stats(p, actions)
        buf.actions[t], buf.values[t] = actions, out.value.float()
        next_obs, reward, term, trunc, info = envs.step(actions.cpu().numpy())
        buf.rewards[t] = torch.as_tensor(reward, dtype=torch.float32, device=device)
        obs = torch.as_tensor(next_obs, dtype=torch.float32, device=device)
        done = torch.as_tensor(np.logical_or(term, trunc), dtype=torch.float32, device=device)
        avail = torch.as_tensor(np.stack(info["avail"]), dtype=torch.bool, device=device)
    last_value = agent(obs, avail).value.float()
    buf.compute_gae(last_value, done, args.gamma, args.gae_lambda)
    return obs, done, avail


def ppo_update(agent, optimizer, buf, args):
    amp_ctx = torch.cuda.amp.autocast(dtype=torch.float16) if args.amp else nullcontext()  # expect: AMP009, AMP010
    stats = {"clipfrac": [], "approx_kl": [], "value_mean": [], "logit_mean": []}
    for epoch in range(args.update_epochs):
        for mb in buf.minibatches(args.minibatch_size):
            with amp_ctx:
                out = agent(mb.obs, mb.avail)
                p = torch.sigmoid(out.logits)
                new_logp, entropy = bernoulli_stats(p, mb.actions)
                logratio = new_logp - mb.logp
                ratio = logratio.exp()
                adv = mb.advantages
                if args.norm_adv:
                    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
                pg_loss = torch.max(-adv * ratio, -adv * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)).mean()
                v_pred = out.value
                v_clipped = mb.values + torch.clamp(v_pred - mb.values, -args.clip_coef, args.clip_coef)
                v_loss = 0.5 * torch.max((v_pred - mb.returns) ** 2, (v_clipped - mb.returns) ** 2).mean()
                loss = pg_loss - args.ent_coef * entropy.mean() + args.vf_coef * v_loss
                value_mean = v_pred.detach().mean()  # expect: AMP004
                logit_mean = out.logits.detach().mean(dtype=torch.float32)

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
            optimizer.step()

            with torch.no_grad():
                approx_kl = ((ratio - 1) - logratio).mean()
                stats["approx_kl"].append(approx_kl.item())
                stats["clipfrac"].append(((ratio - 1.0).abs() > args.clip_coef).float().mean().item())
                stats["value_mean"].append(value_mean.item())
                stats["logit_mean"].append(logit_mean.item())
        if args.target_kl is not None and np.mean(stats["approx_kl"]) > args.target_kl:
            break
    y_pred, y_true = buf.values.flatten().cpu().numpy(), buf.returns.flatten().cpu().numpy()
    var_y = np.var(y_true)
    explained_var = np.nan if var_y == 0 else 1 - np.var(y_true - y_pred) / var_y
    return {k: float(np.mean(v)) for k, v in stats.items()}, explained_var


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--env-id", dest="env_id", default="ButtonPress-v0")
    p.add_argument("--num-envs", dest="num_envs", type=int, default=16)
    p.add_argument("--num-steps", dest="num_steps", type=int, default=256)
    p.add_argument("--total-timesteps", dest="total_timesteps", type=int, default=20_000_000)
    p.add_argument("--lr", type=float, default=2.5e-4)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--gae-lambda", dest="gae_lambda", type=float, default=0.95)
    p.add_argument("--update-epochs", dest="update_epochs", type=int, default=4)
    p.add_argument("--minibatch-size", dest="minibatch_size", type=int, default=1024)
    p.add_argument("--clip-coef", dest="clip_coef", type=float, default=0.2)
    p.add_argument("--ent-coef", dest="ent_coef", type=float, default=0.01)
    p.add_argument("--vf-coef", dest="vf_coef", type=float, default=0.5)
    p.add_argument("--max-grad-norm", dest="max_grad_norm", type=float, default=0.5)
    p.add_argument("--target-kl", dest="target_kl", type=float, default=None)
    p.add_argument("--norm-adv", dest="norm_adv", action="store_true", default=True)
    p.add_argument("--amp", action="store_true")
    return p.parse_args()


def main():
    args = parse_args()
    device = torch.device("cuda")
    envs = make_vec_env(args.env_id, args.num_envs)
    obs_dim, n_buttons = envs.single_observation_space.shape[0], envs.single_action_space.n
    agent = ActorCritic(obs_dim, n_buttons).to(device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.lr, eps=1e-5)
    buf = RolloutBuffer(args.num_steps, args.num_envs, obs_dim, n_buttons, device)

    next_obs, info = envs.reset(seed=1)
    obs = torch.as_tensor(next_obs, dtype=torch.float32, device=device)
    done = torch.zeros(args.num_envs, device=device)
    avail = torch.as_tensor(np.stack(info["avail"]), dtype=torch.bool, device=device)
    num_updates = args.total_timesteps // (args.num_envs * args.num_steps)
    t0 = time.time()
    for update in range(1, num_updates + 1):
        frac = 1.0 - (update - 1.0) / num_updates
        optimizer.param_groups[0]["lr"] = frac * args.lr
        obs, done, avail = collect_rollout(envs, agent, buf, obs, done, avail, args, device)
        stats, ev = ppo_update(agent, optimizer, buf, args)
        if update % 10 == 0:
            sps = int(update * args.num_envs * args.num_steps / (time.time() - t0))
            print(f"update {update} SPS {sps} ev {ev:.3f} " + " ".join(f"{k} {v:.4f}" for k, v in stats.items()))
    torch.save(agent.state_dict(), "ppo_agent.pt")


if __name__ == "__main__":
    main()
