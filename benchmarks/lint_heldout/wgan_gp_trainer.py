"""WGAN-GP on CelebA 64x64, mixed precision. One GradScaler per network, as the AMP docs suggest."""
import argparse
from pathlib import Path

import torch
import torch.nn as nn
from torch import autograd
from torch.amp import GradScaler, autocast
from torchvision.utils import save_image

from models import Critic, Generator
from data import celeba_loader


def gradient_penalty(critic, real, fake, device):
    alpha = torch.rand(real.size(0), 1, 1, 1, device=device)
    mixed = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
    scores = critic(mixed)
    grads = autograd.grad(outputs=scores, inputs=mixed, grad_outputs=torch.ones_like(scores),
                          create_graph=True, retain_graph=True)[0]
    grads = grads.view(grads.size(0), -1)
    return ((grads.norm(2, dim=1) - 1) ** 2).mean()


def train(args):
    device = torch.device("cuda")
    gen, critic = Generator(args.z_dim).to(device), Critic().to(device)
    opt_g = torch.optim.Adam(gen.parameters(), lr=args.lr, betas=(0.0, 0.9))
    opt_c = torch.optim.Adam(critic.parameters(), lr=args.lr, betas=(0.0, 0.9))
    scaler_g = GradScaler("cuda")
    scaler_c = GradScaler("cuda")
    loader = celeba_loader(args.data, args.batch_size)
    fixed_noise = torch.randn(64, args.z_dim, 1, 1, device=device)

    for epoch in range(args.epochs):
        for i, (real, _) in enumerate(loader):
            real = real.to(device)
            for _ in range(args.n_critic):
                noise = torch.randn(real.size(0), args.z_dim, 1, 1, device=device)
                with autocast("cuda"):
                    fake = gen(noise)
                    c_real = critic(real).mean()
                    c_fake = critic(fake.detach()).mean()
                gp = gradient_penalty(critic, real, fake.detach().float(), device)
                loss_c = c_fake - c_real + args.lambda_gp * gp
                opt_c.zero_grad(set_to_none=True)
                scaler_c.scale(loss_c).backward()
                opt_c.step()  # expect: AMP006

            with autocast("cuda"):
                loss_g = -critic(gen(noise)).mean()
            opt_g.zero_grad(set_to_none=True)
            scaler_g.scale(loss_g).backward()
            scaler_g.step(opt_g)  # expect: AMP006

            if i % 200 == 0:
                print(f"[{epoch}/{args.epochs}] {i} loss_c={loss_c.item():.3f} loss_g={loss_g.item():.3f}")
        with torch.no_grad():
            save_image(gen(fixed_noise) * 0.5 + 0.5, Path(args.out) / f"ep{epoch:03d}.png")
        torch.save({"gen": gen.state_dict(), "critic": critic.state_dict()}, Path(args.out) / "last.pt")


def train_fixed(args):
    """After the review: both networks step through their scaler, both scalers update."""
    device = torch.device("cuda")
    gen, critic = Generator(args.z_dim).to(device), Critic().to(device)
    opt_g = torch.optim.Adam(gen.parameters(), lr=args.lr, betas=(0.0, 0.9))
    opt_c = torch.optim.Adam(critic.parameters(), lr=args.lr, betas=(0.0, 0.9))
    scaler_g, scaler_c = GradScaler("cuda"), GradScaler("cuda")
    for real, _ in celeba_loader(args.data, args.batch_size):
        real = real.to(device)
        noise = torch.randn(real.size(0), args.z_dim, 1, 1, device=device)
        with autocast("cuda"):
            fake = gen(noise)
            loss_c = critic(fake.detach()).mean() - critic(real).mean()
        opt_c.zero_grad(set_to_none=True)
        scaler_c.scale(loss_c).backward()
        scaler_c.step(opt_c)
        scaler_c.update()

        with autocast("cuda"):
            loss_g = -critic(fake).mean()
        opt_g.zero_grad(set_to_none=True)
        scaler_g.scale(loss_g).backward()
        scaler_g.step(opt_g)
        scaler_g.update()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="celeba")
    p.add_argument("--out", default="samples")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--z-dim", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--n-critic", type=int, default=5)
    p.add_argument("--lambda-gp", type=float, default=10.0)
    p.add_argument("--fixed", action="store_true")
    a = p.parse_args()
    (train_fixed if a.fixed else train)(a)
