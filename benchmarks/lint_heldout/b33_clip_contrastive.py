"""Contrastive image-text pretraining (CLIP-style) with fp16 autocast and GradScaler.

Two transformer towers, a symmetric InfoNCE loss and an optional VICReg-style
variance term that keeps the embedding dimensions from collapsing early on.
"""
import argparse
import copy
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from data import build_pair_dataset  # local module: (image, token ids, pad mask)


class PatchEmbed(nn.Module):
    def __init__(self, img_size=224, patch_size=16, in_chans=3, dim=512):
        super().__init__()
        self.num_patches = (img_size // patch_size) ** 2
        self.proj = nn.Conv2d(in_chans, dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, dim, num_heads=8):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, pad_mask=None):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = (q @ k.transpose(-2, -1)) * self.scale
        if pad_mask is not None:
            attn = attn.masked_fill(~pad_mask[:, None, None, :], -1e9)  # expect: AMP007
        attn = attn.softmax(dim=-1)
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self.out(x)


class Block(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=4.0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads)
        self.ln_2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x, pad_mask=None):
        x = x + self.attn(self.ln_1(x), pad_mask)
        x = x + self.mlp(self.ln_2(x))
        return x


class VisionTower(nn.Module):
    def __init__(self, img_size, patch_size, width, depth, heads, embed_dim):
        super().__init__()
        self.patch_embed = PatchEmbed(img_size, patch_size, 3, width)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches, width))
        self.blocks = nn.ModuleList([Block(width, heads) for _ in range(depth)])
        self.ln_post = nn.LayerNorm(width)
        self.proj = nn.Linear(width, embed_dim, bias=False)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def forward(self, images):
        x = self.patch_embed(images) + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        # project every patch token, then average (no CLS token)
        x = self.proj(self.ln_post(x))
        return x.mean(dim=1)  # expect: AMP004


class TextTower(nn.Module):
    def __init__(self, vocab_size, context_length, width, depth, heads, embed_dim):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.positional_embedding = nn.Parameter(torch.empty(context_length, width))
        self.blocks = nn.ModuleList([Block(width, heads) for _ in range(depth)])
        self.ln_final = nn.LayerNorm(width)
        self.proj = nn.Linear(width, embed_dim, bias=False)
        nn.init.normal_(self.positional_embedding, std=0.01)

    def forward(self, ids, pad_mask):
        x = self.token_embedding(ids) + self.positional_embedding[: ids.size(1)]
        for blk in self.blocks:
            x = blk(x, pad_mask)
        x = self.ln_final(x)
        # features of the EOT token (highest id in each sequence)
        x = x[torch.arange(x.shape[0], device=x.device), ids.argmax(dim=-1)]
        return self.proj(x)


class CLIP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.visual = VisionTower(cfg.img_size, cfg.patch_size, cfg.vision_width, cfg.vision_depth, cfg.vision_heads, cfg.embed_dim)
        self.text = TextTower(cfg.vocab_size, cfg.context_length, cfg.text_width, cfg.text_depth, cfg.text_heads, cfg.embed_dim)
        self.logit_scale = nn.Parameter(torch.ones([]) * math.log(1 / 0.07))

    def encode_image(self, images):
        return self.visual(images)

    def encode_text(self, ids, pad_mask):
        return self.text(ids, pad_mask)

    def forward(self, images, ids, pad_mask):
        image_embeds = self.encode_image(images)
        text_embeds = self.encode_text(ids, pad_mask)
        return image_embeds, text_embeds, self.logit_scale.exp()


def build_model(cfg):
    return CLIP(cfg)


class ClipLoss(nn.Module):
    def __init__(self, label_smoothing=0.0):
        super().__init__()
        self.label_smoothing = label_smoothing

    def forward(self, image_embeds, text_embeds, logit_scale):
        image_embeds = F.normalize(image_embeds, dim=-1)
        text_embeds = F.normalize(text_embeds, dim=-1)
        logits_per_image = logit_scale * image_embeds @ text_embeds.t()
        labels = torch.arange(logits_per_image.size(0), device=logits_per_image.device)
        loss_i = F.cross_entropy(logits_per_image, labels, label_smoothing=self.label_smoothing)
        loss_t = F.cross_entropy(logits_per_image.t(), labels, label_smoothing=self.label_smoothing)
        return (loss_i + loss_t) / 2


def variance_loss(z, gamma=1.0):
    """VICReg variance term: hinge on the per-dimension std over the batch."""
    std = torch.sqrt(z.var(dim=0) + 1e-4)  # expect: AMP004
    return F.relu(gamma - std).mean()  # expect: AMP004


class ModelEMA:
    def __init__(self, model, decay=0.9995):
        self.module = copy.deepcopy(model).eval()
        self.decay = decay
        for p in self.module.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        for ema_p, p in zip(self.module.parameters(), model.parameters()):
            ema_p.lerp_(p.detach(), 1.0 - self.decay)


class Trainer:
    def __init__(self, cfg):
        self.cfg = cfg
        self.device = torch.device("cuda")
        model = build_model(cfg).to(self.device)
        self.unwrapped = model
        self.model = torch.compile(model) if cfg.compile else model
        self.ema = ModelEMA(model, cfg.ema_decay)
        self.criterion = ClipLoss(cfg.label_smoothing)
        decay, no_decay = [], []
        for n, p in model.named_parameters():
            (no_decay if p.ndim < 2 or "logit_scale" in n else decay).append(p)
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(0.9, 0.98), eps=1e-6,
        )
        self.scaler = torch.amp.GradScaler("cuda", enabled=cfg.amp)
        self.step = 0

    def train_step(self, batch, it):
        images, ids, pad_mask = (t.to(self.device, non_blocking=True) for t in batch)
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.cfg.amp):
            img_emb, txt_emb, logit_scale = self.model(images, ids, pad_mask)
            loss = self.criterion(img_emb, txt_emb, logit_scale)
            if self.cfg.var_weight > 0:
                loss = loss + self.cfg.var_weight * (variance_loss(img_emb) + variance_loss(txt_emb))
            loss = loss / self.cfg.accum_steps
        self.scaler.scale(loss).backward()

        if (it + 1) % self.cfg.accum_steps == 0:
            self.scaler.unscale_(self.optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip_grad)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            self.ema.update(self.unwrapped)
            with torch.no_grad():
                self.unwrapped.logit_scale.clamp_(0, math.log(100))
            self.step += 1

            if self.step % self.cfg.log_every == 0:
                with torch.no_grad():
                    img_n = F.normalize(img_emb.detach(), dim=-1)  # expect: AMP011
                    txt_n = F.normalize(txt_emb.detach(), dim=-1)  # expect: AMP011
                    target = torch.arange(img_n.size(0), device=img_n.device)
                    acc = (img_n @ txt_n.t()).argmax(dim=-1).eq(target).float().mean().item()
                    txt_norm = txt_emb.detach().float().norm(dim=-1).mean().item()
                print(f"step {self.step} loss {loss.item() * self.cfg.accum_steps:.4f} "
                      f"acc {acc:.3f} |t| {txt_norm:.2f} gnorm {grad_norm.item():.2f} "
                      f"scale {self.scaler.get_scale():.0f}")

    @torch.no_grad()
    def evaluate(self, loader):
        model = self.ema.module
        correct, total, diag = 0, 0, 0.0
        for images, ids, pad_mask in loader:
            images, ids, pad_mask = images.to(self.device), ids.to(self.device), pad_mask.to(self.device)
            with torch.autocast("cuda", dtype=torch.float16, enabled=self.cfg.amp):
                img = model.encode_image(images)
                txt = model.encode_text(ids, pad_mask)
                sims = img @ txt.t()
                diag += sims.diagonal().mean().item()
            img = F.normalize(img.float(), dim=-1)
            txt = F.normalize(txt.float(), dim=-1)
            pred = (img @ txt.t()).argmax(dim=-1)
            correct += (pred == torch.arange(len(pred), device=pred.device)).sum().item()
            total += len(pred)
        return correct / max(total, 1), diag / max(len(loader), 1)

    def fit(self, train_loader, val_loader, epochs):
        best = float("-inf")
        for epoch in range(epochs):
            self.model.train()
            t0 = time.time()
            for it, batch in enumerate(train_loader):
                self.train_step(batch, it)
            acc, mean_diag = self.evaluate(val_loader)
            print(f"epoch {epoch} val i2t@1 {acc:.4f} diag {mean_diag:.3f} ({time.time() - t0:.0f}s)")
            if acc > best:
                best = acc
                torch.save({"model": self.unwrapped.state_dict(), "ema": self.ema.module.state_dict()}, self.cfg.out)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--img-size", dest="img_size", type=int, default=224)
    p.add_argument("--patch-size", dest="patch_size", type=int, default=16)
    p.add_argument("--vision-width", dest="vision_width", type=int, default=768)
    p.add_argument("--vision-depth", dest="vision_depth", type=int, default=12)
    p.add_argument("--vision-heads", dest="vision_heads", type=int, default=12)
    p.add_argument("--vocab-size", dest="vocab_size", type=int, default=49408)
    p.add_argument("--context-length", dest="context_length", type=int, default=77)
    p.add_argument("--text-width", dest="text_width", type=int, default=512)
    p.add_argument("--text-depth", dest="text_depth", type=int, default=12)
    p.add_argument("--text-heads", dest="text_heads", type=int, default=8)
    p.add_argument("--embed-dim", dest="embed_dim", type=int, default=512)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--weight-decay", dest="weight_decay", type=float, default=0.2)
    p.add_argument("--label-smoothing", dest="label_smoothing", type=float, default=0.0)
    p.add_argument("--var-weight", dest="var_weight", type=float, default=0.04)
    p.add_argument("--accum-steps", dest="accum_steps", type=int, default=4)
    p.add_argument("--clip-grad", dest="clip_grad", type=float, default=1.0)
    p.add_argument("--ema-decay", dest="ema_decay", type=float, default=0.9995)
    p.add_argument("--batch-size", dest="batch_size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=32)
    p.add_argument("--log-every", dest="log_every", type=int, default=50)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--out", default="clip.pt")
    return p.parse_args()


def main():
    cfg = parse_args()
    train_set, val_set = build_pair_dataset(cfg.data, cfg.img_size, cfg.context_length)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, shuffle=True, num_workers=8, drop_last=True, pin_memory=True)
    val_loader = DataLoader(val_set, batch_size=cfg.batch_size, num_workers=8)
    Trainer(cfg).fit(train_loader, val_loader, cfg.epochs)


if __name__ == "__main__":
    main()
