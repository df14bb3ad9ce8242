"""LoRA fine-tuning of a Stable Diffusion UNet on captioned images.

Plain PyTorch loop (no accelerate); low-rank adapters are injected into the UNet's
attention projections and only they are trained. Fits on a single 12 GB card.
"""
import argparse
import math
import os
import random
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from torch.utils.data import DataLoader
from transformers import CLIPTextModel, CLIPTokenizer

from sd_data import CaptionedImages  # local module


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank=4, alpha=4.0):
        super().__init__()
        self.base = base
        self.lora_down = nn.Linear(base.in_features, rank, bias=False)
        self.lora_up = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.lora_down.weight, std=1.0 / rank)
        nn.init.zeros_(self.lora_up.weight)
        self.scale = alpha / rank

    def forward(self, x):
        return self.base(x) + self.lora_up(self.lora_down(x)) * self.scale


def inject_lora(unet, rank, alpha, targets=("to_q", "to_k", "to_v", "to_out.0")):
    for p in unet.parameters():
        p.requires_grad_(False)
    replaced = 0
    for name, module in list(unet.named_modules()):
        for t in targets:
            child_name = t.split(".")[-1]
            owner_path = name + ("." + t.rsplit(".", 1)[0] if "." in t else "")
            if not name.endswith(("attn1", "attn2")):
                continue
            owner = unet.get_submodule(owner_path)
            child = getattr(owner, child_name) if not child_name.isdigit() else owner[int(child_name)]
            if isinstance(child, nn.Linear):
                lora = LoRALinear(child, rank, alpha)
                if child_name.isdigit():
                    owner[int(child_name)] = lora
                else:
                    setattr(owner, child_name, lora)
                replaced += 1
    return replaced


def compute_snr(noise_scheduler, timesteps):
    alphas_cumprod = noise_scheduler.alphas_cumprod.to(timesteps.device)
    sqrt_alpha = alphas_cumprod[timesteps] ** 0.5
    sqrt_one_minus = (1.0 - alphas_cumprod[timesteps]) ** 0.5
    return (sqrt_alpha / sqrt_one_minus) ** 2


def lora_state_dict(unet):
    return {k: v for k, v in unet.state_dict().items() if "lora_" in k}


def save_lora_weights(unet, path):
    torch.save({k: v.detach().to("cpu", dtype=torch.float16) for k, v in lora_state_dict(unet).items()}, path)


@torch.no_grad()
def log_validation(unet, vae, text_encoder, tokenizer, scheduler, prompts, device, steps=30, seed=0):
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None)
    pipe.set_progress_bar_config(disable=True)
    generator = torch.Generator(device=device).manual_seed(seed)
    return [pipe(p, num_inference_steps=steps, generator=generator).images[0] for p in prompts]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--pretrained", default="runwayml/stable-diffusion-v1-5")
    p.add_argument("--data-dir", required=True)
    p.add_argument("--output-dir", default="runs/sd_lora")
    p.add_argument("--resolution", type=int, default=512)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=8.0)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=1e-2)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--max-train-steps", type=int, default=8000)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--snr-gamma", type=float, default=None)
    p.add_argument("--noise-offset", type=float, default=0.0)
    p.add_argument("--mixed-precision", choices=["no", "fp16"], default="fp16")
    p.add_argument("--validation-prompts", nargs="*", default=["a photo of sks dog in a bucket"])
    p.add_argument("--validation-every", type=int, default=1000)
    p.add_argument("--seed", type=int, default=1337)
    return p.parse_args()


def train(args):
    device = torch.device("cuda")
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    weight_dtype = torch.float16 if args.mixed_precision == "fp16" else torch.float32

    tokenizer = CLIPTokenizer.from_pretrained(args.pretrained, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(args.pretrained, subfolder="text_encoder")
    vae = AutoencoderKL.from_pretrained(args.pretrained, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(args.pretrained, subfolder="unet")
    noise_scheduler = DDPMScheduler.from_pretrained(args.pretrained, subfolder="scheduler")

    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    vae.to(device, dtype=weight_dtype).eval()
    text_encoder.to(device, dtype=torch.float16).eval()

    n = inject_lora(unet, args.rank, args.alpha)
    print(f"injected {n} LoRA adapters")
    unet = unet.to(device).half()  # expect: AMP001
    unet.enable_gradient_checkpointing()
    unet.train()

    lora_params = [p for name, p in unet.named_parameters() if "lora_" in name]
    for p in lora_params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW([{"params": lora_params, "weight_decay": args.weight_decay}], lr=args.lr)  # expect: AMP011
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 500))

    dataset = CaptionedImages(args.data_dir, tokenizer, size=args.resolution, center_crop=False)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=4, drop_last=True)
    ctx = torch.autocast("cuda", dtype=torch.float16) if args.mixed_precision == "fp16" else nullcontext()  # expect: AMP010

    global_step, micro_step = 0, 0
    epochs = math.ceil(args.max_train_steps * args.grad_accum / len(loader))
    for epoch in range(epochs):
        for batch in loader:
            with torch.no_grad():
                pixels = batch["pixel_values"].to(device, dtype=weight_dtype)
                latents = vae.encode(pixels).latent_dist.sample() * vae.config.scaling_factor
                encoder_hidden_states = text_encoder(batch["input_ids"].to(device))[0]
            noise = torch.randn_like(latents)
            if args.noise_offset:
                noise += args.noise_offset * torch.randn(latents.shape[0], latents.shape[1], 1, 1, device=device)
            bsz = latents.shape[0]
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (bsz,), device=device).long()
            noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
            if noise_scheduler.config.prediction_type == "v_prediction":
                target = noise_scheduler.get_velocity(latents, noise, timesteps)
            else:
                target = noise

            with ctx:
                model_pred = unet(noisy_latents, timesteps, encoder_hidden_states).sample

            if args.snr_gamma is None:
                loss = F.mse_loss(model_pred, target)  # expect: AMP002
            else:
                snr = compute_snr(noise_scheduler, timesteps)
                weights = torch.stack([snr, args.snr_gamma * torch.ones_like(timesteps)], dim=1).min(dim=1)[0] / snr
                loss = F.mse_loss(model_pred.float(), target.float(), reduction="none")
                loss = (loss.mean(dim=list(range(1, loss.ndim))) * weights).mean()

            (loss / args.grad_accum).backward()
            micro_step += 1
            if micro_step % args.grad_accum != 0:
                continue
            grad_norm = torch.nn.utils.clip_grad_norm_(lora_params, args.max_grad_norm)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1

            if global_step % 50 == 0:
                print(f"epoch {epoch} step {global_step} loss {loss.item():.4f} gnorm {float(grad_norm):.3f}")
            if global_step % args.validation_every == 0:
                unet.eval()
                images = log_validation(unet, vae, text_encoder, tokenizer, noise_scheduler,
                                        args.validation_prompts, device)
                for i, im in enumerate(images):
                    im.save(os.path.join(args.output_dir, f"val_{global_step:06d}_{i}.png"))
                unet.train()
                save_lora_weights(unet, os.path.join(args.output_dir, f"lora_{global_step:06d}.pt"))
            if global_step >= args.max_train_steps:
                save_lora_weights(unet, os.path.join(args.output_dir, "lora_final.pt"))
                return


if __name__ == "__main__":
    a = parse_args()
    os.makedirs(a.output_dir, exist_ok=True)
    train(a)
