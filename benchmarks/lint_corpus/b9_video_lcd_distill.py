"""Latent consistency distillation of an image-to-video UNet (SVD-style) into a 4-step student.

The VAE and the teacher UNet are frozen; the student starts as a copy of the teacher and a
slow EMA copy of the student provides the consistency target.

    python lcd_video.py --pretrained stabilityai/stable-video-diffusion-img2vid \
        --train-list data/webvid_10k.txt --output-dir out/lcd-svd --num-frames 14
"""
import argparse
import copy
import functools
import math
import os
import random

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLTemporalDecoder, EulerDiscreteScheduler, UNetSpatioTemporalConditionModel
from torch.utils.data import DataLoader
from transformers import CLIPImageProcessor, CLIPVisionModelWithProjection

from video_data import VideoClipDataset  # decodes clips with decord, returns (frames[T,3,H,W] in [-1,1], fps)

WEIGHT_DTYPE = torch.float16


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--pretrained", required=True)
    p.add_argument("--train-list", required=True)
    p.add_argument("--output-dir", default="out/lcd-svd")
    p.add_argument("--num-frames", type=int, default=14)
    p.add_argument("--resolution", type=int, nargs=2, default=[320, 512])
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--learning-rate", type=float, default=1e-6)
    p.add_argument("--adam-weight-decay", type=float, default=1e-2)
    p.add_argument("--max-train-steps", type=int, default=20_000)
    p.add_argument("--num-ddim-timesteps", type=int, default=50)
    p.add_argument("--w-min", type=float, default=1.0)
    p.add_argument("--w-max", type=float, default=3.0)
    p.add_argument("--huber-c", type=float, default=1e-3)
    p.add_argument("--ema-decay", type=float, default=0.95)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--checkpointing-steps", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def scalings_for_boundary_conditions(timestep, sigma_data=0.5, timestep_scaling=10.0):
    scaled = timestep * timestep_scaling
    c_skip = sigma_data**2 / (scaled**2 + sigma_data**2)
    c_out = scaled / (scaled**2 + sigma_data**2) ** 0.5
    return c_skip, c_out


def append_dims(x, n):
    return x[(...,) + (None,) * (n - x.ndim)]


class DDIMSolver:
    def __init__(self, alphas_cumprod, timesteps=1000, ddim_timesteps=50):
        step_ratio = timesteps // ddim_timesteps
        self.ddim_timesteps = (torch.arange(1, ddim_timesteps + 1) * step_ratio).long() - 1
        self.ddim_alpha_cumprods = alphas_cumprod[self.ddim_timesteps]
        self.ddim_alpha_cumprods_prev = torch.cat(
            [alphas_cumprod[:1], alphas_cumprod[self.ddim_timesteps[:-1]]]
        )

    def to(self, device):
        self.ddim_timesteps = self.ddim_timesteps.to(device)
        self.ddim_alpha_cumprods = self.ddim_alpha_cumprods.to(device)
        self.ddim_alpha_cumprods_prev = self.ddim_alpha_cumprods_prev.to(device)
        return self

    def ddim_step(self, pred_x0, pred_noise, index):
        alpha_prev = append_dims(self.ddim_alpha_cumprods_prev[index], pred_x0.ndim)
        return alpha_prev.sqrt() * pred_x0 + (1.0 - alpha_prev).sqrt() * pred_noise


def predicted_origin(model_output, timesteps, sample, alphas, sigmas):
    a = append_dims(alphas[timesteps], sample.ndim)
    s = append_dims(sigmas[timesteps], sample.ndim)
    return (sample - s * model_output) / a


@torch.no_grad()
def update_ema(target_params, source_params, rate):
    for t, s in zip(target_params, source_params):
        t.mul_(rate).add_(s.detach().to(t.dtype), alpha=1 - rate)


@torch.no_grad()
def encode_clip(vae, image_encoder, processor, frames, device):
    latents = vae.encode(frames.flatten(0, 1).to(device, dtype=WEIGHT_DTYPE)).latent_dist.sample()
    latents = latents.unflatten(0, frames.shape[:2]) * vae.config.scaling_factor
    first = processor(images=((frames[:, 0] + 1) / 2).clamp(0, 1), return_tensors="pt", do_rescale=False).pixel_values
    image_embeds = image_encoder(first.to(device, dtype=WEIGHT_DTYPE)).image_embeds.unsqueeze(1)
    cond_latents = vae.encode(frames[:, 0].to(device, dtype=WEIGHT_DTYPE)).latent_dist.mode()
    return latents, image_embeds, cond_latents


def main():
    args = parse_args()
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    device = torch.device("cuda")
    os.makedirs(args.output_dir, exist_ok=True)

    noise_scheduler = EulerDiscreteScheduler.from_pretrained(args.pretrained, subfolder="scheduler")
    alphas_cumprod = (1.0 / (1.0 + noise_scheduler.sigmas[:-1].flip(0).double() ** 2)).float()
    alpha_schedule = alphas_cumprod.sqrt().to(device)
    sigma_schedule = (1.0 - alphas_cumprod).sqrt().to(device)
    solver = DDIMSolver(alphas_cumprod, ddim_timesteps=args.num_ddim_timesteps).to(device)

    vae = AutoencoderKLTemporalDecoder.from_pretrained(args.pretrained, subfolder="vae")
    image_encoder = CLIPVisionModelWithProjection.from_pretrained(args.pretrained, subfolder="image_encoder")
    processor = CLIPImageProcessor.from_pretrained(args.pretrained, subfolder="feature_extractor")
    teacher_unet = UNetSpatioTemporalConditionModel.from_pretrained(args.pretrained, subfolder="unet")
    student_unet = copy.deepcopy(teacher_unet)
    target_unet = copy.deepcopy(teacher_unet)

    for frozen in (vae, image_encoder, teacher_unet, target_unet):
        frozen.requires_grad_(False)
        frozen.eval()
    vae.to(device, dtype=WEIGHT_DTYPE)
    image_encoder.to(device, dtype=WEIGHT_DTYPE)
    teacher_unet.to(device, dtype=WEIGHT_DTYPE)
    target_unet.to(device)

    # fp32 student + Adam states do not fit next to the teacher on a 40GB card: train it in half too
    student_unet.to(device)
    student_unet.half()  # expect: AMP001
    student_unet.enable_gradient_checkpointing()
    student_unet.train()
    optimizer = torch.optim.AdamW(  # expect: AMP011
        student_unet.parameters(), lr=args.learning_rate, betas=(0.9, 0.999), weight_decay=args.adam_weight_decay
    )
    amp_ctx = functools.partial(torch.autocast, device_type="cuda", dtype=torch.float16)  # expect: AMP010

    dataset = VideoClipDataset(args.train_list, num_frames=args.num_frames, size=tuple(args.resolution))
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=4, drop_last=True)

    step = 0
    while step < args.max_train_steps:
        for frames, fps in loader:
            latents, image_embeds, cond_latents = encode_clip(vae, image_encoder, processor, frames, device)
            bsz, n_frames = latents.shape[:2]
            cond = cond_latents.unsqueeze(1).repeat(1, n_frames, 1, 1, 1)
            added_time_ids = torch.tensor([[fps[i].item() - 1, 127, 0.02] for i in range(bsz)], device=device, dtype=WEIGHT_DTYPE)

            index = torch.randint(0, args.num_ddim_timesteps, (bsz,), device=device).long()
            start_t = solver.ddim_timesteps[index]
            prev_t = torch.clamp(start_t - (1000 // args.num_ddim_timesteps), min=0)
            c_skip_start, c_out_start = [append_dims(c, latents.ndim) for c in scalings_for_boundary_conditions(start_t)]
            c_skip, c_out = [append_dims(c, latents.ndim) for c in scalings_for_boundary_conditions(prev_t)]
            noise = torch.randn_like(latents)
            a_t = append_dims(alpha_schedule[start_t], latents.ndim)
            s_t = append_dims(sigma_schedule[start_t], latents.ndim)
            noisy = a_t * latents + s_t * noise
            w = (args.w_max - args.w_min) * torch.rand(bsz, device=device) + args.w_min

            with amp_ctx():
                student_out = student_unet(
                    torch.cat([noisy, cond], dim=2), start_t, encoder_hidden_states=image_embeds, added_time_ids=added_time_ids
                ).sample
            pred_x0 = predicted_origin(student_out.float(), start_t, noisy, alpha_schedule, sigma_schedule)
            model_pred = c_skip_start * noisy + c_out_start * pred_x0

            with torch.no_grad():
                with amp_ctx():
                    inp = torch.cat([noisy, cond], dim=2).to(WEIGHT_DTYPE)
                    t_cond = teacher_unet(inp, start_t, encoder_hidden_states=image_embeds, added_time_ids=added_time_ids).sample
                    t_unc = teacher_unet(inp, start_t, encoder_hidden_states=torch.zeros_like(image_embeds), added_time_ids=added_time_ids).sample
                guided = t_unc.float() + append_dims(w, latents.ndim) * (t_cond.float() - t_unc.float())
                x0_teacher = predicted_origin(guided, start_t, noisy, alpha_schedule, sigma_schedule)
                x_prev = solver.ddim_step(x0_teacher, guided, index)
                with amp_ctx():
                    target_out = target_unet(
                        torch.cat([x_prev, cond.float()], dim=2), prev_t, encoder_hidden_states=image_embeds, added_time_ids=added_time_ids
                    ).sample
                target = c_skip * x_prev + c_out * predicted_origin(target_out.float(), prev_t, x_prev, alpha_schedule, sigma_schedule)

            loss = torch.mean(torch.sqrt((model_pred.float() - target.float()) ** 2 + args.huber_c**2) - args.huber_c)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(student_unet.parameters(), args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            update_ema(target_unet.parameters(), student_unet.parameters(), args.ema_decay)
            step += 1

            if step % 25 == 0:
                print(f"step {step} loss {loss.item():.5f} grad_norm {grad_norm.item():.3f}", flush=True)
            if step % args.checkpointing_steps == 0:
                save_dir = os.path.join(args.output_dir, f"checkpoint-{step}")
                target_unet.save_pretrained(os.path.join(save_dir, "unet_ema"))
                torch.save({"optimizer": optimizer.state_dict(), "step": step}, os.path.join(save_dir, "state.pt"))
            if step >= args.max_train_steps:
                break

    copy.deepcopy(target_unet).half().save_pretrained(os.path.join(args.output_dir, "unet_lcd_fp16"))


if __name__ == "__main__":
    main()
