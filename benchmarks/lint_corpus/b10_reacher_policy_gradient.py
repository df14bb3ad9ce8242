"""Policy-gradient (REINFORCE with a learned baseline) for a 7-DoF reach-and-grasp arm.

Continuous joint-velocity actions (diagonal Gaussian) plus a discrete gripper command
(open / close / hold) whose invalid options are masked by the controller state.
`adapt_on_robot` fine-tunes a trained policy on the real arm's Jetson.
"""
import math
import os
import time
from collections import defaultdict

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

LOG_2PI = math.log(2 * math.pi)

CONFIG = {
    "obs_dim": 39,
    "act_dim": 7,
    "n_grip": 3,
    "hidden": 256,
    "lr": 3e-4,
    "adapt_lr": 1e-4,
    "gamma": 0.99,
    "epochs_per_batch": 4,
    "max_grad_norm": 0.5,
    "ent_coef": 1e-3,
    "vf_coef": 0.5,
    "amp": True,
    "rollout_len": 2048,
    "iterations": 500,
    "ckpt_dir": "checkpoints/reacher",
}


class GaussianGripperPolicy(nn.Module):
    def __init__(self, obs_dim, act_dim, n_grip, hidden):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.mu_head = nn.Linear(hidden, act_dim)
        self.gripper_head = nn.Linear(hidden, n_grip)
        self.log_std = nn.Parameter(torch.full((act_dim,), -0.5))

    def forward(self, obs, action_mask=None, explore=False):
        h = self.trunk(obs)
        mu = self.mu_head(h)
        gripper_logits = self.gripper_head(h)
        if action_mask is not None:
            gripper_logits = gripper_logits.masked_fill(~action_mask, -1e9)  # expect: AMP007
        if explore:
            # Gumbel perturbation: sample the gripper command with argmax in the rollout workers
            u = torch.rand_like(gripper_logits)
            gripper_logits = gripper_logits - torch.log(-torch.log(u + 1e-10) + 1e-10)  # expect: AMP011
        return mu, self.log_std.expand_as(mu), gripper_logits


class ValueNet(nn.Module):
    def __init__(self, obs_dim, hidden):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, obs):
        return self.net(obs).squeeze(-1)


def gaussian_log_prob(mu, log_std, act):
    var = torch.exp(2 * log_std)
    return (-((act - mu) ** 2) / (2 * var) - log_std - 0.5 * LOG_2PI).sum(-1)


def categorical_log_prob(logits, idx):
    return F.log_softmax(logits, dim=-1).gather(-1, idx.unsqueeze(-1)).squeeze(-1)


def discounted_returns(rewards, dones, gamma):
    ret = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[0])
    for t in reversed(range(rewards.shape[0])):
        running = rewards[t] + gamma * running * (1.0 - dones[t])
        ret[t] = running
    return ret


@torch.no_grad()
def collect_rollout(env, policy, cfg, device):
    buf = defaultdict(list)
    obs, info = env.reset()
    for _ in range(cfg["rollout_len"]):
        obs_t = torch.as_tensor(obs, dtype=torch.float32, device=device)
        mask_t = torch.as_tensor(info["grip_mask"], dtype=torch.bool, device=device)
        with torch.autocast("cuda", dtype=torch.float16, enabled=cfg["amp"]):
            mu, log_std, grip_logits = policy(obs_t, mask_t, explore=True)
        act = (mu.float() + torch.randn_like(mu.float()) * log_std.float().exp())
        grip = grip_logits.argmax(-1)
        next_obs, reward, term, trunc, info_next = env.step(act.cpu().numpy(), grip.cpu().numpy())
        for k, v in (("obs", obs_t), ("mask", mask_t), ("act", act), ("grip", grip),
                     ("rew", torch.as_tensor(reward, dtype=torch.float32, device=device)),
                     ("done", torch.as_tensor(term | trunc, dtype=torch.float32, device=device))):
            buf[k].append(v)
        obs, info = next_obs, info_next
    batch = {k: torch.stack(v) for k, v in buf.items()}
    batch["returns"] = discounted_returns(batch.pop("rew"), batch.pop("done"), cfg["gamma"])
    return batch


class ReinforceTrainer:
    """One optimizer over policy + baseline. The update is split into backward() and step()
    so that the distributed subclass can all-reduce gradients in between."""

    def __init__(self, policy, value_fn, cfg, device="cuda"):
        self.policy, self.value_fn, self.cfg, self.device = policy, value_fn, cfg, device
        self.params = list(policy.parameters()) + list(value_fn.parameters())
        self.optimizer = torch.optim.Adam(self.params, lr=cfg["lr"])
        self.scaler = torch.amp.GradScaler("cuda", enabled=cfg["amp"])
        self.stats = defaultdict(list)

    def autocast(self):
        return torch.autocast("cuda", dtype=torch.float16, enabled=self.cfg["amp"])

    def compute_losses(self, batch):
        mu, log_std, grip_logits = self.policy(batch["obs"], batch["mask"])
        logp = gaussian_log_prob(mu, log_std, batch["act"]) + categorical_log_prob(grip_logits, batch["grip"])
        values = self.value_fn(batch["obs"])
        adv = batch["returns"] - values.detach().float()
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        pg_loss = -(logp * adv).mean()
        v_loss = F.mse_loss(values, batch["returns"])
        entropy = (0.5 + 0.5 * LOG_2PI + log_std).sum(-1).mean()
        loss = pg_loss + self.cfg["vf_coef"] * v_loss - self.cfg["ent_coef"] * entropy
        return {"loss": loss, "pg": pg_loss, "v": v_loss, "ent": entropy}

    def backward(self, loss):
        loss = self.scaler.scale(loss)
        loss.backward()

    def step(self):
        grad_norm = nn.utils.clip_grad_norm_(self.params, self.cfg["max_grad_norm"])  # expect: AMP005
        self.optimizer.step()  # expect: AMP006
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def update_policy(self, batch):
        for _ in range(self.cfg["epochs_per_batch"]):
            with self.autocast():
                losses = self.compute_losses(batch)
                self.backward(losses["loss"])  # expect: AMP008
            grad_norm = self.step()
            for k, v in losses.items():
                self.stats[k].append(v.item())
            self.stats["grad_norm"].append(float(grad_norm))

    def warmup_baseline(self, batch, iters=50):
        """Fit the baseline alone before the first policy update (fp32; cheap)."""
        for _ in range(iters):
            values = self.value_fn(batch["obs"])
            v_loss = F.mse_loss(values, batch["returns"])
            self.backward(v_loss)
            self.step()

    def save(self, path):
        torch.save({"policy": self.policy.state_dict(), "value": self.value_fn.state_dict(),
                    "optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict()}, path)


def train(env, cfg=CONFIG, device="cuda"):
    policy = GaussianGripperPolicy(cfg["obs_dim"], cfg["act_dim"], cfg["n_grip"], cfg["hidden"]).to(device)
    value_fn = ValueNet(cfg["obs_dim"], cfg["hidden"]).to(device)
    trainer = ReinforceTrainer(policy, value_fn, cfg, device)
    os.makedirs(cfg["ckpt_dir"], exist_ok=True)
    best_return = -1e9
    for it in range(cfg["iterations"]):
        t0 = time.time()
        batch = collect_rollout(env, policy, cfg, device)
        if it == 0:
            trainer.warmup_baseline(batch)
        trainer.update_policy(batch)
        mean_ret = batch["returns"][0].mean().item()
        print(f"iter {it} return {mean_ret:.2f} loss {np.mean(trainer.stats['loss'][-4:]):.4f} {time.time() - t0:.1f}s")
        if mean_ret > best_return:
            best_return = mean_ret
            trainer.save(os.path.join(cfg["ckpt_dir"], "best.pt"))
    return policy


def load_policy(path, cfg, device):
    policy = GaussianGripperPolicy(cfg["obs_dim"], cfg["act_dim"], cfg["n_grip"], cfg["hidden"])
    policy.load_state_dict(torch.load(path, map_location="cpu")["policy"])
    return policy.to(device)


def adapt_on_robot(robot, ckpt, cfg=CONFIG, episodes=20, device="cuda"):
    """Few-episode on-hardware adaptation. The Jetson has 8 GB shared memory: run the policy in fp16."""
    policy = load_policy(ckpt, cfg, device).half()  # expect: AMP001
    optimizer = torch.optim.Adam(policy.parameters(), lr=cfg["adapt_lr"])  # expect: AMP011
    policy.train()
    for ep in range(episodes):
        obs, info = robot.reset()
        logps, rewards = [], []
        done = False
        while not done:
            obs_t = torch.as_tensor(obs, dtype=torch.float16, device=device)
            mask_t = torch.as_tensor(info["grip_mask"], dtype=torch.bool, device=device)
            mu, log_std, grip_logits = (t.float() for t in policy(obs_t, mask_t))
            act = mu + torch.randn_like(mu) * log_std.exp()
            grip = torch.distributions.Categorical(logits=grip_logits).sample()
            logps.append(gaussian_log_prob(mu, log_std, act.detach()) + categorical_log_prob(grip_logits, grip))
            obs, reward, term, trunc, info = robot.step(act.detach().cpu().numpy(), grip.cpu().numpy())
            rewards.append(float(reward))
            done = term or trunc
        returns = torch.tensor(np.cumsum(np.array(rewards)[::-1])[::-1].copy(), dtype=torch.float32, device=device)
        returns = (returns - returns.mean()) / (returns.std() + 1e-6)
        loss = -(torch.stack(logps) * returns).sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        print(f"[adapt] episode {ep} return {sum(rewards):.2f}")
    torch.save(policy.state_dict(), ckpt.replace(".pt", "_adapted_fp16.pt"))
    return policy
