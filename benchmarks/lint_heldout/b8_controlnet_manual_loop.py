#!/usr/bin/env python
# coding=utf-8
"""Train a ControlNet on (image, conditioning image, caption) triplets -- single GPU, no accelerate.

Adapted from diffusers/examples/controlnet/train_controlnet.py. The Accelerator was replaced
by a plain PyTorch loop so the script runs on a bare workstation without a launcher config.

    python train_controlnet_plain.py --pretrained_model_name_or_path runwayml/stable-diffusion-v1-5 \
        --train_data_dir data/fill50k --resolution 512 --mixed_precision fp16 --train_batch_size 4
"""
import argparse
import copy
import json
import logging
import math
import os
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torchvision import transforms
from tqdm.auto import tqdm
from transformers import AutoTokenizer, CLIPTextModel

from diffusers import (
    AutoencoderKL,
    ControlNetModel,
    DDPMScheduler,
    StableDiffusionControlNetPipeline,
    UNet2DConditionModel,
    UniPCMultistepScheduler,
)
from diffusers.optimization import get_scheduler
from diffusers.training_utils import compute_snr

logger = logging.getLogger(__name__)


def parse_args():
    p = argparse.ArgumentParser(description="ControlNet training without accelerate")
    p.add_argument("--pretrained_model_name_or_path", required=True)
    p.add_argument("--controlnet_model_name_or_path", default=None)
    p.add_argument("--train_data_dir", required=True)
    p.add_argument("--output_dir", default="controlnet-model")
    p.add_argument("--resolution", type=int, default=512)
    p.add_argument("--train_batch_size", type=int, default=4)
    p.add_argument("--num_train_epochs", type=int, default=1)
    p.add_argument("--max_train_steps", type=int, default=None)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--learning_rate", type=float, default=1e-5)
    p.add_argument("--lr_scheduler", default="constant")
    p.add_argument("--lr_warmup_steps", type=int, default=500)
    p.add_argument("--snr_gamma", type=float, default=None)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default="fp16")
    p.add_argument("--checkpointing_steps", type=int, default=500)
    p.add_argument("--validation_steps", type=int, default=100)
    p.add_argument("--validation_prompt", nargs="+", default=None)
    p.add_argument("--validation_image", nargs="+", default=None)
    p.add_argument("--save_fp16_copy", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class Fill50kDataset(torch.utils.data.Dataset):
    def __init__(self, root, tokenizer, resolution):
        with open(os.path.join(root, "prompt.json")) as f:
            self.items = [json.loads(line) for line in f]
        self.root = root
        self.tokenizer = tokenizer
        self.image_tf = transforms.Compose([
            transforms.Resize(resolution), transforms.CenterCrop(resolution),
            transforms.ToTensor(), transforms.Normalize([0.5], [0.5])])
        self.cond_tf = transforms.Compose([
            transforms.Resize(resolution), transforms.CenterCrop(resolution), transforms.ToTensor()])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        item = self.items[i]
        image = Image.open(os.path.join(self.root, item["target"])).convert("RGB")
        cond = Image.open(os.path.join(self.root, item["source"])).convert("RGB")
        ids = self.tokenizer(item["prompt"], max_length=self.tokenizer.model_max_length,
                             padding="max_length", truncation=True, return_tensors="pt").input_ids[0]
        return {"pixel_values": self.image_tf(image), "conditioning_pixel_values": self.cond_tf(cond), "input_ids": ids}


@torch.no_grad()
def log_validation(vae, text_encoder, tokenizer, unet, controlnet, args, weight_dtype, step, device):
    pipeline = StableDiffusionControlNetPipeline.from_pretrained(
        args.pretrained_model_name_or_path, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
        unet=unet, controlnet=controlnet, safety_checker=None, torch_dtype=weight_dtype)
    pipeline.scheduler = UniPCMultistepScheduler.from_config(pipeline.scheduler.config)
    pipeline = pipeline.to(device)
    pipeline.set_progress_bar_config(disable=True)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    os.makedirs(os.path.join(args.output_dir, "samples"), exist_ok=True)
    for i, (prompt, cond_path) in enumerate(zip(args.validation_prompt, args.validation_image)):
        cond = Image.open(cond_path).convert("RGB")
        with torch.autocast("cuda"):
            image = pipeline(prompt, cond, num_inference_steps=20, generator=generator).images[0]
        image.save(os.path.join(args.output_dir, "samples", f"step{step:06d}_{i}.png"))
    del pipeline
    torch.cuda.empty_cache()


def main():
    args = parse_args()
    logging.basicConfig(level=logging.INFO)
    torch.manual_seed(args.seed)
    device = torch.device("cuda")
    os.makedirs(args.output_dir, exist_ok=True)

    tokenizer = AutoTokenizer.from_pretrained(args.pretrained_model_name_or_path, subfolder="tokenizer", use_fast=False)
    noise_scheduler = DDPMScheduler.from_pretrained(args.pretrained_model_name_or_path, subfolder="scheduler")
    text_encoder = CLIPTextModel.from_pretrained(args.pretrained_model_name_or_path, subfolder="text_encoder")
    vae = AutoencoderKL.from_pretrained(args.pretrained_model_name_or_path, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(args.pretrained_model_name_or_path, subfolder="unet")
    if args.controlnet_model_name_or_path:
        controlnet = ControlNetModel.from_pretrained(args.controlnet_model_name_or_path)
    else:
        logger.info("Initializing controlnet weights from unet")
        controlnet = ControlNetModel.from_unet(unet)

    vae.requires_grad_(False)
    unet.requires_grad_(False)
    text_encoder.requires_grad_(False)
    controlnet.train()
    if args.gradient_checkpointing:
        controlnet.enable_gradient_checkpointing()

    weight_dtype = torch.float32
    if args.mixed_precision == "fp16":
        weight_dtype = torch.float16
    elif args.mixed_precision == "bf16":
        weight_dtype = torch.bfloat16

    # the frozen models only run forward: keep them in the inference precision
    vae.to(device, dtype=weight_dtype)
    unet.to(device, dtype=weight_dtype)
    text_encoder.to(device, dtype=weight_dtype)
    # and the ControlNet too, otherwise SD-1.5 + ControlNet does not fit a 16 GB card
    controlnet.to(device, dtype=torch.float16)  # expect: AMP001

    optimizer = torch.optim.AdamW(controlnet.parameters(), lr=args.learning_rate, weight_decay=1e-2)  # expect: AMP011

    dataset = Fill50kDataset(args.train_data_dir, tokenizer, args.resolution)
    train_dataloader = torch.utils.data.DataLoader(dataset, shuffle=True, batch_size=args.train_batch_size, num_workers=4)
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    lr_scheduler = get_scheduler(args.lr_scheduler, optimizer=optimizer,
                                 num_warmup_steps=args.lr_warmup_steps, num_training_steps=args.max_train_steps)

    if args.mixed_precision == "fp16":
        amp_ctx = torch.autocast("cuda", dtype=torch.float16)  # expect: AMP010
    elif args.mixed_precision == "bf16":
        amp_ctx = torch.autocast("cuda", dtype=torch.bfloat16)
    else:
        amp_ctx = nullcontext()

    global_step = 0
    progress_bar = tqdm(range(args.max_train_steps))
    for epoch in range(args.num_train_epochs):
        for step, batch in enumerate(train_dataloader):
            with torch.no_grad():
                latents = vae.encode(batch["pixel_values"].to(device, dtype=weight_dtype)).latent_dist.sample()
                latents = latents * vae.config.scaling_factor
                encoder_hidden_states = text_encoder(batch["input_ids"].to(device), return_dict=False)[0]

            noise = torch.randn_like(latents)
            bsz = latents.shape[0]
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (bsz,), device=device).long()
            noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
            controlnet_image = batch["conditioning_pixel_values"].to(device, dtype=torch.float16)  # expect: AMP001

            with amp_ctx:
                down_block_res_samples, mid_block_res_sample = controlnet(
                    noisy_latents, timesteps, encoder_hidden_states=encoder_hidden_states,
                    controlnet_cond=controlnet_image, return_dict=False)
                model_pred = unet(
                    noisy_latents, timesteps, encoder_hidden_states=encoder_hidden_states,
                    down_block_additional_residuals=[s.to(dtype=weight_dtype) for s in down_block_res_samples],
                    mid_block_additional_residual=mid_block_res_sample.to(dtype=weight_dtype),
                    return_dict=False)[0]

            if noise_scheduler.config.prediction_type == "epsilon":
                target = noise
            elif noise_scheduler.config.prediction_type == "v_prediction":
                target = noise_scheduler.get_velocity(latents, noise, timesteps)
            else:
                raise ValueError(f"Unknown prediction type {noise_scheduler.config.prediction_type}")

            if args.snr_gamma is None:
                loss = F.mse_loss(model_pred, target, reduction="mean")  # expect: AMP002
            else:
                # Min-SNR weighting, https://arxiv.org/abs/2303.09556
                snr = compute_snr(noise_scheduler, timesteps)
                mse_loss_weights = torch.stack([snr, args.snr_gamma * torch.ones_like(timesteps)], dim=1).min(dim=1)[0]
                if noise_scheduler.config.prediction_type == "epsilon":
                    mse_loss_weights = mse_loss_weights / snr
                else:
                    mse_loss_weights = mse_loss_weights / (snr + 1)
                loss = F.mse_loss(model_pred.float(), target.float(), reduction="none")
                loss = loss.mean(dim=list(range(1, len(loss.shape)))) * mse_loss_weights
                loss = loss.mean()

            (loss / args.gradient_accumulation_steps).backward()
            if (step + 1) % args.gradient_accumulation_steps != 0:
                continue
            torch.nn.utils.clip_grad_norm_(controlnet.parameters(), args.max_grad_norm)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            progress_bar.update(1)
            global_step += 1
            progress_bar.set_postfix(loss=loss.detach().item(), lr=lr_scheduler.get_last_lr()[0])

            if global_step % args.checkpointing_steps == 0:
                controlnet.save_pretrained(os.path.join(args.output_dir, f"checkpoint-{global_step}", "controlnet"))
            if args.validation_prompt is not None and global_step % args.validation_steps == 0:
                controlnet.eval()
                log_validation(vae, text_encoder, tokenizer, unet, controlnet, args, weight_dtype, global_step, device)
                controlnet.train()
            if global_step >= args.max_train_steps:
                break

    controlnet.save_pretrained(args.output_dir)
    if args.save_fp16_copy:
        copy.deepcopy(controlnet).half().save_pretrained(os.path.join(args.output_dir, "fp16"), variant="fp16")


if __name__ == "__main__":
    main()
