"""Dreamer-style agent: RSSM world model + actor + critic, each with its own optimizer.

The world model is trained on replayed sequences; actor and critic are trained on
trajectories imagined in latent space. Mixed precision (fp16) on all three.
"""
import copy
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributions import Independent, Normal, kl_divergence


@dataclass
class AgentConfig:
    obs_channels: int = 3
    action_dim: int = 6
    deter: int = 512
    stoch: int = 32
    hidden: int = 400
    horizon: int = 15
    gamma: float = 0.99
    lam: float = 0.95
    kl_scale: float = 1.0
    free_nats: float = 1.0
    ent_coef: float = 3e-4
    wm_lr: float = 6e-4
    actor_lr: float = 8e-5
    critic_lr: float = 8e-5
    wm_clip: float = 100.0
    target_tau: float = 0.02


class MLP(nn.Module):
    def __init__(self, inp, out, hidden=400, layers=3):
        super().__init__()
        mods, d = [], inp
        for _ in range(layers):
            mods += [nn.Linear(d, hidden), nn.LayerNorm(hidden), nn.ELU()]
            d = hidden
        mods.append(nn.Linear(d, out))
        self.net = nn.Sequential(*mods)

    def forward(self, x):
        return self.net(x)


class ConvEncoder(nn.Module):
    def __init__(self, cin, depth=32):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(cin, depth, 4, 2), nn.ELU(), nn.Conv2d(depth, 2 * depth, 4, 2), nn.ELU(),
            nn.Conv2d(2 * depth, 4 * depth, 4, 2), nn.ELU(), nn.Conv2d(4 * depth, 8 * depth, 4, 2), nn.ELU(),
        )
        self.out_dim = 8 * depth * 2 * 2

    def forward(self, obs):
        T, B = obs.shape[:2]
        return self.net(obs.flatten(0, 1)).reshape(T, B, -1)


class ConvDecoder(nn.Module):
    def __init__(self, feat_dim, cout, depth=32):
        super().__init__()
        self.fc = nn.Linear(feat_dim, 32 * depth)
        self.net = nn.Sequential(
            nn.ConvTranspose2d(32 * depth, 4 * depth, 5, 2), nn.ELU(),
            nn.ConvTranspose2d(4 * depth, 2 * depth, 5, 2), nn.ELU(),
            nn.ConvTranspose2d(2 * depth, depth, 6, 2), nn.ELU(),
            nn.ConvTranspose2d(depth, cout, 6, 2),
        )

    def forward(self, feat):
        T, B = feat.shape[:2]
        x = self.fc(feat.flatten(0, 1))[:, :, None, None]
        return self.net(x).reshape(T, B, *self.net[-1].weight.shape[1:2], 64, 64)


class RSSM(nn.Module):
    def __init__(self, embed_dim, action_dim, deter=512, stoch=32, hidden=400):
        super().__init__()
        self.deter, self.stoch = deter, stoch
        self.inp = nn.Linear(stoch + action_dim, hidden)
        self.cell = nn.GRUCell(hidden, deter)
        self.prior_net = MLP(deter, 2 * stoch, hidden, layers=1)
        self.post_net = MLP(deter + embed_dim, 2 * stoch, hidden, layers=1)

    @staticmethod
    def _dist(stats):
        mean, std = stats.chunk(2, dim=-1)
        return Independent(Normal(mean, F.softplus(std) + 0.1), 1)

    def initial(self, batch, device):
        return torch.zeros(batch, self.deter, device=device), torch.zeros(batch, self.stoch, device=device)

    def img_step(self, h, z, action):
        h = self.cell(F.elu(self.inp(torch.cat([z, action], -1))), h)
        prior = self._dist(self.prior_net(h))
        return h, prior

    def observe(self, embed, actions):
        T, B = embed.shape[:2]
        h, z = self.initial(B, embed.device)
        posts, priors, feats = [], [], []
        for t in range(T):
            h, prior = self.img_step(h, z, actions[t])
            post = self._dist(self.post_net(torch.cat([h, embed[t]], -1)))
            z = post.rsample()
            posts.append(post)
            priors.append(prior)
            feats.append(torch.cat([h, z], -1))
        return posts, priors, torch.stack(feats)


def kl_loss(posts, priors, free_nats):
    kl = torch.stack([kl_divergence(p, q) for p, q in zip(posts, priors)])
    return torch.clamp(kl, min=free_nats).mean()


class DreamerAgent:
    def __init__(self, cfg: AgentConfig, device="cuda"):
        self.cfg, self.device = cfg, device
        feat_dim = cfg.deter + cfg.stoch
        self.encoder = ConvEncoder(cfg.obs_channels).to(device)
        self.rssm = RSSM(self.encoder.out_dim, cfg.action_dim, cfg.deter, cfg.stoch, cfg.hidden).to(device)
        self.decoder = ConvDecoder(feat_dim, cfg.obs_channels).to(device)
        self.reward_head = MLP(feat_dim, 1, cfg.hidden).to(device)
        self.cont_head = MLP(feat_dim, 1, cfg.hidden).to(device)
        self.actor = MLP(feat_dim, 2 * cfg.action_dim, cfg.hidden).to(device)
        self.critic = MLP(feat_dim, 1, cfg.hidden).to(device)
        self.target_critic = copy.deepcopy(self.critic).requires_grad_(False)
        wm_modules = [self.encoder, self.rssm, self.decoder, self.reward_head, self.cont_head]
        self.wm_params = [p for m in wm_modules for p in m.parameters()]
        self.wm_opt = torch.optim.Adam(self.wm_params, lr=cfg.wm_lr, eps=1e-8)
        self.actor_opt = torch.optim.Adam(self.actor.parameters(), lr=cfg.actor_lr, eps=1e-5)
        self.critic_opt = torch.optim.Adam(self.critic.parameters(), lr=cfg.critic_lr, eps=1e-5)
        self.scaler = torch.amp.GradScaler("cuda")
        self.critic_scaler = torch.amp.GradScaler("cuda")

    def policy(self, feat):
        mean, std = self.actor(feat).chunk(2, -1)
        return Independent(Normal(torch.tanh(mean), F.softplus(std) + 0.1), 1)

    @torch.inference_mode()
    def act(self, h, z, obs_embed):
        with torch.autocast("cuda", dtype=torch.float16):
            post = self.rssm._dist(self.rssm.post_net(torch.cat([h, obs_embed], -1)))
            feat = torch.cat([h, post.mean], -1)
            return self.policy(feat).sample().clamp(-1, 1)

    def _update_world_model(self, obs, actions, rewards, conts):
        obs = obs.float() / 255.0 - 0.5
        with torch.autocast("cuda", dtype=torch.float16):
            embed = self.encoder(obs)
            posts, priors, feats = self.rssm.observe(embed, actions)
            recon = self.decoder(feats)
            reward_pred = self.reward_head(feats).squeeze(-1)
            cont_prob = torch.sigmoid(self.cont_head(feats).squeeze(-1))
            rew_loss = F.mse_loss(reward_pred, rewards)
            cont_loss = F.binary_cross_entropy(cont_prob, conts)  # expect: AMP003
            kl = kl_loss(posts, priors, self.cfg.free_nats)
        recon_loss = F.mse_loss(recon, obs)  # expect: AMP002
        loss = recon_loss + rew_loss + cont_loss + self.cfg.kl_scale * kl
        self.wm_opt.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(self.wm_params, self.cfg.wm_clip)  # expect: AMP005
        self.scaler.step(self.wm_opt)
        self.scaler.update()
        metrics = {"recon": recon_loss.item(), "reward": rew_loss.item(), "cont": cont_loss.item(), "kl": kl.item()}
        return feats.detach(), metrics

    def _imagine(self, start_feat):
        h, z = start_feat.split([self.cfg.deter, self.cfg.stoch], -1)
        feats, logps, ents = [start_feat], [], []
        for _ in range(self.cfg.horizon):
            dist = self.policy(feats[-1].detach())
            action = dist.rsample()
            logps.append(dist.log_prob(action.detach()))
            ents.append(dist.entropy())
            h, prior = self.rssm.img_step(h, z, action)
            z = prior.rsample()
            feats.append(torch.cat([h, z], -1))
        return torch.stack(feats), torch.stack(logps), torch.stack(ents)

    @torch.no_grad()
    def _lambda_targets(self, rewards, conts, values):
        targets, last = [], values[-1]
        for t in reversed(range(rewards.shape[0])):
            disc = self.cfg.gamma * conts[t]
            last = rewards[t] + disc * ((1 - self.cfg.lam) * values[t + 1] + self.cfg.lam * last)
            targets.append(last)
        return torch.stack(targets[::-1])

    def _update_actor(self, start_feat):
        with torch.autocast("cuda", dtype=torch.float16):
            feats, logps, ents = self._imagine(start_feat.flatten(0, 1))
            rewards = self.reward_head(feats[1:]).squeeze(-1)
            conts = torch.sigmoid(self.cont_head(feats[1:]).squeeze(-1))
            values = self.critic(feats).squeeze(-1)
            td = rewards + self.cfg.gamma * conts * values[1:].detach() - values[:-1].detach()
            adv = (td - td.mean()) / (td.std() + 1e-8)  # expect: AMP004 AMP011
            actor_loss = -(logps.float() * adv.detach().float()).mean() - self.cfg.ent_coef * ents.float().mean()
        self.actor_opt.zero_grad(set_to_none=True)
        self.scaler.scale(actor_loss).backward()
        self.actor_opt.step()  # expect: AMP006
        with torch.no_grad():
            target_values = self.target_critic(feats.detach()).squeeze(-1).float()
            targets = self._lambda_targets(rewards.detach().float(), conts.detach().float(), target_values)
        return feats.detach(), targets, actor_loss.item()

    def _update_critic(self, feats, targets):
        with torch.autocast("cuda", dtype=torch.float16):
            pred = self.critic(feats[:-1]).squeeze(-1)
            critic_loss = 0.5 * F.mse_loss(pred.float(), targets)
            self.critic_opt.zero_grad(set_to_none=True)
            self.critic_scaler.scale(critic_loss).backward()  # expect: AMP008
        self.critic_scaler.step(self.critic_opt)  # expect: AMP006
        with torch.no_grad():
            for tp, p in zip(self.target_critic.parameters(), self.critic.parameters()):
                tp.lerp_(p, self.cfg.target_tau)
        return critic_loss.item()

    def train_step(self, batch):
        obs = batch["obs"].to(self.device, non_blocking=True)
        actions = batch["action"].to(self.device, non_blocking=True)
        rewards = batch["reward"].to(self.device, non_blocking=True)
        conts = 1.0 - batch["done"].to(self.device, non_blocking=True).float()
        post_feats, metrics = self._update_world_model(obs, actions, rewards, conts)
        feats, targets, actor_loss = self._update_actor(post_feats)
        metrics["actor"] = actor_loss
        metrics["critic"] = self._update_critic(feats, targets)
        metrics["loss_scale"] = self.scaler.get_scale()
        return metrics

    def state_dict(self):
        return {
            "encoder": self.encoder.state_dict(), "rssm": self.rssm.state_dict(),
            "decoder": self.decoder.state_dict(), "reward": self.reward_head.state_dict(),
            "cont": self.cont_head.state_dict(), "actor": self.actor.state_dict(),
            "critic": self.critic.state_dict(), "target_critic": self.target_critic.state_dict(),
            "wm_opt": self.wm_opt.state_dict(), "actor_opt": self.actor_opt.state_dict(),
            "critic_opt": self.critic_opt.state_dict(), "scaler": self.scaler.state_dict(),
            "critic_scaler": self.critic_scaler.state_dict(),
        }
