"""Masked latent-diffusion training (inpainting prior).

Two back ends: `--backend accelerate` (multi-GPU, used for the paper runs) and
`--backend native`, a single-GPU loop without accelerate that we use on the
shared cluster where accelerate's launcher is not available.
"""
import argparse
import logging
import math
import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DModel
from diffusers.optimization import get_scheduler
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from data import MaskedImageDataset, collate_masked
from text_encoders import build_text_encoder, caption_loader

logger = logging.getLogger(__name__)


def unwrap_model(model):
    return model.module if hasattr(model, "module") else model


def masked_mse_loss(pred, target, mask):
    err = (pred - target) ** 2
    err = err * mask
    return err.sum() / mask.sum().clamp(min=1.0)


def clip_gradients(parameters, max_norm):
    params = [p for p in parameters if p.grad is not None]
    if not params or max_norm <= 0:
        return None
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def encode_latents(vae, pixel_values):
    with torch.no_grad():
        latents = vae.encode(pixel_values).latent_dist.sample()
    return latents * vae.config.scaling_factor


def add_noise(noise_scheduler, latents):
    noise = torch.randn_like(latents)
    bsz = latents.shape[0]
    timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (bsz,), device=latents.device)
    return noise_scheduler.add_noise(latents, noise, timesteps), noise, timesteps.long()


def train_accelerate(args, unet, vae, noise_scheduler, dataset):
    accelerator = Accelerator(mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=args.gradient_accumulation_steps,
                              log_with="tensorboard", project_dir=args.output_dir)
    weight_dtype = torch.float32
    if accelerator.mixed_precision == "fp16":
        weight_dtype = torch.float16
    elif accelerator.mixed_precision == "bf16":
        weight_dtype = torch.bfloat16
    vae.requires_grad_(False)
    vae.to(accelerator.device, dtype=weight_dtype)

    optimizer = torch.optim.AdamW(unet.parameters(), lr=args.lr, betas=(0.9, 0.999),
                                  weight_decay=args.weight_decay, eps=1e-8)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, collate_fn=collate_masked,
                        num_workers=args.num_workers)
    lr_scheduler = get_scheduler("cosine", optimizer=optimizer, num_warmup_steps=args.warmup_steps,
                                 num_training_steps=args.max_train_steps)
    unet, optimizer, loader, lr_scheduler = accelerator.prepare(unet, optimizer, loader, lr_scheduler)

    global_step = 0
    progress = tqdm(range(args.max_train_steps), disable=not accelerator.is_local_main_process)
    while global_step < args.max_train_steps:
        unet.train()
        for batch in loader:
            with accelerator.accumulate(unet):
                latents = encode_latents(vae, batch["pixel_values"].to(weight_dtype))
                noisy, noise, timesteps = add_noise(noise_scheduler, latents)
                mask = F.interpolate(batch["mask"], size=latents.shape[-2:], mode="nearest")
                with accelerator.autocast():
                    model_pred = unet(noisy, timesteps).sample
                    loss = masked_mse_loss(model_pred.float(), noise.float(), mask)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(unet.parameters(), args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            if accelerator.sync_gradients:
                global_step += 1
                progress.update(1)
                accelerator.log({"loss": loss.detach().item(), "lr": lr_scheduler.get_last_lr()[0]}, step=global_step)
            if global_step >= args.max_train_steps:
                break
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        unwrap_model(unet).save_pretrained(os.path.join(args.output_dir, "unet"))
    accelerator.end_training()


def train_native(args, unet, vae, noise_scheduler, dataset):
    device = torch.device("cuda")
    unet.to(device)
    vae.to(device).requires_grad_(False)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, collate_fn=collate_masked,
                        num_workers=args.num_workers, drop_last=True)
    lr_scheduler = get_scheduler("cosine", optimizer=optimizer, num_warmup_steps=args.warmup_steps,
                                 num_training_steps=args.max_train_steps)
    scaler = torch.amp.GradScaler("cuda")

    global_step = 0
    unet.train()
    for epoch in range(math.ceil(args.max_train_steps * args.gradient_accumulation_steps / len(loader))):
        for step, batch in enumerate(loader):
            latents = encode_latents(vae, batch["pixel_values"].to(device, non_blocking=True))
            latents = latents.to(device, dtype=torch.float16)  # expect: AMP001
            noisy, noise, timesteps = add_noise(noise_scheduler, latents)
            mask = F.interpolate(batch["mask"].to(device), size=latents.shape[-2:], mode="nearest")

            with torch.autocast("cuda", dtype=torch.float16):
                noise_pred = unet(noisy, timesteps).sample
            loss = masked_mse_loss(noise_pred, noise, mask)  # expect: AMP002
            scaler.scale(loss / args.gradient_accumulation_steps).backward()

            if (step + 1) % args.gradient_accumulation_steps != 0:
                continue
            grad_norm = clip_gradients(unet.parameters(), args.max_grad_norm)  # expect: AMP005
            scaler.step(optimizer)  # expect: AMP006
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1

            if global_step % args.log_every == 0:
                logger.info("step %d loss %.4f grad_norm %s scale %.0f", global_step, loss.item(),
                            None if grad_norm is None else f"{grad_norm.item():.3f}", scaler.get_scale())
            if global_step % args.checkpoint_every == 0:
                torch.save({"unet": unet.state_dict(), "optimizer": optimizer.state_dict(),
                            "scaler": scaler.state_dict(), "step": global_step},
                           os.path.join(args.output_dir, f"ckpt-{global_step}.pt"))
            if global_step >= args.max_train_steps:
                return


def finetune_bf16(args, unet, vae, noise_scheduler, dataset):
    """Short high-resolution finetune on A100s, bf16 autocast."""
    device = torch.device("cuda")
    unet.to(device)
    vae.to(device).requires_grad_(False)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=args.lr * 0.1, weight_decay=args.weight_decay)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, collate_fn=collate_masked)
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010

    unet.train()
    for step, batch in enumerate(loader):
        latents = encode_latents(vae, batch["pixel_values"].to(device))
        noisy, noise, timesteps = add_noise(noise_scheduler, latents)
        mask = F.interpolate(batch["mask"].to(device), size=latents.shape[-2:], mode="nearest")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            noise_pred = unet(noisy, timesteps).sample
            loss = masked_mse_loss(noise_pred.float(), noise, mask)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        clip_gradients(unet.parameters(), args.max_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        if step + 1 >= args.finetune_steps:
            break


def train_text_encoder_warmup(args, text_encoder, device):
    """Warm up the caption encoder's new projection layer before joint training."""
    text_encoder.to(device).train()
    optimizer = torch.optim.AdamW([p for p in text_encoder.parameters() if p.requires_grad], lr=args.te_lr)
    for step, batch in enumerate(caption_loader(args)):
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
            out = text_encoder(**batch)
            loss = out.loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step + 1 >= args.te_warmup_steps:
            break


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--backend", choices=["accelerate", "native"], default="accelerate")
    p.add_argument("--mixed-precision", default="fp16", choices=["no", "fp16", "bf16"])
    p.add_argument("--data-dir", required=True)
    p.add_argument("--output-dir", default="out")
    p.add_argument("--resolution", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--num-workers", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--te-lr", type=float, default=5e-5)
    p.add_argument("--weight-decay", type=float, default=1e-2)
    p.add_argument("--warmup-steps", type=int, default=500)
    p.add_argument("--max-train-steps", type=int, default=100_000)
    p.add_argument("--finetune-steps", type=int, default=0)
    p.add_argument("--te-warmup-steps", type=int, default=0)
    p.add_argument("--gradient-accumulation-steps", type=int, default=1)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--checkpoint-every", type=int, default=5000)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main():
    args = parse_args()
    set_seed(args.seed)
    os.makedirs(args.output_dir, exist_ok=True)
    vae = AutoencoderKL.from_pretrained("stabilityai/sd-vae-ft-mse")
    unet = UNet2DModel(sample_size=args.resolution // 8, in_channels=4, out_channels=4,
                       block_out_channels=(128, 256, 512, 512))
    noise_scheduler = DDPMScheduler(num_train_timesteps=1000)
    dataset = MaskedImageDataset(args.data_dir, resolution=args.resolution)

    if args.te_warmup_steps > 0:
        train_text_encoder_warmup(args, build_text_encoder(), torch.device("cuda"))
    if args.backend == "accelerate":
        train_accelerate(args, unet, vae, noise_scheduler, dataset)
    else:
        train_native(args, unet, vae, noise_scheduler, dataset)
    if args.finetune_steps > 0:
        finetune_bf16(args, unet, vae, noise_scheduler, dataset)


if __name__ == "__main__":
    main()
