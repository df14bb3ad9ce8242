"""PPO with invalid-action masking for batched GPU simulators.

Single-file implementation in the CleanRL style: rollouts of thousands of environments
stay on the GPU, the update runs under fp16 autocast.
"""
import argparse
import copy
import os
import random
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributions import Categorical

from gpu_envs import make_vector_env  # local module: batched torch env with action masks


@dataclass
class Args:
    env_id: str = "GridCapture-v1"
    num_envs: int = 4096
    num_steps: int = 64
    total_timesteps: int = 200_000_000
    learning_rate: float = 2.5e-4
    anneal_lr: bool = True
    gamma: float = 0.99
    gae_lambda: float = 0.95
    num_minibatches: int = 8
    update_epochs: int = 4
    norm_adv: bool = True
    clip_coef: float = 0.2
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    target_kl: float = 0.03
    amp: bool = True
    bc_demos: str = ""
    seed: int = 1
    save_dir: str = "runs/ppo_masked"


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


def mask_invalid_actions(logits, action_mask):
    return torch.where(action_mask, logits, torch.tensor(-1e8, device=logits.device))  # expect: AMP007


class RunningMeanStd:
    def __init__(self, shape, device, epsilon=1e-4):
        self.mean = torch.zeros(shape, device=device)
        self.var = torch.ones(shape, device=device)
        self.count = epsilon

    def update(self, x):
        batch_mean, batch_var, batch_count = x.mean(0), x.var(0, unbiased=False), x.shape[0]
        delta = batch_mean - self.mean
        tot = self.count + batch_count
        self.mean = self.mean + delta * batch_count / tot
        m2 = self.var * self.count + batch_var * batch_count + delta.pow(2) * self.count * batch_count / tot
        self.var = m2 / tot
        self.count = tot

    def normalize(self, x):
        return ((x - self.mean) / torch.sqrt(self.var + 1e-8)).clamp(-5.0, 5.0)


class Agent(nn.Module):
    def __init__(self, obs_dim, n_actions, hidden=256):
        super().__init__()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(obs_dim, hidden)), nn.Tanh(),
            layer_init(nn.Linear(hidden, hidden)), nn.Tanh(),
            layer_init(nn.Linear(hidden, 1), std=1.0),
        )
        self.actor = nn.Sequential(
            layer_init(nn.Linear(obs_dim, hidden)), nn.Tanh(),
            layer_init(nn.Linear(hidden, hidden)), nn.Tanh(),
            layer_init(nn.Linear(hidden, n_actions), std=0.01),
        )

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action_mask, action=None):
        logits = mask_invalid_actions(self.actor(x), action_mask)
        dist = Categorical(logits=logits)
        if action is None:
            action = dist.sample()
        return action, dist.log_prob(action), dist.entropy(), self.critic(x)


def make_grad_scaler(enabled):
    try:
        return torch.amp.GradScaler("cuda", enabled=enabled)
    except (AttributeError, TypeError):
        return torch.cuda.amp.GradScaler(enabled=enabled)


def pretrain_behavior_cloning(agent, demo_path, device, epochs=3, batch_size=8192, lr=1e-3):
    """Warm-start the actor on recorded expert transitions (stored in half precision)."""
    demo_obs, demo_masks, demo_actions = torch.load(demo_path, map_location=device)
    bc_policy = copy.deepcopy(agent).half()  # expect: AMP001
    optimizer = torch.optim.Adam(bc_policy.actor.parameters(), lr=lr)  # expect: AMP011
    n = demo_obs.shape[0]
    for epoch in range(epochs):
        perm = torch.randperm(n, device=device)
        for start in range(0, n, batch_size):
            idx = perm[start:start + batch_size]
            logits = mask_invalid_actions(bc_policy.actor(demo_obs[idx]), demo_masks[idx])
            loss = F.cross_entropy(logits, demo_actions[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        print(f"bc epoch {epoch} loss {loss.item():.4f}")
    agent.actor.load_state_dict(bc_policy.actor.float().state_dict())


@torch.inference_mode()
def evaluate_policy(agent, envs, obs_rms, episodes=32):
    policy = copy.deepcopy(agent).half().eval()
    obs, mask = envs.reset()
    returns, ep_ret = [], torch.zeros(envs.num_envs, device=obs.device)
    while len(returns) < episodes:
        logits = mask_invalid_actions(policy.actor(obs_rms.normalize(obs).half()), mask)
        obs, reward, done, mask, _ = envs.step(logits.argmax(dim=-1))
        ep_ret += reward
        returns.extend(ep_ret[done].tolist())
        ep_ret[done] = 0.0
    return float(np.mean(returns[:episodes]))


def train(args: Args):
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device("cuda")
    envs = make_vector_env(args.env_id, args.num_envs, device=device, seed=args.seed)
    eval_envs = make_vector_env(args.env_id, 256, device=device, seed=args.seed + 1)
    obs_dim, n_actions = envs.observation_dim, envs.num_actions

    agent = Agent(obs_dim, n_actions).to(device)
    if args.bc_demos:
        pretrain_behavior_cloning(agent, args.bc_demos, device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
    scaler = make_grad_scaler(args.amp)
    obs_rms = RunningMeanStd((obs_dim,), device)

    batch_size = args.num_envs * args.num_steps
    minibatch_size = batch_size // args.num_minibatches
    num_iterations = args.total_timesteps // batch_size

    obs = torch.zeros((args.num_steps, args.num_envs, obs_dim), device=device)
    masks = torch.zeros((args.num_steps, args.num_envs, n_actions), dtype=torch.bool, device=device)
    actions = torch.zeros((args.num_steps, args.num_envs), dtype=torch.long, device=device)
    logprobs = torch.zeros((args.num_steps, args.num_envs), device=device)
    rewards = torch.zeros((args.num_steps, args.num_envs), device=device)
    dones = torch.zeros((args.num_steps, args.num_envs), device=device)
    values = torch.zeros((args.num_steps, args.num_envs), device=device)
    # only read back in minibatches; half precision halves the two largest buffers
    advantages = torch.zeros((args.num_steps, args.num_envs), dtype=torch.float16, device=device)
    returns = torch.zeros((args.num_steps, args.num_envs), dtype=torch.float16, device=device)

    global_step, start_time, best_eval = 0, time.time(), -float("inf")
    next_obs, next_mask = envs.reset()
    next_done = torch.zeros(args.num_envs, device=device)
    for iteration in range(1, num_iterations + 1):
        if args.anneal_lr:
            optimizer.param_groups[0]["lr"] = (1.0 - (iteration - 1.0) / num_iterations) * args.learning_rate

        for step in range(args.num_steps):
            global_step += args.num_envs
            obs_rms.update(next_obs)
            obs[step] = obs_rms.normalize(next_obs)
            masks[step] = next_mask
            dones[step] = next_done
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                action, logprob, _, value = agent.get_action_and_value(obs[step], next_mask)
            values[step] = value.flatten()
            actions[step] = action
            logprobs[step] = logprob
            next_obs, reward, next_done, next_mask, _ = envs.step(action)
            rewards[step] = reward

        with torch.no_grad():
            next_value = agent.get_value(obs_rms.normalize(next_obs)).reshape(1, -1)
            lastgaelam = 0
            for t in reversed(range(args.num_steps)):
                if t == args.num_steps - 1:
                    nextnonterminal, nextvalues = 1.0 - next_done.float(), next_value
                else:
                    nextnonterminal, nextvalues = 1.0 - dones[t + 1], values[t + 1]
                delta = rewards[t] + args.gamma * nextvalues * nextnonterminal - values[t]
                advantages[t] = lastgaelam = delta + args.gamma * args.gae_lambda * nextnonterminal * lastgaelam
            returns[:] = advantages + values

        b_obs = obs.reshape((-1, obs_dim))
        b_masks = masks.reshape((-1, n_actions))
        b_logprobs = logprobs.reshape(-1)
        b_actions = actions.reshape(-1)
        b_advantages = advantages.reshape(-1)
        b_returns = returns.reshape(-1)
        b_values = values.reshape(-1)

        b_inds = np.arange(batch_size)
        clipfracs = []
        for epoch in range(args.update_epochs):
            np.random.shuffle(b_inds)
            for start in range(0, batch_size, minibatch_size):
                mb_inds = b_inds[start:start + minibatch_size]
                mb_advantages = b_advantages[mb_inds]
                if args.norm_adv:
                    mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)  # expect: AMP004 AMP011
                mb_returns = b_returns[mb_inds]

                with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                    _, newlogprob, entropy, newvalue = agent.get_action_and_value(
                        b_obs[mb_inds], b_masks[mb_inds], b_actions[mb_inds])
                    logratio = newlogprob - b_logprobs[mb_inds]
                    ratio = logratio.exp()
                    pg_loss1 = -mb_advantages * ratio
                    pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
                    pg_loss = torch.max(pg_loss1, pg_loss2).mean()
                    entropy_loss = entropy.mean()
                newvalue = newvalue.view(-1)
                v_loss = F.smooth_l1_loss(mb_returns, newvalue)  # expect: AMP002
                loss = pg_loss - args.ent_coef * entropy_loss + args.vf_coef * v_loss

                with torch.no_grad():
                    approx_kl = ((ratio - 1) - logratio).mean()
                    clipfracs.append(((ratio - 1.0).abs() > args.clip_coef).float().mean().item())

                optimizer.zero_grad(set_to_none=True)
                loss = scaler.scale(loss)
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)  # expect: AMP005
                optimizer.step()  # expect: AMP006

            if args.target_kl is not None and approx_kl > args.target_kl:
                break

        y_pred, y_true = b_values.cpu().numpy(), b_returns.float().cpu().numpy()
        var_y = np.var(y_true)
        explained_var = np.nan if var_y == 0 else 1 - np.var(y_true - y_pred) / var_y
        sps = int(global_step / (time.time() - start_time))
        print(f"iter {iteration} step {global_step} v_loss {v_loss.item():.4f} pg {pg_loss.item():.4f} "
              f"kl {approx_kl.item():.4f} clipfrac {np.mean(clipfracs):.3f} ev {explained_var:.3f} sps {sps}")

        if iteration % 50 == 0:
            score = evaluate_policy(agent, eval_envs, obs_rms)
            print(f"eval return {score:.2f}")
            if score > best_eval:
                best_eval = score
                torch.save({"agent": agent.state_dict(), "obs_mean": obs_rms.mean, "obs_var": obs_rms.var},
                           os.path.join(args.save_dir, "best.pt"))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--env-id", default=Args.env_id)
    p.add_argument("--num-envs", type=int, default=Args.num_envs)
    p.add_argument("--total-timesteps", type=int, default=Args.total_timesteps)
    p.add_argument("--no-amp", action="store_true")
    p.add_argument("--bc-demos", default="")
    p.add_argument("--seed", type=int, default=Args.seed)
    cli = p.parse_args()
    run_args = Args(env_id=cli.env_id, num_envs=cli.num_envs, total_timesteps=cli.total_timesteps,
                    amp=not cli.no_amp, bc_demos=cli.bc_demos, seed=cli.seed)
    os.makedirs(run_args.save_dir, exist_ok=True)
    train(run_args)
