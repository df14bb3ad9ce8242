#!/usr/bin/env python
"""Textual inversion for Stable Diffusion (condensed from the diffusers example)."""
import argparse
import math
import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from diffusers import AutoencoderKL, DDPMScheduler, DiffusionPipeline, UNet2DConditionModel
from diffusers.optimization import get_scheduler
from transformers import CLIPTextModel, CLIPTokenizer

from ti_dataset import TextualInversionDataset  # local


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--pretrained_model_name_or_path", required=True)
    p.add_argument("--train_data_dir", required=True)
    p.add_argument("--placeholder_token", default="<cat-toy>")
    p.add_argument("--initializer_token", default="toy")
    p.add_argument("--num_vectors", type=int, default=1)
    p.add_argument("--output_dir", default="text-inversion-model")
    p.add_argument("--train_batch_size", type=int, default=4)
    p.add_argument("--max_train_steps", type=int, default=3000)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--learning_rate", type=float, default=5e-4)
    p.add_argument("--adam_weight_decay", type=float, default=1e-2)
    p.add_argument("--mixed_precision", default="fp16", choices=["no", "fp16", "bf16"])
    p.add_argument("--validation_prompt", default=None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def log_validation(text_encoder, tokenizer, unet, vae, args, accelerator, weight_dtype):
    pipeline = DiffusionPipeline.from_pretrained(
        args.pretrained_model_name_or_path, text_encoder=accelerator.unwrap_model(text_encoder),
        tokenizer=tokenizer, unet=unet, vae=vae, safety_checker=None, torch_dtype=weight_dtype,
    ).to(accelerator.device)
    generator = torch.Generator(device=accelerator.device).manual_seed(args.seed)
    images = []
    for _ in range(4):
        with torch.autocast("cuda"):
            images.append(pipeline(args.validation_prompt, num_inference_steps=25, generator=generator).images[0])
    del pipeline
    torch.cuda.empty_cache()
    return images


def main():
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps, mixed_precision=args.mixed_precision)
    set_seed(args.seed)
    tokenizer = CLIPTokenizer.from_pretrained(args.pretrained_model_name_or_path, subfolder="tokenizer")
    noise_scheduler = DDPMScheduler.from_pretrained(args.pretrained_model_name_or_path, subfolder="scheduler")
    text_encoder = CLIPTextModel.from_pretrained(args.pretrained_model_name_or_path, subfolder="text_encoder")
    vae = AutoencoderKL.from_pretrained(args.pretrained_model_name_or_path, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(args.pretrained_model_name_or_path, subfolder="unet")

    placeholder_tokens = [args.placeholder_token] + [f"{args.placeholder_token}_{i}" for i in range(1, args.num_vectors)]
    tokenizer.add_tokens(placeholder_tokens)
    initializer_token_id = tokenizer.encode(args.initializer_token, add_special_tokens=False)[0]
    placeholder_token_ids = tokenizer.convert_tokens_to_ids(placeholder_tokens)
    text_encoder.resize_token_embeddings(len(tokenizer))
    token_embeds = text_encoder.get_input_embeddings().weight.data
    with torch.no_grad():
        for token_id in placeholder_token_ids:
            token_embeds[token_id] = token_embeds[initializer_token_id].clone()

    vae.requires_grad_(False)
    unet.requires_grad_(False)
    text_encoder.text_model.encoder.requires_grad_(False)
    text_encoder.text_model.final_layer_norm.requires_grad_(False)
    text_encoder.text_model.embeddings.position_embedding.requires_grad_(False)
    # keep the CLIP text tower small in memory; only the new token rows are trained anyway
    text_encoder.to(accelerator.device, dtype=torch.float16)  # expect: AMP001

    optimizer = torch.optim.AdamW(text_encoder.get_input_embeddings().parameters(), lr=args.learning_rate, weight_decay=args.adam_weight_decay, eps=1e-08)  # expect: AMP011

    train_dataset = TextualInversionDataset(args.train_data_dir, tokenizer, size=512, placeholder_token=" ".join(placeholder_tokens))
    train_dataloader = torch.utils.data.DataLoader(train_dataset, batch_size=args.train_batch_size, shuffle=True)
    lr_scheduler = get_scheduler("constant", optimizer=optimizer, num_warmup_steps=0, num_training_steps=args.max_train_steps)
    text_encoder, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(text_encoder, optimizer, train_dataloader, lr_scheduler)

    weight_dtype = torch.float32
    if accelerator.mixed_precision == "fp16":
        weight_dtype = torch.float16
    elif accelerator.mixed_precision == "bf16":
        weight_dtype = torch.bfloat16
    unet.to(accelerator.device, dtype=weight_dtype)
    vae.to(accelerator.device, dtype=weight_dtype)

    orig_embeds_params = accelerator.unwrap_model(text_encoder).get_input_embeddings().weight.data.clone()
    num_epochs = math.ceil(args.max_train_steps / len(train_dataloader))
    global_step = 0
    for epoch in range(num_epochs):
        text_encoder.train()
        for step, batch in enumerate(train_dataloader):
            with accelerator.accumulate(text_encoder):
                latents = vae.encode(batch["pixel_values"].to(dtype=weight_dtype)).latent_dist.sample().detach()
                latents = latents * vae.config.scaling_factor
                noise = torch.randn_like(latents)
                timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (latents.shape[0],), device=latents.device).long()
                noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
                encoder_hidden_states = text_encoder(batch["input_ids"])[0].to(dtype=weight_dtype)
                model_pred = unet(noisy_latents, timesteps, encoder_hidden_states).sample
                if noise_scheduler.config.prediction_type == "epsilon":
                    target = noise
                else:
                    target = noise_scheduler.get_velocity(latents, noise, timesteps)
                loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()

                # let only the placeholder embeddings move
                index_no_updates = torch.ones((len(tokenizer),), dtype=torch.bool)
                index_no_updates[min(placeholder_token_ids): max(placeholder_token_ids) + 1] = False
                with torch.no_grad():
                    accelerator.unwrap_model(text_encoder).get_input_embeddings().weight[index_no_updates] = orig_embeds_params[index_no_updates]

            if accelerator.sync_gradients:
                global_step += 1
                if args.validation_prompt and global_step % 500 == 0:
                    log_validation(text_encoder, tokenizer, unet, vae, args, accelerator, weight_dtype)
            if global_step >= args.max_train_steps:
                break

    if accelerator.is_main_process:
        learned = accelerator.unwrap_model(text_encoder).get_input_embeddings().weight[min(placeholder_token_ids): max(placeholder_token_ids) + 1]
        torch.save({args.placeholder_token: learned.detach().cpu()}, os.path.join(args.output_dir, "learned_embeds.bin"))
    accelerator.end_training()


if __name__ == "__main__":
    main()
