#!/usr/bin/env python
# Fine-tune the Stable Diffusion UNet with LoRA (optionally DreamBooth prior preservation).
# Single-process version of the diffusers example without accelerate.
import argparse
import logging
import math
import os
import random
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from diffusers.training_utils import cast_training_params, compute_snr
from diffusers.utils import convert_state_dict_to_diffusers
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from transformers import CLIPTextModel, CLIPTokenizer

from data.dreambooth import DreamBoothDataset, collate_fn

logger = logging.getLogger(__name__)


def parse_args():
    parser = argparse.ArgumentParser(description="LoRA fine-tuning of a Stable Diffusion UNet.")
    parser.add_argument("--pretrained_model_name_or_path", type=str, required=True)
    parser.add_argument("--instance_data_dir", type=str, required=True)
    parser.add_argument("--instance_prompt", type=str, required=True)
    parser.add_argument("--class_data_dir", type=str, default=None)
    parser.add_argument("--class_prompt", type=str, default=None)
    parser.add_argument("--with_prior_preservation", action="store_true")
    parser.add_argument("--prior_loss_weight", type=float, default=1.0)
    parser.add_argument("--output_dir", type=str, default="sd-lora")
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--train_batch_size", type=int, default=4)
    parser.add_argument("--max_train_steps", type=int, default=1000)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--adam_beta1", type=float, default=0.9)
    parser.add_argument("--adam_beta2", type=float, default=0.999)
    parser.add_argument("--adam_weight_decay", type=float, default=1e-2)
    parser.add_argument("--adam_epsilon", type=float, default=1e-08)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--snr_gamma", type=float, default=None)
    parser.add_argument("--noise_offset", type=float, default=0.0)
    parser.add_argument("--mixed_precision", type=str, default="fp16", choices=["no", "fp16", "bf16"])
    parser.add_argument("--validation_prompt", type=str, default=None)
    parser.add_argument("--validation_steps", type=int, default=250)
    parser.add_argument("--checkpointing_steps", type=int, default=500)
    parser.add_argument("--seed", type=int, default=None)
    return parser.parse_args()


def log_validation(unet, text_encoder, vae, args, weight_dtype, step, num_images=4):
    logger.info("Running validation: %s", args.validation_prompt)
    pipeline = StableDiffusionPipeline.from_pretrained(
        args.pretrained_model_name_or_path, unet=unet, text_encoder=text_encoder, vae=vae,
        torch_dtype=weight_dtype, safety_checker=None,
    ).to("cuda")
    pipeline.set_progress_bar_config(disable=True)
    generator = torch.Generator(device="cuda").manual_seed(args.seed or 0)
    images = []
    with torch.autocast("cuda"):
        for _ in range(num_images):
            images.append(pipeline(args.validation_prompt, num_inference_steps=30, generator=generator).images[0])
    out = Path(args.output_dir, "validation")
    out.mkdir(parents=True, exist_ok=True)
    for i, im in enumerate(images):
        im.save(out / f"step{step:06d}_{i}.png")
    del pipeline
    torch.cuda.empty_cache()


def save_lora_weights(unet, output_dir, step):
    path = Path(output_dir, f"checkpoint-{step}")
    path.mkdir(parents=True, exist_ok=True)
    lora_state = convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))
    StableDiffusionPipeline.save_lora_weights(save_directory=str(path), unet_lora_layers=lora_state,
                                              safe_serialization=True)
    torch.save({k: v.to(torch.float16) for k, v in unet.state_dict().items() if "lora" in k},
               path / "unet_lora_fp16.bin")


def main():
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s - %(levelname)s - %(message)s")
    if args.seed is not None:
        random.seed(args.seed)
        np.random.seed(args.seed)
        torch.manual_seed(args.seed)
    device = torch.device("cuda")

    noise_scheduler = DDPMScheduler.from_pretrained(args.pretrained_model_name_or_path, subfolder="scheduler")
    tokenizer = CLIPTokenizer.from_pretrained(args.pretrained_model_name_or_path, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(args.pretrained_model_name_or_path, subfolder="text_encoder")
    vae = AutoencoderKL.from_pretrained(args.pretrained_model_name_or_path, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(args.pretrained_model_name_or_path, subfolder="unet")

    # only the LoRA layers are trained
    unet.requires_grad_(False)
    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)

    # For mixed precision the frozen weights are cast to half precision: they are only
    # used for inference, so full precision copies are not needed.
    weight_dtype = torch.float32
    if args.mixed_precision == "fp16":
        weight_dtype = torch.float16
    elif args.mixed_precision == "bf16":
        weight_dtype = torch.bfloat16

    unet.to(device, dtype=weight_dtype)
    vae.to(device, dtype=weight_dtype)
    text_encoder.to(device, dtype=weight_dtype)

    unet_lora_config = LoraConfig(
        r=args.rank, lora_alpha=args.rank, init_lora_weights="gaussian",
        target_modules=["to_k", "to_q", "to_v", "to_out.0"],
    )
    unet.add_adapter(unet_lora_config)
    if args.mixed_precision == "fp16":
        # only upcast trainable parameters (LoRA) into fp32
        cast_training_params(unet, dtype=torch.float32)

    params_to_optimize = list(filter(lambda p: p.requires_grad, unet.parameters()))
    optimizer = torch.optim.AdamW(
        params_to_optimize, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
        weight_decay=args.adam_weight_decay, eps=args.adam_epsilon,
    )

    dataset = DreamBoothDataset(
        instance_data_root=args.instance_data_dir, instance_prompt=args.instance_prompt,
        class_data_root=args.class_data_dir if args.with_prior_preservation else None,
        class_prompt=args.class_prompt, tokenizer=tokenizer, size=args.resolution,
    )
    loader = DataLoader(dataset, batch_size=args.train_batch_size, shuffle=True, num_workers=4,
                        collate_fn=lambda ex: collate_fn(ex, args.with_prior_preservation))
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 100))

    scaler = torch.amp.GradScaler("cuda", enabled=args.mixed_precision == "fp16")
    autocast_ctx = nullcontext() if args.mixed_precision == "no" else torch.autocast("cuda", dtype=weight_dtype)

    global_step = 0
    unet.train()
    num_epochs = math.ceil(args.max_train_steps * args.gradient_accumulation_steps / len(loader))
    for epoch in range(num_epochs):
        for step, batch in enumerate(loader):
            pixel_values = batch["pixel_values"].to(device, dtype=weight_dtype)
            input_ids = batch["input_ids"].to(device)
            with torch.no_grad():
                latents = vae.encode(pixel_values).latent_dist.sample()
                latents = latents * vae.config.scaling_factor
                encoder_hidden_states = text_encoder(input_ids, return_dict=False)[0]

            noise = torch.randn_like(latents)
            if args.noise_offset:
                noise += args.noise_offset * torch.randn(
                    (latents.shape[0], latents.shape[1], 1, 1), device=latents.device, dtype=latents.dtype
                )
            bsz = latents.shape[0]
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (bsz,), device=device).long()
            noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
            if noise_scheduler.config.prediction_type == "epsilon":
                target = noise
            else:
                target = noise_scheduler.get_velocity(latents, noise, timesteps)

            with autocast_ctx:
                model_pred = unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[0]

            if args.with_prior_preservation:
                model_pred, model_pred_prior = torch.chunk(model_pred, 2, dim=0)
                target, target_prior = torch.chunk(target, 2, dim=0)
                timesteps, _ = torch.chunk(timesteps, 2, dim=0)

            if args.snr_gamma is None:
                loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
            else:
                snr = compute_snr(noise_scheduler, timesteps)
                mse_loss_weights = torch.stack([snr, args.snr_gamma * torch.ones_like(timesteps)], dim=1).min(dim=1)[0]
                if noise_scheduler.config.prediction_type == "epsilon":
                    mse_loss_weights = mse_loss_weights / snr
                else:
                    mse_loss_weights = mse_loss_weights / (snr + 1)
                loss = F.mse_loss(model_pred.float(), target.float(), reduction="none")
                loss = loss.mean(dim=list(range(1, len(loss.shape)))) * mse_loss_weights
                loss = loss.mean()

            if args.with_prior_preservation:
                prior_loss = F.mse_loss(model_pred_prior, target_prior, reduction="mean")  # expect: AMP002
                loss = loss + args.prior_loss_weight * prior_loss

            loss = loss / args.gradient_accumulation_steps
            scaler.scale(loss).backward()
            if (step + 1) % args.gradient_accumulation_steps != 0:
                continue

            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(params_to_optimize, args.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1

            if global_step % 10 == 0:
                logger.info("step %d loss %.4f grad_norm %.3f scale %.0f", global_step,
                            loss.detach().item() * args.gradient_accumulation_steps,
                            float(grad_norm), scaler.get_scale())
            if global_step % args.checkpointing_steps == 0:
                save_lora_weights(unet, args.output_dir, global_step)
            if args.validation_prompt and global_step % args.validation_steps == 0:
                unet.eval()
                log_validation(unet, text_encoder, vae, args, weight_dtype, global_step)
                unet.train()
            if global_step >= args.max_train_steps:
                break
        if global_step >= args.max_train_steps:
            break

    save_lora_weights(unet, args.output_dir, global_step)
    logger.info("finished after %d steps", global_step)


if __name__ == "__main__":
    main()
