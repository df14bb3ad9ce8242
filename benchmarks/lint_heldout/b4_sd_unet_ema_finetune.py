"""Stable-Diffusion UNet fine-tuning with an EMA copy, DDPM noise scheduler and min-SNR weighting, plain PyTorch loop."""
import copy
import math
import os

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from diffusers.training_utils import EMAModel
from transformers import CLIPTextModel, CLIPTokenizer


def compute_snr(noise_scheduler, timesteps):
    alphas_cumprod = noise_scheduler.alphas_cumprod.to(timesteps.device)
    sqrt_alphas_cumprod = alphas_cumprod[timesteps] ** 0.5
    sqrt_one_minus = (1.0 - alphas_cumprod[timesteps]) ** 0.5
    return (sqrt_alphas_cumprod / sqrt_one_minus) ** 2


def encode_batch(vae, text_encoder, batch, device, weight_dtype):
    pixel_values = batch["pixel_values"].to(device, dtype=weight_dtype)
    with torch.no_grad():
        latents = vae.encode(pixel_values).latent_dist.sample() * vae.config.scaling_factor
        encoder_hidden_states = text_encoder(batch["input_ids"].to(device))[0]
    return latents.float(), encoder_hidden_states


@torch.no_grad()
def log_validation(unet, args, device, prompts):
    pipe = StableDiffusionPipeline.from_pretrained(args.pretrained, unet=copy.deepcopy(unet), safety_checker=None)
    pipe = pipe.to(device, torch_dtype=torch.float16)
    pipe.unet.half()
    images = [pipe(p, num_inference_steps=30).images[0] for p in prompts]
    del pipe
    return images


def save_unet(unet, ema_unet, output_dir):
    unet_to_save = copy.deepcopy(unet).to(torch.float16)
    unet_to_save.save_pretrained(os.path.join(output_dir, "unet"))
    ema_unet.store(unet.parameters())
    ema_unet.copy_to(unet.parameters())
    torch.save({k: v.half() for k, v in unet.state_dict().items()}, os.path.join(output_dir, "unet_ema_fp16.bin"))
    ema_unet.restore(unet.parameters())


def main(args, train_loader):
    device = torch.device("cuda")
    weight_dtype = torch.bfloat16 if args.mixed_precision == "bf16" else torch.float32
    tokenizer = CLIPTokenizer.from_pretrained(args.pretrained, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(args.pretrained, subfolder="text_encoder")
    vae = AutoencoderKL.from_pretrained(args.pretrained, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(args.pretrained, subfolder="unet")
    noise_scheduler = DDPMScheduler.from_pretrained(args.pretrained, subfolder="scheduler")

    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    vae.to(device, dtype=weight_dtype)
    text_encoder.to(device, dtype=torch.float16)

    unet.enable_gradient_checkpointing()
    unet.to(device, dtype=torch.bfloat16)  # expect: AMP001
    unet.train()
    ema_unet = EMAModel(unet.parameters(), decay=args.ema_decay, model_cls=UNet2DConditionModel, model_config=unet.config)

    optimizer = torch.optim.AdamW(unet.parameters(), lr=args.lr, betas=(0.9, 0.999), weight_decay=1e-2, eps=1e-8)
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010
    lr_lambda = lambda s: min(1.0, (s + 1) / args.warmup_steps)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)

    global_step = 0
    for epoch in range(args.epochs):
        for step, batch in enumerate(train_loader):
            latents, encoder_hidden_states = encode_batch(vae, text_encoder, batch, device, weight_dtype)
            noise = torch.randn_like(latents)
            if args.noise_offset:
                noise += args.noise_offset * torch.randn((latents.shape[0], latents.shape[1], 1, 1), device=device)
            bsz = latents.shape[0]
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (bsz,), device=device).long()
            noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)

            if noise_scheduler.config.prediction_type == "epsilon":
                target = noise
            else:
                target = noise_scheduler.get_velocity(latents, noise, timesteps)

            with torch.autocast("cuda", dtype=torch.bfloat16):
                model_pred = unet(noisy_latents, timesteps, encoder_hidden_states).sample

            if args.snr_gamma is None:
                loss = F.mse_loss(model_pred, target, reduction="mean")  # expect: AMP002
            else:
                snr = compute_snr(noise_scheduler, timesteps)
                mse_loss_weights = torch.stack([snr, args.snr_gamma * torch.ones_like(timesteps)], dim=1).min(dim=1)[0] / snr
                loss = F.mse_loss(model_pred.float(), target.float(), reduction="none")
                loss = loss.mean(dim=list(range(1, len(loss.shape)))) * mse_loss_weights
                loss = loss.mean()

            scaler.scale(loss / args.grad_accum).backward()
            if (step + 1) % args.grad_accum == 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(unet.parameters(), args.max_grad_norm)
                optimizer.step()  # expect: AMP006
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                ema_unet.step(unet.parameters())
                global_step += 1

                if global_step % args.validation_steps == 0:
                    log_validation(unet, args, device, args.validation_prompts)
                if global_step >= args.max_train_steps:
                    break

    save_unet(unet, ema_unet, args.output_dir)
    print(f"done, final loss scale {scaler.get_scale():.1f}, lr {lr_scheduler.get_last_lr()[0]:.2e}")
