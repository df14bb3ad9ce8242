"""Text-to-image fine-tuning of a latent diffusion UNet (diffusers style)."""
import argparse
import math

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from transformers import CLIPTextModel, CLIPTokenizer


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pretrained_model_name_or_path", required=True)
    parser.add_argument("--mixed_precision", default="fp16")
    parser.add_argument("--learning_rate", type=float, default=1e-5)
    parser.add_argument("--max_train_steps", type=int, default=15000)
    parser.add_argument("--snr_gamma", type=float, default=None)
    return parser.parse_args()


def compute_snr(noise_scheduler, timesteps):
    alphas_cumprod = noise_scheduler.alphas_cumprod
    sqrt_alphas_cumprod = alphas_cumprod ** 0.5
    sqrt_one_minus = (1.0 - alphas_cumprod) ** 0.5
    alpha = sqrt_alphas_cumprod.to(device=timesteps.device)[timesteps].float()
    sigma = sqrt_one_minus.to(device=timesteps.device)[timesteps].float()
    return (alpha / sigma) ** 2


def main():
    args = parse_args()
    accelerator = Accelerator(mixed_precision=args.mixed_precision)
    name = args.pretrained_model_name_or_path
    noise_scheduler = DDPMScheduler.from_pretrained(name, subfolder="scheduler")
    tokenizer = CLIPTokenizer.from_pretrained(name, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(name, subfolder="text_encoder")
    vae = AutoencoderKL.from_pretrained(name, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(name, subfolder="unet")
    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    unet.train()
    optimizer = torch.optim.AdamW(unet.parameters(), lr=args.learning_rate, weight_decay=1e-2)
    train_dataloader = []
    unet, optimizer, train_dataloader = accelerator.prepare(unet, optimizer, train_dataloader)
    weight_dtype = torch.float32
    if accelerator.mixed_precision == "fp16":
        weight_dtype = torch.float16
    elif accelerator.mixed_precision == "bf16":
        weight_dtype = torch.bfloat16
    text_encoder.to(accelerator.device, dtype=weight_dtype)
    vae.to(accelerator.device, dtype=weight_dtype)
    global_step = 0
    while global_step < args.max_train_steps:
        for batch in train_dataloader:
            with accelerator.accumulate(unet):
                latents = vae.encode(batch["pixel_values"].to(weight_dtype)).latent_dist.sample()
                latents = latents * vae.config.scaling_factor
                noise = torch.randn_like(latents)
                bsz = latents.shape[0]
                timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (bsz,),
                                          device=latents.device).long()
                noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
                encoder_hidden_states = text_encoder(batch["input_ids"], return_dict=False)[0]
                target = noise
                model_pred = unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[0]
                if args.snr_gamma is None:
                    loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
                else:
                    snr = compute_snr(noise_scheduler, timesteps)
                    mse_loss_weights = torch.stack([snr, args.snr_gamma * torch.ones_like(timesteps)],
                                                   dim=1).min(dim=1)[0] / snr
                    loss = F.mse_loss(model_pred.float(), target.float(), reduction="none")
                    loss = loss.mean(dim=list(range(1, len(loss.shape)))) * mse_loss_weights
                    loss = loss.mean()
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(unet.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                global_step += 1


def train_plain(args, device="cuda"):
    """A second entry point without accelerate, as a user rewrote it."""
    name = args.pretrained_model_name_or_path
    noise_scheduler = DDPMScheduler.from_pretrained(name, subfolder="scheduler")
    text_encoder = CLIPTextModel.from_pretrained(name, subfolder="text_encoder")
    vae = AutoencoderKL.from_pretrained(name, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(name, subfolder="unet")
    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    vae.to(device, dtype=torch.float16)
    text_encoder.to(device, dtype=torch.float16)
    unet.to(device, dtype=torch.float16)  # expect: AMP001
    optimizer = torch.optim.AdamW(unet.parameters(), lr=args.learning_rate, eps=1e-6)
    unet.train()
    for step, batch in enumerate([]):
        with torch.no_grad():
            latents = vae.encode(batch["pixel_values"].to(device, torch.float16)).latent_dist.sample()
            hidden = text_encoder(batch["input_ids"].to(device))[0]
        latents = latents * 0.18215
        noise = torch.randn_like(latents)
        timesteps = torch.randint(0, 1000, (latents.shape[0],), device=device)
        noisy = noise_scheduler.add_noise(latents, noise, timesteps)
        pred = unet(noisy, timesteps, hidden).sample
        loss = F.mse_loss(pred.float(), noise.float())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step >= args.max_train_steps:
            break
    return math.nan
