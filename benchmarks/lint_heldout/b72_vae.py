"""Convolutional VAE on 64x64 images with a Bernoulli decoder, plus the IWAE objective.

    python vae.py --data data/celeba --epochs 50 --beta 1.0 --warmup-epochs 10
    python vae.py --data data/dsprites --objective iwae --k 5
"""
import argparse
import logging
import math
import os

import torch
from torch import nn, optim
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision import datasets, transforms
from torchvision.utils import save_image

LOG_2PI = math.log(2 * math.pi)
logger = logging.getLogger("vae")


class Encoder(nn.Module):
    def __init__(self, in_ch=3, latent_dim=128, hidden=(32, 64, 128, 256)):
        super().__init__()
        layers, c = [], in_ch
        for h in hidden:
            layers += [nn.Conv2d(c, h, 4, 2, 1), nn.BatchNorm2d(h), nn.LeakyReLU(0.2)]
            c = h
        self.net = nn.Sequential(*layers)
        self.fc_mu = nn.Linear(hidden[-1] * 4 * 4, latent_dim)
        self.fc_logvar = nn.Linear(hidden[-1] * 4 * 4, latent_dim)

    def forward(self, x):
        h = self.net(x).flatten(1)
        return self.fc_mu(h), self.fc_logvar(h)


class Decoder(nn.Module):
    def __init__(self, out_ch=3, latent_dim=128, hidden=(256, 128, 64, 32)):
        super().__init__()
        self.first = hidden[0]
        self.fc = nn.Linear(latent_dim, hidden[0] * 4 * 4)
        layers = []
        for a, b in zip(hidden[:-1], hidden[1:]):
            layers += [nn.ConvTranspose2d(a, b, 4, 2, 1), nn.BatchNorm2d(b), nn.LeakyReLU(0.2)]
        layers += [nn.ConvTranspose2d(hidden[-1], out_ch, 4, 2, 1), nn.Sigmoid()]
        self.net = nn.Sequential(*layers)

    def forward(self, z):
        return self.net(self.fc(z).view(-1, self.first, 4, 4))


class ConvVAE(nn.Module):
    def __init__(self, in_ch=3, latent_dim=128):
        super().__init__()
        self.latent_dim = latent_dim
        self.encoder = Encoder(in_ch, latent_dim)
        self.decoder = Decoder(in_ch, latent_dim)

    @staticmethod
    def reparameterize(mu, logvar, k=1):
        std = torch.exp(0.5 * logvar)
        if k == 1:
            return mu + torch.randn_like(std) * std
        eps = torch.randn((k,) + tuple(std.shape), device=std.device, dtype=std.dtype)
        return mu.unsqueeze(0) + eps * std.unsqueeze(0)

    def forward(self, x, k=1):
        mu, logvar = self.encoder(x)
        z = self.reparameterize(mu, logvar, k)
        recon = self.decoder(z.flatten(0, 1) if k > 1 else z)
        return recon, mu, logvar, z

    @torch.no_grad()
    def sample(self, n, device):
        return self.decoder(torch.randn(n, self.latent_dim, device=device))


def vae_loss(recon, x, mu, logvar, beta=1.0):
    """Negative ELBO (Bernoulli likelihood), summed over pixels and averaged over the batch."""
    bce = F.binary_cross_entropy(recon, x, reduction="sum")  # expect: AMP003
    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return (bce + beta * kld) / x.size(0), bce / x.size(0), kld / x.size(0)


def iwae_loss(recon, x, mu, logvar, z, k):
    """Importance-weighted bound with k samples (Burda et al., 2016)."""
    B = x.size(0)
    x_rep = x.unsqueeze(0).expand(k, *x.shape).flatten(0, 1).to(recon.dtype)
    log_px_z = -F.binary_cross_entropy(recon, x_rep, reduction="none").flatten(1).sum(-1).view(k, B)
    log_pz = -0.5 * (z.pow(2) + LOG_2PI).sum(-1)
    log_qz_x = -0.5 * ((z - mu) ** 2 / logvar.exp() + logvar + LOG_2PI).sum(-1)
    log_w = log_px_z + log_pz - log_qz_x
    return -(torch.logsumexp(log_w, dim=0) - math.log(k)).mean()


def kl_weight(epoch, step, steps_per_epoch, args):
    if args.warmup_epochs <= 0:
        return args.beta
    progress = (epoch * steps_per_epoch + step) / (args.warmup_epochs * steps_per_epoch)
    return args.beta * min(1.0, progress)


def train(model, loader, optimizer, epoch, args):
    model.train()
    total = 0.0
    for batch_idx, (x, _) in enumerate(loader):
        x = x.to(args.device, non_blocking=True)
        beta = kl_weight(epoch, batch_idx, len(loader), args)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type="cuda", dtype=torch.float16):  # expect: AMP010
            recon, mu, logvar, _ = model(x)
            loss, rec, kld = vae_loss(recon, x, mu, logvar, beta)
        loss.backward()
        optimizer.step()
        total += loss.item() * x.size(0)
        if batch_idx % args.log_interval == 0:
            logger.info("epoch %d [%d/%d] loss %.2f rec %.2f kl %.2f beta %.3f", epoch, batch_idx, len(loader),
                        loss.item(), rec.item(), kld.item(), beta)
    return total / len(loader.dataset)


def train_iwae(model, loader, optimizer, scaler, epoch, args):
    model.train()
    total = 0.0
    for batch_idx, (x, _) in enumerate(loader):
        x = x.to(args.device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            recon, mu, logvar, z = model(x, k=args.k)
        loss = iwae_loss(recon, x, mu, logvar, z, args.k)  # expect: AMP002
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        total += loss.item() * x.size(0)
        if batch_idx % args.log_interval == 0:
            logger.info("epoch %d [%d/%d] -IWAE %.2f", epoch, batch_idx, len(loader), loss.item())
    return total / len(loader.dataset)


@torch.no_grad()
def evaluate(model, loader, args, epoch=None):
    model.eval()
    total = 0.0
    for i, (x, _) in enumerate(loader):
        x = x.to(args.device)
        recon, mu, logvar, _ = model(x)
        loss, _, _ = vae_loss(recon, x, mu, logvar, beta=1.0)
        total += loss.item() * x.size(0)
        if i == 0 and epoch is not None:
            n = min(x.size(0), 8)
            grid = torch.cat([x[:n], recon[:n]])
            save_image(grid.cpu(), os.path.join(args.out_dir, f"recon_{epoch:03d}.png"), nrow=n)
    return total / len(loader.dataset)


@torch.no_grad()
def export_decoder(model, path):
    decoder = model.decoder.half().eval()
    example = torch.randn(1, model.latent_dim, device=next(decoder.parameters()).device, dtype=torch.float16)
    torch.jit.save(torch.jit.trace(decoder, example), path)


def get_loaders(args):
    tf = transforms.Compose([transforms.CenterCrop(148), transforms.Resize(64), transforms.ToTensor()])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), tf)
    kw = dict(batch_size=args.batch_size, num_workers=args.workers, pin_memory=True)
    return DataLoader(train_set, shuffle=True, drop_last=True, **kw), DataLoader(val_set, **kw)


def main():
    p = argparse.ArgumentParser(description="VAE / IWAE")
    p.add_argument("--data", required=True)
    p.add_argument("--out-dir", default="results/vae")
    p.add_argument("--objective", choices=["elbo", "iwae"], default="elbo")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--latent-dim", type=int, default=128)
    p.add_argument("--beta", type=float, default=1.0)
    p.add_argument("--warmup-epochs", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--log-interval", type=int, default=100)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    os.makedirs(args.out_dir, exist_ok=True)

    train_loader, val_loader = get_loaders(args)
    model = ConvVAE(3, args.latent_dim).to(args.device)
    optimizer = optim.Adam(model.parameters(), lr=args.lr)
    scheduler = optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.95)
    scaler = torch.amp.GradScaler("cuda")

    best = float("inf")
    for epoch in range(args.epochs):
        if args.objective == "iwae":
            train_loss = train_iwae(model, train_loader, optimizer, scaler, epoch, args)
        else:
            train_loss = train(model, train_loader, optimizer, epoch, args)
        val_loss = evaluate(model, val_loader, args, epoch)
        scheduler.step()
        logger.info("epoch %d train %.3f val %.3f", epoch, train_loss, val_loss)
        if val_loss < best:
            best = val_loss
            torch.save({"model": model.state_dict(), "epoch": epoch, "args": vars(args)},
                       os.path.join(args.out_dir, "best.pt"))
        save_image(model.sample(64, args.device).cpu(), os.path.join(args.out_dir, f"sample_{epoch:03d}.png"))

    model.load_state_dict(torch.load(os.path.join(args.out_dir, "best.pt"))["model"])
    export_decoder(model, os.path.join(args.out_dir, "decoder_fp16.pt"))


if __name__ == "__main__":
    main()
