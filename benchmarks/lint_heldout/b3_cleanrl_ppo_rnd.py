"""PPO on Atari with an RND exploration bonus, CleanRL single-file style, with a --precision switch."""
import argparse
import random
import time
from contextlib import nullcontext

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.distributions.categorical import Categorical


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--env-id", default="MontezumaRevengeNoFrameskip-v4")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--total-timesteps", type=int, default=10_000_000)
    p.add_argument("--learning-rate", type=float, default=2.5e-4)
    p.add_argument("--num-envs", type=int, default=8)
    p.add_argument("--num-steps", type=int, default=128)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--gae-lambda", type=float, default=0.95)
    p.add_argument("--num-minibatches", type=int, default=4)
    p.add_argument("--update-epochs", type=int, default=4)
    p.add_argument("--clip-coef", type=float, default=0.1)
    p.add_argument("--ent-coef", type=float, default=0.01)
    p.add_argument("--vf-coef", type=float, default=0.5)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--int-coef", type=float, default=1.0)
    p.add_argument("--rnd-warmup-steps", type=int, default=50)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    args = p.parse_args()
    args.batch_size = args.num_envs * args.num_steps
    args.minibatch_size = args.batch_size // args.num_minibatches
    return args


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, envs):
        super().__init__()
        self.network = nn.Sequential(
            layer_init(nn.Conv2d(4, 32, 8, stride=4)), nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2)), nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1)), nn.ReLU(),
            nn.Flatten(), layer_init(nn.Linear(64 * 7 * 7, 512)), nn.ReLU(),
        )
        self.actor = layer_init(nn.Linear(512, envs.single_action_space.n), std=0.01)
        self.critic = layer_init(nn.Linear(512, 1), std=1)

    def get_value(self, x):
        return self.critic(self.network(x / 255.0))

    def get_action_and_value(self, x, action=None):
        hidden = self.network(x / 255.0)
        probs = Categorical(logits=self.actor(hidden).float())
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(hidden)


class RNDNet(nn.Module):
    def __init__(self, out_dim=512):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 32, 8, stride=4), nn.LeakyReLU(), nn.Conv2d(32, 64, 4, stride=2), nn.LeakyReLU(),
            nn.Conv2d(64, 64, 3, stride=1), nn.LeakyReLU(), nn.Flatten(), nn.Linear(64 * 7 * 7, out_dim))

    def forward(self, obs):
        return self.net(obs.to(self.net[0].weight.dtype) / 255.0)


def rnd_update(predictor, target, obs, rnd_optimizer, update_proportion=0.25):
    pred = predictor(obs)
    with torch.no_grad():
        tgt = target(obs)
    rnd_loss = F.mse_loss(pred.float(), tgt.float(), reduction="none").mean(-1)
    keep = (torch.rand(len(rnd_loss), device=rnd_loss.device) < update_proportion).float()
    rnd_loss = (rnd_loss * keep).sum() / torch.clamp(keep.sum(), min=1.0)
    rnd_optimizer.zero_grad()
    rnd_loss.backward()
    rnd_optimizer.step()
    return rnd_loss.detach()


def main():
    args = parse_args()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    envs = gym.vector.SyncVectorEnv([lambda: gym.wrappers.FrameStack(gym.make(args.env_id), 4) for _ in range(args.num_envs)])

    agent = Agent(envs).to(device)
    optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
    rnd_target = RNDNet().to(device).half().requires_grad_(False)
    rnd_predictor = RNDNet().to(device).half()  # expect: AMP001
    rnd_optimizer = optim.Adam(rnd_predictor.parameters(), lr=1e-4)  # expect: AMP011

    match args.precision:
        case "bf16":
            amp_ctx = torch.autocast("cuda", dtype=torch.bfloat16)
        case "fp16":
            amp_ctx = torch.autocast("cuda", dtype=torch.float16)  # expect: AMP010
        case _:
            amp_ctx = nullcontext()

    obs = torch.zeros((args.num_steps, args.num_envs) + envs.single_observation_space.shape).to(device)
    actions = torch.zeros((args.num_steps, args.num_envs) + envs.single_action_space.shape).to(device)
    logprobs = torch.zeros((args.num_steps, args.num_envs)).to(device)
    rewards = torch.zeros((args.num_steps, args.num_envs)).to(device)
    int_rewards = torch.zeros((args.num_steps, args.num_envs)).to(device)
    dones = torch.zeros((args.num_steps, args.num_envs)).to(device)
    values = torch.zeros((args.num_steps, args.num_envs)).to(device)

    next_obs, _ = envs.reset(seed=args.seed)
    next_obs = torch.Tensor(next_obs).to(device)
    next_done = torch.zeros(args.num_envs).to(device)

    # fit the RND predictor on random-policy frames before PPO starts
    for _ in range(args.rnd_warmup_steps):
        frames, *_ = envs.step(envs.action_space.sample())
        rnd_update(rnd_predictor, rnd_target, torch.Tensor(frames).to(device)[:, -1:], rnd_optimizer)

    global_step = 0
    start_time = time.time()
    num_iterations = args.total_timesteps // args.batch_size
    for iteration in range(1, num_iterations + 1):
        for step in range(args.num_steps):
            global_step += args.num_envs
            obs[step] = next_obs
            dones[step] = next_done
            with torch.no_grad():
                action, logprob, _, value = agent.get_action_and_value(next_obs)
                values[step] = value.flatten()
                int_rewards[step] = (rnd_predictor(next_obs[:, -1:]).float() - rnd_target(next_obs[:, -1:]).float()).pow(2).sum(1) / 2
            actions[step] = action
            logprobs[step] = logprob
            next_obs_np, reward, terminations, truncations, infos = envs.step(action.cpu().numpy())
            next_done = torch.Tensor(np.logical_or(terminations, truncations)).to(device)
            rewards[step] = torch.tensor(reward).to(device).view(-1)
            next_obs = torch.Tensor(next_obs_np).to(device)

        with torch.no_grad():
            next_value = agent.get_value(next_obs).reshape(1, -1)
            total_rewards = rewards + args.int_coef * int_rewards / (int_rewards.std() + 1e-8)
            advantages = torch.zeros_like(rewards).to(device)
            lastgaelam = 0
            for t in reversed(range(args.num_steps)):
                nextnonterminal = 1.0 - (next_done if t == args.num_steps - 1 else dones[t + 1])
                nextvalues = next_value if t == args.num_steps - 1 else values[t + 1]
                delta = total_rewards[t] + args.gamma * nextvalues * nextnonterminal - values[t]
                advantages[t] = lastgaelam = delta + args.gamma * args.gae_lambda * nextnonterminal * lastgaelam
            returns = advantages + values

        b_obs = obs.reshape((-1,) + envs.single_observation_space.shape)
        b_logprobs, b_actions = logprobs.reshape(-1), actions.reshape(-1)
        b_advantages, b_returns = advantages.reshape(-1), returns.reshape(-1)

        b_inds = np.arange(args.batch_size)
        for epoch in range(args.update_epochs):
            np.random.shuffle(b_inds)
            for start in range(0, args.batch_size, args.minibatch_size):
                mb_inds = b_inds[start:start + args.minibatch_size]
                with amp_ctx:
                    _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb_inds], b_actions.long()[mb_inds])
                    ratio = (newlogprob - b_logprobs[mb_inds]).exp()
                    mb_advantages = b_advantages[mb_inds]
                    mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)
                    pg_loss1 = -mb_advantages * ratio
                    pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
                    pg_loss = torch.max(pg_loss1, pg_loss2).mean()
                    entropy_loss = entropy.mean()
                    rnd_loss = rnd_update(rnd_predictor, rnd_target, b_obs[mb_inds][:, -1:], rnd_optimizer)  # expect: AMP008
                v_loss = 0.5 * F.mse_loss(newvalue.view(-1), b_returns[mb_inds])  # expect: AMP002
                loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                optimizer.step()

        sps = int(global_step / (time.time() - start_time))
        print(f"iter {iteration} step {global_step} SPS {sps} v_loss {v_loss.item():.3f} rnd {rnd_loss.item():.4f}")
    envs.close()


if __name__ == "__main__":
    main()
