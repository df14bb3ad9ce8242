"""VQ-VAE with an EMA codebook and commitment loss, trained in bfloat16 autocast.

Encoder/decoder use ConvNeXt-style channel LayerNorm; the quantizer runs its
distance computation and codebook statistics in fp32.
"""
import argparse
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from datasets import build_image_dataset  # local helper


class ChannelLayerNorm(nn.Module):
    """LayerNorm over the channel dim of NCHW tensors (as in ConvNeXt)."""

    def __init__(self, num_channels, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_channels))
        self.bias = nn.Parameter(torch.zeros(num_channels))
        self.eps = eps

    def forward(self, x):
        u = x.mean(1, keepdim=True)  # expect: AMP004
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class ResBlock(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.conv1 = nn.Conv2d(ch, ch, 3, padding=1)
        self.norm1 = ChannelLayerNorm(ch)
        self.conv2 = nn.Conv2d(ch, ch, 1)
        self.norm2 = ChannelLayerNorm(ch)

    def forward(self, x):
        h = F.gelu(self.norm1(self.conv1(x)))
        h = self.norm2(self.conv2(h))
        return x + h


class Encoder(nn.Module):
    def __init__(self, in_ch=3, ch=128, n_res=2, z_dim=64):
        super().__init__()
        self.down1 = nn.Conv2d(in_ch, ch // 2, 4, stride=2, padding=1)
        self.down2 = nn.Conv2d(ch // 2, ch, 4, stride=2, padding=1)
        self.res = nn.ModuleList([ResBlock(ch) for _ in range(n_res)])
        self.pre_quant = nn.Conv2d(ch, z_dim, 1)

    def forward(self, x):
        h = F.gelu(self.down1(x))
        h = F.gelu(self.down2(h))
        for block in self.res:
            h = block(h)
        return self.pre_quant(h)


class Decoder(nn.Module):
    def __init__(self, out_ch=3, ch=128, n_res=2, z_dim=64):
        super().__init__()
        self.post_quant = nn.Conv2d(z_dim, ch, 3, padding=1)
        self.res = nn.ModuleList([ResBlock(ch) for _ in range(n_res)])
        self.up1 = nn.ConvTranspose2d(ch, ch // 2, 4, stride=2, padding=1)
        self.up2 = nn.ConvTranspose2d(ch // 2, out_ch, 4, stride=2, padding=1)

    def forward(self, z):
        h = self.post_quant(z)
        for block in self.res:
            h = block(h)
        h = F.gelu(self.up1(h))
        return self.up2(h)


class VectorQuantizerEMA(nn.Module):
    def __init__(self, num_codes=512, dim=64, decay=0.99, eps=1e-5):
        super().__init__()
        self.num_codes, self.dim, self.decay, self.eps = num_codes, dim, decay, eps
        embed = torch.randn(num_codes, dim)
        self.register_buffer("embed", embed)
        self.register_buffer("cluster_size", torch.zeros(num_codes))
        self.register_buffer("embed_avg", embed.clone())

    def forward(self, z):
        B, C, H, W = z.shape
        # distances and codebook statistics in fp32
        z_flat = z.permute(0, 2, 3, 1).reshape(-1, C).float()
        dist = (
            z_flat.pow(2).sum(1, keepdim=True)
            - 2 * z_flat @ self.embed.t()
            + self.embed.pow(2).sum(1)[None, :]
        )
        idx = dist.argmin(dim=1)
        onehot = F.one_hot(idx, self.num_codes).float()
        z_q = F.embedding(idx, self.embed).view(B, H, W, C).permute(0, 3, 1, 2)

        if self.training:
            with torch.no_grad():
                self.cluster_size.mul_(self.decay).add_(onehot.sum(0), alpha=1 - self.decay)
                self.embed_avg.mul_(self.decay).add_(onehot.t() @ z_flat, alpha=1 - self.decay)
                n = self.cluster_size.sum()
                size = (self.cluster_size + self.eps) / (n + self.num_codes * self.eps) * n
                self.embed.copy_(self.embed_avg / size.unsqueeze(1))

        commitment = F.mse_loss(z, z_q.detach())
        z_q = z + (z_q - z).detach()  # straight-through estimator
        avg_probs = onehot.mean(0)
        perplexity = torch.exp(-torch.sum(avg_probs * torch.log(avg_probs + 1e-10)))
        return z_q, commitment, perplexity, idx.view(B, H, W)


class VQVAE(nn.Module):
    def __init__(self, ch=128, z_dim=64, num_codes=512, n_res=2):
        super().__init__()
        self.encoder = Encoder(3, ch, n_res, z_dim)
        self.quantizer = VectorQuantizerEMA(num_codes, z_dim)
        self.decoder = Decoder(3, ch, n_res, z_dim)

    def forward(self, x):
        z_e = self.encoder(x)
        z_q, commitment, perplexity, _ = self.quantizer(z_e)
        recon = self.decoder(z_q)
        return recon, commitment, perplexity, z_e


def build_model(args):
    return VQVAE(ch=args.ch, z_dim=args.z_dim, num_codes=args.num_codes, n_res=args.n_res)


def train_one_epoch(model, loader, optimizer, scaler, epoch, args, device):
    model.train()
    for i, (x, _) in enumerate(loader):
        x = x.to(device, dtype=torch.bfloat16, non_blocking=True)  # expect: AMP001
        with torch.autocast("cuda", dtype=torch.bfloat16):
            recon, commitment, perplexity, z_e = model(x)
            rec_loss = F.l1_loss(recon, x) + args.mse_weight * F.mse_loss(recon, x)
            loss = rec_loss + args.beta * commitment

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        scaler.step(optimizer)
        scaler.update()

        if i % args.log_every == 0:
            latent_std = z_e.detach().std().item()  # expect: AMP004
            print(f"ep {epoch} it {i} rec {rec_loss.item():.4f} commit {commitment.item():.4f} "
                  f"ppl {perplexity.item():.1f} z-std {latent_std:.3f} gnorm {grad_norm.item():.2f}")


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    mse_sum, n, used = 0.0, 0, set()
    for x, _ in loader:
        x = x.to(device, non_blocking=True)
        with torch.cuda.amp.autocast(dtype=torch.bfloat16):  # expect: AMP009
            z_e = model.encoder(x)
            z_q, _, _, idx = model.quantizer(z_e)
            recon = model.decoder(z_q)
        mse_sum += F.mse_loss(recon.float(), x, reduction="sum").item()
        n += x.numel()
        used.update(idx.unique().tolist())
    mse = mse_sum / max(n, 1)
    psnr = 10 * math.log10(1.0 / max(mse, 1e-10))
    return psnr, len(used)


def save_checkpoint(model, optimizer, epoch, path):
    # fp16 copy of the weights for the release artifact, full state for resuming
    torch.save({k: v.half() for k, v in model.state_dict().items()}, path.replace(".pt", "_fp16.pt"))
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}, path)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--ch", type=int, default=128)
    p.add_argument("--z-dim", dest="z_dim", type=int, default=64)
    p.add_argument("--num-codes", dest="num_codes", type=int, default=512)
    p.add_argument("--n-res", dest="n_res", type=int, default=2)
    p.add_argument("--beta", type=float, default=0.25)
    p.add_argument("--mse-weight", dest="mse_weight", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--batch-size", dest="batch_size", type=int, default=128)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--log-every", dest="log_every", type=int, default=100)
    p.add_argument("--out", default="checkpoints/vqvae.pt")
    return p.parse_args()


def main():
    args = parse_args()
    device = torch.device("cuda")
    train_set, val_set = build_image_dataset(args.data, size=128)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=8, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, num_workers=8)

    model = build_model(args).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.99))
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    best_psnr = -1e9
    for epoch in range(args.epochs):
        train_one_epoch(model, train_loader, optimizer, scaler, epoch, args, device)
        psnr, codes_used = evaluate(model, val_loader, device)
        print(f"epoch {epoch}: val PSNR {psnr:.2f} dB, {codes_used}/{args.num_codes} codes in use")
        if psnr > best_psnr:
            best_psnr = psnr
            save_checkpoint(model, optimizer, epoch, args.out)


if __name__ == "__main__":
    main()
