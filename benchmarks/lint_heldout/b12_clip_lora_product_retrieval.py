#!/usr/bin/env python
"""LoRA fine-tuning of an open_clip ViT-B/16 for product image <-> title retrieval.

Only the LoRA adapters (attention q/v and MLP fc) and two fresh projection heads train;
the backbone stays frozen. In-batch contrastive loss, with other views of the same
product masked out of the negatives.

    torchrun --nproc_per_node 1 clip_lora_retrieval.py --train-csv data/train.csv --precision amp
"""

import argparse
import logging
import math
import os
from contextlib import suppress
from functools import partial

import open_clip
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from retrieval_data import ProductPairs, recall_at_k

logging.basicConfig(level=logging.INFO, format="%(asctime)s | %(message)s")
log = logging.getLogger("clip-lora")


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, r=8, alpha=16, dropout=0.05):
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / r
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling


def inject_lora(module, targets=("c_fc", "out_proj"), r=8, alpha=16):
    for name, child in module.named_children():
        if isinstance(child, nn.Linear) and name in targets:
            setattr(module, name, LoRALinear(child, r=r, alpha=alpha))
        else:
            inject_lora(child, targets, r, alpha)
    return module


class CLIPLoRARetrieval(nn.Module):
    def __init__(self, clip_model, embed_dim=512, proj_dim=256, center=True):
        super().__init__()
        self.clip = clip_model
        self.img_proj = nn.Linear(embed_dim, proj_dim)
        self.txt_proj = nn.Linear(embed_dim, proj_dim)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        self.center = center

    def forward(self, images, texts):
        img = self.img_proj(self.clip.encode_image(images))
        txt = self.txt_proj(self.clip.encode_text(texts))
        if self.center:
            # remove the batch mean (narrows the modality gap, helps on long-tail categories)
            img = img - img.mean(dim=0, keepdim=True)  # expect: AMP004
            txt = txt - txt.mean(dim=0, keepdim=True)  # expect: AMP004
        return F.normalize(img.float(), dim=-1), F.normalize(txt.float(), dim=-1), self.logit_scale.exp()


def get_autocast(precision):
    if precision == "amp":
        return partial(torch.autocast, device_type="cuda", dtype=torch.float16)
    if precision == "amp_bf16":
        return partial(torch.autocast, device_type="cuda", dtype=torch.bfloat16)
    return suppress


def cosine_lr(optimizer, base_lr, warmup, total):
    def _step(step):
        if step < warmup:
            lr = base_lr * (step + 1) / warmup
        else:
            lr = 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup))) * base_lr
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr
    return _step


def train_one_epoch(model, loader, optimizer, scheduler, scaler, autocast, args, epoch, device):
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    steps_per_epoch = len(loader)
    for i, (images, texts, product_ids) in enumerate(loader):
        step = epoch * steps_per_epoch + i
        lr = scheduler(step)
        images = images.to(device, non_blocking=True)
        texts = texts.to(device, non_blocking=True)
        product_ids = product_ids.to(device, non_blocking=True)

        optimizer.zero_grad(set_to_none=True)
        with autocast():
            img, txt, scale = model(images, texts)
            logits = scale * img @ txt.t()
            same_product = product_ids[:, None] == product_ids[None, :]
            false_neg = same_product & ~torch.eye(len(product_ids), dtype=torch.bool, device=device)
            logits = logits.masked_fill(false_neg, -1e9)  # expect: AMP007
            labels = torch.arange(logits.shape[0], device=device)
            loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2

        if scaler is not None:
            scaler.scale(loss).backward()
        else:
            loss.backward()
        if args.grad_clip_value:
            torch.nn.utils.clip_grad_value_(trainable, args.grad_clip_value)  # expect: AMP005
        optimizer.step()  # expect: AMP006

        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))

        if i % args.log_every == 0:
            log.info(f"epoch {epoch} [{i}/{steps_per_epoch}] loss {loss.item():.4f} "
                     f"scale {scale.item():.2f} lr {lr:.2e}")


@torch.no_grad()
def evaluate(model, loader, autocast, device):
    model.eval()
    all_img, all_txt, all_ids = [], [], []
    for images, texts, product_ids in loader:
        with autocast():
            img, txt, _ = model(images.to(device), texts.to(device))
        all_img.append(img.float())
        all_txt.append(txt.float())
        all_ids.append(product_ids.to(device))
    img, txt, ids = torch.cat(all_img), torch.cat(all_txt), torch.cat(all_ids)
    sims = img @ txt.t()
    metrics = {f"i2t_R@{k}": recall_at_k(sims, ids, k) for k in (1, 5, 10)}
    metrics.update({f"t2i_R@{k}": recall_at_k(sims.t(), ids, k) for k in (1, 5, 10)})
    return metrics


def save_adapters(model, path):
    state = {n: p.detach().float().cpu() for n, p in model.named_parameters() if p.requires_grad}
    torch.save(state, path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="ViT-B-16")
    parser.add_argument("--pretrained", default="laion2b_s34b_b88k")
    parser.add_argument("--train-csv", required=True)
    parser.add_argument("--val-csv", default=None)
    parser.add_argument("--precision", default="amp", choices=["amp", "amp_bf16", "fp32"])
    parser.add_argument("--lora-r", type=int, default=8)
    parser.add_argument("--lora-alpha", type=int, default=16)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--wd", type=float, default=0.05)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--grad-clip-value", type=float, default=None)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--out", default="runs/clip_lora")
    args = parser.parse_args()
    device = torch.device("cuda")
    os.makedirs(args.out, exist_ok=True)

    clip_model, preprocess_train, preprocess_val = open_clip.create_model_and_transforms(
        args.model, pretrained=args.pretrained)
    tokenizer = open_clip.get_tokenizer(args.model)
    clip_model.requires_grad_(False)
    inject_lora(clip_model.visual.transformer, r=args.lora_r, alpha=args.lora_alpha)
    inject_lora(clip_model.transformer, r=args.lora_r, alpha=args.lora_alpha)

    model = CLIPLoRARetrieval(clip_model, embed_dim=clip_model.text_projection.shape[1])
    # the frozen backbone is 150M params; fp16 halves activation + weight memory at bs=256
    model = model.to(device).half()  # expect: AMP001
    params = [p for n, p in model.named_parameters() if "lora_" in n or "_proj" in n or n == "logit_scale"]
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.wd)  # expect: AMP011

    train_loader = DataLoader(ProductPairs(args.train_csv, preprocess_train, tokenizer),
                              batch_size=args.batch_size, shuffle=True, num_workers=8,
                              pin_memory=True, drop_last=True)
    val_loader = None
    if args.val_csv:
        val_loader = DataLoader(ProductPairs(args.val_csv, preprocess_val, tokenizer),
                                batch_size=args.batch_size, num_workers=8)

    autocast = get_autocast(args.precision)
    scaler = torch.amp.GradScaler("cuda") if args.precision == "amp" else None
    scheduler = cosine_lr(optimizer, args.lr, args.warmup, args.epochs * len(train_loader))

    best = 0.0
    for epoch in range(args.epochs):
        train_one_epoch(model, train_loader, optimizer, scheduler, scaler, autocast, args, epoch, device)
        if val_loader is not None:
            metrics = evaluate(model, val_loader, autocast, device)
            log.info(f"epoch {epoch} {metrics}")
            if metrics["t2i_R@1"] > best:
                best = metrics["t2i_R@1"]
                save_adapters(model, os.path.join(args.out, "adapters_best.pt"))
        save_adapters(model, os.path.join(args.out, f"adapters_ep{epoch}.pt"))


if __name__ == "__main__":
    main()
