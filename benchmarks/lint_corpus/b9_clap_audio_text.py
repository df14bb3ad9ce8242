"""Contrastive language-audio pretraining (CLAP-style) on AudioCaps/Clotho + AudioSet tags.

Audio tower: log-mel frontend + small transformer. Text tower: a pretrained RoBERTa.
Loss: symmetric InfoNCE with a learnable temperature, features all-gathered across ranks,
plus a multi-label tagging loss on the audio tower.
"""
import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.distributed.nn
import torch.nn as nn
import torch.nn.functional as F
from torch.cuda.amp import autocast
from transformers import AutoModel


def mel_filterbank(sr, n_fft, n_mels, fmin=50.0, fmax=14000.0):
    def hz_to_mel(f):
        return 2595.0 * math.log10(1.0 + f / 700.0)

    mels = torch.linspace(hz_to_mel(fmin), hz_to_mel(fmax), n_mels + 2)
    hz = 700.0 * (10 ** (mels / 2595.0) - 1.0)
    bins = torch.floor((n_fft + 1) * hz / sr).long()
    fb = torch.zeros(n_fft // 2 + 1, n_mels)
    for m in range(1, n_mels + 1):
        lo, c, hi = bins[m - 1].item(), bins[m].item(), bins[m + 1].item()
        for k in range(lo, c):
            fb[k, m - 1] = (k - lo) / max(c - lo, 1)
        for k in range(c, hi):
            fb[k, m - 1] = (hi - k) / max(hi - c, 1)
    return fb


class LogMelFrontend(nn.Module):
    def __init__(self, sr=32000, n_fft=1024, hop=320, n_mels=64):
        super().__init__()
        self.n_fft, self.hop = n_fft, hop
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)
        self.register_buffer("mel_fb", mel_filterbank(sr, n_fft, n_mels), persistent=False)

    def forward(self, wave):
        spec = torch.stft(wave, self.n_fft, self.hop, window=self.window, return_complex=True)
        power = spec.abs() ** 2
        mel = torch.matmul(power.transpose(1, 2), self.mel_fb)  # (B, frames, n_mels)
        return torch.log(mel + 1e-10)  # expect: AMP011


class AudioBlock(nn.Module):
    def __init__(self, dim, heads, mlp_ratio=4.0, drop=0.1):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, int(dim * mlp_ratio)), nn.GELU(), nn.Dropout(drop), nn.Linear(int(dim * mlp_ratio), dim))

    def forward(self, x, pad_mask):
        B, N, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1)) * (C // self.heads) ** -0.5
        attn.masked_fill_(pad_mask[:, None, None, :], -1e9)  # expect: AMP007
        attn = attn.softmax(dim=-1)
        x = x + self.proj((attn @ v).transpose(1, 2).reshape(B, N, C))
        return x + self.mlp(self.norm2(x))


class AudioEncoder(nn.Module):
    def __init__(self, n_mels=64, dim=512, depth=8, heads=8, patch=4, num_tags=527):
        super().__init__()
        self.frontend = LogMelFrontend(n_mels=n_mels)
        self.bn0 = nn.BatchNorm1d(n_mels)
        self.patch = patch
        self.embed = nn.Linear(n_mels * patch, dim)
        self.pos = nn.Parameter(torch.zeros(1, 1024, dim))
        self.blocks = nn.ModuleList([AudioBlock(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.frame_head = nn.Linear(dim, num_tags)

    def forward(self, wave, wave_lens):
        mel = self.frontend(wave)
        mel = self.bn0(mel.transpose(1, 2)).transpose(1, 2)
        B, T, M = mel.shape
        T = T - T % self.patch
        x = self.embed(mel[:, :T].reshape(B, T // self.patch, M * self.patch))
        x = x + self.pos[:, : x.size(1)]
        n_tokens = (wave_lens // self.frontend.hop) // self.patch
        pad_mask = torch.arange(x.size(1), device=x.device)[None, :] >= n_tokens[:, None]
        for blk in self.blocks:
            x = blk(x, pad_mask)
        x = self.norm(x)
        keep = (~pad_mask).unsqueeze(-1).to(x.dtype)
        pooled = (x * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1.0)
        frame_logits = self.frame_head(x)
        tag_logits = frame_logits.mean(dim=1)  # expect: AMP004
        return pooled, tag_logits


class CLAP(nn.Module):
    def __init__(self, text_model="roberta-base", embed_dim=512, num_tags=527):
        super().__init__()
        self.audio_encoder = AudioEncoder(num_tags=num_tags)
        self.text_encoder = AutoModel.from_pretrained(text_model)
        self.audio_proj = nn.Sequential(nn.Linear(512, embed_dim), nn.ReLU(), nn.Linear(embed_dim, embed_dim))
        self.text_proj = nn.Sequential(nn.Linear(self.text_encoder.config.hidden_size, embed_dim), nn.ReLU(), nn.Linear(embed_dim, embed_dim))
        self.logit_scale = nn.Parameter(torch.ones([]) * math.log(1 / 0.07))
        self.embed_dim = embed_dim

    def encode_audio(self, wave, wave_lens):
        pooled, tag_logits = self.audio_encoder(wave, wave_lens)
        return F.normalize(self.audio_proj(pooled), dim=-1), tag_logits

    def encode_text(self, input_ids, attention_mask):
        h = self.text_encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, 0]
        return F.normalize(self.text_proj(h), dim=-1)

    def forward(self, wave, wave_lens, input_ids, attention_mask):
        audio_emb, tag_logits = self.encode_audio(wave, wave_lens)
        text_emb = self.encode_text(input_ids, attention_mask)
        return audio_emb, text_emb, self.logit_scale.exp(), tag_logits


def gather_features(audio, text, world_size, rank):
    if world_size == 1:
        return audio, text
    all_audio = torch.cat(torch.distributed.nn.all_gather(audio), dim=0)
    all_text = torch.cat(torch.distributed.nn.all_gather(text), dim=0)
    return all_audio, all_text


class ClipLoss(nn.Module):
    def __init__(self, world_size=1, rank=0):
        super().__init__()
        self.world_size, self.rank = world_size, rank

    def forward(self, audio, text, logit_scale):
        all_audio, all_text = gather_features(audio, text, self.world_size, self.rank)
        logits_per_audio = logit_scale * audio @ all_text.T
        logits_per_text = logit_scale * text @ all_audio.T
        labels = torch.arange(audio.size(0), device=audio.device) + self.rank * audio.size(0)
        return 0.5 * (F.cross_entropy(logits_per_audio, labels) + F.cross_entropy(logits_per_text, labels))


class ClapTrainer:
    def __init__(self, model, cfg, device, world_size=1, rank=0):
        self.model, self.cfg, self.device = model, cfg, device
        if cfg.freeze_text:
            model.text_encoder.requires_grad_(False)
            if cfg.amp:
                model.text_encoder.half()  # frozen tower: half the memory, autocast feeds it fp16 anyway
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.2, betas=(0.9, 0.98), eps=1e-6)
        self.scheduler = torch.optim.lr_scheduler.OneCycleLR(self.optimizer, max_lr=cfg.lr, total_steps=cfg.total_steps, pct_start=0.05)
        self.scaler = torch.amp.GradScaler("cuda", enabled=cfg.amp)
        self.clip_loss = ClipLoss(world_size, rank)
        self.clip_grad = cfg.clip_grad
        self.step = 0

    def _backward(self, loss):
        self.scaler.scale(loss / self.cfg.accum_steps).backward()

    def _optimizer_step(self):
        if self.clip_grad:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad)  # expect: AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        with torch.no_grad():
            self.model.logit_scale.clamp_(0, math.log(100))
        self.step += 1

    def train_step(self, batch, micro_step):
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        with autocast(enabled=self.cfg.amp):  # expect: AMP009
            audio_emb, text_emb, logit_scale, tag_logits = self.model(
                batch["wave"], batch["wave_lens"], batch["input_ids"], batch["attention_mask"]
            )
            contrastive = self.clip_loss(audio_emb, text_emb, logit_scale)
        tag_loss = F.binary_cross_entropy_with_logits(tag_logits, batch["tags"])  # expect: AMP002
        loss = contrastive + self.cfg.tag_weight * tag_loss
        self._backward(loss)
        if (micro_step + 1) % self.cfg.accum_steps == 0:
            self._optimizer_step()
        return {"loss": loss.item(), "contrastive": contrastive.item(), "tag": tag_loss.item(), "scale": logit_scale.item()}

    @torch.no_grad()
    def evaluate_retrieval(self, loader):
        self.model.eval()
        audio_feats, text_feats = [], []
        for batch in loader:
            batch = {k: v.to(self.device) for k, v in batch.items()}
            with autocast(enabled=self.cfg.amp):  # expect: AMP009
                a, _ = self.model.encode_audio(batch["wave"], batch["wave_lens"])
                t = self.model.encode_text(batch["input_ids"], batch["attention_mask"])
            audio_feats.append(a.float())
            text_feats.append(t.float())
        sims = torch.cat(audio_feats) @ torch.cat(text_feats).T
        ranks = (sims > sims.diag()[:, None]).sum(dim=1)
        self.model.train()
        return {"a2t_R@1": (ranks < 1).float().mean().item(), "a2t_R@10": (ranks < 10).float().mean().item()}


def linear_probe(model, train_loader, num_classes, device, epochs=10):
    """ESC-50 style probe on frozen audio embeddings."""
    head = nn.Linear(model.embed_dim, num_classes).to(device)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010
    model.eval()
    for _ in range(epochs):
        for wave, wave_lens, y in train_loader:
            wave, wave_lens, y = wave.to(device), wave_lens.to(device), y.to(device)
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                emb, _ = model.encode_audio(wave, wave_lens)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(head(emb.float()), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return head


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--train-shards", required=True)
    p.add_argument("--val-shards", required=True)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--total-steps", type=int, default=200_000)
    p.add_argument("--accum-steps", type=int, default=1)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--tag-weight", type=float, default=0.1)
    p.add_argument("--freeze-text", action="store_true")
    p.add_argument("--amp", action="store_true")
    p.add_argument("--out", default="ckpt/clap")
    cfg = p.parse_args()

    from data import build_audio_text_loader  # webdataset pipeline, not part of this file

    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("nccl")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)

    model = CLAP().to(device)
    trainer = ClapTrainer(model, cfg, device, world_size=world, rank=rank)
    train_loader = build_audio_text_loader(cfg.train_shards, batch_size=128, train=True)
    val_loader = build_audio_text_loader(cfg.val_shards, batch_size=256, train=False)
    micro = 0
    while trainer.step < cfg.total_steps:
        for batch in train_loader:
            stats = trainer.train_step(batch, micro)
            micro += 1
            if rank == 0 and trainer.step % 100 == 0 and micro % cfg.accum_steps == 0:
                print({k: round(v, 4) for k, v in stats.items()}, flush=True)
            if trainer.step % 5000 == 0 and micro % cfg.accum_steps == 0 and rank == 0:
                print(trainer.evaluate_retrieval(val_loader))
                os.makedirs(cfg.out, exist_ok=True)
                torch.save({"model": model.state_dict(), "step": trainer.step}, os.path.join(cfg.out, f"step{trainer.step}.pt"))
            if trainer.step >= cfg.total_steps:
                break


if __name__ == "__main__":
    main()
