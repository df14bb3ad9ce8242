"""Flamingo-style visual adapters for a frozen causal language model.

A Perceiver resampler turns cached vision-encoder patch features into a fixed
number of latents per frame; gated cross-attention blocks are inserted before
every `cross_attn_every`-th decoder layer of the frozen LM. An auxiliary
text-media contrastive term aligns pooled text and media embeddings.
"""
import argparse
import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange, repeat
from transformers import AutoModelForCausalLM, AutoTokenizer


class FeedForward(nn.Module):
    def __init__(self, dim, mult=4):
        super().__init__()
        inner = int(dim * mult)
        self.net = nn.Sequential(
            nn.LayerNorm(dim), nn.Linear(dim, inner, bias=False), nn.GELU(), nn.Linear(inner, dim, bias=False))

    def forward(self, x):
        return self.net(x)


class PerceiverAttention(nn.Module):
    def __init__(self, dim, dim_head=64, heads=8):
        super().__init__()
        self.scale, self.heads = dim_head ** -0.5, heads
        inner = dim_head * heads
        self.norm_media = nn.LayerNorm(dim)
        self.norm_latents = nn.LayerNorm(dim)
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_kv = nn.Linear(dim, inner * 2, bias=False)
        self.to_out = nn.Linear(inner, dim, bias=False)

    def forward(self, x, latents, media_mask=None):
        x = self.norm_media(x)
        latents = self.norm_latents(latents)
        q = self.to_q(latents)
        k, v = self.to_kv(torch.cat((x, latents), dim=-2)).chunk(2, dim=-1)
        q, k, v = (rearrange(t, "b t n (h d) -> b h t n d", h=self.heads) for t in (q, k, v))
        sim = torch.einsum("... i d, ... j d -> ... i j", q * self.scale, k)
        if media_mask is not None:
            key_mask = torch.cat([media_mask, media_mask.new_ones(latents.shape[:3])], dim=-1)
            sim = sim.masked_fill(~key_mask[:, None, :, None, :], torch.finfo(sim.dtype).min)
        sim = sim - sim.amax(dim=-1, keepdim=True).detach()
        attn = sim.softmax(dim=-1)
        out = torch.einsum("... i j, ... j d -> ... i d", attn, v)
        return self.to_out(rearrange(out, "b h t n d -> b t n (h d)"))


class PerceiverResampler(nn.Module):
    def __init__(self, dim, depth=6, dim_head=64, heads=8, num_latents=64, max_num_frames=8, ff_mult=4):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(num_latents, dim))
        self.frame_embs = nn.Parameter(torch.randn(max_num_frames, dim))
        self.layers = nn.ModuleList([
            nn.ModuleList([PerceiverAttention(dim, dim_head, heads), FeedForward(dim, ff_mult)])
            for _ in range(depth)
        ])
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, media_mask=None):
        b, T = x.shape[:2]
        x = x + self.frame_embs[:T].unsqueeze(1)
        latents = repeat(self.latents, "n d -> b T n d", b=b, T=T)
        for attn, ff in self.layers:
            latents = attn(x, latents, media_mask) + latents
            latents = ff(latents) + latents
        return self.norm(latents)


class MaskedCrossAttention(nn.Module):
    def __init__(self, dim, dim_visual, dim_head=64, heads=8, only_attend_immediate_media=True):
        super().__init__()
        self.scale, self.heads = dim_head ** -0.5, heads
        inner = dim_head * heads
        self.norm = nn.LayerNorm(dim)
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_kv = nn.Linear(dim_visual, inner * 2, bias=False)
        self.to_out = nn.Linear(inner, dim, bias=False)
        self.only_attend_immediate_media = only_attend_immediate_media

    def forward(self, x, media, media_locations=None):
        T_img, n = media.shape[1:3]
        q = self.to_q(self.norm(x))
        k, v = self.to_kv(rearrange(media, "b t n d -> b (t n) d")).chunk(2, dim=-1)
        q, k, v = (rearrange(t, "b n (h d) -> b h n d", h=self.heads) for t in (q, k, v))
        sim = (q * self.scale) @ k.transpose(-2, -1)
        if media_locations is not None:
            text_time = media_locations.cumsum(dim=-1)
            media_time = torch.arange(T_img, device=x.device) + 1
            mask_op = torch.eq if self.only_attend_immediate_media else torch.ge
            text_to_media_mask = mask_op(
                rearrange(text_time, "b i -> b 1 i 1"), repeat(media_time, "j -> 1 1 1 (j n)", n=n))
            sim = torch.where(text_to_media_mask, sim, torch.tensor(-1e9, device=sim.device))  # expect: AMP007
        sim = sim - sim.amax(dim=-1, keepdim=True).detach()
        attn = sim.softmax(dim=-1)
        if media_locations is not None and self.only_attend_immediate_media:
            text_without_media = rearrange(text_time == 0, "b i -> b 1 i 1")
            attn = attn.masked_fill(text_without_media, 0.0)
        out = rearrange(attn @ v, "b h n d -> b n (h d)")
        return self.to_out(out)


class GatedCrossAttentionBlock(nn.Module):
    def __init__(self, dim, dim_visual, dim_head=64, heads=8, ff_mult=4):
        super().__init__()
        self.attn = MaskedCrossAttention(dim, dim_visual, dim_head, heads)
        self.attn_gate = nn.Parameter(torch.tensor([0.0]))
        self.ff = FeedForward(dim, ff_mult)
        self.ff_gate = nn.Parameter(torch.tensor([0.0]))

    def forward(self, x, media, media_locations=None):
        x = self.attn(x, media, media_locations) * self.attn_gate.tanh() + x
        return self.ff(x) * self.ff_gate.tanh() + x


class FlamingoLayer(nn.Module):
    def __init__(self, gated_xattn, decoder_layer):
        super().__init__()
        self.gated_xattn = gated_xattn
        self.decoder_layer = decoder_layer
        self.media = None
        self.media_locations = None

    def condition(self, media, media_locations):
        self.media, self.media_locations = media, media_locations

    def forward(self, hidden_states, *args, **kwargs):
        if self.gated_xattn is not None and self.media is not None:
            hidden_states = self.gated_xattn(hidden_states, self.media, self.media_locations)
        return self.decoder_layer(hidden_states, *args, **kwargs)


class FlamingoModel(nn.Module):
    def __init__(self, lm, media_token_id, vis_dim=1024, cross_attn_every=4, align_dim=256, itc_weight=0.1):
        super().__init__()
        self.lm = lm
        self.media_token_id = media_token_id
        self.itc_weight = itc_weight
        lm_dim = lm.config.hidden_size
        self.perceiver = PerceiverResampler(vis_dim)
        layers = lm.model.layers
        self.xattn_layers = nn.ModuleDict({
            str(i): GatedCrossAttentionBlock(lm_dim, vis_dim)
            for i in range(len(layers)) if (i + 1) % cross_attn_every == 0
        })
        lm.model.layers = nn.ModuleList([
            FlamingoLayer(self.xattn_layers[str(i)] if str(i) in self.xattn_layers else None, layer)
            for i, layer in enumerate(layers)
        ])
        self.text_proj = nn.Linear(lm_dim, align_dim)
        self.media_proj = nn.Linear(vis_dim, align_dim)
        self.logit_scale = math.log(1 / 0.07)

    def _alignment_logits(self, hidden, media):
        text_emb = self.text_proj(hidden).mean(dim=1)  # expect: AMP004
        media_emb = self.media_proj(media).mean(dim=(1, 2))  # expect: AMP004
        text_emb = F.normalize(text_emb, dim=-1)
        media_emb = F.normalize(media_emb, dim=-1)
        return text_emb @ media_emb.t() * math.exp(self.logit_scale)

    def forward(self, vis_feats, input_ids, attention_mask, labels=None, media_mask=None):
        media = self.perceiver(vis_feats, media_mask)
        media_locations = input_ids == self.media_token_id
        for layer in self.lm.model.layers:
            layer.condition(media, media_locations)
        out = self.lm(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                      output_hidden_states=labels is not None)
        result = {"logits": out.logits, "media_std": media.detach().std()}
        if labels is not None:
            logits = self._alignment_logits(out.hidden_states[-1], media)
            targets = torch.arange(logits.size(0), device=logits.device)
            itc = (F.cross_entropy(logits, targets) + F.cross_entropy(logits.t(), targets)) / 2
            result.update(lm_loss=out.loss, itc_loss=itc, loss=out.loss + self.itc_weight * itc)
        return result


def load_frozen_lm(name):
    lm = AutoModelForCausalLM.from_pretrained(name)
    lm = lm.half().eval()
    lm.requires_grad_(False)
    return lm


def trainable_params(model):
    return [p for p in model.parameters() if p.requires_grad]


def train_one_epoch(model, loader, optimizer, scheduler, scaler, epoch, args):
    model.train()
    for step, batch in enumerate(loader):
        vis_feats = batch["vis_feats"].to(args.device, dtype=torch.float16, non_blocking=True)  # expect: AMP001
        input_ids = batch["input_ids"].to(args.device, non_blocking=True)
        attention_mask = batch["attention_mask"].to(args.device, non_blocking=True)
        media_mask = batch["media_mask"].to(args.device, non_blocking=True)
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        labels[labels == model.media_token_id] = -100
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(vis_feats, input_ids, attention_mask, labels=labels, media_mask=media_mask)
        loss = out["loss"] / args.grad_accum
        scaler.scale(loss).backward()
        if (step + 1) % args.grad_accum == 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(trainable_params(model), args.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
        if step % args.log_every == 0:
            gates = torch.stack([blk.attn_gate.detach() for blk in model.xattn_layers.values()])
            print(f"epoch {epoch} step {step} lm {out['lm_loss'].item():.4f} itc {out['itc_loss'].item():.4f} "
                  f"media_std {out['media_std'].item():.3f} |gate| {gates.tanh().abs().mean().item():.4f}")


@torch.no_grad()
def generate_captions(model, vision_encoder, tokenizer, images, prompt, args, max_new_tokens=20):
    model.eval()
    cast_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.precision, torch.float32)
    images = images.to(args.device, dtype=cast_dtype, non_blocking=True)
    vis_feats = vision_encoder(images)
    enc = tokenizer([prompt] * images.size(0), return_tensors="pt").to(args.device)
    input_ids = enc.input_ids
    for _ in range(max_new_tokens):
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(vis_feats, input_ids, torch.ones_like(input_ids))["logits"][:, -1]
        input_ids = torch.cat([input_ids, logits.argmax(-1, keepdim=True)], dim=1)
    return tokenizer.batch_decode(input_ids, skip_special_tokens=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lm", default="facebook/opt-1.3b")
    parser.add_argument("--data", default="data/mmc4_cached_feats.pt")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precision", default="fp16")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--grad-accum", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--log-every", type=int, default=50)
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.lm)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    lm = load_frozen_lm(args.lm)
    model = FlamingoModel(lm, tokenizer.convert_tokens_to_ids("<image>")).to(args.device)
    loader = torch.utils.data.DataLoader(torch.load(args.data), batch_size=args.batch_size, shuffle=True)
    optimizer = torch.optim.AdamW(trainable_params(model), lr=args.lr, eps=1e-8, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(loader) // args.grad_accum)
    scaler = torch.amp.GradScaler("cuda")
    for epoch in range(args.epochs):
        train_one_epoch(model, loader, optimizer, scheduler, scaler, epoch, args)
        torch.save({k: v for k, v in model.state_dict().items() if not k.startswith("lm.")}, "adapter.pt")


if __name__ == "__main__":
    main()
