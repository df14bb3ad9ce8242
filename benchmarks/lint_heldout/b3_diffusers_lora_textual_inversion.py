"""Stable Diffusion fine-tuning in the diffusers examples style: UNet LoRA training and a textual-inversion mode."""
import argparse
import os

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from peft import LoraConfig
from torch.utils.data import DataLoader
from transformers import CLIPTextModel, CLIPTokenizer


def make_noise_schedule(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, device="cuda"):
    """Scaled-linear schedule, kept in half precision next to the fp16 latents."""
    betas = torch.linspace(beta_start ** 0.5, beta_end ** 0.5, num_train_timesteps, dtype=torch.float16, device=device) ** 2
    alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)  # expect: AMP004
    return alphas_cumprod


def compute_snr(alphas_cumprod, timesteps):
    alpha = alphas_cumprod[timesteps].float()
    return alpha / (1.0 - alpha)


def train_unet_lora(args, text_encoder, vae, unet, noise_scheduler, train_dataloader, device):
    weight_dtype = torch.float16 if args.mixed_precision == "fp16" else torch.float32
    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    unet.requires_grad_(False)
    vae.to(device, dtype=weight_dtype)
    text_encoder.to(device, dtype=weight_dtype)
    unet.to(device)
    unet.add_adapter(LoraConfig(r=args.rank, lora_alpha=args.rank, init_lora_weights="gaussian",
                                target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
    lora_layers = [p for p in unet.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(lora_layers, lr=args.learning_rate, weight_decay=1e-2)
    alphas_cumprod = make_noise_schedule(device=device)

    global_step = 0
    for epoch in range(args.num_train_epochs):
        unet.train()
        for step, batch in enumerate(train_dataloader):
            with torch.no_grad():
                latents = vae.encode(batch["pixel_values"].to(device, dtype=weight_dtype)).latent_dist.sample()
                latents = latents * vae.config.scaling_factor
                encoder_hidden_states = text_encoder(batch["input_ids"].to(device))[0]
            noise = torch.randn(latents.shape, device=device, dtype=torch.float16)
            noise = noise - noise.mean(dim=(1, 2, 3), keepdim=True)  # expect: AMP004
            if args.noise_offset:
                noise += args.noise_offset * torch.randn((latents.shape[0], latents.shape[1], 1, 1), device=device)
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (latents.shape[0],), device=device)
            noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)

            with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
                model_pred = unet(noisy_latents, timesteps, encoder_hidden_states).sample
                if args.snr_gamma is None:
                    loss = F.mse_loss(model_pred.float(), noise.float(), reduction="mean")
                else:
                    snr = compute_snr(alphas_cumprod, timesteps)
                    weights = torch.clamp(snr, max=args.snr_gamma) / snr
                    loss = F.mse_loss(model_pred.float(), noise.float(), reduction="none")
                    loss = (loss.mean(dim=list(range(1, loss.ndim))) * weights).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(lora_layers, args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
            global_step += 1
            if global_step % 50 == 0:
                print(f"epoch {epoch} step {global_step}: loss {loss.item():.4f}")
    return unet


def train_textual_inversion(args, tokenizer, text_encoder, vae, unet, noise_scheduler, train_dataloader,
                            placeholder_token_id, device):
    vae.requires_grad_(False)
    unet.requires_grad_(False)
    vae.to(device, dtype=torch.float16)
    unet.to(device, dtype=torch.float16)
    text_encoder = text_encoder.to(device, dtype=torch.float16)  # expect: AMP001
    text_encoder.text_model.encoder.requires_grad_(False)
    text_encoder.text_model.final_layer_norm.requires_grad_(False)
    text_encoder.text_model.embeddings.position_embedding.requires_grad_(False)
    optimizer = torch.optim.AdamW(text_encoder.get_input_embeddings().parameters(), lr=args.learning_rate, weight_decay=0.0)  # expect: AMP011
    orig_embeds_params = text_encoder.get_input_embeddings().weight.data.clone()

    for epoch in range(args.num_train_epochs):
        text_encoder.train()
        for step, batch in enumerate(train_dataloader):
            with torch.no_grad():
                latents = vae.encode(batch["pixel_values"].to(device, dtype=torch.float16)).latent_dist.sample()
                latents = latents * vae.config.scaling_factor
            noise = torch.randn_like(latents)
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (latents.shape[0],), device=device)
            noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
            encoder_hidden_states = text_encoder(batch["input_ids"].to(device))[0]
            model_pred = unet(noisy_latents, timesteps, encoder_hidden_states).sample
            loss = F.mse_loss(model_pred.float(), noise.float(), reduction="mean")
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

            # only the placeholder row may change
            index_no_updates = torch.ones((len(tokenizer),), dtype=torch.bool)
            index_no_updates[placeholder_token_id] = False
            with torch.no_grad():
                text_encoder.get_input_embeddings().weight[index_no_updates] = orig_embeds_params[index_no_updates]
    learned = text_encoder.get_input_embeddings().weight[placeholder_token_id].detach().float().cpu()
    torch.save({args.placeholder_token: learned}, os.path.join(args.output_dir, "learned_embeds.bin"))
    return text_encoder


@torch.no_grad()
def log_validation(args, text_encoder, unet, vae, tokenizer, device):
    pipeline = StableDiffusionPipeline.from_pretrained(args.pretrained_model_name_or_path, text_encoder=text_encoder,
                                                       unet=unet, vae=vae, tokenizer=tokenizer, safety_checker=None)
    pipeline = pipeline.to(device, torch.float16)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    images = [pipeline(args.validation_prompt, num_inference_steps=25, generator=generator).images[0]
              for _ in range(args.num_validation_images)]
    for i, image in enumerate(images):
        image.save(os.path.join(args.output_dir, f"validation_{i}.png"))


def main(train_dataset):
    p = argparse.ArgumentParser()
    p.add_argument("--pretrained_model_name_or_path", default="runwayml/stable-diffusion-v1-5")
    p.add_argument("--mode", default="lora", choices=["lora", "textual_inversion"])
    p.add_argument("--placeholder_token", default="<cat-toy>")
    p.add_argument("--initializer_token", default="toy")
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--learning_rate", type=float, default=1e-4)
    p.add_argument("--num_train_epochs", type=int, default=100)
    p.add_argument("--mixed_precision", default="fp16", choices=["no", "fp16"])
    p.add_argument("--noise_offset", type=float, default=0.0)
    p.add_argument("--snr_gamma", type=float, default=None)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--validation_prompt", default="a photo of <cat-toy> on a beach")
    p.add_argument("--num_validation_images", type=int, default=4)
    p.add_argument("--output_dir", default="sd-finetuned")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    device = torch.device("cuda")
    name = args.pretrained_model_name_or_path
    tokenizer = CLIPTokenizer.from_pretrained(name, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(name, subfolder="text_encoder")
    vae = AutoencoderKL.from_pretrained(name, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(name, subfolder="unet")
    noise_scheduler = DDPMScheduler.from_pretrained(name, subfolder="scheduler")
    loader = DataLoader(train_dataset, batch_size=4, shuffle=True, num_workers=4)

    if args.mode == "lora":
        unet = train_unet_lora(args, text_encoder, vae, unet, noise_scheduler, loader, device)
    else:
        tokenizer.add_tokens(args.placeholder_token)
        placeholder_token_id = tokenizer.convert_tokens_to_ids(args.placeholder_token)
        text_encoder.resize_token_embeddings(len(tokenizer))
        init_id = tokenizer.encode(args.initializer_token, add_special_tokens=False)[0]
        with torch.no_grad():
            emb = text_encoder.get_input_embeddings().weight
            emb[placeholder_token_id] = emb[init_id].clone()
        text_encoder = train_textual_inversion(args, tokenizer, text_encoder, vae, unet, noise_scheduler, loader,
                                               placeholder_token_id, device)
    log_validation(args, text_encoder, unet, vae, tokenizer, device)
