# Minimal DreamerV2-style agent: RSSM world model + actor/critic trained in imagination.
# Single-file script; run: python dreamer_train.py --env-steps 1000000 --amp
import argparse
from contextlib import nullcontext

import numpy as np
import torch as th
import torch.nn as nn
import torch.nn.functional as F
from torch.distributions import Independent, Normal, OneHotCategorical, kl_divergence

parser = argparse.ArgumentParser()
parser.add_argument("--batch", type=int, default=16)
parser.add_argument("--seq-len", type=int, default=50)
parser.add_argument("--horizon", type=int, default=15)
parser.add_argument("--n-actions", type=int, default=6)
parser.add_argument("--train-steps", type=int, default=100000)
parser.add_argument("--gamma", type=float, default=0.99)
parser.add_argument("--lam", type=float, default=0.95)
parser.add_argument("--kl-scale", type=float, default=1.0)
parser.add_argument("--amp", action="store_true")
args = parser.parse_args()

device = "cuda" if th.cuda.is_available() else "cpu"
ctx = th.autocast(device_type="cuda", dtype=th.float16) if args.amp else nullcontext()
scaler = th.amp.GradScaler("cuda", enabled=args.amp)

DETER, STOCH, HID = 200, 32, 400


def mlp(inp, out, hidden=HID, layers=2):
    mods, d = [], inp
    for _ in range(layers):
        mods += [nn.Linear(d, hidden), nn.ELU()]
        d = hidden
    mods.append(nn.Linear(d, out))
    return nn.Sequential(*mods)


class ConvEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 32, 4, 2), nn.ELU(), nn.Conv2d(32, 64, 4, 2), nn.ELU(),
            nn.Conv2d(64, 128, 4, 2), nn.ELU(), nn.Conv2d(128, 256, 4, 2), nn.ELU(), nn.Flatten(),
        )

    def forward(self, obs):
        return self.net(obs)


class ConvDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(DETER + STOCH, 1024)
        self.net = nn.Sequential(
            nn.ConvTranspose2d(1024, 128, 5, 2), nn.ELU(), nn.ConvTranspose2d(128, 64, 5, 2), nn.ELU(),
            nn.ConvTranspose2d(64, 32, 6, 2), nn.ELU(), nn.ConvTranspose2d(32, 3, 6, 2),
        )

    def forward(self, feat):
        return self.net(self.fc(feat).view(-1, 1024, 1, 1))


class RSSM(nn.Module):
    def __init__(self, n_actions):
        super().__init__()
        self.inp = nn.Linear(STOCH + n_actions, DETER)
        self.cell = nn.GRUCell(DETER, DETER)
        self.prior_head = mlp(DETER, 2 * STOCH, layers=1)
        self.post_head = mlp(DETER + 1024, 2 * STOCH, layers=1)

    def dist(self, stats):
        mean, std = stats.float().chunk(2, -1)
        return Independent(Normal(mean, F.softplus(std) + 0.1), 1)

    def img_step(self, h, z, a):
        h = self.cell(F.elu(self.inp(th.cat([z, a], -1))), h)
        prior = self.dist(self.prior_head(h))
        return h, prior

    def observe(self, embed, actions):
        B, T = actions.shape[:2]
        h = embed.new_zeros(B, DETER)
        z = embed.new_zeros(B, STOCH)
        hs, zs, priors, posts = [], [], [], []
        for t in range(T):
            h, prior = self.img_step(h, z, actions[:, t])
            post = self.dist(self.post_head(th.cat([h, embed[:, t]], -1)))
            z = post.rsample()
            hs.append(h)
            zs.append(z)
            priors.append(prior)
            posts.append(post)
        return th.stack(hs, 1), th.stack(zs, 1), priors, posts


class Actor(nn.Module):
    def __init__(self, n_actions):
        super().__init__()
        self.net = mlp(DETER + STOCH, n_actions, layers=4)

    def forward(self, feat, action_mask=None):
        logits = self.net(feat)
        if action_mask is not None:
            logits = logits.masked_fill(~action_mask, -1e10)  # expect: AMP007
        return OneHotCategorical(logits=logits.float())


encoder, decoder = ConvEncoder().to(device), ConvDecoder().to(device)
rssm = RSSM(args.n_actions).to(device)
reward_head = mlp(DETER + STOCH, 1).to(device)
cont_head = mlp(DETER + STOCH, 1).to(device)
actor = Actor(args.n_actions).to(device)
critic = mlp(DETER + STOCH, 1).to(device)
target_critic = mlp(DETER + STOCH, 1).to(device)
target_critic.load_state_dict(critic.state_dict())
target_critic.requires_grad_(False)

wm_params = [p for m in (encoder, decoder, rssm, reward_head, cont_head) for p in m.parameters()]
wm_opt = th.optim.Adam(wm_params, lr=6e-4, eps=1e-5, weight_decay=1e-6)
actor_opt = th.optim.Adam(actor.parameters(), lr=8e-5, eps=1e-5)
critic_opt = th.optim.Adam(critic.parameters(), lr=8e-5, eps=1e-5)


def sample_batch():
    obs = np.random.randint(0, 255, (args.batch, args.seq_len, 3, 64, 64), dtype=np.uint8)
    act = np.eye(args.n_actions, dtype=np.float32)[np.random.randint(0, args.n_actions, (args.batch, args.seq_len))]
    rew = np.random.randn(args.batch, args.seq_len).astype(np.float32)
    cont = (np.random.rand(args.batch, args.seq_len) > 0.01).astype(np.float32)
    return {k: th.as_tensor(v, device=device) for k, v in dict(obs=obs, act=act, rew=rew, cont=cont).items()}


def lambda_returns(reward, value, cont, bootstrap):
    next_values = th.cat([value[1:], bootstrap[None]], 0)
    inputs = reward + args.gamma * cont * next_values * (1 - args.lam)
    out, last = [], bootstrap
    for t in reversed(range(reward.shape[0])):
        last = inputs[t] + args.gamma * cont[t] * args.lam * last
        out.append(last)
    return th.stack(out[::-1], 0)


for step in range(args.train_steps):
    batch = sample_batch()
    obs = batch["obs"].half() / 255.0 - 0.5  # expect: AMP001
    B, T = obs.shape[:2]

    # ---- world model ----
    with ctx:
        embed = encoder(obs.flatten(0, 1)).view(B, T, -1)
        hs, zs, priors, posts = rssm.observe(embed, batch["act"])
        feat = th.cat([hs, zs], -1)
        recon = decoder(feat.flatten(0, 1)).view(B, T, 3, 64, 64)
        reward_pred = reward_head(feat).squeeze(-1)
        reward_loss = F.mse_loss(reward_pred.float(), batch["rew"])
        cont_prob = th.sigmoid(cont_head(feat).squeeze(-1))
        cont_loss = F.binary_cross_entropy(cont_prob, batch["cont"])  # expect: AMP003
        kl = th.stack([kl_divergence(q, p) for q, p in zip(posts, priors)], 1)
        kl_loss = th.clamp(kl, min=1.0).mean()
    recon_loss = F.mse_loss(recon, obs)  # expect: AMP002
    img_mae = (recon.detach() - obs).abs().mean()  # expect: AMP004
    wm_loss = recon_loss + reward_loss + cont_loss + args.kl_scale * kl_loss

    wm_opt.zero_grad(set_to_none=True)
    scaler.scale(wm_loss).backward()
    wm_grad = th.nn.utils.clip_grad_norm_(wm_params, 100.0)  # expect: AMP005
    scaler.step(wm_opt)
    scaler.update()

    # ---- imagination ----
    start_h = hs.detach().flatten(0, 1).float()
    start_z = zs.detach().flatten(0, 1).float()
    legal = th.ones(start_h.shape[0], args.n_actions, dtype=th.bool, device=device)
    with ctx:
        h, z = start_h, start_z
        feats, ents = [], []
        for _ in range(args.horizon):
            f = th.cat([h, z], -1)
            pi = actor(f.detach(), legal)
            a = pi.sample() + pi.probs - pi.probs.detach()
            ents.append(pi.entropy())
            feats.append(f)
            h, prior = rssm.img_step(h, z, a)
            z = prior.rsample()
        feats = th.stack(feats, 0)
        rew = reward_head(feats).squeeze(-1).float()
        cont_im = th.sigmoid(cont_head(feats).squeeze(-1)).float()
        with th.no_grad():
            tv = target_critic(feats).squeeze(-1).float()
        returns = lambda_returns(rew[:-1], tv[:-1], cont_im[:-1], tv[-1])
        actor_loss = -(returns - 1e-3 * th.stack(ents[:-1], 0)).mean()

    actor_opt.zero_grad(set_to_none=True)
    scaler.scale(actor_loss).backward(retain_graph=True)
    actor_opt.step()  # expect: AMP006

    with ctx:
        value = critic(feats[:-1].detach()).squeeze(-1)
        critic_loss = 0.5 * (value.float() - returns.detach()).pow(2).mean()
        critic_opt.zero_grad(set_to_none=True)
        scaler.scale(critic_loss).backward()  # expect: AMP008
    scaler.unscale_(critic_opt)
    th.nn.utils.clip_grad_norm_(critic.parameters(), 100.0)
    scaler.step(critic_opt)
    scaler.update()

    if step % 100 == 0:
        with th.no_grad():
            for p, tp in zip(critic.parameters(), target_critic.parameters()):
                tp.lerp_(p, 0.02)
    if step % 1000 == 0:
        print(f"step {step} wm {wm_loss.item():.3f} actor {actor_loss.item():.3f} "
              f"critic {critic_loss.item():.3f} img_mae {img_mae.item():.4f} scale {scaler.get_scale():.0f}")
        th.save({"rssm": rssm.state_dict(), "actor": actor.state_dict(), "critic": critic.state_dict()},
                "dreamer_ckpt.pt")
