#!/usr/bin/env python
# coding=utf-8
"""DreamBooth / LoRA fine-tuning for Stable Diffusion.

The VAE, the text encoder and (in LoRA mode) the UNet are frozen and kept in half
precision to save memory; only the LoRA network is trained, in fp32, under
accelerate's mixed precision.  ``--full_unet`` switches to classic DreamBooth where
the UNet itself is trained.
"""

import argparse
import itertools
import logging
import math
import os
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from diffusers.optimization import get_scheduler
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms
from transformers import CLIPTextModel, CLIPTokenizer

logger = logging.getLogger(__name__)


class LoRAModule(nn.Module):
    """Low-rank adapter that takes over the forward of a frozen Linear layer."""

    def __init__(self, name, org_module, rank=4, alpha=1.0):
        super().__init__()
        self.lora_name = name
        self.lora_down = nn.Linear(org_module.in_features, rank, bias=False)
        self.lora_up = nn.Linear(rank, org_module.out_features, bias=False)
        self.scale = alpha / rank
        nn.init.kaiming_uniform_(self.lora_down.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_up.weight)
        # kept in a list so the frozen layer is not registered as a child of the network
        self.org_module = [org_module]
        self.org_forward = None

    def apply_to(self):
        self.org_forward = self.org_module[0].forward
        self.org_module[0].forward = self.forward

    def forward(self, x):
        down = self.lora_down(x.to(self.lora_down.weight.dtype))
        return self.org_forward(x) + (self.lora_up(down) * self.scale).to(x.dtype)


class LoRANetwork(nn.Module):
    TARGETS = ("to_q", "to_k", "to_v", "to_out.0")

    def __init__(self, unet, rank=4, alpha=1.0):
        super().__init__()
        loras = []
        for name, module in unet.named_modules():
            if isinstance(module, nn.Linear) and name.endswith(self.TARGETS):
                loras.append(LoRAModule("lora_unet_" + name.replace(".", "_"), module, rank, alpha))
        self.unet_loras = nn.ModuleList(loras)
        logger.info("created %d LoRA modules for the UNet", len(loras))

    def apply_to(self):
        for lora in self.unet_loras:
            lora.apply_to()

    def save_weights(self, path, dtype=None):
        state = self.state_dict()
        if dtype is not None:
            state = {k: v.detach().clone().cpu().to(dtype) for k, v in state.items()}
        torch.save(state, path)


class DreamBoothDataset(Dataset):
    def __init__(self, instance_root, instance_prompt, tokenizer, size=512, class_root=None, class_prompt=None):
        self.instance_images = sorted(p for p in Path(instance_root).iterdir() if p.suffix in {".jpg", ".png"})
        self.class_images = sorted(Path(class_root).iterdir()) if class_root else []
        self.instance_prompt = instance_prompt
        self.class_prompt = class_prompt
        self.tokenizer = tokenizer
        self.length = max(len(self.instance_images), len(self.class_images))
        self.transform = transforms.Compose([
            transforms.Resize(size, interpolation=transforms.InterpolationMode.BILINEAR),
            transforms.CenterCrop(size),
            transforms.ToTensor(),
            transforms.Normalize([0.5], [0.5]),
        ])

    def __len__(self):
        return self.length

    def _tokens(self, prompt):
        return self.tokenizer(prompt, padding="max_length", truncation=True,
                              max_length=self.tokenizer.model_max_length, return_tensors="pt").input_ids[0]

    def __getitem__(self, index):
        image = Image.open(self.instance_images[index % len(self.instance_images)]).convert("RGB")
        example = {"pixel_values": self.transform(image), "input_ids": self._tokens(self.instance_prompt)}
        if self.class_images:
            class_image = Image.open(self.class_images[index % len(self.class_images)]).convert("RGB")
            example["class_pixel_values"] = self.transform(class_image)
            example["class_input_ids"] = self._tokens(self.class_prompt)
        return example


def collate_fn(examples, with_prior_preservation=False):
    pixel_values = [e["pixel_values"] for e in examples]
    input_ids = [e["input_ids"] for e in examples]
    if with_prior_preservation:
        pixel_values += [e["class_pixel_values"] for e in examples]
        input_ids += [e["class_input_ids"] for e in examples]
    pixel_values = torch.stack(pixel_values).to(memory_format=torch.contiguous_format)
    return {"pixel_values": pixel_values, "input_ids": torch.stack(input_ids)}


def load_components(args):
    path = args.pretrained_model_name_or_path
    tokenizer = CLIPTokenizer.from_pretrained(path, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(path, subfolder="text_encoder")
    vae = AutoencoderKL.from_pretrained(path, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(path, subfolder="unet")
    noise_scheduler = DDPMScheduler.from_pretrained(path, subfolder="scheduler")
    return tokenizer, text_encoder, vae, unet, noise_scheduler


def diffusion_target(noise_scheduler, latents, noise, timesteps):
    if noise_scheduler.config.prediction_type == "epsilon":
        return noise
    return noise_scheduler.get_velocity(latents, noise, timesteps)


def generate_validation_images(args, accelerator, vae, text_encoder, tokenizer, unet, epoch):
    pipeline = StableDiffusionPipeline.from_pretrained(
        args.pretrained_model_name_or_path, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
        unet=unet, safety_checker=None, torch_dtype=torch.float16,
    )
    pipeline = pipeline.to(accelerator.device)
    pipeline.set_progress_bar_config(disable=True)
    generator = torch.Generator(device=accelerator.device).manual_seed(args.seed)
    latents = torch.randn((args.num_validation_images, 4, 64, 64), generator=generator,
                          device=accelerator.device, dtype=torch.float16)
    with torch.autocast("cuda", dtype=torch.float16):
        images = pipeline([args.validation_prompt] * args.num_validation_images, latents=latents,
                          num_inference_steps=25).images
    for i, image in enumerate(images):
        image.save(os.path.join(args.output_dir, f"validation-{epoch:04d}-{i}.png"))
    del pipeline
    torch.cuda.empty_cache()


def train_lora(args):
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps,
                              mixed_precision=args.mixed_precision, project_dir=args.output_dir)
    set_seed(args.seed)
    tokenizer, text_encoder, vae, unet, noise_scheduler = load_components(args)

    # everything except the LoRA network is frozen and stored in half precision
    for frozen in (vae, text_encoder, unet):
        frozen.requires_grad_(False)
        frozen.eval()
        frozen.to(accelerator.device, dtype=torch.float16)
    if args.upcast_vae:
        vae.to(dtype=torch.float32)  # the SD-2 VAE overflows in fp16 at 768px

    network = LoRANetwork(unet, rank=args.rank, alpha=args.network_alpha)
    network.apply_to()
    network.to(accelerator.device)
    if args.gradient_checkpointing:
        unet.enable_gradient_checkpointing()

    optimizer = torch.optim.AdamW(network.parameters(), lr=args.learning_rate,
                                  betas=(args.adam_beta1, args.adam_beta2), weight_decay=args.adam_weight_decay)
    dataset = DreamBoothDataset(args.instance_data_dir, args.instance_prompt, tokenizer, args.resolution,
                                args.class_data_dir, args.class_prompt)
    loader = DataLoader(dataset, batch_size=args.train_batch_size, shuffle=True, num_workers=4,
                        collate_fn=lambda ex: collate_fn(ex, args.with_prior_preservation))
    steps_per_epoch = math.ceil(len(loader) / args.gradient_accumulation_steps)
    lr_scheduler = get_scheduler(args.lr_scheduler, optimizer=optimizer, num_warmup_steps=args.lr_warmup_steps,
                                 num_training_steps=args.num_train_epochs * steps_per_epoch)
    network, optimizer, loader, lr_scheduler = accelerator.prepare(network, optimizer, loader, lr_scheduler)

    global_step = 0
    for epoch in range(args.num_train_epochs):
        network.train()
        for batch in loader:
            with accelerator.accumulate(network):
                with torch.no_grad():
                    pixel_values = batch["pixel_values"].to(accelerator.device, dtype=torch.float16)
                    latents = vae.encode(pixel_values).latent_dist.sample() * vae.config.scaling_factor
                    encoder_hidden_states = text_encoder(batch["input_ids"])[0]

                noise = torch.randn_like(latents)
                if args.noise_offset:
                    noise += args.noise_offset * torch.randn((latents.shape[0], latents.shape[1], 1, 1),
                                                             device=latents.device, dtype=latents.dtype)
                timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (latents.shape[0],),
                                          device=latents.device).long()
                noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
                noisy_latents = noisy_latents.to(dtype=torch.float16)  # expect: AMP001
                with accelerator.autocast():
                    model_pred = unet(noisy_latents, timesteps, encoder_hidden_states).sample
                    target = diffusion_target(noise_scheduler, latents, noise, timesteps)
                    if args.with_prior_preservation:
                        model_pred, model_pred_prior = torch.chunk(model_pred, 2, dim=0)
                        target, target_prior = torch.chunk(target, 2, dim=0)
                        loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
                        prior_loss = F.mse_loss(model_pred_prior.float(), target_prior.float(), reduction="mean")
                        loss = loss + args.prior_loss_weight * prior_loss
                    else:
                        loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")

                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(network.parameters(), args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)

            if accelerator.sync_gradients:
                global_step += 1
                if accelerator.is_main_process and global_step % args.checkpointing_steps == 0:
                    save_dir = os.path.join(args.output_dir, f"checkpoint-{global_step}")
                    accelerator.save_state(save_dir)
                    unwrapped = accelerator.unwrap_model(network)
                    torch.save({k: v.half() for k, v in unwrapped.state_dict().items()}, os.path.join(save_dir, "lora.pt"))
            accelerator.log({"loss": loss.detach().item(), "lr": lr_scheduler.get_last_lr()[0]}, step=global_step)

        if accelerator.is_main_process and args.validation_prompt and epoch % args.validation_epochs == 0:
            generate_validation_images(args, accelerator, vae, text_encoder, tokenizer, unet, epoch)

    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        accelerator.unwrap_model(network).save_weights(os.path.join(args.output_dir, "pytorch_lora_weights.pt"),
                                                       dtype=torch.float16)
    accelerator.end_training()


def finetune_unet(args):
    """Classic DreamBooth: the whole UNet is trained (needs about 24 GB)."""
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps,
                              mixed_precision=args.mixed_precision, project_dir=args.output_dir)
    set_seed(args.seed)
    tokenizer, text_encoder, vae, unet, noise_scheduler = load_components(args)
    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    vae.half()
    text_encoder.half()
    unet = unet.half()  # expect: AMP001
    unet.enable_gradient_checkpointing()
    unet.train()
    vae.to(accelerator.device)
    text_encoder.to(accelerator.device)

    optimizer = torch.optim.AdamW(unet.parameters(), lr=args.learning_rate, weight_decay=args.adam_weight_decay)  # expect: AMP011
    dataset = DreamBoothDataset(args.instance_data_dir, args.instance_prompt, tokenizer, args.resolution)
    loader = DataLoader(dataset, batch_size=args.train_batch_size, shuffle=True, collate_fn=collate_fn)
    unet, optimizer, loader = accelerator.prepare(unet, optimizer, loader)

    for epoch in range(args.num_train_epochs):
        for batch in loader:
            with accelerator.accumulate(unet):
                with torch.no_grad():
                    latents = vae.encode(batch["pixel_values"].half()).latent_dist.sample()
                    latents = latents * vae.config.scaling_factor
                    encoder_hidden_states = text_encoder(batch["input_ids"])[0]
                noise = torch.randn_like(latents)
                timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (latents.shape[0],),
                                          device=latents.device)
                noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
                with accelerator.autocast():
                    model_pred = unet(noisy_latents, timesteps, encoder_hidden_states).sample
                    target = diffusion_target(noise_scheduler, latents, noise, timesteps)
                    loss = F.mse_loss(model_pred.float(), target.float())
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(unet.parameters(), args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

    if accelerator.is_main_process:
        pipeline = StableDiffusionPipeline.from_pretrained(
            args.pretrained_model_name_or_path, unet=accelerator.unwrap_model(unet), text_encoder=text_encoder)
        pipeline.save_pretrained(args.output_dir)


def export_lora_for_webui(lora_path, out_path):
    """Rename keys to the kohya/webui convention and store the weights in fp16."""
    state = torch.load(lora_path, map_location="cpu")
    converted = {}
    for key, value in state.items():
        name = key.replace("unet_loras.", "lora_unet.")
        converted[name] = value.to(torch.float16)
    torch.save(converted, out_path)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--pretrained_model_name_or_path", required=True)
    p.add_argument("--instance_data_dir", required=True)
    p.add_argument("--instance_prompt", required=True)
    p.add_argument("--class_data_dir")
    p.add_argument("--class_prompt")
    p.add_argument("--with_prior_preservation", action="store_true")
    p.add_argument("--prior_loss_weight", type=float, default=1.0)
    p.add_argument("--output_dir", default="lora-dreambooth")
    p.add_argument("--resolution", type=int, default=512)
    p.add_argument("--train_batch_size", type=int, default=1)
    p.add_argument("--num_train_epochs", type=int, default=100)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--learning_rate", type=float, default=1e-4)
    p.add_argument("--lr_scheduler", default="constant")
    p.add_argument("--lr_warmup_steps", type=int, default=0)
    p.add_argument("--adam_beta1", type=float, default=0.9)
    p.add_argument("--adam_beta2", type=float, default=0.999)
    p.add_argument("--adam_weight_decay", type=float, default=1e-2)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--network_alpha", type=float, default=1.0)
    p.add_argument("--noise_offset", type=float, default=0.0)
    p.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default="fp16")
    p.add_argument("--upcast_vae", action="store_true")
    p.add_argument("--validation_prompt")
    p.add_argument("--num_validation_images", type=int, default=4)
    p.add_argument("--validation_epochs", type=int, default=50)
    p.add_argument("--checkpointing_steps", type=int, default=500)
    p.add_argument("--full_unet", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


if __name__ == "__main__":
    cli_args = parse_args()
    os.makedirs(cli_args.output_dir, exist_ok=True)
    if cli_args.full_unet:
        finetune_unet(cli_args)
    else:
        train_lora(cli_args)
