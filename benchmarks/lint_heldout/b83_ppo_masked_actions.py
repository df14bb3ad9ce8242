"""PPO with invalid-action masking for discrete grid environments.

The environments expose ``info["action_mask"]`` (bool, one entry per action).
A value-only warm-up on Monte Carlo returns from a scripted policy runs first,
then the usual clipped-surrogate PPO loop.
"""
import argparse
import copy
import time
from collections import defaultdict
from contextlib import nullcontext

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributions import Categorical


class MaskedActorCritic(nn.Module):
    def __init__(self, obs_dim, n_actions, hidden=256):
        super().__init__()
        self.trunk = nn.Sequential(
            nn.Linear(obs_dim, hidden), nn.Tanh(),
            nn.Linear(hidden, hidden), nn.Tanh(),
        )
        self.pi = nn.Linear(hidden, n_actions)
        self.v = nn.Linear(hidden, 1)

    def forward(self, obs, action_mask):
        h = self.trunk(obs)
        logits = self.pi(h)
        logits = logits.masked_fill(~action_mask, -1e9)  # expect: AMP007
        return logits, self.v(h).squeeze(-1)


def to_tensor(x, device, dtype=torch.float32):
    return torch.as_tensor(np.asarray(x), dtype=dtype, device=device)


def collect_rollout(envs, policy, obs, mask, horizon, device):
    """Run the current policy for ``horizon`` steps in every environment."""
    buf = defaultdict(list)
    with torch.inference_mode():
        actor = copy.deepcopy(policy).half().eval()
        for _ in range(horizon):
            logits, value = actor(obs.half(), mask)
            dist = Categorical(logits=logits.float())
            action = dist.sample()
            next_obs, reward, term, trunc, info = envs.step(action.cpu().numpy())
            buf["obs"].append(obs)
            buf["mask"].append(mask)
            buf["actions"].append(action)
            buf["logp"].append(dist.log_prob(action))
            buf["values"].append(value.float())
            buf["rewards"].append(to_tensor(reward, device))
            buf["dones"].append(to_tensor(np.logical_or(term, trunc), device))
            obs = to_tensor(next_obs, device)
            mask = to_tensor(info["action_mask"], device, dtype=torch.bool)
        _, last_value = actor(obs.half(), mask)
    rollout = {k: torch.stack(v) for k, v in buf.items()}
    rollout["last_value"] = last_value.float()
    return rollout, obs, mask


def compute_gae(rollout, gamma, lam):
    rewards, values, dones = rollout["rewards"], rollout["values"], rollout["dones"]
    adv = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[0])
    next_value = rollout["last_value"]
    for t in reversed(range(rewards.shape[0])):
        nonterminal = 1.0 - dones[t]
        delta = rewards[t] + gamma * next_value * nonterminal - values[t]
        last = delta + gamma * lam * nonterminal * last
        adv[t] = last
        next_value = values[t]
    return adv, adv + values


def warmup_critic(policy, batches, args):
    """Fit the value head on Monte Carlo returns of the scripted policy."""
    opt = torch.optim.Adam(policy.v.parameters(), lr=args.critic_lr)
    scaler = torch.amp.GradScaler("cuda")
    for epoch in range(args.critic_warmup_epochs):
        total = 0.0
        for obs, mask, returns in batches:
            with torch.autocast("cuda", dtype=torch.float16):
                _, values = policy(obs, mask)
            v_loss = F.mse_loss(returns, values)  # expect: AMP002
            opt.zero_grad(set_to_none=True)
            scaler.scale(v_loss).backward()
            nn.utils.clip_grad_norm_(policy.v.parameters(), args.max_grad_norm)  # expect: AMP005
            scaler.step(opt)
            scaler.update()
            total += v_loss.item()
        print(f"critic warm-up epoch {epoch}: value loss {total / max(1, len(batches)):.4f}")


def ppo_update(policy, optimizer, batch, args):
    match args.precision:
        case "fp16":
            autocast_ctx = torch.autocast("cuda", dtype=torch.float16)  # expect: AMP010
        case "bf16":
            autocast_ctx = torch.autocast("cuda", dtype=torch.bfloat16)
        case _:
            autocast_ctx = nullcontext()
    n = batch["obs"].shape[0]
    stats = defaultdict(list)
    for _ in range(args.update_epochs):
        perm = torch.randperm(n, device=batch["obs"].device)
        for start in range(0, n, args.minibatch_size):
            idx = perm[start:start + args.minibatch_size]
            adv = batch["adv"][idx]
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)
            with autocast_ctx:
                logits, values = policy(batch["obs"][idx], batch["mask"][idx])
                dist = Categorical(logits=logits.float())
                logp = dist.log_prob(batch["actions"][idx])
                ratio = torch.exp(logp - batch["logp"][idx])
                clipped = ratio.clamp(1.0 - args.clip_coef, 1.0 + args.clip_coef)
                pg_loss = torch.max(-adv * ratio, -adv * clipped).mean()
                v_loss = 0.5 * F.mse_loss(values.float(), batch["returns"][idx])
                entropy = dist.entropy().mean()
                loss = pg_loss + args.vf_coef * v_loss - args.ent_coef * entropy
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
            optimizer.step()
            stats["pg_loss"].append(pg_loss.item())
            stats["v_loss"].append(v_loss.item())
            stats["entropy"].append(entropy.item())
    return {k: float(np.mean(v)) for k, v in stats.items()}


def distill_student(policy, batches, args):
    """Compress the trained policy into a bf16 student for the on-device agent."""
    student = copy.deepcopy(policy).to(torch.bfloat16)  # expect: AMP001
    policy.eval()
    opt = torch.optim.SGD(student.parameters(), lr=args.distill_lr, momentum=0.9)
    dtype = next(student.parameters()).dtype
    for obs, mask, _ in batches:
        with torch.no_grad():
            t_logits, _ = policy(obs, mask)
        s_logits, _ = student(obs.to(dtype), mask)
        loss = F.kl_div(F.log_softmax(s_logits.float(), dim=-1), F.softmax(t_logits.float(), dim=-1), reduction="batchmean")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return student


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--env-id", default="GridRally-v0")
    p.add_argument("--num-envs", type=int, default=16)
    p.add_argument("--horizon", type=int, default=256)
    p.add_argument("--iterations", type=int, default=2000)
    p.add_argument("--lr", type=float, default=2.5e-4)
    p.add_argument("--critic-lr", type=float, default=1e-3)
    p.add_argument("--distill-lr", type=float, default=1e-2)
    p.add_argument("--critic-warmup-epochs", type=int, default=5)
    p.add_argument("--update-epochs", type=int, default=4)
    p.add_argument("--minibatch-size", type=int, default=1024)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--gae-lambda", type=float, default=0.95)
    p.add_argument("--clip-coef", type=float, default=0.2)
    p.add_argument("--vf-coef", type=float, default=0.5)
    p.add_argument("--ent-coef", type=float, default=0.01)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default="fp32")
    p.add_argument("--warmup-data", default="scripted_returns.pt")
    p.add_argument("--save", default="ppo_policy.pt")
    args = p.parse_args()

    device = torch.device("cuda")
    envs = gym.make_vec(args.env_id, num_envs=args.num_envs)
    raw_obs, info = envs.reset(seed=0)
    obs, mask = to_tensor(raw_obs, device), to_tensor(info["action_mask"], device, dtype=torch.bool)
    policy = MaskedActorCritic(obs.shape[-1], int(envs.single_action_space.n)).to(device)
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr, eps=1e-5)

    warmup = [tuple(t.to(device) for t in b) for b in torch.load(args.warmup_data)]
    warmup_critic(policy, warmup, args)

    for it in range(args.iterations):
        t0 = time.time()
        rollout, obs, mask = collect_rollout(envs, policy, obs, mask, args.horizon, device)
        adv, returns = compute_gae(rollout, args.gamma, args.gae_lambda)
        flat = {k: rollout[k].flatten(0, 1) for k in ("obs", "mask", "actions", "logp")}
        flat["adv"], flat["returns"] = adv.flatten(), returns.flatten()
        stats = ppo_update(policy, optimizer, flat, args)
        if it % 10 == 0:
            ret = rollout["rewards"].sum(0).mean().item()
            print(f"iter {it} return {ret:.2f} {stats} ({time.time() - t0:.1f}s)")

    torch.save({k: v.half() for k, v in policy.state_dict().items()}, args.save)
    student = distill_student(policy, warmup, args)
    torch.save(student.state_dict(), args.save.replace(".pt", "_student.pt"))


if __name__ == "__main__":
    main()
