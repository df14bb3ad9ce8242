"""PPO (CleanRL layout) for an entity-based environment with a discrete move action and a
multi-binary "toggle" action, plus a GAIL discriminator for the imitation bonus.

    python b51_ppo_actor_critic.py --env-id Entities-v0 --expert data/expert_sa.npy
"""
import argparse
import copy
import time
from collections import namedtuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributions import Categorical

from envs import make_vec_env

PolicyOutput = namedtuple("PolicyOutput", ["logits", "bin_logits", "value", "features"])


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias_const)
    return layer


class RunningMeanStd:
    def __init__(self, shape=(), epsilon=1e-4):
        self.mean, self.var, self.count = np.zeros(shape), np.ones(shape), epsilon

    def update(self, x):
        batch_mean, batch_var, batch_count = np.mean(x, axis=0), np.var(x, axis=0), x.shape[0]
        delta = batch_mean - self.mean
        tot = self.count + batch_count
        self.mean = self.mean + delta * batch_count / tot
        m2 = self.var * self.count + batch_var * batch_count + delta ** 2 * self.count * batch_count / tot
        self.var, self.count = m2 / tot, tot

    def normalize(self, x):
        return np.clip((x - self.mean) / np.sqrt(self.var + 1e-8), -10.0, 10.0)


class EntityEncoder(nn.Module):
    """DeepSets encoder over a padded set of entities."""

    def __init__(self, ent_dim, hidden, n_layers=2):
        super().__init__()
        self.layers = nn.ModuleList(
            [layer_init(nn.Linear(ent_dim if i == 0 else hidden, hidden)) for i in range(n_layers)])

    def forward(self, ents, ent_mask):
        h = ents
        for layer in self.layers:
            h = F.relu(layer(h))
        h = h.masked_fill(~ent_mask[..., None], 0.0)
        pooled_mean = h.mean(dim=1)  # expect: AMP004
        pooled_max = h.masked_fill(~ent_mask[..., None], float("-inf")).amax(dim=1)
        return pooled_mean, torch.nan_to_num(pooled_max, neginf=0.0)


class ActorCritic(nn.Module):
    def __init__(self, obs_dim, ent_dim, n_actions, n_binary, hidden=256):
        super().__init__()
        self.entity_enc = EntityEncoder(ent_dim, hidden)
        self.trunk = nn.Sequential(
            layer_init(nn.Linear(obs_dim + 2 * hidden, hidden)), nn.Tanh(),
            layer_init(nn.Linear(hidden, hidden)), nn.Tanh(),
        )
        self.actor = layer_init(nn.Linear(hidden, n_actions), std=0.01)
        self.binary_head = layer_init(nn.Linear(hidden, n_binary), std=0.01)
        self.critic = layer_init(nn.Linear(hidden, 1), std=1.0)

    def forward(self, obs, ents, ent_mask):
        pooled_mean, pooled_max = self.entity_enc(ents, ent_mask)
        h = self.trunk(torch.cat([obs, pooled_mean, pooled_max], dim=-1))
        return PolicyOutput(self.actor(h), self.binary_head(h), self.critic(h).squeeze(-1), h)


def action_log_probs(out, actions, bin_actions):
    log_probs = F.log_softmax(out.logits, dim=-1)
    logp = log_probs.gather(-1, actions[:, None]).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    p = torch.sigmoid(out.bin_logits)
    bin_logp = (bin_actions * torch.log(p + 1e-8) + (1.0 - bin_actions) * torch.log(1.0 - p + 1e-8)).sum(-1)  # expect: AMP011
    bin_entropy = -(p * torch.log(p + 1e-8) + (1.0 - p) * torch.log(1.0 - p + 1e-8)).sum(-1)  # expect: AMP011
    return logp + bin_logp, entropy + bin_entropy


def make_discriminator(sa_dim, hidden=256):
    return nn.Sequential(nn.Linear(sa_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                         nn.Linear(hidden, 1))


def train_discriminator(disc_state, expert_sa, policy_sa, device, steps=10):
    disc = make_discriminator(expert_sa.shape[1]).to(device)
    disc.load_state_dict(disc_state)
    disc = disc.half()  # expect: AMP001
    disc_opt = torch.optim.Adam(disc.parameters(), lr=3e-4)  # expect: AMP011
    expert = torch.as_tensor(expert_sa, dtype=torch.float16, device=device)
    policy = torch.as_tensor(policy_sa, dtype=torch.float16, device=device)
    for _ in range(steps):
        d_exp, d_pol = disc(expert), disc(policy)
        d_loss = (F.binary_cross_entropy_with_logits(d_exp, torch.ones_like(d_exp))
                  + F.binary_cross_entropy_with_logits(d_pol, torch.zeros_like(d_pol)))
        disc_opt.zero_grad()
        d_loss.backward()
        disc_opt.step()
    return disc


@torch.no_grad()
def gail_reward(disc, sa, device):
    logits = disc(torch.as_tensor(sa, dtype=torch.float16, device=device))
    return (-F.logsigmoid(-logits.float())).squeeze(-1).cpu().numpy()


def export_policy(model, path):
    policy = copy.deepcopy(model).half().eval()
    torch.save(policy.state_dict(), path)


def ppo_update(model, optimizer, scaler, batch, args, stats):
    b_inds = np.arange(args.batch_size)
    for epoch in range(args.update_epochs):
        np.random.shuffle(b_inds)
        for start in range(0, args.batch_size, args.minibatch_size):
            mb = b_inds[start:start + args.minibatch_size]
            mb_adv = batch["advantages"][mb]
            mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(batch["obs"][mb], batch["ents"][mb], batch["mask"][mb])
                new_logp, entropy = action_log_probs(out, batch["actions"][mb], batch["bin_actions"][mb])
                logratio = new_logp - batch["logp"][mb]
                ratio = logratio.exp()
                pg_loss = torch.max(-mb_adv * ratio,
                                    -mb_adv * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)).mean()
                v_clipped = batch["values"][mb] + torch.clamp(out.value - batch["values"][mb],
                                                              -args.clip_coef, args.clip_coef)
                v_loss = 0.5 * torch.max((out.value - batch["returns"][mb]) ** 2,
                                         (v_clipped - batch["returns"][mb]) ** 2).mean()
                loss = pg_loss - args.ent_coef * entropy.mean() + args.vf_coef * v_loss
                stats["value_mean"].append(out.value.mean().item())  # expect: AMP004
            with torch.no_grad():
                approx_kl = ((ratio - 1) - logratio).mean()
                stats["clipfrac"].append(((ratio - 1.0).abs() > args.clip_coef).float().mean().item())
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()  # expect: AMP006
            scaler.update()
        if args.target_kl is not None and approx_kl > args.target_kl:
            break


def compute_gae(rewards, values, dones, next_value, next_done, gamma, lam):
    advantages = torch.zeros_like(rewards)
    lastgaelam = 0.0
    for t in reversed(range(rewards.shape[0])):
        nonterminal = 1.0 - (next_done if t == rewards.shape[0] - 1 else dones[t + 1])
        nextvalues = next_value if t == rewards.shape[0] - 1 else values[t + 1]
        delta = rewards[t] + gamma * nextvalues * nonterminal - values[t]
        advantages[t] = lastgaelam = delta + gamma * lam * nonterminal * lastgaelam
    return advantages, advantages + values


def main(args):
    device = torch.device("cuda")
    envs = make_vec_env(args.env_id, args.num_envs, seed=args.seed)
    obs_dim, (n_ent, ent_dim) = envs.obs_dim, envs.entity_shape
    model = ActorCritic(obs_dim, ent_dim, envs.n_actions, envs.n_binary).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, eps=1e-5)
    scaler = torch.amp.GradScaler("cuda")
    obs_rms = RunningMeanStd(shape=(obs_dim,))
    expert_sa = np.load(args.expert).astype(np.float32)
    disc = make_discriminator(expert_sa.shape[1]).to(device)
    T, N = args.num_steps, args.num_envs
    buf = {k: torch.zeros((T, N) + s, device=device) for k, s in
           [("obs", (obs_dim,)), ("ents", (n_ent, ent_dim)), ("bin_actions", (envs.n_binary,)),
            ("logp", ()), ("rewards", ()), ("dones", ()), ("values", ())]}
    buf["mask"] = torch.zeros((T, N, n_ent), dtype=torch.bool, device=device)
    buf["actions"] = torch.zeros((T, N), dtype=torch.long, device=device)
    next_obs, next_ents, next_mask = envs.reset()
    next_done = torch.zeros(N, device=device)
    start = time.time()
    for update in range(1, args.total_timesteps // (T * N) + 1):
        optimizer.param_groups[0]["lr"] = args.lr * (1.0 - (update - 1.0) / (args.total_timesteps // (T * N)))
        for step in range(T):
            obs_rms.update(next_obs)
            o = torch.as_tensor(obs_rms.normalize(next_obs), dtype=torch.float32, device=device)
            e = torch.as_tensor(next_ents, dtype=torch.float32, device=device)
            m = torch.as_tensor(next_mask, device=device)
            with torch.no_grad():
                out = model(o, e, m)
                move = Categorical(logits=out.logits).sample()
                bin_p = torch.sigmoid(out.bin_logits)
                toggles = torch.bernoulli(bin_p)
                logp, _ = action_log_probs(out, move, toggles)
            buf["obs"][step], buf["ents"][step], buf["mask"][step] = o, e, m
            buf["actions"][step], buf["bin_actions"][step] = move, toggles
            buf["logp"][step], buf["values"][step], buf["dones"][step] = logp, out.value, next_done
            (next_obs, next_ents, next_mask), reward, done, _ = envs.step(move.cpu().numpy(), toggles.cpu().numpy())
            sa = np.concatenate([o.cpu().numpy(), toggles.cpu().numpy()], axis=1)
            bonus = gail_reward(disc, sa, device) if update > args.gail_warmup else 0.0
            buf["rewards"][step] = torch.as_tensor(reward + args.gail_coef * bonus, dtype=torch.float32, device=device)
            next_done = torch.as_tensor(done, dtype=torch.float32, device=device)
        with torch.no_grad():
            o = torch.as_tensor(obs_rms.normalize(next_obs), dtype=torch.float32, device=device)
            next_value = model(o, torch.as_tensor(next_ents, dtype=torch.float32, device=device),
                               torch.as_tensor(next_mask, device=device)).value
            adv, ret = compute_gae(buf["rewards"], buf["values"], buf["dones"], next_value, next_done,
                                   args.gamma, args.gae_lambda)
        batch = {k: v.reshape((T * N,) + v.shape[2:]) for k, v in buf.items()}
        batch["advantages"], batch["returns"] = adv.reshape(-1), ret.reshape(-1)
        stats = {"value_mean": [], "clipfrac": []}
        ppo_update(model, optimizer, scaler, batch, args, stats)
        policy_sa = torch.cat([batch["obs"], batch["bin_actions"]], dim=1).cpu().numpy()
        disc = train_discriminator(disc.float().state_dict(), expert_sa, policy_sa, device)
        if update % 10 == 0:
            sps = int(update * T * N / (time.time() - start))
            print(f"update {update} sps {sps} v {np.mean(stats['value_mean']):.3f} "
                  f"clipfrac {np.mean(stats['clipfrac']):.3f}")
    export_policy(model, "ppo_policy_fp16.pt")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--env-id", default="Entities-v0")
    p.add_argument("--expert", required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--num-envs", type=int, default=16)
    p.add_argument("--num-steps", type=int, default=128)
    p.add_argument("--total-timesteps", type=int, default=10_000_000)
    p.add_argument("--lr", type=float, default=2.5e-4)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--gae-lambda", type=float, default=0.95)
    p.add_argument("--update-epochs", type=int, default=4)
    p.add_argument("--num-minibatches", type=int, default=4)
    p.add_argument("--clip-coef", type=float, default=0.2)
    p.add_argument("--ent-coef", type=float, default=0.01)
    p.add_argument("--vf-coef", type=float, default=0.5)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--target-kl", type=float, default=None)
    p.add_argument("--gail-coef", type=float, default=0.1)
    p.add_argument("--gail-warmup", type=int, default=5)
    a = p.parse_args()
    a.batch_size = a.num_envs * a.num_steps
    a.minibatch_size = a.batch_size // a.num_minibatches
    main(a)
