#!/usr/bin/env python
# coding=utf-8
"""Fine-tuning script for Stable Diffusion for text2image.

Variant of ``examples/text_to_image/train_text_to_image.py`` that runs
without ``accelerate``: single GPU, mixed precision and EMA written out by
hand.
"""
import argparse
import copy
import logging
import math
import os
import random

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from datasets import load_dataset
from torchvision import transforms
from tqdm.auto import tqdm
from transformers import CLIPTextModel, CLIPTokenizer

from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from diffusers.optimization import get_scheduler

logger = logging.getLogger(__name__)


class EMAModel:
    """Exponential Moving Average of model weights."""

    def __init__(self, parameters, decay=0.9999, min_decay=0.0, update_after_step=0, use_ema_warmup=False, inv_gamma=1.0, power=2 / 3):
        parameters = list(parameters)
        self.shadow_params = [p.clone().detach() for p in parameters]
        self.decay = decay
        self.min_decay = min_decay
        self.update_after_step = update_after_step
        self.use_ema_warmup = use_ema_warmup
        self.inv_gamma = inv_gamma
        self.power = power
        self.optimization_step = 0

    def get_decay(self, optimization_step):
        step = max(0, optimization_step - self.update_after_step - 1)
        if step <= 0:
            return 0.0
        if self.use_ema_warmup:
            cur_decay_value = 1 - (1 + step / self.inv_gamma) ** -self.power
        else:
            cur_decay_value = (1 + step) / (10 + step)
        return max(min(cur_decay_value, self.decay), self.min_decay)

    @torch.no_grad()
    def step(self, parameters):
        self.optimization_step += 1
        one_minus_decay = 1 - self.get_decay(self.optimization_step)
        for s_param, param in zip(self.shadow_params, parameters):
            if param.requires_grad:
                s_param.sub_(one_minus_decay * (s_param - param))
            else:
                s_param.copy_(param)

    def copy_to(self, parameters):
        for s_param, param in zip(self.shadow_params, parameters):
            param.data.copy_(s_param.to(param.device).data)

    def to(self, device=None, dtype=None):
        self.shadow_params = [p.to(device=device, dtype=dtype) if p.is_floating_point() else p.to(device=device) for p in self.shadow_params]


def compute_snr(noise_scheduler, timesteps):
    """SNR of the forward process at ``timesteps`` (Min-SNR weighting, https://arxiv.org/abs/2303.09556)."""
    alphas_cumprod = noise_scheduler.alphas_cumprod
    sqrt_alphas_cumprod = alphas_cumprod**0.5
    sqrt_one_minus_alphas_cumprod = (1.0 - alphas_cumprod) ** 0.5
    alpha = sqrt_alphas_cumprod.to(device=timesteps.device)[timesteps].float()
    sigma = sqrt_one_minus_alphas_cumprod.to(device=timesteps.device)[timesteps].float()
    return (alpha / sigma) ** 2


def parse_args():
    parser = argparse.ArgumentParser(description="Simple example of a training script.")
    parser.add_argument("--pretrained_model_name_or_path", type=str, required=True)
    parser.add_argument("--dataset_name", type=str, default="lambdalabs/naruto-blip-captions")
    parser.add_argument("--image_column", type=str, default="image")
    parser.add_argument("--caption_column", type=str, default="text")
    parser.add_argument("--output_dir", type=str, default="sd-model-finetuned")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--train_batch_size", type=int, default=16)
    parser.add_argument("--num_train_epochs", type=int, default=100)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--lr_scheduler", type=str, default="constant")
    parser.add_argument("--lr_warmup_steps", type=int, default=500)
    parser.add_argument("--snr_gamma", type=float, default=None)
    parser.add_argument("--use_ema", action="store_true")
    parser.add_argument("--adam_beta1", type=float, default=0.9)
    parser.add_argument("--adam_beta2", type=float, default=0.999)
    parser.add_argument("--adam_weight_decay", type=float, default=1e-2)
    parser.add_argument("--adam_epsilon", type=float, default=1e-08)
    parser.add_argument("--max_grad_norm", default=1.0, type=float)
    parser.add_argument("--mixed_precision", type=str, default="fp16", choices=["no", "fp16", "bf16"])
    parser.add_argument("--noise_offset", type=float, default=0)
    parser.add_argument("--validation_prompts", type=str, nargs="+", default=None)
    return parser.parse_args()


def log_validation(vae, text_encoder, tokenizer, unet, args, device, weight_dtype, epoch):
    logger.info("Running validation... ")
    pipeline = StableDiffusionPipeline.from_pretrained(
        args.pretrained_model_name_or_path, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, safety_checker=None, torch_dtype=weight_dtype
    )
    pipeline = pipeline.to(device)
    pipeline.set_progress_bar_config(disable=True)
    generator = None if args.seed is None else torch.Generator(device=device).manual_seed(args.seed)
    images = []
    for prompt in args.validation_prompts:
        with torch.autocast("cuda"), torch.no_grad():
            image = pipeline(prompt, num_inference_steps=20, generator=generator).images[0]
        images.append(image)
    for i, image in enumerate(images):
        image.save(os.path.join(args.output_dir, f"validation_e{epoch}_{i}.png"))
    del pipeline
    torch.cuda.empty_cache()
    return images


def main():
    args = parse_args()
    device = torch.device("cuda")
    if args.seed is not None:
        random.seed(args.seed)
        np.random.seed(args.seed)
        torch.manual_seed(args.seed)
    os.makedirs(args.output_dir, exist_ok=True)

    noise_scheduler = DDPMScheduler.from_pretrained(args.pretrained_model_name_or_path, subfolder="scheduler")
    tokenizer = CLIPTokenizer.from_pretrained(args.pretrained_model_name_or_path, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(args.pretrained_model_name_or_path, subfolder="text_encoder")
    vae = AutoencoderKL.from_pretrained(args.pretrained_model_name_or_path, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(args.pretrained_model_name_or_path, subfolder="unet")

    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    unet.train()
    if args.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    if args.use_ema:
        ema_unet = EMAModel(copy.deepcopy(unet).parameters())

    # Frozen models only run inference, so they can live in half precision.
    weight_dtype = torch.float32
    if args.mixed_precision == "fp16":
        weight_dtype = torch.float16
    elif args.mixed_precision == "bf16":
        weight_dtype = torch.bfloat16
    use_amp = args.mixed_precision != "no"
    vae.to(device, dtype=weight_dtype)
    text_encoder.to(device, dtype=weight_dtype)
    unet.to(device)
    if args.use_ema:
        ema_unet.to(device)

    optimizer = torch.optim.AdamW(unet.parameters(), lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), weight_decay=args.adam_weight_decay, eps=args.adam_epsilon)
    scaler = torch.cuda.amp.GradScaler(enabled=args.mixed_precision == "fp16")  # expect: AMP009

    dataset = load_dataset(args.dataset_name)["train"]
    train_transforms = transforms.Compose([
        transforms.Resize(args.resolution, interpolation=transforms.InterpolationMode.BILINEAR),
        transforms.CenterCrop(args.resolution),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize([0.5], [0.5]),
    ])

    def preprocess_train(examples):
        images = [image.convert("RGB") for image in examples[args.image_column]]
        examples["pixel_values"] = [train_transforms(image) for image in images]
        captions = [random.choice(c) if isinstance(c, (list, np.ndarray)) else c for c in examples[args.caption_column]]
        examples["input_ids"] = tokenizer(captions, max_length=tokenizer.model_max_length, padding="max_length", truncation=True, return_tensors="pt").input_ids
        return examples

    def collate_fn(examples):
        pixel_values = torch.stack([example["pixel_values"] for example in examples]).to(memory_format=torch.contiguous_format).float()
        input_ids = torch.stack([example["input_ids"] for example in examples])
        return {"pixel_values": pixel_values, "input_ids": input_ids}

    train_dataset = dataset.with_transform(preprocess_train)
    train_dataloader = torch.utils.data.DataLoader(train_dataset, shuffle=True, collate_fn=collate_fn, batch_size=args.train_batch_size, num_workers=4)
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    lr_scheduler = get_scheduler(args.lr_scheduler, optimizer=optimizer, num_warmup_steps=args.lr_warmup_steps, num_training_steps=max_train_steps)

    global_step = 0
    progress_bar = tqdm(range(max_train_steps), desc="Steps")
    for epoch in range(args.num_train_epochs):
        train_loss = 0.0
        for step, batch in enumerate(train_dataloader):
            with torch.no_grad():
                latents = vae.encode(batch["pixel_values"].to(device, dtype=weight_dtype)).latent_dist.sample()
                latents = latents * vae.config.scaling_factor
                encoder_hidden_states = text_encoder(batch["input_ids"].to(device), return_dict=False)[0]

            noise = torch.randn_like(latents)
            if args.noise_offset:
                noise += args.noise_offset * torch.randn((latents.shape[0], latents.shape[1], 1, 1), device=latents.device)
            bsz = latents.shape[0]
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (bsz,), device=latents.device).long()
            noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
            if noise_scheduler.config.prediction_type == "epsilon":
                target = noise
            elif noise_scheduler.config.prediction_type == "v_prediction":
                target = noise_scheduler.get_velocity(latents, noise, timesteps)
            else:
                raise ValueError(f"Unknown prediction type {noise_scheduler.config.prediction_type}")

            with torch.autocast("cuda", dtype=weight_dtype, enabled=use_amp):
                model_pred = unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[0]

            if args.snr_gamma is None:
                loss = F.mse_loss(model_pred, target, reduction="mean")  # expect: AMP002
            else:
                snr = compute_snr(noise_scheduler, timesteps)
                mse_loss_weights = torch.stack([snr, args.snr_gamma * torch.ones_like(timesteps)], dim=1).min(dim=1)[0]
                if noise_scheduler.config.prediction_type == "epsilon":
                    mse_loss_weights = mse_loss_weights / snr
                elif noise_scheduler.config.prediction_type == "v_prediction":
                    mse_loss_weights = mse_loss_weights / (snr + 1)
                loss = F.mse_loss(model_pred.float(), target.float(), reduction="none")
                loss = loss.mean(dim=list(range(1, len(loss.shape)))) * mse_loss_weights
                loss = loss.mean()

            train_loss += loss.detach().item() / args.gradient_accumulation_steps
            loss = scaler.scale(loss / args.gradient_accumulation_steps)
            loss.backward()

            if (step + 1) % args.gradient_accumulation_steps == 0:
                torch.nn.utils.clip_grad_norm_(unet.parameters(), args.max_grad_norm)  # expect: AMP005
                optimizer.step()  # expect: AMP006
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                if args.use_ema:
                    ema_unet.step(unet.parameters())
                progress_bar.update(1)
                global_step += 1
                progress_bar.set_postfix(step_loss=train_loss, lr=lr_scheduler.get_last_lr()[0])
                train_loss = 0.0
            if global_step >= max_train_steps:
                break

        if args.validation_prompts is not None and epoch % 5 == 0:
            log_validation(vae, text_encoder, tokenizer, unet, args, device, weight_dtype, epoch)

    if args.use_ema:
        ema_unet.copy_to(unet.parameters())
    pipeline = StableDiffusionPipeline.from_pretrained(args.pretrained_model_name_or_path, text_encoder=text_encoder, vae=vae, unet=unet)
    pipeline.save_pretrained(args.output_dir)


if __name__ == "__main__":
    main()
