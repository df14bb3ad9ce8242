"""Contrastive image-text pretraining (CLIP) with a learnable temperature.

Single-file version of the loop we use for the internal retrieval models, modelled on
open_clip's ``train_one_epoch``. Precision is chosen with ``--precision``
(``amp``, ``amp_bf16``, ``fp32``); gradient accumulation splits the batch into
micro-batches and only all-reduces on the last one.
"""
import argparse
import logging
import math
import time
from contextlib import suppress
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def get_autocast(precision):
    if precision == "amp":
        return partial(torch.autocast, device_type="cuda", dtype=torch.float16)
    if precision in ("amp_bf16", "amp_bfloat16"):
        return partial(torch.autocast, device_type="cuda", dtype=torch.bfloat16)
    return suppress


def unwrap_model(model):
    return model.module if hasattr(model, "module") else model


class ResidualAttentionBlock(nn.Module):
    def __init__(self, d_model, n_head, causal=False, mlp_ratio=4.0):
        super().__init__()
        self.n_head = n_head
        self.causal = causal
        self.ln_1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.ln_2 = nn.LayerNorm(d_model)
        hidden = int(d_model * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(), nn.Linear(hidden, d_model))

    def attention(self, x, key_padding_mask=None):
        B, L, C = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
        if self.causal:
            future = attn.new_full((L, L), -1e9).triu_(1)  # expect: AMP007
            attn = attn + future
        if key_padding_mask is not None:
            attn = attn.masked_fill(key_padding_mask[:, None, None, :], torch.finfo(attn.dtype).min)
        attn = attn.softmax(dim=-1)
        return self.out_proj((attn @ v).transpose(1, 2).reshape(B, L, C))

    def forward(self, x, key_padding_mask=None):
        x = x + self.attention(self.ln_1(x), key_padding_mask)
        return x + self.mlp(self.ln_2(x))


class VisionTransformer(nn.Module):
    def __init__(self, image_size=224, patch_size=16, width=768, layers=12, heads=12, output_dim=512, pool="tok"):
        super().__init__()
        self.pool = pool
        self.conv1 = nn.Conv2d(3, width, kernel_size=patch_size, stride=patch_size, bias=False)
        scale = width ** -0.5
        self.class_embedding = nn.Parameter(scale * torch.randn(width))
        self.positional_embedding = nn.Parameter(scale * torch.randn((image_size // patch_size) ** 2 + 1, width))
        self.ln_pre = nn.LayerNorm(width)
        self.blocks = nn.ModuleList([ResidualAttentionBlock(width, heads) for _ in range(layers)])
        self.ln_post = nn.LayerNorm(width)
        self.proj = nn.Linear(width, output_dim, bias=False)

    def forward(self, x):
        x = self.conv1(x).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(x.shape[0], 1, -1)
        x = torch.cat([cls, x], dim=1) + self.positional_embedding
        x = self.ln_pre(x)
        for blk in self.blocks:
            x = blk(x)
        pooled = x[:, 1:].mean(dim=1) if self.pool == "avg" else x[:, 0]
        return self.proj(self.ln_post(pooled))


class CLIP(nn.Module):
    def __init__(self, embed_dim=512, vocab_size=49408, context_length=77, width=512, layers=12, heads=8):
        super().__init__()
        self.visual = VisionTransformer(output_dim=embed_dim)
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.positional_embedding = nn.Parameter(torch.empty(context_length, width).normal_(std=0.01))
        self.blocks = nn.ModuleList([ResidualAttentionBlock(width, heads, causal=True) for _ in range(layers)])
        self.ln_final = nn.LayerNorm(width)
        self.text_projection = nn.Linear(width, embed_dim, bias=False)
        self.logit_scale = nn.Parameter(torch.ones([]) * math.log(1 / 0.07))

    def encode_image(self, image, normalize=True):
        features = self.visual(image)
        return F.normalize(features, dim=-1) if normalize else features

    def encode_text(self, text, normalize=True):
        x = self.token_embedding(text) + self.positional_embedding[: text.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        x = self.ln_final(x)
        x = self.text_projection(x[torch.arange(x.shape[0]), text.argmax(dim=-1)])
        return F.normalize(x, dim=-1) if normalize else x

    def forward(self, image, text):
        return self.encode_image(image), self.encode_text(text), self.logit_scale.exp()


class ClipLoss(nn.Module):
    def __init__(self, rank=0, world_size=1):
        super().__init__()
        self.rank = rank
        self.world_size = world_size
        self._labels = {}

    def _gather(self, features):
        gathered = [torch.zeros_like(features) for _ in range(self.world_size)]
        dist.all_gather(gathered, features)
        gathered[self.rank] = features  # keep the local shard in the graph
        return torch.cat(gathered, dim=0)

    def forward(self, image_features, text_features, logit_scale):
        if self.world_size > 1:
            all_image, all_text = self._gather(image_features), self._gather(text_features)
        else:
            all_image, all_text = image_features, text_features
        logits_per_image = logit_scale * image_features @ all_text.T
        logits_per_text = logit_scale * text_features @ all_image.T
        n = logits_per_image.shape[0]
        if n not in self._labels:
            self._labels[n] = torch.arange(n, device=image_features.device) + n * self.rank
        labels = self._labels[n]
        return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels)) / 2


def backward(total_loss, scaler):
    if scaler is not None:
        scaler.scale(total_loss).backward()
    else:
        total_loss.backward()


def cosine_lr(optimizer, base_lr, warmup, steps):
    def _adjust(step):
        if step < warmup:
            lr = base_lr * (step + 1) / warmup
        else:
            lr = 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))) * base_lr
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    return _adjust


def train_one_epoch(model, loader, loss_fn, epoch, optimizer, scaler, scheduler, args):
    device = torch.device(args.device)
    autocast = get_autocast(args.precision)
    model.train()
    num_batches = len(loader)
    end = time.time()
    for i, (images, texts) in enumerate(loader):
        step = num_batches * epoch + i
        scheduler(step)
        images = images.to(device=device, non_blocking=True)
        texts = texts.to(device=device, non_blocking=True)

        if args.accum_freq == 1:
            with autocast():
                image_features, text_features, logit_scale = model(images, texts)
                total_loss = loss_fn(image_features, text_features, logit_scale)
            backward(total_loss, scaler)
        else:
            chunks = list(zip(images.chunk(args.accum_freq), texts.chunk(args.accum_freq)))
            for j, (img_chunk, txt_chunk) in enumerate(chunks):
                sync_ctx = model.no_sync if j < len(chunks) - 1 else suppress
                with sync_ctx():
                    with autocast():
                        image_features, text_features, logit_scale = model(img_chunk, txt_chunk)
                        total_loss = loss_fn(image_features, text_features, logit_scale) / len(chunks)
                        backward(total_loss, scaler)  # expect: AMP008

        if scaler is not None:
            if args.grad_clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip_norm, norm_type=2.0)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
        else:
            if args.grad_clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip_norm, norm_type=2.0)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        # Note: we clamp to 4.6052 = ln(100), as in the original paper.
        with torch.no_grad():
            unwrap_model(model).logit_scale.clamp_(0, math.log(100))

        if i % args.log_every == 0 and args.rank == 0:
            batch_time = time.time() - end
            end = time.time()
            logging.info(
                f"epoch {epoch} [{i}/{num_batches}] loss {total_loss.item():.4f} "
                f"scale {logit_scale.item():.2f} {args.batch_size / batch_time:.1f} samples/s"
            )


@torch.no_grad()
def evaluate_retrieval(model, loader, args):
    model.eval()
    autocast = get_autocast(args.precision)
    image_feats, text_feats = [], []
    for images, texts in loader:
        with autocast():
            img, txt, _ = model(images.to(args.device), texts.to(args.device))
        image_feats.append(img.float())
        text_feats.append(txt.float())
    sims = torch.cat(image_feats) @ torch.cat(text_feats).T
    ranks = sims.argsort(dim=1, descending=True)
    target = torch.arange(sims.shape[0], device=sims.device)[:, None]
    r1 = (ranks[:, :1] == target).any(dim=1).float().mean().item()
    r5 = (ranks[:, :5] == target).any(dim=1).float().mean().item()
    model.train()
    return {"image_to_text_R@1": r1, "image_to_text_R@5": r5}


def main(args):
    dist.init_process_group("nccl")
    args.rank, args.world_size = dist.get_rank(), dist.get_world_size()
    args.device = f"cuda:{args.rank % torch.cuda.device_count()}"
    torch.cuda.set_device(args.device)

    model = CLIP(embed_dim=args.embed_dim).to(args.device)
    if args.lock_image:
        model.visual.requires_grad_(False)
    model = DDP(model, device_ids=[args.device], static_graph=args.ddp_static_graph)

    def exclude(n, p):
        return p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for n, p in named if exclude(n, p)], "weight_decay": 0.0},
            {"params": [p for n, p in named if not exclude(n, p)], "weight_decay": args.wd},
        ],
        lr=args.lr,
        betas=(0.9, 0.98),
        eps=1e-6,
    )
    scaler = torch.cuda.amp.GradScaler() if args.precision == "amp" else None  # expect: AMP009

    from training.data import get_data  # project-local

    train_loader, val_loader = get_data(args)
    scheduler = cosine_lr(optimizer, args.lr, args.warmup, len(train_loader) * args.epochs)
    loss_fn = ClipLoss(args.rank, args.world_size)
    for epoch in range(args.epochs):
        train_one_epoch(model, train_loader, loss_fn, epoch, optimizer, scaler, scheduler, args)
        if args.rank == 0:
            logging.info(evaluate_retrieval(model, val_loader, args))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--precision", default="amp", choices=["amp", "amp_bf16", "fp32"])
    parser.add_argument("--accum_freq", type=int, default=1)
    parser.add_argument("--grad_clip_norm", type=float, default=None)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--wd", type=float, default=0.2)
    parser.add_argument("--warmup", type=int, default=10000)
    parser.add_argument("--epochs", type=int, default=32)
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--embed_dim", type=int, default=512)
    parser.add_argument("--log_every", type=int, default=100)
    parser.add_argument("--lock_image", action="store_true")
    parser.add_argument("--ddp_static_graph", action="store_true")
    main(parser.parse_args())
