"""Decision Transformer (Chen et al., 2021) for D4RL locomotion, minGPT backbone.

Per-modality token normalisation is written out by hand (ported from the JAX version);
training uses fp16 autocast with a GradScaler when --amp is given.
"""
import argparse
import math
import pickle
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class ModalityNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.g = nn.Parameter(torch.ones(dim))
        self.b = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)  # expect: AMP004
        sigma = x.std(-1, keepdim=True, unbiased=False)  # expect: AMP004
        return self.g * (x - mu) / (sigma + 1e-8) + self.b  # expect: AMP011


class CausalSelfAttention(nn.Module):
    def __init__(self, dim, n_head, block_size, dropout=0.1):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.attn_drop, self.resid_drop = nn.Dropout(dropout), nn.Dropout(dropout)
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x, pad_mask):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, -1e10)  # expect: AMP007
        att = att.masked_fill(pad_mask[:, None, None, :] == 0, torch.finfo(att.dtype).min)
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.c_proj(y))


class Block(nn.Module):
    def __init__(self, dim, n_head, block_size, dropout=0.1):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, n_head, block_size, dropout)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))

    def forward(self, x, pad_mask):
        x = x + self.attn(self.ln1(x), pad_mask)
        return x + self.mlp(self.ln2(x))


class DecisionTransformer(nn.Module):
    def __init__(self, state_dim, act_dim, hidden=128, n_layer=3, n_head=1, max_length=20, max_ep_len=1000):
        super().__init__()
        self.state_dim, self.act_dim, self.hidden = state_dim, act_dim, hidden
        self.embed_timestep = nn.Embedding(max_ep_len, hidden)
        self.embed_return = nn.Linear(1, hidden)
        self.embed_state = nn.Linear(state_dim, hidden)
        self.embed_action = nn.Linear(act_dim, hidden)
        self.norm_return, self.norm_state, self.norm_action = ModalityNorm(hidden), ModalityNorm(hidden), ModalityNorm(hidden)
        self.embed_ln = nn.LayerNorm(hidden)
        self.blocks = nn.ModuleList(Block(hidden, n_head, 3 * max_length) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(hidden)
        self.predict_state = nn.Linear(hidden, state_dim)
        self.predict_action = nn.Linear(hidden, act_dim)
        self.predict_return = nn.Linear(hidden, 1)

    def forward(self, states, actions, returns_to_go, timesteps, attention_mask):
        B, T = states.shape[0], states.shape[1]
        time_emb = self.embed_timestep(timesteps)
        s = self.norm_state(self.embed_state(states)) + time_emb
        a = self.norm_action(self.embed_action(actions)) + time_emb
        r = self.norm_return(self.embed_return(returns_to_go)) + time_emb
        h = torch.stack((r, s, a), dim=1).permute(0, 2, 1, 3).reshape(B, 3 * T, self.hidden)
        h = self.embed_ln(h)
        pad = torch.stack((attention_mask,) * 3, dim=1).permute(0, 2, 1).reshape(B, 3 * T)
        for block in self.blocks:
            h = block(h, pad)
        h = self.ln_f(h).reshape(B, T, 3, self.hidden).permute(0, 2, 1, 3)
        return_preds = self.predict_return(h[:, 2])
        state_preds = self.predict_state(h[:, 2])
        action_preds = torch.tanh(self.predict_action(h[:, 1]))
        return state_preds, action_preds, return_preds


def get_batch(trajectories, state_mean, state_std, batch_size, K, device, scale=1000.0):
    s, a, rtg, ts, mask = [], [], [], [], []
    for _ in range(batch_size):
        traj = random.choice(trajectories)
        si = random.randint(0, traj["rewards"].shape[0] - 1)
        obs = (traj["observations"][si:si + K] - state_mean) / state_std
        tlen = obs.shape[0]
        rew_to_go = np.cumsum(traj["rewards"][si:][::-1])[::-1][:tlen].reshape(-1, 1) / scale
        pad = K - tlen
        s.append(np.concatenate([np.zeros((pad, obs.shape[1])), obs]))
        a.append(np.concatenate([np.ones((pad, traj["actions"].shape[1])) * -10.0, traj["actions"][si:si + K]]))
        rtg.append(np.concatenate([np.zeros((pad, 1)), rew_to_go]))
        ts.append(np.concatenate([np.zeros(pad), np.arange(si, si + tlen)]))
        mask.append(np.concatenate([np.zeros(pad), np.ones(tlen)]))
    as_t = lambda x, dt=torch.float32: torch.from_numpy(np.stack(x)).to(device=device, dtype=dt)
    return as_t(s), as_t(a), as_t(rtg), as_t(ts, torch.long), as_t(mask, torch.long)


def train(args):
    device = torch.device("cuda")
    with open(args.dataset, "rb") as f:
        trajectories = pickle.load(f)
    states = np.concatenate([t["observations"] for t in trajectories], axis=0)
    state_mean, state_std = states.mean(axis=0), states.std(axis=0) + 1e-6
    model = DecisionTransformer(states.shape[1], trajectories[0]["actions"].shape[1], max_length=args.K).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda steps: min((steps + 1) / args.warmup_steps, 1))
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
    model.train()
    for it in range(args.max_iters):
        s, a, rtg, ts, mask = get_batch(trajectories, state_mean, state_std, args.batch_size, args.K, device)
        action_target = a.clone()
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            _, action_preds, _ = model(s, a, rtg, ts, mask)
            act_dim = action_preds.shape[2]
            action_preds = action_preds.reshape(-1, act_dim)[mask.reshape(-1) > 0]
            action_target = action_target.reshape(-1, act_dim)[mask.reshape(-1) > 0]
            loss = torch.mean((action_preds - action_target) ** 2)
            scaler.scale(loss).backward()  # expect: AMP008
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if it % 1000 == 0:
            ret = evaluate_episode(model, args.env_targets, state_mean, state_std, device)
            print(f"iter {it} action mse {loss.item():.4f} eval return {ret:.1f}")


@torch.no_grad()
def evaluate_episode(model, target_return, state_mean, state_std, device, K=20, max_ep_len=1000):
    model.eval()
    state_dim, act_dim = model.state_dim, model.act_dim
    states = torch.zeros((1, 1, state_dim), device=device)
    actions = torch.zeros((1, 1, act_dim), device=device)
    rtg = torch.full((1, 1, 1), target_return / 1000.0, device=device)
    timesteps = torch.zeros((1, 1), dtype=torch.long, device=device)
    episode_return = 0.0
    for t in range(max_ep_len):
        with torch.autocast("cuda", dtype=torch.float16):
            _, action_preds, _ = model(states[:, -K:], actions[:, -K:], rtg[:, -K:], timesteps[:, -K:],
                                       torch.ones_like(timesteps[:, -K:]))
        action = action_preds[0, -1].float()
        reward = float(-action.pow(2).sum())  # stands in for env.step in this excerpt
        episode_return += reward
        actions = torch.cat([actions, action.view(1, 1, -1)], dim=1)
        states = torch.cat([states, torch.randn((1, 1, state_dim), device=device)], dim=1)
        rtg = torch.cat([rtg, (rtg[:, -1:] - reward / 1000.0)], dim=1)
        timesteps = torch.cat([timesteps, torch.full((1, 1), t + 1, dtype=torch.long, device=device)], dim=1)
    model.train()
    return episode_return


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", default="hopper-medium-v2.pkl")
    p.add_argument("--K", type=int, default=20)
    p.add_argument("--batch-size", dest="batch_size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup-steps", dest="warmup_steps", type=int, default=10000)
    p.add_argument("--max-iters", dest="max_iters", type=int, default=100000)
    p.add_argument("--env-targets", dest="env_targets", type=float, default=3600.0)
    p.add_argument("--amp", action="store_true")
    train(p.parse_args())
