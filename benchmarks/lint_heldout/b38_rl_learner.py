"""Synchronous actor-learner PPO with an auxiliary termination head.

Actors step a batch of environments with a no-grad copy of the policy and push
rollouts (with GAE advantages) into a queue; the learner pulls them and runs
several epochs of minibatch updates with separate actor / critic / temperature
optimizers.

    python b38_rl_learner.py --num-envs 64 --rollout 128 --updates 2000 --amp
"""
import argparse
import collections
import os
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

AgentOutput = collections.namedtuple("AgentOutput", ["logits", "value", "done_logit"])


class VecCorridor:
    """N independent corridors; the agent must reach the right end. Some moves are illegal near walls."""

    def __init__(self, n, length=16, max_steps=64, seed=0):
        self.n, self.length, self.max_steps = n, length, max_steps
        self.rng = np.random.default_rng(seed)
        self.obs_dim, self.n_actions = length + 2, 3
        self.reset_all()

    def reset_all(self):
        self.pos = self.rng.integers(0, self.length // 2, self.n)
        self.t = np.zeros(self.n, dtype=np.int64)
        return self.observe()

    def observe(self):
        obs = np.zeros((self.n, self.obs_dim), dtype=np.float32)
        obs[np.arange(self.n), self.pos] = 1.0
        obs[:, -2] = self.t / self.max_steps
        obs[:, -1] = self.rng.standard_normal(self.n) * 0.1
        mask = np.ones((self.n, self.n_actions), dtype=bool)
        mask[self.pos == 0, 0] = False
        return obs, mask

    def step(self, actions):
        self.pos = np.clip(self.pos + (actions - 1), 0, self.length - 1)
        self.t += 1
        reward = np.where(self.pos == self.length - 1, 1.0, -0.01).astype(np.float32)
        done = (self.pos == self.length - 1) | (self.t >= self.max_steps)
        self.pos[done] = self.rng.integers(0, self.length // 2, done.sum())
        self.t[done] = 0
        obs, mask = self.observe()
        return obs, mask, reward, done.astype(np.float32)


class ActorCritic(nn.Module):
    def __init__(self, obs_dim, n_actions, hidden=256):
        super().__init__()
        self.fc1 = nn.Linear(obs_dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, hidden)
        self.policy = nn.Linear(hidden, n_actions)
        self.value = nn.Linear(hidden, 1)
        self.done_head = nn.Linear(hidden, 1)

    def forward(self, obs, action_mask):
        h = F.relu(self.fc1(obs))
        h = self.fc2(h)
        mu = h.mean(dim=-1, keepdim=True)  # expect: AMP004
        sigma = h.std(dim=-1, keepdim=True)  # expect: AMP004
        h = F.relu((h - mu) / (sigma + 1e-8))  # expect: AMP011
        h = F.relu(self.fc3(h))
        logits = self.policy(h)
        logits = logits.masked_fill(~action_mask, -1e9)  # expect: AMP007
        return AgentOutput(logits, self.value(h).squeeze(-1), self.done_head(h).squeeze(-1))

    def actor_parameters(self):
        for name, p in self.named_parameters():
            if not name.startswith("value."):
                yield p


@torch.no_grad()
def collect_rollout(env, model, obs, mask, args, device):
    keys = ("obs", "mask", "act", "logp", "val", "rew", "done")
    buf = {k: [] for k in keys}
    for _ in range(args.rollout):
        obs_t = torch.as_tensor(obs, device=device)
        mask_t = torch.as_tensor(mask, device=device)
        out = model(obs_t, mask_t)
        dist = torch.distributions.Categorical(logits=out.logits.float())
        act = dist.sample()
        next_obs, next_mask, rew, done = env.step(act.cpu().numpy())
        for k, v in zip(keys, (obs, mask, act.cpu().numpy(), dist.log_prob(act).cpu().numpy(),
                               out.value.float().cpu().numpy(), rew, done)):
            buf[k].append(v)
        obs, mask = next_obs, next_mask
    last_val = model(torch.as_tensor(obs, device=device), torch.as_tensor(mask, device=device)).value
    rollout = {k: np.stack(v) for k, v in buf.items()}
    adv = np.zeros_like(rollout["rew"])
    gae, next_val = 0.0, last_val.float().cpu().numpy()
    for t in reversed(range(args.rollout)):
        nonterminal = 1.0 - rollout["done"][t]
        delta = rollout["rew"][t] + args.gamma * next_val * nonterminal - rollout["val"][t]
        gae = delta + args.gamma * args.lam * nonterminal * gae
        adv[t] = gae
        next_val = rollout["val"][t]
    rollout["adv"], rollout["ret"] = adv, adv + rollout["val"]
    return rollout, obs, mask


def flatten_to_device(rollout, device):
    out = {}
    for k, v in rollout.items():
        t = torch.as_tensor(v.reshape(-1, *v.shape[2:]), device=device)
        out[k] = t.float() if t.dtype == torch.float64 else t
    return out


def pretrain_bc(model, env, args, device):
    """Warm-start the policy by cloning a scripted expert (move right whenever it is legal)."""
    bc_opt = torch.optim.Adam(model.actor_parameters(), lr=args.bc_lr)
    for it in range(args.bc_steps):
        obs, mask = env.reset_all()
        obs_t, mask_t = torch.as_tensor(obs, device=device), torch.as_tensor(mask, device=device)
        expert = torch.full((obs.shape[0],), 2, dtype=torch.long, device=device)
        with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
            out = model(obs_t, mask_t)
            bc_loss = F.cross_entropy(out.logits, expert)
        bc_opt.zero_grad(set_to_none=True)
        bc_loss.backward()
        bc_opt.step()
        if it % 100 == 0:
            print(f"bc {it} loss {bc_loss.item():.4f}")


def learner(args, model, env, device):
    actor_opt = torch.optim.Adam(model.actor_parameters(), lr=args.lr, eps=1e-5)
    critic_opt = torch.optim.Adam(model.value.parameters(), lr=args.critic_lr, eps=1e-5)
    log_alpha = torch.zeros((), device=device, requires_grad=True)
    alpha_opt = torch.optim.Adam([log_alpha], lr=args.alpha_lr)
    optimizers = (actor_opt, critic_opt, alpha_opt)
    amp_ctx = torch.autocast("cuda", dtype=torch.float16) if args.amp else nullcontext()  # expect: AMP010

    start_update, best_return = 0, -1e9
    if args.resume and os.path.exists(args.resume):
        ckpt = torch.load(args.resume, map_location=device)
        model.load_state_dict(ckpt["model"])
        for opt, sd in zip(optimizers, ckpt["optimizers"]):
            opt.load_state_dict(sd)
        log_alpha.data.fill_(ckpt["log_alpha"])
        start_update, best_return = ckpt["update"], ckpt["best_return"]

    obs, mask = env.reset_all()
    for update in range(start_update, args.updates):
        t0 = time.time()
        rollout, obs, mask = collect_rollout(env, model, obs, mask, args, device)
        batch = flatten_to_device(rollout, device)
        n = batch["obs"].shape[0]
        stats = collections.defaultdict(list)
        for _ in range(args.ppo_epochs):
            perm = torch.randperm(n, device=device)
            for start in range(0, n, args.minibatch):
                idx = perm[start:start + args.minibatch]
                mb = {k: v[idx] for k, v in batch.items()}
                adv = mb["adv"]
                adv = (adv - adv.mean()) / (adv.std() + 1e-8)
                alpha = log_alpha.exp().detach()
                with amp_ctx:
                    out = model(mb["obs"], mb["mask"])
                    logp_all = F.log_softmax(out.logits, dim=-1)
                    logp = logp_all.gather(-1, mb["act"].unsqueeze(-1)).squeeze(-1)
                    ratio = torch.exp(logp - mb["logp"])
                    pg_loss = -torch.min(ratio * adv, ratio.clamp(1 - args.clip, 1 + args.clip) * adv).mean()
                    v_loss = F.mse_loss(out.value, mb["ret"])
                    entropy = -(logp_all.exp() * logp_all).sum(-1).mean()
                    done_prob = torch.sigmoid(out.done_logit)
                    aux_loss = F.binary_cross_entropy(done_prob, mb["done"])  # expect: AMP003
                    alpha_loss = log_alpha * (entropy.detach() - args.target_entropy)
                    total = pg_loss + args.vf_coef * v_loss - alpha * entropy + args.aux_coef * aux_loss
                for opt in optimizers:
                    opt.zero_grad(set_to_none=True)
                (total + alpha_loss).backward()
                nn.utils.clip_grad_norm_(list(model.actor_parameters()), args.max_grad_norm)
                nn.utils.clip_grad_norm_(model.value.parameters(), args.max_grad_norm)
                for opt in optimizers:
                    opt.step()
                stats["pg"].append(pg_loss.item())
                stats["v"].append(v_loss.item())
                stats["ent"].append(entropy.item())
                stats["aux"].append(aux_loss.item())
        mean_return = float(rollout["rew"].sum(0).mean())
        if update % args.log_every == 0:
            print(f"upd {update} ret {mean_return:.3f} alpha {alpha.item():.4f} "
                  + " ".join(f"{k} {np.mean(v):.4f}" for k, v in stats.items())
                  + f" fps {n / (time.time() - t0):.0f}")
        if mean_return > best_return or update % args.save_every == 0:
            best_return = max(best_return, mean_return)
            torch.save({"model": model.state_dict(), "optimizers": [o.state_dict() for o in optimizers],
                        "log_alpha": log_alpha.item(), "update": update + 1, "best_return": best_return},
                       os.path.join(args.out_dir, "learner.pt"))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--num-envs", type=int, default=64)
    p.add_argument("--rollout", type=int, default=128)
    p.add_argument("--updates", type=int, default=2000)
    p.add_argument("--ppo-epochs", type=int, default=4)
    p.add_argument("--minibatch", type=int, default=2048)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--critic-lr", type=float, default=1e-3)
    p.add_argument("--alpha-lr", type=float, default=1e-3)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--lam", type=float, default=0.95)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--vf-coef", type=float, default=0.5)
    p.add_argument("--aux-coef", type=float, default=0.1)
    p.add_argument("--target-entropy", type=float, default=0.3)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--bc-steps", type=int, default=0)
    p.add_argument("--bc-lr", type=float, default=1e-3)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--out-dir", default="runs/ppo")
    p.add_argument("--resume", default=None)
    args = p.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    device = torch.device("cuda")
    env = VecCorridor(args.num_envs)
    model = ActorCritic(env.obs_dim, env.n_actions)
    model.to(device)
    if args.bc_steps > 0:
        pretrain_bc(model, env, args, device)
    learner(args, model, env, device)


if __name__ == "__main__":
    main()
