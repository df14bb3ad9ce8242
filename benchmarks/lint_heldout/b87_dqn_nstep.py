"""n-step DQN for pixel environments (single file, CleanRL style).

Supports environments that expose legal actions through info["action_mask"].
"""
import argparse
import copy
import random
import time
from collections import deque

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--env-id", default="ALE/Breakout-v5")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--total-timesteps", type=int, default=10_000_000)
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--buffer-size", type=int, default=1_000_000)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--n-step", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--target-update", type=int, default=1000)
    p.add_argument("--start-eps", type=float, default=1.0)
    p.add_argument("--end-eps", type=float, default=0.01)
    p.add_argument("--exploration-fraction", type=float, default=0.1)
    p.add_argument("--learning-starts", type=int, default=80000)
    p.add_argument("--train-freq", type=int, default=4)
    p.add_argument("--max-grad-norm", type=float, default=10.0)
    return p.parse_args()


def make_env(env_id, seed):
    env = gym.make(env_id, frameskip=1, repeat_action_probability=0.0)
    env = gym.wrappers.AtariPreprocessing(env, frame_skip=4, screen_size=84, grayscale_obs=True)
    env = gym.wrappers.FrameStackObservation(env, 4)
    env.action_space.seed(seed)
    return env


class QNetwork(nn.Module):
    def __init__(self, n_actions):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(4, 32, 8, stride=4), nn.ReLU(),
            nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=1), nn.ReLU(),
            nn.Flatten(),
            nn.Linear(3136, 512), nn.ReLU(),
            nn.Linear(512, n_actions),
        )

    def forward(self, x, action_mask=None):
        q = self.net(x.to(self.net[0].weight.dtype) / 255.0)
        if action_mask is not None:
            q = q.masked_fill(~action_mask, -1e9)  # expect: AMP007
        return q


class NStepReplay:
    def __init__(self, capacity, obs_shape, n_actions, n_step, gamma):
        self.obs = np.zeros((capacity, *obs_shape), dtype=np.uint8)
        self.actions = np.zeros(capacity, dtype=np.int64)
        self.rewards = np.zeros(capacity, dtype=np.float32)
        self.dones = np.zeros(capacity, dtype=np.float32)
        self.masks = np.ones((capacity, n_actions), dtype=bool)
        self.capacity, self.n_step, self.gamma = capacity, n_step, gamma
        self.pos, self.full = 0, False

    def add(self, obs, action, reward, done, mask):
        self.obs[self.pos], self.actions[self.pos] = obs, action
        self.rewards[self.pos], self.dones[self.pos], self.masks[self.pos] = reward, done, mask
        self.pos = (self.pos + 1) % self.capacity
        self.full = self.full or self.pos == 0

    def __len__(self):
        return self.capacity if self.full else self.pos

    def sample(self, batch_size, device):
        hi = len(self) - self.n_step - 1
        idx = np.random.randint(0, hi, size=batch_size)
        seq = idx[:, None] + np.arange(self.n_step)[None, :]
        done_seq = self.dones[seq]
        # stop accumulating reward after the first terminal in the window
        alive = np.cumprod(np.concatenate([np.ones((batch_size, 1)), 1 - done_seq[:, :-1]], axis=1), axis=1)
        rewards = torch.as_tensor(self.rewards[seq] * alive, dtype=torch.float16, device=device)
        discounts = self.gamma ** torch.arange(self.n_step, device=device, dtype=torch.float16)
        returns = (rewards * discounts).sum(dim=1)  # expect: AMP004
        ended = torch.as_tensor(done_seq.max(axis=1), dtype=torch.float16, device=device)
        nxt = idx + self.n_step
        return (
            torch.as_tensor(self.obs[idx], device=device),
            torch.as_tensor(self.actions[idx], device=device),
            returns,
            torch.as_tensor(self.obs[nxt], device=device),
            torch.as_tensor(self.masks[nxt], device=device),
            ended,
        )


def linear_schedule(start, end, duration, t):
    return max(end, start + (end - start) * t / duration)


@torch.inference_mode()
def evaluate(q_network, env_id, device, episodes=10, eps=0.001):
    env = make_env(env_id, seed=1234)
    returns = []
    for _ in range(episodes):
        obs, info = env.reset()
        done, ep_ret = False, 0.0
        while not done:
            if random.random() < eps:
                action = env.action_space.sample()
            else:
                q = q_network(torch.as_tensor(np.asarray(obs), device=device).unsqueeze(0))
                action = int(q.argmax(dim=1).item())
            obs, reward, term, trunc, info = env.step(action)
            ep_ret += float(reward)
            done = term or trunc
        returns.append(ep_ret)
    return float(np.mean(returns))


def main():
    args = parse_args()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    writer = SummaryWriter(f"runs/dqn_{args.env_id.replace('/', '_')}_{args.seed}_{int(time.time())}")

    env = make_env(args.env_id, args.seed)
    n_actions = env.action_space.n
    q_network = QNetwork(n_actions).to(device)
    q_network.half()  # expect: AMP001
    optimizer = optim.Adam(q_network.parameters(), lr=args.learning_rate, eps=1e-8)  # expect: AMP011
    target_network = copy.deepcopy(q_network)
    rb = NStepReplay(args.buffer_size, (4, 84, 84), n_actions, args.n_step, args.gamma)
    gamma_n = args.gamma ** args.n_step

    obs, info = env.reset(seed=args.seed)
    ep_returns = deque(maxlen=100)
    ep_ret, start = 0.0, time.time()
    for global_step in range(args.total_timesteps):
        mask = np.asarray(info.get("action_mask", np.ones(n_actions, dtype=bool)), dtype=bool)
        eps = linear_schedule(args.start_eps, args.end_eps, args.exploration_fraction * args.total_timesteps, global_step)
        if random.random() < eps:
            action = int(np.random.choice(np.flatnonzero(mask)))
        else:
            with torch.no_grad():
                obs_t = torch.as_tensor(np.asarray(obs), device=device).unsqueeze(0)
                q = q_network(obs_t, torch.as_tensor(mask, device=device).unsqueeze(0))
                action = int(q.argmax(dim=1).item())

        next_obs, reward, term, trunc, info = env.step(action)
        rb.add(np.asarray(obs), action, np.sign(reward), float(term), mask)
        ep_ret += float(reward)
        obs = next_obs
        if term or trunc:
            ep_returns.append(ep_ret)
            writer.add_scalar("charts/episodic_return", ep_ret, global_step)
            ep_ret = 0.0
            obs, info = env.reset()

        if global_step > args.learning_starts and global_step % args.train_freq == 0:
            b_obs, b_actions, b_returns, b_next_obs, b_next_mask, b_ended = rb.sample(args.batch_size, device)
            with torch.no_grad():
                target_max = target_network(b_next_obs, b_next_mask).max(dim=1).values
                td_target = b_returns + gamma_n * target_max * (1 - b_ended)
            old_val = q_network(b_obs).gather(1, b_actions.unsqueeze(1)).squeeze(1)
            loss = F.smooth_l1_loss(old_val, td_target)

            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(q_network.parameters(), args.max_grad_norm)
            optimizer.step()

            if global_step % 1000 == 0:
                writer.add_scalar("losses/td_loss", loss.item(), global_step)
                writer.add_scalar("losses/q_values", old_val.detach().float().mean().item(), global_step)
                writer.add_scalar("charts/SPS", int(global_step / (time.time() - start)), global_step)

        if global_step % args.target_update == 0:
            target_network.load_state_dict(q_network.state_dict())

        if global_step > 0 and global_step % 500_000 == 0:
            writer.add_scalar("eval/return", evaluate(q_network, args.env_id, device), global_step)
            torch.save(q_network.state_dict(), f"dqn_{global_step}.pt")

    env.close()
    writer.close()


if __name__ == "__main__":
    main()
