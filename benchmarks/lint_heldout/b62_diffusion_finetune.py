"""
Fine-tune a latent-diffusion UNet with an image-prompt adapter (IP-Adapter style).

    python b62_diffusion_finetune.py --pretrained runwayml/stable-diffusion-v1-5 \
        --image_encoder openai/clip-vit-large-patch14 --train_data data/pairs.jsonl --snr_gamma 5.0

EMA of the UNet weights, classifier-free guidance dropout of the text and image conditions,
and min-SNR loss weighting. Requires an Ampere or newer GPU (bf16 autocast).
"""
import argparse
import copy
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers import AutoencoderKL, DDIMScheduler, DDPMScheduler, UNet2DConditionModel
from torch.utils.data import DataLoader
from transformers import CLIPTextModel, CLIPTokenizer, CLIPVisionModelWithProjection

from data.pairs import ImageTextPairs


class ImageProjection(nn.Module):
    """Maps a pooled CLIP image embedding to `num_tokens` extra cross-attention tokens."""

    def __init__(self, clip_dim, cross_dim, num_tokens=4):
        super().__init__()
        self.num_tokens, self.cross_dim = num_tokens, cross_dim
        self.proj = nn.Linear(clip_dim, num_tokens * cross_dim)
        self.norm = nn.LayerNorm(cross_dim)

    def forward(self, image_embeds):
        return self.norm(self.proj(image_embeds).reshape(-1, self.num_tokens, self.cross_dim))


class EMAModel:
    """Exponential moving average of parameters, shadow copy kept in fp32."""

    def __init__(self, parameters, decay=0.9999, update_after_step=0, inv_gamma=1.0, power=2 / 3):
        self.shadow = [p.detach().clone().float() for p in parameters]
        self.decay, self.update_after_step = decay, update_after_step
        self.inv_gamma, self.power = inv_gamma, power
        self.optimization_step = 0

    def get_decay(self, step):
        step = max(0, step - self.update_after_step - 1)
        if step <= 0:
            return 0.0
        return min(self.decay, max(1 - (1 + step / self.inv_gamma) ** -self.power, 0.0))

    @torch.no_grad()
    def step(self, parameters):
        self.optimization_step += 1
        one_minus_decay = 1 - self.get_decay(self.optimization_step)
        for s, p in zip(self.shadow, parameters):
            if p.requires_grad:
                s.sub_(one_minus_decay * (s - p.float()))
            else:
                s.copy_(p)

    def copy_to(self, parameters):
        for s, p in zip(self.shadow, parameters):
            p.data.copy_(s.to(p.device, p.dtype))

    def state_dict(self):
        return {"shadow": self.shadow, "optimization_step": self.optimization_step, "decay": self.decay}


def compute_snr(noise_scheduler, timesteps):
    alphas_cumprod = noise_scheduler.alphas_cumprod.to(device=timesteps.device, dtype=torch.float32)
    alpha = alphas_cumprod[timesteps] ** 0.5
    sigma = (1.0 - alphas_cumprod[timesteps]) ** 0.5
    return (alpha / sigma) ** 2


@torch.no_grad()
def log_validation(unet, image_proj, vae, text_encoder, tokenizer, noise_scheduler, image_embeds, args,
                   device, step, ema_unet=None):
    if ema_unet is not None:
        backup = [p.detach().clone() for p in unet.parameters()]
        ema_unet.copy_to(unet.parameters())
    unet.eval()
    sampler = DDIMScheduler.from_config(noise_scheduler.config)
    sampler.set_timesteps(args.val_steps)
    n = len(args.val_prompts)
    ids = tokenizer(list(args.val_prompts) + [""] * n, padding="max_length", truncation=True,
                    max_length=tokenizer.model_max_length, return_tensors="pt").input_ids.to(device)
    text = text_encoder(ids)[0]
    g = torch.Generator(device).manual_seed(args.seed)
    latents = torch.randn(n, 4, args.resolution // 8, args.resolution // 8, device=device, generator=g)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ip = image_proj(torch.cat([image_embeds[:n], torch.zeros_like(image_embeds[:n])]))
        cond = torch.cat([text, ip.to(text.dtype)], dim=1)
        for t in sampler.timesteps:
            noise_pred = unet(torch.cat([latents] * 2), t, cond).sample
            noise_text, noise_uncond = noise_pred.chunk(2)
            noise_pred = noise_uncond + args.guidance_scale * (noise_text - noise_uncond)
            latents = sampler.step(noise_pred, t, latents).prev_sample
        images = vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor).sample
    images = (images.float() / 2 + 0.5).clamp(0, 1)
    torch.save(images.cpu(), os.path.join(args.output_dir, f"samples_{step:06d}.pt"))
    if ema_unet is not None:
        for p, b in zip(unet.parameters(), backup):
            p.data.copy_(b)
    unet.train()


def main(args):
    device = torch.device("cuda")
    torch.manual_seed(args.seed)
    os.makedirs(args.output_dir, exist_ok=True)
    noise_scheduler = DDPMScheduler.from_pretrained(args.pretrained, subfolder="scheduler")
    tokenizer = CLIPTokenizer.from_pretrained(args.pretrained, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(args.pretrained, subfolder="text_encoder")
    vae = AutoencoderKL.from_pretrained(args.pretrained, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(args.pretrained, subfolder="unet")
    image_encoder = CLIPVisionModelWithProjection.from_pretrained(args.image_encoder)

    weight_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.frozen_dtype]
    for frozen in (vae, text_encoder, image_encoder):
        frozen.requires_grad_(False)
        frozen.to(device, dtype=weight_dtype)
    unet.to(device)
    unet.train()
    if args.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    image_proj = ImageProjection(image_encoder.config.projection_dim, unet.config.cross_attention_dim,
                                 args.num_image_tokens)
    image_proj.to(device, dtype=torch.bfloat16)  # expect: AMP001
    ema_unet = EMAModel(unet.parameters(), decay=args.ema_decay) if args.use_ema else None

    params = list(unet.parameters()) + list(image_proj.parameters())
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), weight_decay=1e-2, eps=1e-8)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / args.warmup_steps))
    loader = DataLoader(ImageTextPairs(args.train_data, tokenizer, args.resolution), batch_size=args.batch_size,
                        shuffle=True, num_workers=8, drop_last=True)
    with torch.no_grad():
        null_ids = tokenizer([""], padding="max_length", max_length=tokenizer.model_max_length,
                             return_tensors="pt").input_ids.to(device)
        null_text = text_encoder(null_ids)[0]
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010

    global_step = 0
    for epoch in range(args.epochs):
        for step, batch in enumerate(loader):
            with torch.no_grad():
                pixel_values = batch["pixel_values"].to(device, dtype=weight_dtype)
                latents = vae.encode(pixel_values).latent_dist.sample() * vae.config.scaling_factor
                encoder_hidden_states = text_encoder(batch["input_ids"].to(device))[0]
                clip_pixels = batch["clip_pixel_values"].to(device, dtype=weight_dtype)
                image_embeds = image_encoder(clip_pixels).image_embeds
            latents = latents.float()
            noise = torch.randn_like(latents)
            if args.noise_offset:
                noise += args.noise_offset * torch.randn((latents.shape[0], latents.shape[1], 1, 1), device=device)
            bsz = latents.shape[0]
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (bsz,), device=device)
            noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
            # classifier-free guidance: drop the text and the image condition independently
            drop_text = torch.rand(bsz, device=device) < args.cond_drop_prob
            drop_image = torch.rand(bsz, device=device) < args.cond_drop_prob
            encoder_hidden_states = torch.where(drop_text[:, None, None],
                                                null_text.expand_as(encoder_hidden_states), encoder_hidden_states)
            image_embeds = image_embeds * (~drop_image)[:, None].to(image_embeds.dtype)
            if noise_scheduler.config.prediction_type == "epsilon":
                target = noise
            else:
                target = noise_scheduler.get_velocity(latents, noise, timesteps)

            with torch.autocast("cuda", dtype=torch.bfloat16):
                ip_tokens = image_proj(image_embeds)
                cond = torch.cat([encoder_hidden_states, ip_tokens.to(encoder_hidden_states.dtype)], dim=1)
                model_pred = unet(noisy_latents, timesteps, cond).sample
                loss = F.mse_loss(model_pred.float(), target.float(), reduction="none")
                loss = loss.mean(dim=list(range(1, len(loss.shape))))
                if args.snr_gamma is not None:
                    snr = compute_snr(noise_scheduler, timesteps)
                    weights = torch.stack([snr, args.snr_gamma * torch.ones_like(snr)], dim=1).min(dim=1)[0]
                    if noise_scheduler.config.prediction_type == "epsilon":
                        weights = weights / (snr + 1e-8)
                    else:
                        weights = weights / (snr + 1)
                    loss = loss * weights
                loss = loss.mean() / args.gradient_accumulation_steps
            scaler.scale(loss).backward()

            if (step + 1) % args.gradient_accumulation_steps == 0:
                scaler.unscale_(optimizer)
                grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
                scaler.step(optimizer)
                scaler.update()
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                if ema_unet is not None:
                    ema_unet.step(unet.parameters())
                global_step += 1
                if global_step % args.log_every == 0:
                    print(f"epoch {epoch} step {global_step} loss {loss.item() * args.gradient_accumulation_steps:.4f}"
                          f" grad_norm {grad_norm:.3f} lr {lr_scheduler.get_last_lr()[0]:.2e}")
                if global_step % args.validation_steps == 0:
                    log_validation(unet, image_proj, vae, text_encoder, tokenizer, noise_scheduler, image_embeds,
                                   args, device, global_step, ema_unet)
                if global_step % args.checkpointing_steps == 0:
                    ckpt_dir = os.path.join(args.output_dir, f"checkpoint-{global_step}")
                    unet.save_pretrained(os.path.join(ckpt_dir, "unet"))
                    torch.save(image_proj.state_dict(), os.path.join(ckpt_dir, "image_proj.bin"))
                    torch.save(copy.deepcopy(image_proj).half().state_dict(), os.path.join(ckpt_dir, "image_proj_fp16.bin"))
                    torch.save({"optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                                "ema": ema_unet.state_dict() if ema_unet else None, "step": global_step},
                               os.path.join(ckpt_dir, "training_state.pt"))
            if global_step >= args.max_train_steps:
                return


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--pretrained", default="runwayml/stable-diffusion-v1-5")
    p.add_argument("--image_encoder", default="openai/clip-vit-large-patch14")
    p.add_argument("--train_data", required=True)
    p.add_argument("--output_dir", default="ip-adapter-finetune")
    p.add_argument("--frozen_dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--resolution", type=int, default=512)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--gradient_accumulation_steps", type=int, default=4)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--max_train_steps", type=int, default=50000)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--warmup_steps", type=int, default=500)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--snr_gamma", type=float, default=None)
    p.add_argument("--noise_offset", type=float, default=0.0)
    p.add_argument("--cond_drop_prob", type=float, default=0.05)
    p.add_argument("--num_image_tokens", type=int, default=4)
    p.add_argument("--use_ema", action="store_true")
    p.add_argument("--ema_decay", type=float, default=0.9999)
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--guidance_scale", type=float, default=7.5)
    p.add_argument("--val_prompts", nargs="+", default=["a photo of a corgi on the beach"])
    p.add_argument("--val_steps", type=int, default=30)
    p.add_argument("--validation_steps", type=int, default=1000)
    p.add_argument("--checkpointing_steps", type=int, default=5000)
    p.add_argument("--log_every", type=int, default=50)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


if __name__ == "__main__":
    main(parse_args())
