"""Deep Q-learning agent with a target network and prioritized replay weights."""
import random
from collections import deque

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class QNetwork(nn.Module):
    def __init__(self, obs_dim, n_actions, hidden=256):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, n_actions))

    def forward(self, obs):
        return self.net(obs)


class ReplayBuffer:
    def __init__(self, capacity):
        self.buffer = deque(maxlen=capacity)
        self.priorities = deque(maxlen=capacity)

    def push(self, transition, priority=1.0):
        self.buffer.append(transition)
        self.priorities.append(priority)

    def sample(self, batch_size, alpha=0.6, beta=0.4):
        p = np.asarray(self.priorities, dtype=np.float64) ** alpha
        p /= p.sum()
        idx = np.random.choice(len(self.buffer), batch_size, p=p)
        weights = (len(self.buffer) * p[idx]) ** (-beta)
        weights /= weights.max() + 1e-8
        return [self.buffer[i] for i in idx], idx, weights


class Agent:
    def __init__(self, obs_dim, n_actions, gamma=0.99, lr=2.5e-4, use_amp=True):
        self.q = QNetwork(obs_dim, n_actions).cuda()
        self.target = QNetwork(obs_dim, n_actions).cuda()
        self.target.load_state_dict(self.q.state_dict())
        self.target.half().eval()
        self.optimizer = torch.optim.Adam(self.q.parameters(), lr=lr, eps=1.5e-4)
        self.scaler = torch.amp.GradScaler("cuda", enabled=use_amp)
        self.use_amp = use_amp
        self.gamma = gamma
        self.n_actions = n_actions

    def act(self, obs, eps):
        if random.random() < eps:
            return random.randrange(self.n_actions)
        with torch.no_grad():
            return self.q(torch.as_tensor(obs, device="cuda").float()[None]).argmax(1).item()

    def update(self, batch, weights):
        obs, actions, rewards, next_obs, dones = [torch.as_tensor(np.array(x), device="cuda") for x in zip(*batch)]
        with torch.no_grad():
            next_q = self.target(next_obs.half()).float().max(1).values
            target = rewards.float() + self.gamma * (1 - dones.float()) * next_q
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.use_amp):
            q = self.q(obs.float()).gather(1, actions.long()[:, None]).squeeze(1)
        td = target - q.float()
        loss = (torch.as_tensor(weights, device="cuda").float() * F.smooth_l1_loss(q.float(), target, reduction="none")).mean()
        self.optimizer.zero_grad()
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        nn.utils.clip_grad_norm_(self.q.parameters(), 10.0)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return td.abs().detach().cpu().numpy() + 1e-6

    def sync_target(self):
        self.target.load_state_dict({k: v.half() for k, v in self.q.state_dict().items()})
