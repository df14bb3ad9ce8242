# Copyright 2020 LMNT, Inc. / modified for bf16 training on A100s.
# Licensed under the Apache License, Version 2.0.
"""DiffWave vocoder: model and learner (mel spectrogram -> waveform, 50-step schedule)."""

import copy
import os
from dataclasses import dataclass, field
from functools import partial
from math import sqrt

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.tensorboard import SummaryWriter


@dataclass
class DiffWaveParams:
    batch_size: int = 16
    learning_rate: float = 2e-4
    max_grad_norm: float = None
    sample_rate: int = 22050
    n_mels: int = 80
    hop_samples: int = 256
    residual_layers: int = 30
    residual_channels: int = 64
    dilation_cycle_length: int = 10
    noise_schedule: list = field(default_factory=lambda: np.linspace(1e-4, 0.05, 50).tolist())
    ema_decay: float = 0.9999
    use_amp: bool = True


class DiffusionEmbedding(nn.Module):
    def __init__(self, max_steps):
        super().__init__()
        self.register_buffer("embedding", self._build_embedding(max_steps), persistent=False)
        self.projection1 = nn.Linear(128, 512)
        self.projection2 = nn.Linear(512, 512)

    def forward(self, diffusion_step):
        x = self.embedding[diffusion_step]
        x = F.silu(self.projection1(x))
        return F.silu(self.projection2(x))

    def _build_embedding(self, max_steps):
        steps = torch.arange(max_steps).unsqueeze(1)
        dims = torch.arange(64).unsqueeze(0)
        table = steps * 10.0 ** (dims * 4.0 / 63.0)
        return torch.cat([torch.sin(table), torch.cos(table)], dim=1)


class SpectrogramUpsampler(nn.Module):
    def __init__(self, n_mels):
        super().__init__()
        self.conv1 = nn.ConvTranspose2d(1, 1, [3, 32], stride=[1, 16], padding=[1, 8])
        self.conv2 = nn.ConvTranspose2d(1, 1, [3, 32], stride=[1, 16], padding=[1, 8])

    def forward(self, x):
        x = torch.unsqueeze(x, 1)
        x = F.leaky_relu(self.conv1(x), 0.4)
        x = F.leaky_relu(self.conv2(x), 0.4)
        x = torch.squeeze(x, 1)
        # per-utterance normalisation of the upsampled conditioner
        x = (x - x.mean(dim=-1, keepdim=True)) / (x.std(dim=-1, keepdim=True) + 1e-5)  # expect: AMP004
        return x


class ResidualBlock(nn.Module):
    def __init__(self, n_mels, residual_channels, dilation):
        super().__init__()
        self.dilated_conv = nn.Conv1d(residual_channels, 2 * residual_channels, 3,
                                      padding=dilation, dilation=dilation)
        self.diffusion_projection = nn.Linear(512, residual_channels)
        self.conditioner_projection = nn.Conv1d(n_mels, 2 * residual_channels, 1)
        self.output_projection = nn.Conv1d(residual_channels, 2 * residual_channels, 1)

    def forward(self, x, diffusion_step, conditioner):
        diffusion_step = self.diffusion_projection(diffusion_step).unsqueeze(-1)
        y = x + diffusion_step
        y = self.dilated_conv(y) + self.conditioner_projection(conditioner)
        gate, filter_ = torch.chunk(y, 2, dim=1)
        y = torch.sigmoid(gate) * torch.tanh(filter_)
        y = self.output_projection(y)
        residual, skip = torch.chunk(y, 2, dim=1)
        return (x + residual) / sqrt(2.0), skip


class DiffWave(nn.Module):
    def __init__(self, params):
        super().__init__()
        self.params = params
        self.input_projection = nn.Conv1d(1, params.residual_channels, 1)
        self.diffusion_embedding = DiffusionEmbedding(len(params.noise_schedule))
        self.spectrogram_upsampler = SpectrogramUpsampler(params.n_mels)
        self.residual_layers = nn.ModuleList([
            ResidualBlock(params.n_mels, params.residual_channels,
                          2 ** (i % params.dilation_cycle_length))
            for i in range(params.residual_layers)
        ])
        self.skip_projection = nn.Conv1d(params.residual_channels, params.residual_channels, 1)
        self.output_projection = nn.Conv1d(params.residual_channels, 1, 1)
        nn.init.zeros_(self.output_projection.weight)

    def forward(self, audio, diffusion_step, spectrogram):
        x = F.relu(self.input_projection(audio.unsqueeze(1)))
        diffusion_step = self.diffusion_embedding(diffusion_step)
        spectrogram = self.spectrogram_upsampler(spectrogram)
        skip = []
        for layer in self.residual_layers:
            x, skip_connection = layer(x, diffusion_step, spectrogram)
            skip.append(skip_connection)
        x = torch.sum(torch.stack(skip), dim=0) / sqrt(len(self.residual_layers))
        x = F.relu(self.skip_projection(x))
        return self.output_projection(x)


class DiffWaveLearner:
    def __init__(self, model_dir, model, dataset, optimizer, params, device="cuda"):
        os.makedirs(model_dir, exist_ok=True)
        self.model_dir = model_dir
        self.model = model
        self.dataset = dataset
        self.optimizer = optimizer
        self.params = params
        self.device = torch.device(device)
        self.ema = copy.deepcopy(model).eval().requires_grad_(False)
        # A100: bf16 has the range of fp32, the scaler is kept from the fp16 version "just in case"
        self.autocast = partial(torch.autocast, device_type="cuda", dtype=torch.bfloat16, enabled=params.use_amp)
        self.scaler = torch.amp.GradScaler("cuda", enabled=params.use_amp)  # expect: AMP010
        self.loss_fn = nn.L1Loss()
        self.step = 0
        self.is_master = True
        beta = np.array(self.params.noise_schedule)
        noise_level = np.cumprod(1 - beta)
        self.noise_level = torch.tensor(noise_level.astype(np.float32), device=self.device)
        self.summary_writer = None

    def state_dict(self):
        return {
            "step": self.step,
            "model": {k: v.cpu() for k, v in self.model.state_dict().items()},
            "ema": {k: v.cpu() for k, v in self.ema.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "params": dict(self.params.__dict__),
        }

    def load_state_dict(self, state_dict):
        self.model.load_state_dict(state_dict["model"])
        self.ema.load_state_dict(state_dict["ema"])
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.scaler.load_state_dict(state_dict["scaler"])
        self.step = state_dict["step"]

    def save_to_checkpoint(self, filename="weights"):
        save_name = f"{self.model_dir}/{filename}-{self.step}.pt"
        link_name = f"{self.model_dir}/{filename}.pt"
        torch.save(self.state_dict(), save_name)
        if os.path.islink(link_name):
            os.unlink(link_name)
        os.symlink(os.path.basename(save_name), link_name)

    def export_fp16_ema(self, path):
        """Half-precision EMA weights for the vocoder server."""
        ema16 = copy.deepcopy(self.ema).half()
        torch.save({"model": ema16.state_dict(), "params": dict(self.params.__dict__)}, path)

    def train(self, max_steps=None):
        while True:
            for features in self.dataset:
                if max_steps is not None and self.step >= max_steps:
                    return
                features = {k: v.to(self.device, non_blocking=True) for k, v in features.items()}
                loss, grad_norm = self.train_step(features)
                if torch.isnan(loss).any():
                    raise RuntimeError(f"Detected NaN loss at step {self.step}.")
                if self.is_master:
                    if self.step % 50 == 0:
                        self._write_summary(self.step, features, loss, grad_norm)
                    if self.step % 10000 == 0:
                        self.save_to_checkpoint()
                self.step += 1

    def train_step(self, features):
        audio = features["audio"].bfloat16()  # expect: AMP001
        spectrogram = features["spectrogram"]
        N, T = audio.shape
        t = torch.randint(0, len(self.params.noise_schedule), [N], device=audio.device)
        noise_scale = self.noise_level[t].unsqueeze(1)
        noise = torch.randn_like(audio)
        noisy_audio = noise_scale ** 0.5 * audio + (1.0 - noise_scale) ** 0.5 * noise

        with self.autocast():
            predicted = self.model(noisy_audio, t, spectrogram)
        loss = self.loss_fn(noise, predicted.squeeze(1))  # expect: AMP002
        self.backward(loss)
        grad_norm = self.optimizer_step()
        self.update_ema()
        return loss, grad_norm

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def optimizer_step(self):
        grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.params.max_grad_norm or 1e9)  # expect: AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    @torch.no_grad()
    def update_ema(self):
        d = self.params.ema_decay
        for ema_p, p in zip(self.ema.parameters(), self.model.parameters()):
            ema_p.mul_(d).add_(p.detach(), alpha=1.0 - d)

    def _write_summary(self, step, features, loss, grad_norm):
        writer = self.summary_writer or SummaryWriter(self.model_dir, purge_step=step)
        writer.add_audio("feature/audio", features["audio"][0].float(), step,
                         sample_rate=self.params.sample_rate)
        writer.add_scalar("train/loss", loss.item(), step)
        writer.add_scalar("train/grad_norm", float(grad_norm), step)
        writer.add_scalar("train/loss_scale", self.scaler.get_scale(), step)
        writer.flush()
        self.summary_writer = writer


@torch.no_grad()
def predict(spectrogram, model, params, device="cuda"):
    """Reverse diffusion for inference (fp16 weights are fine here)."""
    model = model.half().eval()
    spectrogram = spectrogram.to(device).half()
    beta = np.array(params.noise_schedule)
    alpha = 1 - beta
    alpha_cum = np.cumprod(alpha)
    audio = torch.randn(spectrogram.shape[0], params.hop_samples * spectrogram.shape[-1],
                        device=device, dtype=torch.float16)
    for n in range(len(alpha) - 1, -1, -1):
        c1 = 1 / alpha[n] ** 0.5
        c2 = beta[n] / (1 - alpha_cum[n]) ** 0.5
        step = torch.tensor([n], device=device)
        audio = c1 * (audio - c2 * model(audio, step, spectrogram).squeeze(1))
        if n > 0:
            sigma = ((1.0 - alpha_cum[n - 1]) / (1.0 - alpha_cum[n]) * beta[n]) ** 0.5
            audio += sigma * torch.randn_like(audio)
        audio = torch.clamp(audio, -1.0, 1.0)
    return audio.float()


def train(dataset, model_dir, params):
    model = DiffWave(params).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=params.learning_rate)
    learner = DiffWaveLearner(model_dir, model, dataset, optimizer, params)
    ckpt = f"{model_dir}/weights.pt"
    if os.path.exists(ckpt):
        learner.load_state_dict(torch.load(ckpt, map_location="cpu"))
    learner.train(max_steps=1_000_000)
