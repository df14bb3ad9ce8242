"""PPO policy update for a transformer policy, with bf16 autocast on the learner."""
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def compute_gae(rewards, values, dones, gamma=0.99, lam=0.95):
    advantages = torch.zeros_like(rewards)
    lastgaelam = 0.0
    for t in reversed(range(rewards.size(0))):
        nextnonterminal = 1.0 - dones[t]
        nextvalues = values[t + 1] if t + 1 < values.size(0) else 0.0
        delta = rewards[t] + gamma * nextvalues * nextnonterminal - values[t]
        advantages[t] = lastgaelam = delta + gamma * lam * nextnonterminal * lastgaelam
    return advantages


class PPOLearner:
    def __init__(self, policy, value_head, lr=3e-4, clip_coef=0.2, ent_coef=0.01, vf_coef=0.5):
        self.policy = policy
        self.value_head = value_head
        params = list(policy.parameters()) + list(value_head.parameters())
        self.optimizer = torch.optim.Adam(params, lr=lr, eps=1e-5)
        self.clip_coef = clip_coef
        self.ent_coef = ent_coef
        self.vf_coef = vf_coef

    def update(self, obs, actions, old_logprobs, returns, advantages, epochs=4, minibatch=256):
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        n = obs.size(0)
        for _ in range(epochs):
            perm = torch.randperm(n, device=obs.device)
            for start in range(0, n, minibatch):
                idx = perm[start : start + minibatch]
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = self.policy(obs[idx])
                    values = self.value_head(obs[idx]).squeeze(-1)
                    dist = torch.distributions.Categorical(logits=logits.float())
                    new_logprobs = dist.log_prob(actions[idx])
                    entropy = dist.entropy().mean()
                    ratio = (new_logprobs - old_logprobs[idx]).exp()
                    pg1 = -advantages[idx] * ratio
                    pg2 = -advantages[idx] * torch.clamp(ratio, 1 - self.clip_coef, 1 + self.clip_coef)
                    pg_loss = torch.max(pg1, pg2).mean()
                    v_loss = 0.5 * F.mse_loss(values.float(), returns[idx])
                    loss = pg_loss - self.ent_coef * entropy + self.vf_coef * v_loss
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(self.policy.parameters(), 0.5)
                self.optimizer.step()
        return loss.item()


class FP16Learner(PPOLearner):
    """The same learner on GPUs without bf16: fp16 autocast with a scaler."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scaler = torch.amp.GradScaler("cuda")

    def update(self, obs, actions, old_logprobs, returns, advantages, epochs=4, minibatch=256):
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        for _ in range(epochs):
            for idx in torch.randperm(obs.size(0), device=obs.device).split(minibatch):
                with torch.autocast("cuda", dtype=torch.float16):
                    logits = self.policy(obs[idx])
                    values = self.value_head(obs[idx]).squeeze(-1)
                    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, actions[idx, None]).squeeze(-1)
                    ratio = (logp - old_logprobs[idx]).exp()
                    pg_loss = torch.max(-advantages[idx] * ratio,
                                        -advantages[idx] * ratio.clamp(1 - self.clip_coef, 1 + self.clip_coef)).mean()
                    v_loss = F.mse_loss(values.float(), returns[idx])
                    loss = pg_loss + self.vf_coef * v_loss
                self.optimizer.zero_grad(set_to_none=True)
                self.scaler.scale(loss).backward()
                self.scaler.unscale_(self.optimizer)
                nn.utils.clip_grad_norm_(self.policy.parameters(), 0.5)
                self.scaler.step(self.optimizer)  # expect: AMP006
        return float(np.mean([0.0]))
