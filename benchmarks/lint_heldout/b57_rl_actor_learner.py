"""Actor-learner PPO with phasic auxiliary updates.

Rollout workers run an fp16 copy of the policy (cheap, no gradients); the learner
keeps the fp32 master copy and trains it under fp16 autocast with a GradScaler.
Written in the stable-baselines3 style (``import torch as th``).
"""

import copy
import time
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch as th
import torch.nn as nn
import torch.nn.functional as F


class ActorCritic(nn.Module):
    def __init__(self, obs_dim, n_actions, hidden=256):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(obs_dim, hidden), nn.Tanh(),
            nn.Linear(hidden, hidden), nn.Tanh(),
        )
        self.pi = nn.Linear(hidden, n_actions)
        self.value_head = nn.Linear(hidden, 1)
        self.aux_value_head = nn.Linear(hidden, 1)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.orthogonal_(m.weight, gain=np.sqrt(2))
                nn.init.zeros_(m.bias)
        nn.init.orthogonal_(self.pi.weight, gain=0.01)

    def forward(self, obs):
        h = self.body(obs)
        return self.pi(h), self.value_head(h).squeeze(-1)

    def aux(self, obs):
        h = self.body(obs)
        return self.pi(h), self.aux_value_head(h).squeeze(-1)


@dataclass
class Batch:
    obs: th.Tensor
    actions: th.Tensor
    old_log_prob: th.Tensor
    old_values: th.Tensor
    advantages: th.Tensor
    returns: th.Tensor


class RolloutBuffer:
    """Stores rollouts in numpy; observations in fp16 to halve host memory."""

    def __init__(self, n_steps, n_envs, obs_dim, gamma=0.99, gae_lambda=0.95):
        self.n_steps, self.n_envs = n_steps, n_envs
        self.gamma, self.gae_lambda = gamma, gae_lambda
        self.obs = np.zeros((n_steps, n_envs, obs_dim), dtype=np.float16)
        self.actions = np.zeros((n_steps, n_envs), dtype=np.int64)
        self.rewards = np.zeros((n_steps, n_envs), dtype=np.float32)
        self.dones = np.zeros((n_steps, n_envs), dtype=np.float32)
        self.values = np.zeros((n_steps, n_envs), dtype=np.float32)
        self.log_probs = np.zeros((n_steps, n_envs), dtype=np.float32)
        self.pos = 0

    def add(self, obs, action, reward, done, value, log_prob):
        self.obs[self.pos] = np.asarray(obs).astype(np.float16)
        self.actions[self.pos] = action
        self.rewards[self.pos] = reward
        self.dones[self.pos] = done
        self.values[self.pos] = value
        self.log_probs[self.pos] = log_prob
        self.pos += 1

    def compute_returns_and_advantage(self, last_values, last_dones):
        last_gae = 0.0
        self.advantages = np.zeros_like(self.rewards)
        for t in reversed(range(self.n_steps)):
            next_non_terminal = 1.0 - (last_dones if t == self.n_steps - 1 else self.dones[t + 1])
            next_values = last_values if t == self.n_steps - 1 else self.values[t + 1]
            delta = self.rewards[t] + self.gamma * next_values * next_non_terminal - self.values[t]
            last_gae = delta + self.gamma * self.gae_lambda * next_non_terminal * last_gae
            self.advantages[t] = last_gae
        self.returns = self.advantages + self.values
        self.advantages = (self.advantages - self.advantages.mean()) / (self.advantages.std() + 1e-8)

    def get(self, batch_size, device):
        n = self.n_steps * self.n_envs
        idx = np.random.permutation(n)
        flat = lambda a: a.reshape(n, *a.shape[2:])
        obs, act, lp = flat(self.obs), flat(self.actions), flat(self.log_probs)
        val, adv, ret = flat(self.values), flat(self.advantages), flat(self.returns)
        for start in range(0, n, batch_size):
            j = idx[start:start + batch_size]
            yield Batch(
                obs=th.as_tensor(obs[j], device=device).float(),
                actions=th.as_tensor(act[j], device=device),
                old_log_prob=th.as_tensor(lp[j], device=device),
                old_values=th.as_tensor(val[j], device=device),
                advantages=th.as_tensor(adv[j], device=device),
                returns=th.as_tensor(ret[j], device=device),
            )
        self.pos = 0


def to_actor_dtype(x, half=True):
    return x.half() if half else x


class RolloutWorker:
    """Steps the vectorised environments with a frozen fp16 copy of the policy."""

    def __init__(self, env_id, n_envs, policy, device, seed=0):
        self.envs = gym.vector.SyncVectorEnv([lambda: gym.make(env_id) for _ in range(n_envs)])
        self.device = device
        self.actor = copy.deepcopy(policy).half().eval()
        self.actor.requires_grad_(False)
        self._obs, _ = self.envs.reset(seed=seed)
        self._dones = np.zeros(n_envs, dtype=np.float32)
        self._hidden = th.zeros(n_envs, 1, device=device, dtype=th.float16)

    def sync(self, policy):
        self.actor.load_state_dict({k: v.half() for k, v in policy.state_dict().items()})

    def collect(self, buffer, n_steps):
        episode_returns = []
        with th.no_grad():
            for _ in range(n_steps):
                obs_t = th.as_tensor(self._obs, device=self.device).half()
                logits, values = self.actor(obs_t)
                dist = th.distributions.Categorical(logits=logits.float())
                actions = dist.sample()
                log_probs = dist.log_prob(actions)
                next_obs, rewards, terms, truncs, infos = self.envs.step(actions.cpu().numpy())
                buffer.add(self._obs, actions.cpu().numpy(), rewards, self._dones,
                           values.float().cpu().numpy(), log_probs.cpu().numpy())
                self._obs, self._dones = next_obs, np.logical_or(terms, truncs).astype(np.float32)
                if "episode" in infos:
                    episode_returns.extend(infos["episode"]["r"][infos["_episode"]].tolist())
            last_obs = to_actor_dtype(th.as_tensor(self._obs, device=self.device))
            _, last_values = self.actor(last_obs)
        buffer.compute_returns_and_advantage(last_values.float().cpu().numpy(), self._dones)
        return episode_returns


class Learner:
    def __init__(self, policy, lr=3e-4, clip_range=0.2, ent_coef=0.01, vf_coef=0.5, max_grad_norm=0.5,
                 device="cuda"):
        self.policy = policy.to(device)
        self.device = device
        self.clip_range, self.ent_coef, self.vf_coef = clip_range, ent_coef, vf_coef
        self.max_grad_norm = max_grad_norm
        self.optimizer = th.optim.Adam(self.policy.parameters(), lr=lr, eps=1e-5)
        self.scaler = th.amp.GradScaler("cuda")

    def update(self, buffer, n_epochs, batch_size):
        self.policy.train()
        stats = []
        for _ in range(n_epochs):
            for batch in buffer.get(batch_size, self.device):
                obs, old_values = [t.half() for t in (batch.obs, batch.old_values)]  # expect: AMP001
                with th.autocast("cuda", dtype=th.float16):
                    logits, values = self.policy(obs)
                    dist = th.distributions.Categorical(logits=logits.float())
                    log_prob = dist.log_prob(batch.actions)
                    ratio = th.exp(log_prob - batch.old_log_prob)
                    pg1 = batch.advantages * ratio
                    pg2 = batch.advantages * th.clamp(ratio, 1.0 - self.clip_range, 1.0 + self.clip_range)
                    policy_loss = -th.min(pg1, pg2).mean()
                    v = values.float()
                    v_clipped = old_values.float() + (v - old_values.float()).clamp(-self.clip_range, self.clip_range)
                    value_loss = 0.5 * th.max((v - batch.returns).pow(2), (v_clipped - batch.returns).pow(2)).mean()
                    entropy = dist.entropy().mean()
                    loss = policy_loss + self.vf_coef * value_loss - self.ent_coef * entropy
                self.optimizer.zero_grad(set_to_none=True)
                self.scaler.scale(loss).backward()
                nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)  # expect: AMP005
                self.scaler.step(self.optimizer)
                self.scaler.update()
                stats.append((policy_loss.item(), value_loss.item(), entropy.item()))
        return np.mean(stats, axis=0)


def make_aux_optimizer(policy, lr):
    """Phasic policy gradient: the auxiliary phase refits the value head on its own."""
    policy.value_head.to(th.float16)  # expect: AMP001
    return th.optim.SGD(policy.value_head.parameters(), lr=lr, momentum=0.9)


def aux_phase(policy, aux_opt, buffer, device, epochs=2, batch_size=512):
    for _ in range(epochs):
        for batch in buffer.get(batch_size, device):
            _, values = policy(batch.obs)
            loss = 0.5 * (values.float() - batch.returns).pow(2).mean()
            aux_opt.zero_grad(set_to_none=True)
            loss.backward()
            aux_opt.step()


def evaluate_policy(policy, env_id, episodes=10, device="cuda"):
    env = gym.make(env_id)
    eval_actor = copy.deepcopy(policy).half().eval()
    returns = []
    with th.no_grad():
        for ep in range(episodes):
            obs, _ = env.reset(seed=10_000 + ep)
            done, total = False, 0.0
            while not done:
                logits, _ = eval_actor(th.as_tensor(obs, device=device).half()[None])
                obs, r, term, trunc, _ = env.step(int(logits.argmax(-1)))
                total += r
                done = term or trunc
            returns.append(total)
    return float(np.mean(returns))


def export_policy(policy, path, obs_dim):
    actor = copy.deepcopy(policy).cpu().eval().half()
    example = th.zeros(1, obs_dim, dtype=th.float16)
    th.jit.trace(actor, example).save(path)


def save_checkpoint(learner, step, path):
    th.save({
        "step": step,
        "policy": learner.policy.state_dict(),
        "actor_fp16": {k: v.to(th.float16) for k, v in learner.policy.state_dict().items()},
        "optimizer": learner.optimizer.state_dict(),
        "scaler": learner.scaler.state_dict(),
    }, path)


def train(env_id="LunarLander-v2", total_steps=5_000_000, n_envs=16, n_steps=256, device="cuda"):
    probe = gym.make(env_id)
    obs_dim, n_actions = probe.observation_space.shape[0], probe.action_space.n
    policy = ActorCritic(obs_dim, n_actions)
    learner = Learner(policy, device=device)
    worker = RolloutWorker(env_id, n_envs, learner.policy, device)
    buffer = RolloutBuffer(n_steps, n_envs, obs_dim)
    aux_opt = make_aux_optimizer(learner.policy, lr=1e-3)
    steps, iteration, t0 = 0, 0, time.time()
    while steps < total_steps:
        ep_returns = worker.collect(buffer, n_steps)
        pg, vf, ent = learner.update(buffer, n_epochs=4, batch_size=1024)
        worker.sync(learner.policy)
        steps += n_steps * n_envs
        iteration += 1
        if iteration % 32 == 0:
            aux_phase(learner.policy, aux_opt, buffer, device)
        if iteration % 10 == 0:
            fps = steps / (time.time() - t0)
            mean_ret = np.mean(ep_returns) if ep_returns else float("nan")
            print(f"it {iteration} steps {steps} fps {fps:.0f} ret {mean_ret:.1f} pg {pg:.3f} vf {vf:.3f} ent {ent:.3f}")
        if iteration % 200 == 0:
            print("eval return", evaluate_policy(learner.policy, env_id, device=device))
            save_checkpoint(learner, steps, f"ppo_{env_id}_{steps}.pt")
    export_policy(learner.policy, f"ppo_{env_id}_actor.pt", obs_dim)


if __name__ == "__main__":
    train()
