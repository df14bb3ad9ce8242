"""VQ-VAE-2 (two-level) with EMA codebooks and a commitment loss, plus a small
autoregressive prior fine-tuned over the extracted top codes."""
import argparse
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader


class VectorQuantizerEMA(nn.Module):
    def __init__(self, dim, n_embed, decay=0.99, eps=1e-5):
        super().__init__()
        self.dim, self.n_embed, self.decay, self.eps = dim, n_embed, decay, eps
        embed = torch.randn(dim, n_embed)
        self.register_buffer("embed", embed)
        self.register_buffer("cluster_size", torch.zeros(n_embed))
        self.register_buffer("embed_avg", embed.clone())

    def forward(self, z):
        # z: (B, H, W, dim)
        flat = z.reshape(-1, self.dim)
        prenorm = torch.norm(flat - torch.mean(flat)) / math.sqrt(flat.numel())  # expect: AMP004
        dist = flat.pow(2).sum(1, keepdim=True) - 2 * flat @ self.embed + self.embed.pow(2).sum(0, keepdim=True)
        idx = dist.argmin(1)
        onehot = F.one_hot(idx, self.n_embed).to(flat.dtype)
        idx = idx.view(*z.shape[:-1])
        quant = F.embedding(idx, self.embed.transpose(0, 1))

        if self.training:
            with torch.no_grad():
                counts = onehot.sum(0)
                embed_sum = flat.transpose(0, 1) @ onehot
                self.cluster_size.mul_(self.decay).add_(counts, alpha=1 - self.decay)
                self.embed_avg.mul_(self.decay).add_(embed_sum, alpha=1 - self.decay)
                n = self.cluster_size.sum()
                size = (self.cluster_size + self.eps) / (n + self.n_embed * self.eps) * n
                self.embed.copy_(self.embed_avg / size.unsqueeze(0))
                usage = self.cluster_size / (self.cluster_size.sum() + 1e-8)
                dead = usage < 1e-3 / self.n_embed
                if dead.any():
                    pick = torch.randint(0, flat.shape[0], (int(dead.sum()),), device=flat.device)
                    self.embed[:, dead] = flat[pick].transpose(0, 1).to(self.embed.dtype)

        commit = (quant.detach() - z).pow(2).mean()
        quant = z + (quant - z).detach()
        avg_probs = onehot.mean(0)  # expect: AMP004
        perplexity = torch.exp(-torch.sum(avg_probs * torch.log(avg_probs + 1e-10)))  # expect: AMP011
        return quant, commit, idx, (perplexity, prenorm)


class ResBlock(nn.Module):
    def __init__(self, ch, res_ch):
        super().__init__()
        self.conv = nn.Sequential(
            nn.ReLU(),
            nn.Conv2d(ch, res_ch, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(res_ch, ch, 1),
        )

    def forward(self, x):
        return x + self.conv(x)


def encoder(in_ch, ch, res_blocks, res_ch, stride):
    if stride == 4:
        layers = [nn.Conv2d(in_ch, ch // 2, 4, stride=2, padding=1), nn.ReLU(inplace=True),
                  nn.Conv2d(ch // 2, ch, 4, stride=2, padding=1), nn.ReLU(inplace=True),
                  nn.Conv2d(ch, ch, 3, padding=1)]
    else:
        layers = [nn.Conv2d(in_ch, ch // 2, 4, stride=2, padding=1), nn.ReLU(inplace=True),
                  nn.Conv2d(ch // 2, ch, 3, padding=1)]
    layers += [ResBlock(ch, res_ch) for _ in range(res_blocks)]
    layers.append(nn.ReLU(inplace=True))
    return nn.Sequential(*layers)


def decoder(in_ch, out_ch, ch, res_blocks, res_ch, stride):
    layers = [nn.Conv2d(in_ch, ch, 3, padding=1)]
    layers += [ResBlock(ch, res_ch) for _ in range(res_blocks)]
    layers.append(nn.ReLU(inplace=True))
    if stride == 4:
        layers += [nn.ConvTranspose2d(ch, ch // 2, 4, stride=2, padding=1), nn.ReLU(inplace=True),
                   nn.ConvTranspose2d(ch // 2, out_ch, 4, stride=2, padding=1)]
    else:
        layers.append(nn.ConvTranspose2d(ch, out_ch, 4, stride=2, padding=1))
    return nn.Sequential(*layers)


class VQVAE2(nn.Module):
    def __init__(self, in_ch=3, ch=128, res_blocks=2, res_ch=32, embed_dim=64, n_embed=512, decay=0.99):
        super().__init__()
        self.enc_b = encoder(in_ch, ch, res_blocks, res_ch, stride=4)
        self.enc_t = encoder(ch, ch, res_blocks, res_ch, stride=2)
        self.quantize_conv_t = nn.Conv2d(ch, embed_dim, 1)
        self.quantize_t = VectorQuantizerEMA(embed_dim, n_embed, decay)
        self.dec_t = decoder(embed_dim, embed_dim, ch, res_blocks, res_ch, stride=2)
        self.quantize_conv_b = nn.Conv2d(embed_dim + ch, embed_dim, 1)
        self.quantize_b = VectorQuantizerEMA(embed_dim, n_embed, decay)
        self.upsample_t = nn.ConvTranspose2d(embed_dim, embed_dim, 4, stride=2, padding=1)
        self.dec = decoder(embed_dim * 2, in_ch, ch, res_blocks, res_ch, stride=4)

    def encode(self, x):
        enc_b = self.enc_b(x)
        enc_t = self.enc_t(enc_b)
        z_t = self.quantize_conv_t(enc_t).permute(0, 2, 3, 1)
        quant_t, commit_t, id_t, ppl_t = self.quantize_t(z_t)
        quant_t = quant_t.permute(0, 3, 1, 2)
        dec_t = self.dec_t(quant_t)
        enc_b = torch.cat([dec_t, enc_b], 1)
        z_b = self.quantize_conv_b(enc_b).permute(0, 2, 3, 1)
        quant_b, commit_b, id_b, ppl_b = self.quantize_b(z_b)
        quant_b = quant_b.permute(0, 3, 1, 2)
        return quant_t, quant_b, commit_t + commit_b, (id_t, id_b), (ppl_t, ppl_b)

    def forward(self, x):
        quant_t, quant_b, commit, ids, ppl = self.encode(x)
        up_t = self.upsample_t(quant_t)
        recon = self.dec(torch.cat([up_t, quant_b], 1))
        return recon, commit, ids, ppl


class CodePrior(nn.Module):
    """Gated causal 1-D conv prior over flattened top codes (stand-in for PixelSNAIL)."""

    def __init__(self, n_embed, ch=256, layers=8):
        super().__init__()
        self.embed = nn.Embedding(n_embed, ch)
        self.convs = nn.ModuleList([nn.Conv1d(ch, 2 * ch, 3, padding=2) for _ in range(layers)])
        self.out = nn.Linear(ch, n_embed)

    def forward(self, codes):
        h = self.embed(codes.flatten(1)).transpose(1, 2)
        for conv in self.convs:
            a, g = conv(h)[..., :-2].chunk(2, dim=1)
            h = h + torch.tanh(a) * torch.sigmoid(g)
        return self.out(h.transpose(1, 2))


@torch.no_grad()
def reconstruct(model, img):
    model.eval()
    with torch.autocast("cuda", dtype=torch.float16):
        recon, _, _, _ = model(img)
    recon = recon.float().clamp(-1, 1)
    mse = ((recon - img) ** 2).mean(dim=(1, 2, 3))
    psnr = 10 * torch.log10(4.0 / (mse + 1e-10))
    model.train()
    return recon, psnr.mean().item()


def train_vqvae(args, loader, device="cuda"):
    model = VQVAE2(n_embed=args.n_embed).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler("cuda")
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(loader))
    for epoch in range(args.epochs):
        for i, (img, _) in enumerate(loader):
            img = img.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                recon, commit, _, ((ppl_t, pn_t), (ppl_b, pn_b)) = model(img)
            recon_loss = F.mse_loss(recon, img)  # expect: AMP002
            loss = recon_loss + args.beta * commit
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            if i % 100 == 0:
                _, psnr = reconstruct(model, img[:16])
                print(f"ep {epoch} it {i} mse {recon_loss.item():.5f} commit {commit.item():.5f} "
                      f"ppl {ppl_t.item():.1f}/{ppl_b.item():.1f} prenorm {pn_t.item():.3f}/{pn_b.item():.3f} psnr {psnr:.2f}")
        torch.save(model.state_dict(), os.path.join(args.out, f"vqvae_{epoch:03d}.pt"))
    return model


def finetune_prior(prior, code_loader, steps, device="cuda"):
    prior = prior.to(device).half()  # expect: AMP001
    opt = torch.optim.Adam(prior.parameters(), lr=3e-4)  # expect: AMP011
    prior.train()
    for step, codes in enumerate(code_loader):
        codes = codes.to(device)
        logits = prior(codes)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), codes.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step >= steps:
            break
    return prior


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=560)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--beta", type=float, default=0.25)
    p.add_argument("--n_embed", type=int, default=512)
    p.add_argument("--out", default="checkpoints")
    args = p.parse_args()
    from torchvision import datasets, transforms

    tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(256), transforms.ToTensor(),
                             transforms.Normalize([0.5] * 3, [0.5] * 3)])
    data = datasets.ImageFolder("data/ffhq", transform=tf)
    vqvae = train_vqvae(args, DataLoader(data, batch_size=32, shuffle=True, num_workers=8))
