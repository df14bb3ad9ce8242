#!/usr/bin/env python
"""
Fine-tune the UNet of a Stable Diffusion 1.x checkpoint on image/caption pairs, with an
optional inpainting mode (9-channel conv_in: noisy latents + mask + masked-image latents).

Single GPU, plain PyTorch; VAE and text encoder stay frozen.

    python train_sd_unet.py --pretrained runwayml/stable-diffusion-v1-5 \
        --train_data /data/pokemon --mixed_precision fp16 --use_ema
"""
import argparse
import copy
import logging
import math
import os
import random
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel, compute_snr
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import CLIPTextModel, CLIPTokenizer

from .captions import CaptionDataset, collate_captions

logger = logging.getLogger(__name__)


def parse_args():
    parser = argparse.ArgumentParser(description="Stable Diffusion UNet fine-tuning")
    parser.add_argument("--pretrained", required=True)
    parser.add_argument("--train_data", required=True)
    parser.add_argument("--output_dir", default="sd-finetuned")
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--train_batch_size", type=int, default=4)
    parser.add_argument("--num_train_epochs", type=int, default=100)
    parser.add_argument("--max_train_steps", type=int, default=15000)
    parser.add_argument("--learning_rate", type=float, default=1e-5)
    parser.add_argument("--adam_weight_decay", type=float, default=1e-2)
    parser.add_argument("--lr_scheduler", default="constant_with_warmup")
    parser.add_argument("--lr_warmup_steps", type=int, default=500)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--snr_gamma", type=float, default=None)
    parser.add_argument("--noise_offset", type=float, default=0.0)
    parser.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default="fp16")
    parser.add_argument("--inpainting", action="store_true")
    parser.add_argument("--use_ema", action="store_true")
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--validation_prompts", nargs="*", default=["a cartoon of a blue dragon"])
    parser.add_argument("--validation_steps", type=int, default=1000)
    parser.add_argument("--checkpointing_steps", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=1337)
    return parser.parse_args()


def encode_prompt(text_encoder, input_ids):
    with torch.no_grad():
        return text_encoder(input_ids, return_dict=False)[0]


def prepare_latents(vae, pixel_values, scaling_factor):
    with torch.no_grad():
        latents = vae.encode(pixel_values.to(torch.float16)).latent_dist.sample()
    return (latents * scaling_factor).half()  # expect: AMP001


@torch.no_grad()
def log_validation(unet, vae, text_encoder, tokenizer, args, step):
    logger.info("running validation at step %d", step)
    pipeline = StableDiffusionPipeline.from_pretrained(
        args.pretrained,
        unet=unet,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        safety_checker=None,
        torch_dtype=torch.float16,
    ).to("cuda")
    pipeline.set_progress_bar_config(disable=True)
    generator = torch.Generator(device="cuda").manual_seed(args.seed)
    out_dir = Path(args.output_dir) / "validation"
    out_dir.mkdir(parents=True, exist_ok=True)
    for i, prompt in enumerate(args.validation_prompts):
        with torch.autocast("cuda", dtype=torch.float16):
            image = pipeline(prompt, num_inference_steps=30, generator=generator).images[0]
        image.save(out_dir / f"step{step:06d}_{i}.png")
    del pipeline
    torch.cuda.empty_cache()


def export_pipeline(unet, ema_unet, vae, text_encoder, tokenizer, args):
    unet_export = copy.deepcopy(unet)
    if ema_unet is not None:
        ema_unet.copy_to(unet_export.parameters())
    unet_export = unet_export.to(torch.float16)
    pipeline = StableDiffusionPipeline.from_pretrained(
        args.pretrained, unet=unet_export, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
        safety_checker=None, torch_dtype=torch.float16,
    )
    pipeline.save_pretrained(args.output_dir)


def train(args):
    device = torch.device("cuda")
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    tokenizer = CLIPTokenizer.from_pretrained(args.pretrained, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(args.pretrained, subfolder="text_encoder")
    vae = AutoencoderKL.from_pretrained(args.pretrained, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(args.pretrained, subfolder="unet")
    noise_scheduler = DDPMScheduler.from_pretrained(args.pretrained, subfolder="scheduler")

    # frozen parts run in half precision to save memory
    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    vae.to(device, dtype=torch.float16)
    text_encoder.to(device, dtype=torch.float16)
    unet.to(device)

    if args.inpainting and unet.config.in_channels == 4:
        # widen conv_in for [noisy latents, mask, masked-image latents]; extra channels start at zero
        old = unet.conv_in
        new_conv_in = torch.nn.Conv2d(9, old.out_channels, old.kernel_size, old.stride, old.padding)
        with torch.no_grad():
            new_conv_in.weight.zero_()
            new_conv_in.weight[:, :4].copy_(old.weight)
            new_conv_in.bias.copy_(old.bias)
        unet.conv_in = new_conv_in.to(device, dtype=torch.float16)  # expect: AMP001
        unet.register_to_config(in_channels=9)

    if args.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    ema_unet = None
    if args.use_ema:
        ema_unet = EMAModel(unet.parameters(), model_cls=UNet2DConditionModel, model_config=unet.config)
        ema_unet.to(device)

    optimizer = torch.optim.AdamW(unet.parameters(), lr=args.learning_rate, betas=(0.9, 0.999),
                                  weight_decay=args.adam_weight_decay)
    dataset = CaptionDataset(args.train_data, tokenizer, resolution=args.resolution, inpainting=args.inpainting)
    train_dataloader = DataLoader(dataset, batch_size=args.train_batch_size, shuffle=True,
                                  collate_fn=collate_captions, num_workers=4, drop_last=True)
    lr_scheduler = get_scheduler(args.lr_scheduler, optimizer=optimizer,
                                 num_warmup_steps=args.lr_warmup_steps, num_training_steps=args.max_train_steps)

    if args.mixed_precision == "fp16":
        autocast_ctx = torch.autocast("cuda", dtype=torch.float16)  # expect: AMP010
    elif args.mixed_precision == "bf16":
        autocast_ctx = torch.autocast("cuda", dtype=torch.bfloat16)
    else:
        autocast_ctx = nullcontext()

    global_step = 0
    progress = tqdm(range(args.max_train_steps), desc="steps")
    unet.train()
    for epoch in range(args.num_train_epochs):
        for batch in train_dataloader:
            pixel_values = batch["pixel_values"].to(device, non_blocking=True)
            latents = prepare_latents(vae, pixel_values, vae.config.scaling_factor)
            noise = torch.randn_like(latents)
            if args.noise_offset:
                noise += args.noise_offset * torch.randn(
                    (latents.shape[0], latents.shape[1], 1, 1), device=device, dtype=latents.dtype
                )
            bsz = latents.shape[0]
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (bsz,), device=device).long()
            noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
            encoder_hidden_states = encode_prompt(text_encoder, batch["input_ids"].to(device))

            if args.inpainting:
                mask = F.interpolate(batch["masks"].to(device), size=latents.shape[-2:])
                masked_latents = prepare_latents(vae, batch["masked_pixel_values"].to(device),
                                                 vae.config.scaling_factor)
                model_input = torch.cat([noisy_latents, mask.to(latents.dtype), masked_latents], dim=1)
            else:
                model_input = noisy_latents

            if noise_scheduler.config.prediction_type == "epsilon":
                target = noise
            elif noise_scheduler.config.prediction_type == "v_prediction":
                target = noise_scheduler.get_velocity(latents, noise, timesteps)
            else:
                raise ValueError(f"unknown prediction type {noise_scheduler.config.prediction_type}")

            with autocast_ctx:
                model_pred = unet(model_input, timesteps, encoder_hidden_states, return_dict=False)[0]
                if args.snr_gamma is None:
                    loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
                else:
                    # Min-SNR weighting, https://arxiv.org/abs/2303.09556
                    snr = compute_snr(noise_scheduler, timesteps)
                    weights = torch.stack([snr, args.snr_gamma * torch.ones_like(timesteps)], dim=1).min(dim=1)[0]
                    if noise_scheduler.config.prediction_type == "epsilon":
                        weights = weights / snr
                    else:
                        weights = weights / (snr + 1)
                    loss = F.mse_loss(model_pred.float(), target.float(), reduction="none")
                    loss = loss.mean(dim=list(range(1, len(loss.shape)))) * weights
                    loss = loss.mean()

            loss.backward()
            if args.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(unet.parameters(), args.max_grad_norm)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if ema_unet is not None:
                ema_unet.step(unet.parameters())

            global_step += 1
            progress.update(1)
            progress.set_postfix(loss=loss.detach().item(), lr=lr_scheduler.get_last_lr()[0])

            if global_step % args.checkpointing_steps == 0:
                ckpt_dir = Path(args.output_dir) / f"checkpoint-{global_step}"
                ckpt_dir.mkdir(parents=True, exist_ok=True)
                unet.save_pretrained(ckpt_dir / "unet")
                if ema_unet is not None:
                    torch.save(ema_unet.state_dict(), ckpt_dir / "ema_unet.pt")
                torch.save({"optimizer": optimizer.state_dict(), "step": global_step}, ckpt_dir / "state.pt")
            if args.validation_prompts and global_step % args.validation_steps == 0:
                unet.eval()
                log_validation(unet, vae, text_encoder, tokenizer, args, global_step)
                unet.train()
            if global_step >= args.max_train_steps:
                break
        if global_step >= args.max_train_steps:
            break

    export_pipeline(unet, ema_unet, vae, text_encoder, tokenizer, args)
    return global_step


def main():
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    os.makedirs(args.output_dir, exist_ok=True)
    steps = train(args)
    logger.info("finished after %d steps", steps)


if __name__ == "__main__":
    main()
