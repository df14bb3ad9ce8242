"""Image-text dual encoder (CLIP-style) fine-tuning with accelerate.

    accelerate launch --mixed_precision fp16 accelerate_dual_encoder.py --train-shards data/train-{0000..0255}.tar
"""
import argparse
import math
import os
import time

import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import get_cosine_schedule_with_warmup

from pairs_data import build_pair_loader


class TextTower(nn.Module):
    def __init__(self, vocab_size, width=512, heads=8, layers=6, context=77, embed_dim=512):
        super().__init__()
        self.heads = heads
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.positional_embedding = nn.Parameter(torch.empty(context, width).normal_(std=0.01))
        self.ln_attn = nn.ModuleList([nn.LayerNorm(width) for _ in range(layers)])
        self.qkv = nn.ModuleList([nn.Linear(width, 3 * width) for _ in range(layers)])
        self.attn_out = nn.ModuleList([nn.Linear(width, width) for _ in range(layers)])
        self.mlp = nn.ModuleList([
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(layers)
        ])
        self.ln_final = nn.LayerNorm(width, eps=1e-12)
        self.proj = nn.Linear(width, embed_dim, bias=False)

    def forward(self, input_ids, attention_mask):
        b, t = input_ids.shape
        x = self.token_embedding(input_ids) + self.positional_embedding[:t]
        keep = attention_mask[:, None, None, :].bool()
        for ln, qkv, out, mlp in zip(self.ln_attn, self.qkv, self.attn_out, self.mlp):
            q, k, v = qkv(ln(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            scores = (q @ k.transpose(-2, -1)) * q.size(-1) ** -0.5
            scores = torch.where(keep, scores, -1e9)  # expect: AMP007
            x = x + out((scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, t, -1))
            x = x + mlp(x)
        x = self.ln_final(x)
        eot = attention_mask.sum(dim=1) - 1
        return self.proj(x[torch.arange(b, device=x.device), eot])


class DualEncoder(nn.Module):
    def __init__(self, vision_name, vocab_size, embed_dim=512):
        super().__init__()
        self.visual = timm.create_model(vision_name, pretrained=True, num_classes=embed_dim)
        self.text = TextTower(vocab_size, embed_dim=embed_dim)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, pixel_values, input_ids, attention_mask):
        img = F.normalize(self.visual(pixel_values).float(), dim=-1)
        txt = F.normalize(self.text(input_ids, attention_mask).float(), dim=-1)
        return img, txt, self.logit_scale.exp()


def clip_loss(img, txt, scale):
    logits = scale * img @ txt.t()
    labels = torch.arange(logits.size(0), device=logits.device)
    return 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels))


def benchmark_train_step(model, optimizer, batch, steps=20, warmup=5):
    """Rough per-step time for a fixed batch, used to pick batch sizes for new hardware."""
    model.train()
    times = []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
            img, txt, scale = model(batch["pixel_values"], batch["input_ids"], batch["attention_mask"])
            loss = clip_loss(img, txt, scale)
            loss.backward()  # expect: AMP008
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return sum(times) / len(times)


@torch.no_grad()
def evaluate(accelerator, model, loader):
    model.eval()
    correct, total = 0, 0
    for batch in loader:
        with accelerator.autocast():
            img, txt, _ = model(batch["pixel_values"], batch["input_ids"], batch["attention_mask"])
        sim = img @ txt.t()
        labels = torch.arange(sim.size(0), device=sim.device)
        hits = (sim.argmax(dim=1) == labels).float()
        correct += accelerator.gather_for_metrics(hits).sum().item()
        total += accelerator.gather_for_metrics(hits).numel()
    model.train()
    return correct / max(total, 1)


def train(args):
    accelerator = Accelerator(gradient_accumulation_steps=args.accum_steps, log_with="tensorboard", project_dir=args.output_dir)
    set_seed(args.seed)
    model = DualEncoder(args.vision_model, vocab_size=args.vocab_size)
    train_loader = build_pair_loader(args.train_shards, args.batch_size, image_size=224)
    val_loader = build_pair_loader(args.val_shards, args.batch_size, image_size=224, shuffle=False)

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "logit_scale" in name else decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.2}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, args.max_steps)
    model, optimizer, train_loader, val_loader, scheduler = accelerator.prepare(model, optimizer, train_loader, val_loader, scheduler)

    if args.benchmark:
        batch = next(iter(train_loader))
        accelerator.print(f"step time: {benchmark_train_step(model, optimizer, batch):.3f}s")
        return

    if args.resume:
        accelerator.load_state(args.resume)
    accelerator.init_trackers("dual_encoder")
    step = 0
    while step < args.max_steps:
        for batch in train_loader:
            pixel_values = batch["pixel_values"].to(dtype=torch.float16)  # expect: AMP001
            with accelerator.accumulate(model):
                with accelerator.autocast():
                    img, txt, scale = model(pixel_values, batch["input_ids"], batch["attention_mask"])
                    loss = clip_loss(img, txt, scale)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                accelerator.unwrap_model(model).logit_scale.clamp_(0, math.log(100))
            if not accelerator.sync_gradients:
                continue
            step += 1
            if step % args.log_every == 0:
                accelerator.log({"train/loss": loss.item(), "train/scale": scale.item()}, step=step)
            if step % args.eval_every == 0:
                accelerator.log({"val/i2t_top1": evaluate(accelerator, model, val_loader)}, step=step)
                accelerator.save_state(os.path.join(args.output_dir, f"step_{step}"))
            if step >= args.max_steps:
                break
    accelerator.end_training()


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-shards", required=True)
    p.add_argument("--val-shards", required=True)
    p.add_argument("--vision-model", default="vit_base_patch16_224")
    p.add_argument("--vocab-size", type=int, default=49408)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--accum-steps", type=int, default=1)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup-steps", type=int, default=2000)
    p.add_argument("--max-steps", type=int, default=100_000)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=2000)
    p.add_argument("--output-dir", default="runs/dual_encoder")
    p.add_argument("--resume", default=None)
    p.add_argument("--benchmark", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


if __name__ == "__main__":
    train(parse_args())
