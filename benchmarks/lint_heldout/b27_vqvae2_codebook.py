"""Hierarchical VQ-VAE (VQ-VAE-2) with EMA codebooks for 256x256 images.

Stage 1 of the two-stage pipeline: trains encoders, decoders and codebooks.
The codebook is kept in standardised latent coordinates (affine
re-parameterisation with running latent statistics), which keeps code usage
high early in training.  ``extract_codes`` dumps the discrete latents for the
prior.
"""
import argparse
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision import datasets, transforms, utils


@dataclass
class VQConfig:
    in_channel: int = 3
    channel: int = 128
    n_res_block: int = 2
    n_res_channel: int = 32
    embed_dim: int = 64
    n_embed: int = 512
    decay: float = 0.99
    beta: float = 0.25
    lr: float = 3e-4
    epochs: int = 560
    grad_clip: float = 1.0
    batch_size: int = 128


class Quantize(nn.Module):
    def __init__(self, dim, n_embed, decay=0.99, eps=1e-5, stat_momentum=0.01):
        super().__init__()
        self.dim, self.n_embed, self.decay, self.eps = dim, n_embed, decay, eps
        self.stat_momentum = stat_momentum
        embed = torch.randn(dim, n_embed)
        self.register_buffer("embed", embed)
        self.register_buffer("cluster_size", torch.zeros(n_embed))
        self.register_buffer("embed_avg", embed.clone())
        self.register_buffer("latent_mean", torch.zeros(dim))
        self.register_buffer("latent_std", torch.ones(dim))

    def codebook(self):
        return self.embed * self.latent_std[:, None] + self.latent_mean[:, None]

    def forward(self, input):
        flatten = input.reshape(-1, self.dim)
        if self.training:
            with torch.no_grad():
                batch_mean = flatten.mean(dim=0)  # expect: AMP004
                batch_std = flatten.std(dim=0)  # expect: AMP004
                self.latent_mean.lerp_(batch_mean.float(), self.stat_momentum)
                self.latent_std.lerp_(batch_std.float(), self.stat_momentum)

        embed = self.codebook()
        flat32 = flatten.float()
        distance = flat32.pow(2).sum(1, keepdim=True) - 2 * flat32 @ embed + embed.pow(2).sum(0, keepdim=True)
        _, embed_ind = (-distance).max(1)
        embed_onehot = F.one_hot(embed_ind, self.n_embed).float()
        embed_ind = embed_ind.view(*input.shape[:-1])
        quantize = F.embedding(embed_ind, embed.t())

        if self.training:
            with torch.no_grad():
                embed_onehot_sum = embed_onehot.sum(0)
                normed = (flat32 - self.latent_mean) / self.latent_std
                embed_sum = normed.t() @ embed_onehot
                if dist.is_available() and dist.is_initialized():
                    dist.all_reduce(embed_onehot_sum)
                    dist.all_reduce(embed_sum)
                self.cluster_size.mul_(self.decay).add_(embed_onehot_sum, alpha=1 - self.decay)
                self.embed_avg.mul_(self.decay).add_(embed_sum, alpha=1 - self.decay)
                n = self.cluster_size.sum()
                cluster_size = (self.cluster_size + self.eps) / (n + self.n_embed * self.eps) * n
                self.embed.copy_(self.embed_avg / cluster_size.unsqueeze(0))

        diff = (quantize.detach() - input.float()).pow(2).mean()
        quantize = input + (quantize - input).detach()
        avg_probs = embed_onehot.mean(0)
        perplexity = torch.exp(-torch.sum(avg_probs * torch.log(avg_probs + 1e-10)))
        return quantize, diff, embed_ind, perplexity

    def embed_code(self, embed_id):
        return F.embedding(embed_id, self.codebook().t())


class ResBlock(nn.Module):
    def __init__(self, in_channel, channel):
        super().__init__()
        self.conv = nn.Sequential(
            nn.ReLU(),
            nn.Conv2d(in_channel, channel, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(channel, in_channel, 1),
        )

    def forward(self, input):
        return self.conv(input) + input


def _res_stack(channel, n_res_block, n_res_channel):
    return [ResBlock(channel, n_res_channel) for _ in range(n_res_block)] + [nn.ReLU(inplace=True)]


class Encoder(nn.Module):
    def __init__(self, in_channel, channel, n_res_block, n_res_channel, stride):
        super().__init__()
        if stride == 4:
            blocks = [nn.Conv2d(in_channel, channel // 2, 4, stride=2, padding=1), nn.ReLU(inplace=True),
                      nn.Conv2d(channel // 2, channel, 4, stride=2, padding=1), nn.ReLU(inplace=True),
                      nn.Conv2d(channel, channel, 3, padding=1)]
        else:
            blocks = [nn.Conv2d(in_channel, channel // 2, 4, stride=2, padding=1), nn.ReLU(inplace=True),
                      nn.Conv2d(channel // 2, channel, 3, padding=1)]
        self.blocks = nn.Sequential(*blocks, *_res_stack(channel, n_res_block, n_res_channel))

    def forward(self, input):
        return self.blocks(input)


class Decoder(nn.Module):
    def __init__(self, in_channel, out_channel, channel, n_res_block, n_res_channel, stride):
        super().__init__()
        blocks = [nn.Conv2d(in_channel, channel, 3, padding=1)] + _res_stack(channel, n_res_block, n_res_channel)
        if stride == 4:
            blocks += [nn.ConvTranspose2d(channel, channel // 2, 4, stride=2, padding=1), nn.ReLU(inplace=True),
                       nn.ConvTranspose2d(channel // 2, out_channel, 4, stride=2, padding=1)]
        else:
            blocks.append(nn.ConvTranspose2d(channel, out_channel, 4, stride=2, padding=1))
        self.blocks = nn.Sequential(*blocks)

    def forward(self, input):
        return self.blocks(input)


class VQVAE2(nn.Module):
    def __init__(self, cfg: VQConfig):
        super().__init__()
        c, d = cfg.channel, cfg.embed_dim
        self.enc_b = Encoder(cfg.in_channel, c, cfg.n_res_block, cfg.n_res_channel, stride=4)
        self.enc_t = Encoder(c, c, cfg.n_res_block, cfg.n_res_channel, stride=2)
        # level 0 = top, level 1 = bottom
        self.quantize_convs = nn.ModuleList([nn.Conv2d(c, d, 1), nn.Conv2d(d + c, d, 1)])
        self.quantizers = nn.ModuleList([Quantize(d, cfg.n_embed, cfg.decay) for _ in range(2)])
        self.dec_t = Decoder(d, d, c, cfg.n_res_block, cfg.n_res_channel, stride=2)
        self.upsample_t = nn.ConvTranspose2d(d, d, 4, stride=2, padding=1)
        self.dec = Decoder(d + d, cfg.in_channel, c, cfg.n_res_block, cfg.n_res_channel, stride=4)

    def encode(self, input):
        enc_b = self.enc_b(input)
        h = self.enc_t(enc_b)
        quants, diffs, ids, perps = [], [], [], []
        for level, (proj, quantizer) in enumerate(zip(self.quantize_convs, self.quantizers)):
            q = proj(h).permute(0, 2, 3, 1)
            q, diff, idx, perp = quantizer(q)
            q = q.permute(0, 3, 1, 2)
            quants.append(q)
            diffs.append(diff.unsqueeze(0))
            ids.append(idx)
            perps.append(perp)
            if level == 0:
                h = torch.cat([self.dec_t(q), enc_b], 1)
        return quants[0], quants[1], sum(diffs), ids, perps

    def decode(self, quant_t, quant_b):
        return self.dec(torch.cat([self.upsample_t(quant_t), quant_b], 1))

    def decode_code(self, code_t, code_b):
        quant_t = self.quantizers[0].embed_code(code_t).permute(0, 3, 1, 2)
        quant_b = self.quantizers[1].embed_code(code_b).permute(0, 3, 1, 2)
        return self.decode(quant_t, quant_b)

    def forward(self, input):
        quant_t, quant_b, diff, _, perps = self.encode(input)
        return self.decode(quant_t, quant_b), diff, perps


class VQVAETrainer:
    def __init__(self, cfg: VQConfig, device):
        self.cfg, self.device = cfg, device
        self.model = VQVAE2(cfg).to(device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=cfg.lr)
        self.scaler = torch.amp.GradScaler("cuda")  # expect: AMP010
        self.criterion = nn.MSELoss()

    def _backward(self, loss):
        self.scaler.scale(loss).backward()  # expect: AMP008

    def _optimizer_step(self):
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)  # expect: AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)

    def train_step(self, img):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out, latent_loss, perps = self.model(img)
            recon_loss = self.criterion(out, img)
            latent_loss = latent_loss.mean()
            loss = recon_loss + self.cfg.beta * latent_loss
            self._backward(loss)
        self._optimizer_step()
        return recon_loss.detach(), latent_loss.detach(), perps

    @torch.no_grad()
    def save_samples(self, sample, path):
        self.model.eval()
        sample = sample.to(self.device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out, _, _ = self.model(sample)
        utils.save_image(torch.cat([sample, out.float()], 0), path, nrow=len(sample), normalize=True, value_range=(-1, 1))
        self.model.train()

    def fit(self, loader, out_dir, sampler=None, log_every=100):
        for epoch in range(self.cfg.epochs):
            if sampler is not None:
                sampler.set_epoch(epoch)
            self.model.train()
            for i, (img, _) in enumerate(loader):
                recon, latent, perps = self.train_step(img.to(self.device, non_blocking=True))
                if i % log_every == 0:
                    usage = " ".join(f"{p.item():.1f}" for p in perps)
                    print(f"epoch {epoch + 1}; mse {recon.item():.5f}; latent {latent.item():.3f}; perplexity {usage}")
            self.save_samples(next(iter(loader))[0][:16], os.path.join(out_dir, f"sample_{epoch + 1:03d}.png"))
            torch.save(self.model.state_dict(), os.path.join(out_dir, f"vqvae_{epoch + 1:03d}.pt"))


def codebook_usage(model):
    stats = {}
    for i, q in enumerate(model.quantizers):
        usage = q.cluster_size / q.cluster_size.sum()
        stats[f"level{i}_dead"] = int((q.cluster_size < 1e-3).sum().item())
        stats[f"level{i}_entropy"] = float(-(usage * torch.log(usage + 1e-10)).sum())
    return stats


@torch.no_grad()
def extract_codes(model, loader, device, out_path):
    model.eval()
    codes_t, codes_b = [], []
    for img, _ in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, _, _, ids, _ = model.encode(img.to(device))
        codes_t.append(ids[0].cpu().numpy().astype(np.int16))
        codes_b.append(ids[1].cpu().numpy().astype(np.int16))
    np.savez_compressed(out_path, top=np.concatenate(codes_t), bottom=np.concatenate(codes_b))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("path", help="ImageFolder root")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=560)
    parser.add_argument("--out", default="checkpoint/vqvae2")
    parser.add_argument("--extract", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda")

    transform = transforms.Compose([
        transforms.Resize(args.size),
        transforms.CenterCrop(args.size),
        transforms.ToTensor(),
        transforms.Normalize([0.5, 0.5, 0.5], [0.5, 0.5, 0.5]),
    ])
    dataset = datasets.ImageFolder(args.path, transform=transform)
    loader = DataLoader(dataset, batch_size=VQConfig.batch_size, shuffle=True, num_workers=8, pin_memory=True, drop_last=True)

    cfg = VQConfig(epochs=args.epochs)
    trainer = VQVAETrainer(cfg, device)
    trainer.fit(loader, args.out)
    print(codebook_usage(trainer.model))
    if args.extract:
        eval_loader = DataLoader(dataset, batch_size=64, shuffle=False, num_workers=8)
        extract_codes(trainer.model, eval_loader, device, os.path.join(args.out, "codes.npz"))


if __name__ == "__main__":
    main()
