"""Research-repo argparse script: contrastive image-text training of a small CLIP/LiT-like dual encoder."""
import argparse
import json
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import clip_grad_norm_
from torch.utils._pytree import tree_map
from torch.utils.data import DataLoader


class VisionTower(nn.Module):
    def __init__(self, width=512, patch=16, layers=6, heads=8, image_size=224):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, kernel_size=patch, stride=patch, bias=False)
        self.cls = nn.Parameter(torch.zeros(1, 1, width))
        self.pos = nn.Parameter(torch.randn(1, (image_size // patch) ** 2 + 1, width) * 0.02)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, batch_first=True, norm_first=True)
        self.transformer = nn.TransformerEncoder(layer, layers)
        self.ln_post = nn.LayerNorm(width)

    def forward(self, x):
        x = self.conv1(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.size(0), -1, -1), x], dim=1) + self.pos
        return self.ln_post(self.transformer(x)[:, 0])


class TextTower(nn.Module):
    def __init__(self, vocab_size=49408, width=512, layers=6, heads=8, context_length=77):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.pos = nn.Parameter(torch.randn(1, context_length, width) * 0.01)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, batch_first=True, norm_first=True)
        self.transformer = nn.TransformerEncoder(layer, layers)
        self.ln_final = nn.LayerNorm(width)

    def forward(self, input_ids):
        x = self.token_embedding(input_ids) + self.pos[:, : input_ids.size(1)]
        causal = torch.triu(torch.full((input_ids.size(1), input_ids.size(1)), float("-inf"), device=x.device), 1)
        x = self.ln_final(self.transformer(x, mask=causal))
        return x[torch.arange(x.size(0)), input_ids.argmax(dim=-1)]


class DualEncoder(nn.Module):
    def __init__(self, embed_dim=512, width=512):
        super().__init__()
        self.visual = VisionTower(width)
        self.text = TextTower(width=width)
        self.img_proj = nn.Linear(width, embed_dim, bias=False)
        self.txt_proj = nn.Linear(width, embed_dim, bias=False)
        self.logit_scale = nn.Parameter(torch.ones([]) * math.log(1 / 0.07))


def contrastive_loss(logits_per_image):
    labels = torch.arange(logits_per_image.size(0), device=logits_per_image.device)
    return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_image.t(), labels)) / 2


def train_one_epoch(model, loader, optimizer, scheduler, scaler, args, epoch):
    model.train()
    for step, batch in enumerate(loader):
        batch = tree_map(lambda t: t.cuda(non_blocking=True).half() if t.is_floating_point() else t.cuda(non_blocking=True), batch)  # expect: AMP001
        with torch.autocast("cuda", dtype=torch.float16):
            img = model.img_proj(model.visual(batch["image"]))
            txt = model.txt_proj(model.text(batch["input_ids"]))
            img = img - img.mean(dim=0, keepdim=True)  # expect: AMP004
            img = img / img.norm(dim=-1, keepdim=True)
            txt = F.normalize(txt, dim=-1)
            logits_per_image = model.logit_scale.exp() * img @ txt.t()
            if args.entropy_reg > 0:
                p = torch.sigmoid(logits_per_image)
                ent = -(p * torch.log(p + 1e-10)).sum(dim=-1).mean()  # expect: AMP011
            else:
                ent = 0.0
        loss = contrastive_loss(logits_per_image) + args.entropy_reg * ent  # expect: AMP002
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if args.grad_clip > 0:
            clip_grad_norm_(model.parameters(), args.grad_clip)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))
        if step % args.log_every == 0:
            print(json.dumps({"epoch": epoch, "step": step, "loss": round(loss.item(), 4),
                              "scale": model.logit_scale.exp().item(), "lr": scheduler.get_last_lr()[0]}))


@torch.no_grad()
def evaluate_retrieval(model, loader):
    model.eval()
    img_feats, txt_feats = [], []
    for batch in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            img = model.img_proj(model.visual(batch["image"].cuda()))
            txt = model.txt_proj(model.text(batch["input_ids"].cuda()))
        img_feats.append(F.normalize(img.float(), dim=-1))
        txt_feats.append(F.normalize(txt.float(), dim=-1))
    img_feats, txt_feats = torch.cat(img_feats), torch.cat(txt_feats)
    sims = img_feats @ txt_feats.t()
    gt = torch.arange(sims.size(0), device=sims.device)
    i2t = (sims.topk(5, dim=1).indices == gt[:, None]).any(dim=1).float().mean().item()
    t2i = (sims.t().topk(5, dim=1).indices == gt[:, None]).any(dim=1).float().mean().item()
    return {"i2t_r5": i2t, "t2i_r5": t2i}


def main(train_set, val_set):
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=32)
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--wd", type=float, default=0.2)
    parser.add_argument("--warmup", type=int, default=2000)
    parser.add_argument("--grad_clip", type=float, default=1.0)
    parser.add_argument("--entropy_reg", type=float, default=0.0)
    parser.add_argument("--log_every", type=int, default=50)
    parser.add_argument("--out", default="runs/clip")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    model = DualEncoder().cuda()
    exclude = lambda n, p: p.ndim < 2 or "ln" in n or "logit_scale" in n  # noqa: E731
    groups = [{"params": [p for n, p in model.named_parameters() if not exclude(n, p)], "weight_decay": args.wd},
              {"params": [p for n, p in model.named_parameters() if exclude(n, p)], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=8, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, num_workers=8)
    total = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / args.warmup if s < args.warmup
        else 0.5 * (1 + math.cos(math.pi * (s - args.warmup) / (total - args.warmup))))
    try:
        scaler = torch.amp.GradScaler("cuda")
    except (AttributeError, TypeError):
        scaler = torch.cuda.amp.GradScaler()

    for epoch in range(args.epochs):
        train_one_epoch(model, train_loader, optimizer, scheduler, scaler, args, epoch)
        metrics = evaluate_retrieval(model, val_loader)
        print(json.dumps({"epoch": epoch, **metrics}))
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scaler": scaler.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pt"))
