"""ControlNet-style fine-tuning of a small latent denoiser.

The VAE, text encoder and denoiser are frozen and kept in half precision to save
memory; only the control branch is trained.
"""
import argparse
import copy
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default="fp16")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--snr_gamma", type=float, default=None)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--output_dir", default="out/controlnet")
    return p.parse_args(argv)


class TinyVAE(nn.Module):
    def __init__(self, ch=64, latent=4):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, ch, 3, 2, 1), nn.SiLU(), nn.Conv2d(ch, 2 * latent, 3, 2, 1))

    def encode(self, x):
        mean, logvar = self.enc(x).chunk(2, dim=1)
        return mean + torch.randn_like(mean) * torch.exp(0.5 * logvar.clamp(-30.0, 20.0))


class TextEncoder(nn.Module):
    def __init__(self, vocab=49408, dim=256):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(dim, 4, 4 * dim, batch_first=True), 2)

    def forward(self, ids):
        return self.enc(self.emb(ids))


class DenoiseNet(nn.Module):
    def __init__(self, latent=4, ch=128, ctx_dim=256):
        super().__init__()
        self.inp = nn.Conv2d(latent, ch, 3, padding=1)
        self.time = nn.Sequential(nn.Linear(1, ch), nn.SiLU(), nn.Linear(ch, ch))
        self.ctx_score = nn.Linear(ctx_dim, 1)
        self.ctx_proj = nn.Linear(ctx_dim, ch)
        self.mid = nn.Conv2d(ch, ch, 3, padding=1)
        self.out = nn.Conv2d(ch, latent, 3, padding=1)

    def forward(self, x, t, ctx, ctx_mask=None, residual=None):
        h = self.inp(x) + self.time(t[:, None].float())[:, :, None, None]
        w = self.ctx_score(ctx).squeeze(-1)
        if ctx_mask is not None:
            w = w.masked_fill(~ctx_mask, -1e9)  # expect: AMP007
        pooled = torch.einsum("bt,btd->bd", w.softmax(dim=-1), ctx)
        h = h + self.ctx_proj(pooled)[:, :, None, None]
        if residual is not None:
            h = h + residual
        return self.out(F.silu(self.mid(F.silu(h))))


class ControlNet(nn.Module):
    def __init__(self, latent=4, ch=128):
        super().__init__()
        self.hint = nn.Sequential(nn.Conv2d(3, 32, 3, 2, 1), nn.SiLU(), nn.Conv2d(32, latent, 3, 2, 1))
        self.body = nn.Conv2d(latent, ch, 3, padding=1)
        self.zero = nn.Conv2d(ch, ch, 1)
        nn.init.zeros_(self.zero.weight)
        nn.init.zeros_(self.zero.bias)

    def forward(self, x, cond):
        return self.zero(F.silu(self.body(x + self.hint(cond))))


class PairDataset(Dataset):
    def __init__(self, n=512, size=64):
        self.n, self.size = n, size

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {
            "pixel_values": torch.rand(3, self.size, self.size) * 2 - 1,
            "conditioning_pixel_values": torch.rand(3, self.size, self.size),
            "input_ids": torch.randint(0, 49408, (77,)),
            "attention_mask": torch.ones(77, dtype=torch.long),
        }


def make_schedule(num_steps=1000):
    betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, num_steps) ** 2
    return torch.cumprod(1.0 - betas, dim=0)


def compute_snr(alphas_cumprod, timesteps):
    a = alphas_cumprod[timesteps].float()
    return a / (1.0 - a)


def train(args, unet, controlnet, vae, text_encoder, loader, optimizer, scaler, weight_dtype, device):
    alphas_cumprod = make_schedule().to(device)
    controlnet.train()
    for step, batch in enumerate(loader):
        pixel_values = batch["pixel_values"].to(device, memory_format=torch.contiguous_format)
        cond = batch["conditioning_pixel_values"].to(device, dtype=weight_dtype)
        ctx_mask = batch["attention_mask"].to(device).bool()
        with torch.no_grad():
            latents = vae.encode(pixel_values.half()) * 0.18215
            encoder_hidden_states = text_encoder(batch["input_ids"].to(device))
        noise = torch.randn_like(latents)
        timesteps = torch.randint(0, alphas_cumprod.numel(), (latents.shape[0],), device=device)
        a = alphas_cumprod[timesteps].to(latents.dtype)[:, None, None, None]
        noisy = a.sqrt() * latents + (1 - a).sqrt() * noise
        with torch.autocast("cuda", dtype=torch.float16):
            residual = controlnet(noisy, cond)
            model_pred = unet(noisy, timesteps, encoder_hidden_states, ctx_mask=ctx_mask, residual=residual)
        if args.snr_gamma is None:
            loss = F.mse_loss(noise, model_pred)  # expect: AMP002
        else:
            snr = compute_snr(alphas_cumprod, timesteps)
            mse_weights = torch.clamp(snr, max=args.snr_gamma) / snr
            loss = F.mse_loss(model_pred.float(), noise.float(), reduction="none")
            loss = (loss.mean(dim=[1, 2, 3]) * mse_weights).mean()
        scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(controlnet.parameters(), args.max_grad_norm)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if step % 100 == 0:
            print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():.0f}")


def log_validation(unet, controlnet, vae, text_encoder, batch, device, num_steps=20):
    control = copy.deepcopy(controlnet).to(device, dtype=torch.float16).eval()
    with torch.inference_mode():
        cond = batch["conditioning_pixel_values"].to(device).half()
        ctx = text_encoder(batch["input_ids"].to(device))
        x = torch.randn(cond.shape[0], 4, cond.shape[2] // 4, cond.shape[3] // 4, device=device, dtype=torch.float16)
        alphas_cumprod = make_schedule().to(device)
        for t in torch.linspace(999, 0, num_steps, device=device).long():
            eps = unet(x, t.expand(x.shape[0]), ctx, residual=control(x, cond))
            a = alphas_cumprod[t].to(x.dtype)
            x = (x - (1 - a).sqrt() * eps) / a.sqrt()
    return x


def save_controlnet(controlnet, path, half=True):
    state = controlnet.state_dict()
    if half:
        state = {k: v.to(torch.float16) for k, v in state.items()}
    torch.save(state, path)


def main(argv=None):
    args = parse_args(argv)
    device = torch.device("cuda")
    weight_dtype = torch.float32
    if args.mixed_precision == "fp16":
        weight_dtype = torch.float16
    elif args.mixed_precision == "bf16":
        weight_dtype = torch.bfloat16
    vae, text_encoder, unet = TinyVAE(), TextEncoder(), DenoiseNet()
    controlnet = ControlNet()
    for frozen in (vae, text_encoder, unet):
        frozen.requires_grad_(False)
    vae.to(device, dtype=torch.float16)
    text_encoder.to(device, dtype=weight_dtype)
    unet.to(device, dtype=torch.float16)
    controlnet.to(device, dtype=torch.float16)  # expect: AMP001
    optimizer = torch.optim.AdamW(controlnet.parameters(), lr=args.lr, eps=1e-6)
    scaler = torch.amp.GradScaler("cuda", enabled=args.mixed_precision == "fp16")
    loader = DataLoader(PairDataset(), batch_size=args.batch_size, shuffle=True, num_workers=2)
    train(args, unet, controlnet, vae, text_encoder, loader, optimizer, scaler, weight_dtype, device)
    log_validation(unet, controlnet, vae, text_encoder, next(iter(loader)), device)
    os.makedirs(args.output_dir, exist_ok=True)
    save_controlnet(controlnet, os.path.join(args.output_dir, "diffusion_pytorch_model.pt"))


if __name__ == "__main__":
    main()
