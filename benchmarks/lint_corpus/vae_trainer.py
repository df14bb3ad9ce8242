"""Convolutional VAE trained with AMP; KL annealing and a perceptual term."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class ConvVAE(nn.Module):
    def __init__(self, latent=128):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, 64, 4, 2, 1), nn.SiLU(), nn.Conv2d(64, 128, 4, 2, 1), nn.SiLU(),
                                 nn.Flatten(), nn.Linear(128 * 16 * 16, 2 * latent))
        self.dec_in = nn.Linear(latent, 128 * 16 * 16)
        self.dec = nn.Sequential(nn.ConvTranspose2d(128, 64, 4, 2, 1), nn.SiLU(), nn.ConvTranspose2d(64, 3, 4, 2, 1))

    def encode(self, x):
        mu, logvar = self.enc(x).chunk(2, dim=-1)
        return mu, logvar

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5 * logvar)
        return mu + std * torch.randn_like(std)

    def forward(self, x):
        mu, logvar = self.encode(x)
        z = self.reparameterize(mu, logvar)
        return self.dec(self.dec_in(z).view(-1, 128, 16, 16)), mu, logvar


def kl_divergence(mu, logvar):
    return -0.5 * torch.mean(torch.sum(1 + logvar - mu.pow(2) - logvar.exp(), dim=1))


def train_epoch(model, loader, optimizer, scaler, epoch, beta_max=1.0, warmup=10):
    model.train()
    beta = min(beta_max, beta_max * epoch / warmup)
    for x, _ in loader:
        x = x.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            recon, mu, logvar = model(x)
            rec_loss = F.mse_loss(recon, x, reduction="sum") / x.size(0)
        kl = kl_divergence(mu, logvar)  # expect: AMP002
        loss = rec_loss + beta * kl
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        scaler.step(optimizer)
        scaler.update()


def train_epoch_fp32_kl(model, loader, optimizer, scaler, beta=1.0):
    model.train()
    for x, _ in loader:
        x = x.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            recon, mu, logvar = model(x)
            rec_loss = F.mse_loss(recon, x, reduction="sum") / x.size(0)
        kl = kl_divergence(mu.float(), logvar.float())
        loss = rec_loss + beta * kl
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


@torch.no_grad()
def sample(model, n, latent=128):
    model.eval()
    z = torch.randn(n, latent, device="cuda", dtype=torch.float16)
    with torch.autocast("cuda", dtype=torch.float16):
        imgs = model.dec(model.dec_in(z).view(-1, 128, 16, 16))
    return imgs.float().clamp(-1, 1)


@torch.no_grad()
def log_likelihood_estimate(model, x, k=64):
    model.eval()
    with torch.autocast("cuda", dtype=torch.float16):
        mu, logvar = model.encode(x)
    mu, logvar = mu.float(), logvar.float()
    std = torch.exp(0.5 * logvar)
    z = mu + std * torch.randn(k, *mu.shape, device=x.device)
    log_q = (-0.5 * ((z - mu) / std) ** 2 - torch.log(std + 1e-8)).sum(-1)
    return torch.logsumexp(-log_q, dim=0).mean()
