"""DreamBooth fine-tuning of the UNet (no accelerate; plain loop on one 24GB card)."""
import argparse

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from transformers import CLIPTextModel, CLIPTokenizer

from db_data import DreamBoothDataset


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--pretrained", default="stabilityai/stable-diffusion-2-1-base")
    p.add_argument("--instance-dir", required=True)
    p.add_argument("--mixed-precision", default="fp16", choices=["no", "fp16", "bf16"])
    p.add_argument("--lr", type=float, default=5e-6)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--prior-weight", type=float, default=1.0)
    return p.parse_args()


def main():
    args = parse_args()
    device = "cuda"
    weight_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.mixed_precision, torch.float32)
    tokenizer = CLIPTokenizer.from_pretrained(args.pretrained, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(args.pretrained, subfolder="text_encoder")
    vae = AutoencoderKL.from_pretrained(args.pretrained, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(args.pretrained, subfolder="unet")
    noise_scheduler = DDPMScheduler.from_pretrained(args.pretrained, subfolder="scheduler")

    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    vae.to(device, dtype=weight_dtype)
    text_encoder.to(device, dtype=weight_dtype)
    unet.to(device, dtype=torch.float16)  # expect: AMP001
    unet.enable_gradient_checkpointing()

    optimizer = torch.optim.AdamW(unet.parameters(), lr=args.lr, weight_decay=1e-2, eps=1e-8)  # expect: AMP011
    loader = torch.utils.data.DataLoader(DreamBoothDataset(args.instance_dir, tokenizer), batch_size=1, shuffle=True)
    scaler = torch.amp.GradScaler("cuda", enabled=args.mixed_precision == "fp16")

    step = 0
    unet.train()
    while step < args.steps:
        for batch in loader:
            with torch.no_grad():
                latents = vae.encode(batch["pixel_values"].to(device, dtype=weight_dtype)).latent_dist.sample()
                latents = latents * vae.config.scaling_factor
                encoder_hidden_states = text_encoder(batch["input_ids"].to(device))[0]
            noise = torch.randn_like(latents)
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (latents.shape[0],), device=device)
            noisy = noise_scheduler.add_noise(latents, noise, timesteps)
            with torch.autocast("cuda", dtype=weight_dtype, enabled=args.mixed_precision != "no"):
                model_pred = unet(noisy, timesteps, encoder_hidden_states).sample
            pred, prior_pred = model_pred.float().chunk(2)
            target, prior_target = noise.float().chunk(2)
            loss = F.mse_loss(pred, target) + args.prior_weight * F.mse_loss(prior_pred, prior_target)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step >= args.steps:
                break
    unet.save_pretrained("dreambooth-unet")


if __name__ == "__main__":
    main()
