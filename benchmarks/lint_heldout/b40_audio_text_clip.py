"""Contrastive audio-text pre-training (CLAP-style) with a momentum audio encoder:
symmetric InfoNCE plus queue negatives and masked audio-audio negatives, a DINO-style
self-distillation head on augmented audio (teacher centring), and masked language
modelling on the text tower.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class CLAPConfig:
    n_mels: int = 64
    audio_dim: int = 384
    text_dim: int = 384
    vocab_size: int = 30522
    max_text_len: int = 64
    embed_dim: int = 256
    num_protos: int = 1024
    depth: int = 4
    heads: int = 6
    queue_size: int = 4096
    momentum: float = 0.995
    center_momentum: float = 0.9
    teacher_temp: float = 0.04
    student_temp: float = 0.1
    distill_weight: float = 0.5
    mlm_weight: float = 0.1
    lr: float = 1e-4
    epochs: int = 10


@dataclass
class CLAPOutput:
    audio_embed: torch.Tensor
    text_embed: torch.Tensor
    student_logits: torch.Tensor
    teacher_probs: torch.Tensor
    key_m: torch.Tensor
    mlm_logits: torch.Tensor
    logit_scale: torch.Tensor


class Block(nn.Module):
    def __init__(self, dim, heads, mlp_ratio=4):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim * mlp_ratio), nn.GELU(), nn.Linear(dim * mlp_ratio, dim))

    def forward(self, x, key_padding_mask=None):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, key_padding_mask=key_padding_mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class AudioEncoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.frontend = nn.Sequential(
            nn.Conv1d(cfg.n_mels, cfg.audio_dim, 3, padding=1), nn.GELU(),
            nn.Conv1d(cfg.audio_dim, cfg.audio_dim, 3, stride=2, padding=1), nn.GELU(),
        )
        self.pos = nn.Parameter(torch.zeros(1, 1024, cfg.audio_dim))
        self.blocks = nn.ModuleDict({f"layer{i}": Block(cfg.audio_dim, cfg.heads) for i in range(cfg.depth)})
        self.norm = nn.LayerNorm(cfg.audio_dim)
        self.frame_proj = nn.Linear(cfg.audio_dim, cfg.audio_dim)

    def forward(self, mel):  # mel: (B, n_mels, T)
        x = self.frontend(mel).transpose(1, 2)
        x = x + self.pos[:, : x.size(1)]
        for block in self.blocks.values():
            x = block(x)
        frames = self.frame_proj(self.norm(x))
        return torch.cat([frames.mean(dim=1), frames.amax(dim=1)], dim=-1)  # expect: AMP004


class TextEncoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.text_dim)
        self.pos = nn.Embedding(cfg.max_text_len, cfg.text_dim)
        self.blocks = nn.ModuleList([Block(cfg.text_dim, cfg.heads) for _ in range(cfg.depth)])
        self.norm = nn.LayerNorm(cfg.text_dim)

    def forward(self, tokens, attention_mask):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.size(1), device=tokens.device))[None]
        pad = attention_mask == 0
        for block in self.blocks:
            x = block(x, key_padding_mask=pad)
        x = self.norm(x)
        m = attention_mask.unsqueeze(-1).to(x.dtype)
        return x, (x * m).sum(1) / m.sum(1).clamp(min=1.0)


class ProjectionHead(nn.Module):
    def __init__(self, din, dout, hidden=None):
        super().__init__()
        hidden = hidden or din
        self.net = nn.Sequential(nn.Linear(din, hidden), nn.GELU(), nn.Linear(hidden, dout))

    def forward(self, x):
        return self.net(x)


class AudioTextModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.audio_encoder = AudioEncoder(cfg)
        self.text_encoder = TextEncoder(cfg)
        self.audio_proj = ProjectionHead(2 * cfg.audio_dim, cfg.embed_dim)
        self.text_proj = ProjectionHead(cfg.text_dim, cfg.embed_dim)
        self.proto_head = ProjectionHead(2 * cfg.audio_dim, cfg.num_protos)
        self.mlm_head = nn.Linear(cfg.text_dim, cfg.vocab_size)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        # momentum (teacher) towers, MoCo-style: fresh modules initialised from the online ones
        self.audio_encoder_m = AudioEncoder(cfg)
        self.audio_proj_m = ProjectionHead(2 * cfg.audio_dim, cfg.embed_dim)
        self.proto_head_m = ProjectionHead(2 * cfg.audio_dim, cfg.num_protos)
        for online, target in self._momentum_pairs():
            target.load_state_dict(online.state_dict())
            target.requires_grad_(False)
        self.register_buffer("audio_queue", F.normalize(torch.randn(cfg.embed_dim, cfg.queue_size), dim=0))
        self.register_buffer("queue_ptr", torch.zeros((), dtype=torch.long))
        self.register_buffer("center", torch.zeros(1, cfg.num_protos))

    def _momentum_pairs(self):
        return ((self.audio_encoder, self.audio_encoder_m), (self.audio_proj, self.audio_proj_m),
                (self.proto_head, self.proto_head_m))

    @torch.no_grad()
    def momentum_update(self):
        m = self.cfg.momentum
        for online, target in self._momentum_pairs():
            for p, pm in zip(online.parameters(), target.parameters()):
                pm.mul_(m).add_(p.detach(), alpha=1 - m)

    @torch.no_grad()
    def update_center(self, teacher_logits):
        batch_center = teacher_logits.mean(dim=0, keepdim=True)  # expect: AMP004
        self.center.mul_(self.cfg.center_momentum).add_(batch_center, alpha=1 - self.cfg.center_momentum)

    @torch.no_grad()
    def enqueue(self, keys):
        bs, ptr = keys.size(0), int(self.queue_ptr)
        self.audio_queue[:, ptr:ptr + bs] = keys.t().float()
        self.queue_ptr.fill_((ptr + bs) % self.cfg.queue_size)

    def forward(self, mel, mel_aug, tokens, attention_mask, mlm_tokens):
        a_feat = self.audio_encoder(mel)
        _, t_pooled = self.text_encoder(tokens, attention_mask)
        student_logits = self.proto_head(self.audio_encoder(mel_aug))
        with torch.no_grad():
            feat_m = self.audio_encoder_m(mel)
            key_m = F.normalize(self.audio_proj_m(feat_m), dim=-1)
            teacher_logits = self.proto_head_m(feat_m)
        teacher_probs = F.softmax((teacher_logits - self.center) / self.cfg.teacher_temp, dim=-1)
        self.update_center(teacher_logits)
        mlm_hidden, _ = self.text_encoder(mlm_tokens, attention_mask)
        return CLAPOutput(
            audio_embed=self.audio_proj(a_feat),
            text_embed=self.text_proj(t_pooled),
            student_logits=student_logits,
            teacher_probs=teacher_probs,
            key_m=key_m,
            mlm_logits=self.mlm_head(mlm_hidden),
            logit_scale=self.logit_scale,
        )


class ContrastiveLoss(nn.Module):
    def __init__(self, intra_weight=0.1):
        super().__init__()
        self.intra_weight = intra_weight

    def forward(self, out, queue):
        a = F.normalize(out.audio_embed, dim=-1)
        t = F.normalize(out.text_embed, dim=-1)
        scale = out.logit_scale.exp().clamp(max=100.0)
        logits_at = scale * a @ t.t()
        labels = torch.arange(a.size(0), device=a.device)
        loss = (F.cross_entropy(logits_at, labels) + F.cross_entropy(logits_at.t(), labels)) / 2
        logits_aq = scale * a @ queue.to(a.dtype)
        sim_aa = a @ a.t()
        sim_aa = sim_aa.masked_fill(torch.eye(a.size(0), dtype=torch.bool, device=a.device), -1e9)  # expect: AMP007
        negatives = torch.cat([logits_at, logits_aq, scale * sim_aa], dim=1)
        return loss + self.intra_weight * F.cross_entropy(negatives, labels)


def distillation_loss(student_logits, teacher_probs, temp):
    return torch.sum(-teacher_probs * F.log_softmax(student_logits / temp, dim=-1), dim=-1).mean()


def spec_augment(mel, max_f=8, max_t=20):
    b, f, t = mel.shape
    f0 = torch.randint(0, f - max_f, (b, 1, 1), device=mel.device)
    t0 = torch.randint(0, t - max_t, (b, 1, 1), device=mel.device)
    fi = torch.arange(f, device=mel.device)[None, :, None]
    ti = torch.arange(t, device=mel.device)[None, None, :]
    mask = ((fi >= f0) & (fi < f0 + max_f)) | ((ti >= t0) & (ti < t0 + max_t))
    return mel.masked_fill(mask, 0.0)


def train(model, loader, optimizer, scaler, cfg, device="cuda"):
    criterion = ContrastiveLoss()
    unwrapped = model.module if hasattr(model, "module") else model
    model.train()
    for it, batch in enumerate(loader):
        mel = batch["mel"].to(device, dtype=torch.float16)  # expect: AMP001
        tokens = batch["tokens"].to(device)
        attention_mask = batch["attention_mask"].to(device)
        mlm_tokens, mlm_labels = batch["mlm_tokens"].to(device), batch["mlm_labels"].to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(mel, spec_augment(mel), tokens, attention_mask, mlm_tokens)
            loss = criterion(out, unwrapped.audio_queue.clone())
            loss = loss + cfg.distill_weight * distillation_loss(out.student_logits, out.teacher_probs, cfg.student_temp)
        mlm_loss = F.cross_entropy(out.mlm_logits.flatten(0, 1), mlm_labels.flatten(), ignore_index=-100)  # expect: AMP002
        loss = loss + cfg.mlm_weight * mlm_loss
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        unwrapped.momentum_update()
        unwrapped.enqueue(out.key_m)
        with torch.no_grad():
            unwrapped.logit_scale.clamp_(0, math.log(100))
        a_det = F.normalize(out.audio_embed.detach(), dim=-1)  # expect: AMP011
        t_det = F.normalize(out.text_embed.detach().float(), dim=-1)
        r1 = ((a_det.float() @ t_det.t()).argmax(-1) == torch.arange(a_det.size(0), device=device)).float().mean()
        if it % 50 == 0:
            print(f"it {it} loss {loss.item():.4f} mlm {mlm_loss.item():.3f} R@1 {r1.item():.3f}")


@torch.no_grad()
def evaluate_retrieval(model, loader, device="cuda"):
    model.eval()
    audio, text = [], []
    for batch in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            a = model.audio_proj(model.audio_encoder(batch["mel"].to(device)))
            _, t_pooled = model.text_encoder(batch["tokens"].to(device), batch["attention_mask"].to(device))
            t = model.text_proj(t_pooled)
        audio.append(F.normalize(a.float(), dim=-1))
        text.append(F.normalize(t.float(), dim=-1))
    sim = torch.cat(audio) @ torch.cat(text).t()
    ranks = (sim.argsort(dim=-1, descending=True) == torch.arange(sim.size(0), device=sim.device)[:, None]).nonzero()[:, 1]
    model.train()
    return {"R@1": (ranks < 1).float().mean().item(), "R@10": (ranks < 10).float().mean().item()}


def synthetic_loader(cfg, n_batches=100, batch=32, frames=400):
    for _ in range(n_batches):
        tokens = torch.randint(1000, cfg.vocab_size, (batch, cfg.max_text_len))
        mlm_mask = torch.rand(tokens.shape) < 0.15
        yield {
            "mel": torch.randn(batch, cfg.n_mels, frames),
            "tokens": tokens,
            "attention_mask": torch.ones_like(tokens),
            "mlm_tokens": tokens.masked_fill(mlm_mask, 103),
            "mlm_labels": tokens.masked_fill(~mlm_mask, -100),
        }


def main():
    cfg = CLAPConfig()
    model = AudioTextModel(cfg).cuda()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.2, betas=(0.9, 0.98))
    scaler = torch.amp.GradScaler("cuda")
    for epoch in range(cfg.epochs):
        train(model, synthetic_loader(cfg), optimizer, scaler, cfg)
        print(epoch, evaluate_retrieval(model, synthetic_loader(cfg, n_batches=4)))
        torch.save(model.state_dict(), f"clap_{epoch:02d}.pt")


if __name__ == "__main__":
    main()
