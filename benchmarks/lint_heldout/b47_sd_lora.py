"""LoRA fine-tuning of the Stable Diffusion UNet (text-to-image and DreamBooth).

The VAE, the text encoder and the base UNet weights are frozen and kept in the
weight dtype of the run; only the LoRA matrices train, in fp32 master weights.
"""
import argparse
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from transformers import CLIPTextModel, CLIPTokenizer


class LoRALinear(nn.Module):
    def __init__(self, base, rank=4, alpha=4.0):
        super().__init__()
        self.base = base
        self.lora_down = nn.Linear(base.in_features, rank, bias=False)
        self.lora_up = nn.Linear(rank, base.out_features, bias=False)
        self.scale = alpha / rank
        nn.init.normal_(self.lora_down.weight, std=1.0 / rank)
        nn.init.zeros_(self.lora_up.weight)

    def forward(self, x):
        lora_dtype = self.lora_down.weight.dtype
        delta = self.lora_up(self.lora_down(x.to(lora_dtype)))
        return self.base(x) + delta.to(x.dtype) * self.scale


def inject_lora(unet, rank, alpha, targets=("to_q", "to_k", "to_v")):
    replaced = 0
    for parent in list(unet.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and name in targets:
                setattr(parent, name, LoRALinear(child, rank, alpha))
                replaced += 1
    return replaced


def weight_dtype_for(precision):
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision, torch.float32)


def load_models(args, device):
    tokenizer = CLIPTokenizer.from_pretrained(args.model, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(args.model, subfolder="text_encoder")
    vae = AutoencoderKL.from_pretrained(args.model, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(args.model, subfolder="unet")
    noise_scheduler = DDPMScheduler.from_pretrained(args.model, subfolder="scheduler")
    weight_dtype = weight_dtype_for(args.mixed_precision)
    for frozen in (vae, text_encoder, unet):
        frozen.requires_grad_(False)
    vae.to(device, dtype=weight_dtype)
    text_encoder.to(device, dtype=weight_dtype)
    unet.to(device, dtype=weight_dtype)
    inject_lora(unet, args.rank, args.alpha)
    unet.to(device)
    for p in unet.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return tokenizer, text_encoder, vae, unet, noise_scheduler, weight_dtype


def compute_snr(noise_scheduler, timesteps):
    alphas_cumprod = noise_scheduler.alphas_cumprod.to(timesteps.device, dtype=torch.float32)
    alpha = alphas_cumprod[timesteps] ** 0.5
    sigma = (1.0 - alphas_cumprod[timesteps]) ** 0.5
    return (alpha / sigma) ** 2


def diffusion_targets(batch, text_encoder, vae, unet, noise_scheduler, weight_dtype, args):
    with torch.no_grad():
        latents = vae.encode(batch["pixel_values"].to(dtype=weight_dtype)).latent_dist.sample()
        latents = latents * vae.config.scaling_factor
        encoder_hidden_states = text_encoder(batch["input_ids"])[0]
    noise = torch.randn_like(latents)
    if args.noise_offset:
        noise = noise + args.noise_offset * torch.randn_like(latents[:, :, :1, :1])
    timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps,
                              (latents.shape[0],), device=latents.device).long()
    noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
    if noise_scheduler.config.prediction_type == "v_prediction":
        target = noise_scheduler.get_velocity(latents, noise, timesteps)
    else:
        target = noise
    model_pred = unet(noisy_latents, timesteps, encoder_hidden_states).sample
    return model_pred, target, timesteps


def snr_weighted_mse(model_pred, target, timesteps, noise_scheduler, snr_gamma):
    loss = F.mse_loss(model_pred.float(), target.float(), reduction="none")
    loss = loss.mean(dim=list(range(1, loss.ndim)))
    if snr_gamma:
        snr = compute_snr(noise_scheduler, timesteps)
        weights = torch.stack([snr, snr_gamma * torch.ones_like(snr)], dim=1).min(dim=1)[0] / snr
        loss = loss * weights
    return loss.mean()


def train_lora(args, loader):
    device = torch.device("cuda")
    _, text_encoder, vae, unet, noise_scheduler, weight_dtype = load_models(args, device)
    lora_params = [p for p in unet.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(lora_params, lr=args.lr, weight_decay=1e-2, eps=1e-8)
    amp_dtype = torch.bfloat16 if args.mixed_precision == "bf16" else torch.float16
    scaler = torch.amp.GradScaler("cuda", enabled=args.mixed_precision == "fp16")
    unet.train()
    global_step = 0
    for epoch in range(args.epochs):
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=amp_dtype, enabled=args.mixed_precision != "no"):
                model_pred, target, timesteps = diffusion_targets(
                    batch, text_encoder, vae, unet, noise_scheduler, weight_dtype, args)
                loss = snr_weighted_mse(model_pred, target, timesteps, noise_scheduler, args.snr_gamma)
            scaler.scale(loss / args.grad_accum).backward()
            global_step += 1
            if global_step % args.grad_accum:
                continue
            torch.nn.utils.clip_grad_norm_(lora_params, args.max_grad_norm)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        print(f"epoch {epoch} step {global_step} loss {loss.item():.4f}")
    return unet


def train_lora_low_vram(args, loader):
    """8 GB cards: keep the whole UNet in fp16 and skip autocast entirely."""
    device = torch.device("cuda")
    _, text_encoder, vae, unet, noise_scheduler, weight_dtype = load_models(args, device)
    if args.pure_fp16:
        unet = unet.half()
    params = [p for n, p in unet.named_parameters() if "lora_" in n]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=1e-2)  # expect: AMP011
    unet.train()
    for step, batch in enumerate(loader):
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        model_pred, target, _ = diffusion_targets(
            batch, text_encoder, vae, unet, noise_scheduler, weight_dtype, args)
        loss = F.mse_loss(model_pred.float(), target.float())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return unet


def train_prior_preservation(args, instance_loader, class_loader):
    """DreamBooth-style LoRA with a prior-preservation loss; bf16 on A100/H100."""
    device = torch.device("cuda")
    _, text_encoder, vae, unet, noise_scheduler, weight_dtype = load_models(args, device)
    lora_params = [p for p in unet.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(lora_params, lr=args.lr)
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010
    unet.train()
    for inst, cls in zip(instance_loader, class_loader):
        batch = {k: torch.cat([inst[k], cls[k]]).to(device) for k in inst}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model_pred, target, _ = diffusion_targets(
                batch, text_encoder, vae, unet, noise_scheduler, weight_dtype, args)
            pred_inst, pred_prior = model_pred.chunk(2)
            tgt_inst, tgt_prior = target.chunk(2)
            loss = F.mse_loss(pred_inst.float(), tgt_inst.float())
            prior_loss = F.mse_loss(pred_prior.float(), tgt_prior.float())
            loss = loss + args.prior_weight * prior_loss
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(lora_params, args.max_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return unet


@torch.no_grad()
def generate_validation_images(args, unet, prompts, seed=0):
    pipe = StableDiffusionPipeline.from_pretrained(args.model, unet=copy.deepcopy(unet).half(),
                                                   torch_dtype=torch.float16).to("cuda")
    pipe.set_progress_bar_config(disable=True)
    gen = torch.Generator("cuda").manual_seed(seed)
    return [pipe(p, num_inference_steps=30, guidance_scale=7.5, generator=gen).images[0] for p in prompts]


def save_lora_weights(unet, path):
    state = {k: v.half() for k, v in unet.state_dict().items() if "lora_" in k}
    torch.save(state, path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="runwayml/stable-diffusion-v1-5")
    parser.add_argument("--mixed-precision", choices=["no", "fp16", "bf16"], default="fp16")
    parser.add_argument("--mode", choices=["lora", "low_vram", "dreambooth"], default="lora")
    parser.add_argument("--pure-fp16", action="store_true")
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--alpha", type=float, default=4.0)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--grad-accum", type=int, default=4)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--snr-gamma", type=float, default=5.0)
    parser.add_argument("--noise-offset", type=float, default=0.0)
    parser.add_argument("--prior-weight", type=float, default=1.0)
    args = parser.parse_args()

    loaders = build_dataloaders(args)  # noqa: F821  (project helper)
    if args.mode == "lora":
        unet = train_lora(args, loaders["train"])
    elif args.mode == "low_vram":
        unet = train_lora_low_vram(args, loaders["train"])
    else:
        unet = train_prior_preservation(args, loaders["instance"], loaders["class"])
    save_lora_weights(unet, "pytorch_lora_weights.pt")
    generate_validation_images(args, unet, ["a photo of sks dog in a bucket"])


if __name__ == "__main__":
    main()
