"""Convolutional beta-VAE on 64x64 images (CelebA crops by default).

    python conv_vae.py --data ~/data/celeba64 --epochs 50 --beta 4
    python conv_vae.py --data ~/data/sketches --resume vae.pt --finetune-decoder

Pixel intensities are modelled as Bernoulli (logits out of the decoder); the KL
weight is annealed linearly over the first ``--warmup-epochs``.
"""
import argparse
import copy
import os
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader
from torchvision import transforms


class VAEOutput(NamedTuple):
    recon_logits: torch.Tensor
    mu: torch.Tensor
    logvar: torch.Tensor


class ConvVAE(nn.Module):
    def __init__(self, latent_dim=128, base=32):
        super().__init__()
        self.latent_dim = latent_dim
        self.encoder = nn.Sequential(
            nn.Conv2d(3, base, 4, 2, 1), nn.LeakyReLU(0.2),
            nn.Conv2d(base, base * 2, 4, 2, 1), nn.BatchNorm2d(base * 2), nn.LeakyReLU(0.2),
            nn.Conv2d(base * 2, base * 4, 4, 2, 1), nn.BatchNorm2d(base * 4), nn.LeakyReLU(0.2),
            nn.Conv2d(base * 4, base * 8, 4, 2, 1), nn.BatchNorm2d(base * 8), nn.LeakyReLU(0.2),
            nn.Flatten(),
        )
        self.fc_mu = nn.Linear(base * 8 * 16, latent_dim)
        self.fc_logvar = nn.Linear(base * 8 * 16, latent_dim)
        self.fc_dec = nn.Linear(latent_dim, base * 8 * 16)
        self.decoder = nn.Sequential(
            nn.Unflatten(1, (base * 8, 4, 4)),
            nn.ConvTranspose2d(base * 8, base * 4, 4, 2, 1), nn.BatchNorm2d(base * 4), nn.ReLU(),
            nn.ConvTranspose2d(base * 4, base * 2, 4, 2, 1), nn.BatchNorm2d(base * 2), nn.ReLU(),
            nn.ConvTranspose2d(base * 2, base, 4, 2, 1), nn.BatchNorm2d(base), nn.ReLU(),
            nn.ConvTranspose2d(base, 3, 4, 2, 1),
        )

    def encode(self, x):
        h = self.encoder(x)
        return self.fc_mu(h), self.fc_logvar(h)

    def decode(self, z):
        return self.decoder(self.fc_dec(z))

    def forward(self, x):
        h = self.encoder(x)
        mu = self.fc_mu(h)
        logvar = self.fc_logvar(h)
        std = torch.exp(0.5 * logvar)
        z = mu + torch.randn_like(std) * std
        return VAEOutput(self.decode(z), mu, logvar)


def vae_loss(recon_logits, x, mu, logvar, beta=1.0):
    batch = x.shape[0]
    rec = F.binary_cross_entropy_with_logits(recon_logits, x, reduction="sum") / batch
    kl = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp()) / batch
    return rec + beta * kl, rec, kl


def kl_weight(epoch, step, steps_per_epoch, warmup_epochs, beta):
    if warmup_epochs == 0:
        return beta
    progress = (epoch * steps_per_epoch + step) / (warmup_epochs * steps_per_epoch)
    return beta * min(1.0, progress)


def train(model, loader, args, device):
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler("cuda")
    for epoch in range(args.epochs):
        model.train()
        for step, (x, _) in enumerate(loader):
            x = x.to(device, non_blocking=True)
            beta = kl_weight(epoch, step, len(loader), args.warmup_epochs, args.beta)
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(x)
                unit_var = out.mu.var(dim=0)  # expect: AMP004
            loss, rec, kl = vae_loss(out.recon_logits, x, out.mu, out.logvar, beta=beta)  # expect: AMP002
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            scaler.step(optimizer)
            scaler.update()
            if step % args.log_every == 0:
                active = int((unit_var > 0.01).sum())
                print(f"ep {epoch} it {step} loss {loss.item():.2f} rec {rec.item():.2f} "
                      f"kl {kl.item():.2f} beta {beta:.2f} active {active}/{model.latent_dim}")
        save_samples(model, os.path.join(args.out, f"samples_{epoch:03d}.png"), device)
        torch.save(model.state_dict(), os.path.join(args.out, "vae.pt"))


def finetune_decoder(vae, loader, args, device):
    """Adapt only the decoder to a new image domain; the encoder stays as trained."""
    decoder = copy.deepcopy(vae.decoder).half()  # expect: AMP001
    fc_dec = vae.fc_dec.requires_grad_(False)
    optimizer = torch.optim.Adam(decoder.parameters(), lr=args.ft_lr)  # expect: AMP011
    vae.eval()
    for epoch in range(args.ft_epochs):
        for x, _ in loader:
            x = x.to(device, non_blocking=True)
            with torch.no_grad():
                h = fc_dec(vae.encode(x)[0]).half()
            recon_logits = decoder(h)
            loss = F.binary_cross_entropy_with_logits(recon_logits.float(), x, reduction="sum") / x.shape[0]
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        print(f"decoder fine-tune epoch {epoch}: loss {loss.item():.2f}")
    vae.decoder.load_state_dict({k: v.float() for k, v in decoder.state_dict().items()})
    return vae


@torch.no_grad()
def save_samples(model, path, device, n=64):
    model.eval()
    z = torch.randn(n, model.latent_dim, device=device)
    with torch.autocast("cuda", dtype=torch.float16):
        imgs = torch.sigmoid(model.decode(z))
    torchvision.utils.save_image(imgs.float(), path, nrow=8)
    model.train()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/vae")
    ap.add_argument("--resume")
    ap.add_argument("--latent-dim", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--beta", type=float, default=1.0)
    ap.add_argument("--warmup-epochs", type=int, default=10)
    ap.add_argument("--clip", type=float, default=100.0)
    ap.add_argument("--log-every", type=int, default=200)
    ap.add_argument("--finetune-decoder", action="store_true")
    ap.add_argument("--ft-epochs", type=int, default=5)
    ap.add_argument("--ft-lr", type=float, default=1e-4)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda")

    tf = transforms.Compose([transforms.Resize(64), transforms.CenterCrop(64), transforms.ToTensor()])
    data = torchvision.datasets.ImageFolder(args.data, transform=tf)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, num_workers=8, drop_last=True, pin_memory=True)
    model = ConvVAE(args.latent_dim).to(device)
    if args.resume:
        model.load_state_dict(torch.load(args.resume, map_location=device))
    if args.finetune_decoder:
        model = finetune_decoder(model, loader, args, device)
        torch.save(model.state_dict(), os.path.join(args.out, "vae_finetuned.pt"))
    else:
        train(model, loader, args, device)


if __name__ == "__main__":
    main()
