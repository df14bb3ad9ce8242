"""Soft Actor-Critic for continuous control (CleanRL sac_continuous_action style) with bf16 autocast updates."""
import argparse
import copy
import random
import time

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from stable_baselines3.common.buffers import ReplayBuffer

BF16 = torch.bfloat16
LOG_STD_MAX = 2
LOG_STD_MIN = -5


class SoftQNetwork(nn.Module):
    def __init__(self, env):
        super().__init__()
        in_dim = int(np.prod(env.single_observation_space.shape) + np.prod(env.single_action_space.shape))
        self.fc1 = nn.Linear(in_dim, 256)
        self.fc2 = nn.Linear(256, 256)
        self.fc3 = nn.Linear(256, 1)

    def forward(self, x, a):
        x = torch.cat([x, a], 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class Actor(nn.Module):
    def __init__(self, env):
        super().__init__()
        obs_dim = int(np.prod(env.single_observation_space.shape))
        act_dim = int(np.prod(env.single_action_space.shape))
        self.fc1 = nn.Linear(obs_dim, 256)
        self.fc2 = nn.Linear(256, 256)
        self.fc_mean = nn.Linear(256, act_dim)
        self.fc_logstd = nn.Linear(256, act_dim)
        high, low = env.single_action_space.high, env.single_action_space.low
        self.register_buffer("action_scale", torch.tensor((high - low) / 2.0, dtype=torch.float32))
        self.register_buffer("action_bias", torch.tensor((high + low) / 2.0, dtype=torch.float32))

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        mean = self.fc_mean(x)
        log_std = torch.tanh(self.fc_logstd(x))
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1)
        return mean, log_std

    def get_action(self, x):
        mean, log_std = self(x)
        normal = torch.distributions.Normal(mean.float(), log_std.float().exp())
        x_t = normal.rsample()
        y_t = torch.tanh(x_t)
        action = y_t * self.action_scale + self.action_bias
        log_prob = normal.log_prob(x_t)
        log_prob -= torch.log(self.action_scale * (1 - y_t.pow(2)) + 1e-6)
        log_prob = log_prob.sum(1, keepdim=True)
        mean = torch.tanh(mean) * self.action_scale + self.action_bias
        return action, log_prob, mean


def update_critic(data, actor, qf1, qf2, qf1_target, qf2_target, q_optimizer, scaler, alpha, args):
    obs = data.observations.to(BF16)  # expect: AMP001
    with torch.no_grad():
        next_actions, next_log_pi, _ = actor.get_action(data.next_observations)
        qf1_next = qf1_target(data.next_observations, next_actions)
        qf2_next = qf2_target(data.next_observations, next_actions)
        min_qf_next = torch.min(qf1_next, qf2_next) - alpha * next_log_pi
        next_q_value = data.rewards.flatten() + (1 - data.dones.flatten()) * args.gamma * min_qf_next.view(-1)

    with torch.autocast("cuda", dtype=torch.bfloat16):
        qf1_a_values = qf1(obs, data.actions).view(-1)
        qf2_a_values = qf2(obs, data.actions).view(-1)
    qf1_loss = F.mse_loss(qf1_a_values, next_q_value)  # expect: AMP002
    qf2_loss = F.mse_loss(qf2_a_values.float(), next_q_value)
    qf_loss = qf1_loss + qf2_loss

    q_optimizer.zero_grad()
    scaler.scale(qf_loss).backward()
    nn.utils.clip_grad_norm_(list(qf1.parameters()) + list(qf2.parameters()), args.max_grad_norm)  # expect: AMP005
    scaler.step(q_optimizer)
    scaler.update()
    return qf1_a_values.detach().float(), qf_loss.detach()


def update_actor(data, actor, qf1, qf2, actor_optimizer, scaler, log_alpha, a_optimizer, target_entropy, args):
    for _ in range(args.policy_frequency):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pi, log_pi, _ = actor.get_action(data.observations)
            min_qf_pi = torch.min(qf1(data.observations, pi), qf2(data.observations, pi))
            actor_loss = ((log_alpha.exp().detach() * log_pi) - min_qf_pi).mean()
        actor_optimizer.zero_grad()
        scaler.scale(actor_loss).backward()
        actor_optimizer.step()  # expect: AMP006

        if args.autotune:
            with torch.no_grad():
                _, log_pi, _ = actor.get_action(data.observations)
            alpha_loss = (-log_alpha.exp() * (log_pi + target_entropy)).mean()
            a_optimizer.zero_grad()
            alpha_loss.backward()
            a_optimizer.step()
    return actor_loss.detach()


@torch.no_grad()
def evaluate_policy(actor, env_id, device, episodes=10):
    policy = copy.deepcopy(actor).to(torch.bfloat16).eval()
    env = gym.make(env_id)
    returns = []
    for ep in range(episodes):
        obs, _ = env.reset(seed=1000 + ep)
        done, ep_ret = False, 0.0
        while not done:
            _, _, action = policy.get_action(torch.as_tensor(obs, device=device, dtype=torch.bfloat16)[None])
            obs, r, term, trunc, _ = env.step(action[0].float().cpu().numpy())
            ep_ret += r
            done = term or trunc
        returns.append(ep_ret)
    return float(np.mean(returns))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--env-id", default="HalfCheetah-v4")
    p.add_argument("--total-timesteps", type=int, default=1_000_000)
    p.add_argument("--buffer-size", type=int, default=1_000_000)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--tau", type=float, default=0.005)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--learning-starts", type=int, default=5000)
    p.add_argument("--policy-lr", type=float, default=3e-4)
    p.add_argument("--q-lr", type=float, default=1e-3)
    p.add_argument("--policy-frequency", type=int, default=2)
    p.add_argument("--max-grad-norm", type=float, default=10.0)
    p.add_argument("--autotune", action="store_true", default=True)
    args = p.parse_args()

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    device = torch.device("cuda")
    envs = gym.vector.SyncVectorEnv([lambda: gym.wrappers.RecordEpisodeStatistics(gym.make(args.env_id))])

    actor = Actor(envs).to(device)
    qf1, qf2 = SoftQNetwork(envs).to(device), SoftQNetwork(envs).to(device)
    qf1_target, qf2_target = copy.deepcopy(qf1), copy.deepcopy(qf2)
    q_optimizer = optim.Adam(list(qf1.parameters()) + list(qf2.parameters()), lr=args.q_lr)
    actor_optimizer = optim.Adam(list(actor.parameters()), lr=args.policy_lr)
    target_entropy = -torch.prod(torch.Tensor(envs.single_action_space.shape).to(device)).item()
    log_alpha = torch.zeros(1, requires_grad=True, device=device)
    a_optimizer = optim.Adam([log_alpha], lr=args.q_lr)
    alpha = log_alpha.exp().item()
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010

    rb = ReplayBuffer(args.buffer_size, envs.single_observation_space, envs.single_action_space, device,
                      handle_timeout_termination=False)
    obs, _ = envs.reset(seed=0)
    start_time = time.time()
    for global_step in range(args.total_timesteps):
        if global_step < args.learning_starts:
            actions = np.array([envs.single_action_space.sample() for _ in range(envs.num_envs)])
        else:
            actions, _, _ = actor.get_action(torch.Tensor(obs).to(device))
            actions = actions.detach().cpu().numpy()
        next_obs, rewards, terminations, truncations, infos = envs.step(actions)
        rb.add(obs, next_obs.copy(), actions, rewards, terminations, infos)
        obs = next_obs

        if global_step > args.learning_starts:
            data = rb.sample(args.batch_size)
            qf_values, qf_loss = update_critic(data, actor, qf1, qf2, qf1_target, qf2_target, q_optimizer, scaler, alpha, args)
            if global_step % args.policy_frequency == 0:
                update_actor(data, actor, qf1, qf2, actor_optimizer, scaler, log_alpha, a_optimizer, target_entropy, args)
                alpha = log_alpha.exp().item()
            with torch.no_grad():
                for net, tgt in ((qf1, qf1_target), (qf2, qf2_target)):
                    for param, target_param in zip(net.parameters(), tgt.parameters()):
                        target_param.data.copy_(args.tau * param.data + (1 - args.tau) * target_param.data)
            if global_step % 10_000 == 0:
                ret = evaluate_policy(actor, args.env_id, device)
                print(f"step {global_step}: qf_loss {qf_loss.item():.3f} q {qf_values.mean().item():.2f} "
                      f"eval return {ret:.1f} SPS {int(global_step / (time.time() - start_time))}")
    envs.close()


if __name__ == "__main__":
    main()
