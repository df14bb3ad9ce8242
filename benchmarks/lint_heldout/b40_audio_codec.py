"""SoundStream/DAC-style neural audio codec: conv encoder -> residual vector quantizer
(factorised codes, EMA codebooks, commitment loss, quantizer dropout) -> conv decoder,
trained with L1 + multi-resolution STFT loss."""
import copy
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class CodecConfig:
    channels: int = 32
    strides: tuple = (2, 4, 5, 8)
    latent_dim: int = 128
    codebook_size: int = 1024
    codebook_dim: int = 8
    num_quantizers: int = 8
    quantizer_dropout: float = 0.5
    commit_weight: float = 0.25
    spec_weight: float = 1.0
    lr: float = 3e-4
    accum_steps: int = 4
    clip: float = 1.0
    ema_decay: float = 0.999
    amp: bool = True
    compile: bool = False


@dataclass
class CodecOutput:
    recon: torch.Tensor
    codes: torch.Tensor
    z_e: torch.Tensor
    commit_loss: torch.Tensor
    perplexity: torch.Tensor


def make_grad_scaler(enabled):
    try:
        return torch.amp.GradScaler("cuda", enabled=enabled)
    except (AttributeError, TypeError):  # torch < 2.3
        return torch.cuda.amp.GradScaler(enabled=enabled)


def wn_conv1d(cin, cout, kernel, stride=1, dilation=1):
    pad = (kernel - 1) * dilation // 2
    return nn.utils.parametrizations.weight_norm(nn.Conv1d(cin, cout, kernel, stride, pad, dilation))


class ResidualUnit(nn.Module):
    def __init__(self, ch, dilation):
        super().__init__()
        self.block = nn.Sequential(
            nn.ELU(), wn_conv1d(ch, ch, 7, dilation=dilation), nn.ELU(), wn_conv1d(ch, ch, 1)
        )

    def forward(self, x):
        return x + self.block(x)


def build_encoder(cfg):
    layers = [wn_conv1d(1, cfg.channels, 7)]
    ch = cfg.channels
    for stride in cfg.strides:
        layers += [ResidualUnit(ch, d) for d in (1, 3, 9)]
        layers += [nn.ELU(), wn_conv1d(ch, ch * 2, 2 * stride, stride=stride)]
        ch *= 2
    layers += [nn.ELU(), wn_conv1d(ch, cfg.latent_dim, 3)]
    return nn.Sequential(*layers)


def build_decoder(cfg):
    ch = cfg.channels * 2 ** len(cfg.strides)
    blocks = OrderedDict(stem=wn_conv1d(cfg.latent_dim, ch, 7))
    for i, stride in enumerate(reversed(cfg.strides)):
        blocks[f"up{i}_act"] = nn.ELU()
        blocks[f"up{i}"] = nn.ConvTranspose1d(
            ch, ch // 2, 2 * stride, stride, padding=(stride + 1) // 2, output_padding=stride % 2
        )
        ch //= 2
        for j, d in enumerate((1, 3, 9)):
            blocks[f"up{i}_res{j}"] = ResidualUnit(ch, d)
    blocks["out_act"] = nn.ELU()
    blocks["out"] = wn_conv1d(ch, 1, 7)
    blocks["tanh"] = nn.Tanh()
    return nn.Sequential(blocks)


class VectorQuantizerEMA(nn.Module):
    """One codebook: low-dimensional factorised codes, EMA updates, dead-code restarts."""

    def __init__(self, dim, codebook_size, codebook_dim, decay=0.99, dead_threshold=2.0):
        super().__init__()
        self.codebook_size = codebook_size
        self.decay = decay
        self.dead_threshold = dead_threshold
        self.in_proj = nn.Linear(dim, codebook_dim)
        self.out_proj = nn.Linear(codebook_dim, dim)
        embed = torch.randn(codebook_size, codebook_dim)
        self.register_buffer("embed", embed)
        self.register_buffer("embed_avg", embed.clone())
        self.register_buffer("cluster_size", torch.ones(codebook_size))

    def forward(self, z):
        z_p = self.in_proj(z)
        flat = z_p.reshape(-1, z_p.size(-1))
        dist = (
            flat.pow(2).sum(1, keepdim=True)
            - 2 * flat @ self.embed.t()
            + self.embed.pow(2).sum(1)[None, :]
        )
        idx = dist.argmin(dim=1)
        onehot = F.one_hot(idx, self.codebook_size).to(flat.dtype)
        zq_p = F.embedding(idx, self.embed).view_as(z_p)
        if self.training:
            self._ema_update(flat, onehot)
        commit = F.mse_loss(z_p, zq_p.detach())
        zq_p = z_p + (zq_p - z_p).detach()  # straight-through estimator
        avg_probs = onehot.mean(dim=0)  # expect: AMP004
        perplexity = torch.exp(-torch.sum(avg_probs * torch.log(avg_probs + 1e-10)))  # expect: AMP011
        return self.out_proj(zq_p), idx.view(z.shape[:-1]), commit, perplexity

    @torch.no_grad()
    def _ema_update(self, flat, onehot):
        counts = onehot.sum(dim=0)
        embed_sum = onehot.t() @ flat
        self.cluster_size.mul_(self.decay).add_(counts, alpha=1 - self.decay)
        self.embed_avg.mul_(self.decay).add_(embed_sum, alpha=1 - self.decay)
        n = self.cluster_size.sum()
        smoothed = (self.cluster_size + 1e-8) / (n + self.codebook_size * 1e-8) * n
        self.embed.copy_(self.embed_avg / smoothed.unsqueeze(1))
        dead = self.cluster_size < self.dead_threshold
        if dead.any():
            pick = torch.randint(0, flat.size(0), (int(dead.sum()),), device=flat.device)
            self.embed[dead] = flat[pick].float()
            self.embed_avg[dead] = flat[pick].float()
            self.cluster_size[dead] = 1.0


class ResidualVQ(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.quantizer_dropout = cfg.quantizer_dropout
        self.layers = nn.ModuleList(
            [VectorQuantizerEMA(cfg.latent_dim, cfg.codebook_size, cfg.codebook_dim)
             for _ in range(cfg.num_quantizers)]
        )

    def forward(self, z, n_q=None):
        n_q = n_q or len(self.layers)
        if self.training and torch.rand(()) < self.quantizer_dropout:
            n_q = int(torch.randint(1, len(self.layers) + 1, ()))
        residual, quantized = z, torch.zeros_like(z)
        codes, commits, ppls = [], [], []
        for i, layer in enumerate(self.layers):
            if i >= n_q:
                break
            zq, idx, commit, ppl = layer(residual)
            residual = residual - zq.detach()
            quantized = quantized + zq
            codes.append(idx)
            commits.append(commit)
            ppls.append(ppl)
        return quantized, torch.stack(codes, -1), torch.stack(commits).mean(), torch.stack(ppls).mean()


class SoundStreamCodec(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.encoder = build_encoder(cfg)
        self.pre_quant = nn.Conv1d(cfg.latent_dim, cfg.latent_dim, 1)
        self.quantizer = ResidualVQ(cfg)
        self.post_quant = nn.Conv1d(cfg.latent_dim, cfg.latent_dim, 1)
        self.decoder = build_decoder(cfg)

    def forward(self, wav, n_q=None):
        z_e = self.pre_quant(self.encoder(wav))
        zq, codes, commit, ppl = self.quantizer(z_e.transpose(1, 2), n_q)
        recon = self.decoder(self.post_quant(zq.transpose(1, 2)))[..., : wav.size(-1)]
        return CodecOutput(recon=recon, codes=codes, z_e=z_e, commit_loss=commit, perplexity=ppl)


class MultiResolutionSTFTLoss(nn.Module):
    def __init__(self, fft_sizes=(512, 1024, 2048), hop_ratio=0.25):
        super().__init__()
        self.fft_sizes = fft_sizes
        self.hop_ratio = hop_ratio
        for n in fft_sizes:
            self.register_buffer(f"window_{n}", torch.hann_window(n), persistent=False)

    def _magnitude(self, x, n):
        spec = torch.stft(x.float().flatten(0, 1), n, hop_length=int(n * self.hop_ratio),
                          window=getattr(self, f"window_{n}"), return_complex=True)
        return spec.abs().clamp(min=1e-7)

    def forward(self, pred, target):
        loss = 0.0
        for n in self.fft_sizes:
            p, t = self._magnitude(pred, n), self._magnitude(target, n)
            spectral_convergence = torch.norm(t - p, p="fro") / torch.norm(t, p="fro")
            log_mag = F.l1_loss(torch.log(p), torch.log(t))
            loss = loss + spectral_convergence + log_mag
        return loss / len(self.fft_sizes)


def si_snr(est, ref, eps=1e-8):
    est = est - est.mean(-1, keepdim=True)
    ref = ref - ref.mean(-1, keepdim=True)
    proj = (est * ref).sum(-1, keepdim=True) * ref / (ref.pow(2).sum(-1, keepdim=True) + eps)
    noise = est - proj
    return 10 * torch.log10(proj.pow(2).sum(-1) / (noise.pow(2).sum(-1) + eps))


class CodecTrainer:
    def __init__(self, cfg, device="cuda"):
        self.cfg = cfg
        self.device = device
        self.model = SoundStreamCodec(cfg).to(device)
        self.ema_model = copy.deepcopy(self.model).requires_grad_(False).eval()
        if cfg.compile:
            self.model = torch.compile(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(0.8, 0.99))
        self.scaler = make_grad_scaler(enabled=cfg.amp)
        self.spec_loss = MultiResolutionSTFTLoss().to(device)
        self.step = 0

    def compute_losses(self, out, wav):
        recon = F.l1_loss(out.recon, wav)
        spec = self.spec_loss(out.recon, wav)
        total = recon + self.cfg.spec_weight * spec + self.cfg.commit_weight * out.commit_loss
        return {"recon": recon, "spec": spec, "commit": out.commit_loss, "total": total}

    def train_step(self, wav, micro_step):
        wav = wav.to(self.device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.cfg.amp):
            out = self.model(wav)
            losses = self.compute_losses(out, wav)
            loss = losses["total"] / self.cfg.accum_steps
        self.scaler.scale(loss).backward()

        stats = {k: v.detach().item() for k, v in losses.items()}
        stats["perplexity"] = out.perplexity.item()
        stats["latent_rms"] = out.z_e.detach().pow(2).mean().sqrt().item()  # expect: AMP004
        stats["snr"] = si_snr(out.recon.detach().float(), wav).mean().item()
        if (micro_step + 1) % self.cfg.accum_steps == 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip)  # expect: AMP005
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            self.update_ema()
            self.step += 1
            stats["grad_norm"] = grad_norm.item()
        return stats

    @torch.no_grad()
    def update_ema(self):
        model = self.model._orig_mod if hasattr(self.model, "_orig_mod") else self.model
        d = self.cfg.ema_decay
        for e, p in zip(self.ema_model.parameters(), model.parameters()):
            e.mul_(d).add_(p.detach(), alpha=1 - d)
        for e, b in zip(self.ema_model.buffers(), model.buffers()):
            e.copy_(b)

    @torch.no_grad()
    def evaluate(self, loader):
        self.ema_model.eval()
        total, latent_std, n = 0.0, 0.0, 0
        for wav in loader:
            wav = wav.to(self.device)
            with torch.autocast("cuda", dtype=torch.float16, enabled=self.cfg.amp):
                out = self.ema_model(wav, n_q=self.cfg.num_quantizers)
                latent_std += out.z_e.std().item()
            total += si_snr(out.recon.float(), wav).mean().item()
            n += 1
        return {"si_snr": total / n, "latent_std": latent_std / n}

    def save(self, path):
        model = self.model._orig_mod if hasattr(self.model, "_orig_mod") else self.model
        model = model.module if hasattr(model, "module") else model
        torch.save({
            "model": model.state_dict(),
            "ema_fp16": {k: v.half() for k, v in self.ema_model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "step": self.step,
        }, path)


def synthetic_audio(n_clips, seconds=1.0, sr=16000, hop=320):
    length = int(seconds * sr) // hop * hop
    t = torch.arange(length) / sr
    f0 = torch.rand(n_clips, 1) * 400 + 100
    wav = 0.5 * torch.sin(2 * torch.pi * f0 * t) + 0.05 * torch.randn(n_clips, length)
    return wav.unsqueeze(1)


def fit(cfg, epochs=10, batch_size=16):
    trainer = CodecTrainer(cfg)
    train_set = synthetic_audio(512)
    val_set = synthetic_audio(32)
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=batch_size, shuffle=True, drop_last=True)
    val_loader = torch.utils.data.DataLoader(val_set, batch_size=batch_size)
    micro = 0
    for epoch in range(epochs):
        trainer.model.train()
        for wav in train_loader:
            stats = trainer.train_step(wav, micro)
            micro += 1
            if micro % (50 * cfg.accum_steps) == 0:
                print(epoch, trainer.step, {k: round(v, 4) for k, v in stats.items()})
        print("val", trainer.evaluate(val_loader))
        trainer.save(f"codec_{epoch:03d}.pt")


if __name__ == "__main__":
    fit(CodecConfig(compile=torch.cuda.is_available() and hasattr(torch, "compile")))
