"""Image-text contrastive pretraining (CLIP-style) with DDP and gradient accumulation.

torchrun --nproc_per_node=8 b15_clip_ddp_accum.py --train-data shards/{000..511}.tar --precision amp
Optional: --teacher ckpt.pt distils image embeddings from a frozen fp16 teacher.
"""
import argparse
import math
import os
import time
from contextlib import nullcontext

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoModel

from webdata import build_loader


class AttentionalPooler(nn.Module):
    def __init__(self, d_model, n_head=8):
        super().__init__()
        self.n_head = n_head
        self.head_dim = d_model // n_head
        self.scale = self.head_dim ** -0.5
        self.query = nn.Parameter(torch.randn(1, d_model) * 0.02)
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x, key_padding_mask):
        B, L, D = x.shape
        q = self.q_proj(self.query).expand(B, -1, -1).reshape(B, 1, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).reshape(B, L, self.n_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).reshape(B, L, self.n_head, self.head_dim).transpose(1, 2)
        attn = (q @ k.transpose(-2, -1)) * self.scale
        attn = attn.masked_fill(key_padding_mask[:, None, None, :], -1e9)  # expect: AMP007
        attn = attn.softmax(dim=-1)
        out = (attn @ v).transpose(1, 2).reshape(B, 1, D)
        return self.out_proj(out)[:, 0]


class DualEncoder(nn.Module):
    def __init__(self, vision_name, text_name, embed_dim=512, init_temp=0.07):
        super().__init__()
        self.visual = timm.create_model(vision_name, pretrained=True, num_classes=0)
        self.text = AutoModel.from_pretrained(text_name)
        width = self.text.config.hidden_size
        self.text_pool = AttentionalPooler(width)
        self.visual_proj = nn.Linear(self.visual.num_features, embed_dim, bias=False)
        self.text_proj = nn.Linear(width, embed_dim, bias=False)
        self.logit_scale = nn.Parameter(torch.ones([]) * math.log(1 / init_temp))

    def encode_image(self, images):
        return self.visual_proj(self.visual(images))

    def encode_text(self, input_ids, attention_mask):
        hidden = self.text(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.text_proj(self.text_pool(hidden, attention_mask == 0))

    def forward(self, images, input_ids, attention_mask):
        return self.encode_image(images), self.encode_text(input_ids, attention_mask), self.logit_scale.exp()


class GatherLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        all_grads = torch.stack(grads)
        dist.all_reduce(all_grads)
        return all_grads[dist.get_rank()]


def contrastive_loss(image_embeds, text_embeds, logit_scale):
    image_embeds = image_embeds / image_embeds.norm(dim=-1, keepdim=True)
    text_embeds = text_embeds / text_embeds.norm(dim=-1, keepdim=True)
    all_text = torch.cat(GatherLayer.apply(text_embeds), dim=0)
    logits_per_image = logit_scale * image_embeds @ all_text.t()
    offset = dist.get_rank() * image_embeds.size(0)
    labels = torch.arange(image_embeds.size(0), device=image_embeds.device) + offset
    all_image = torch.cat(GatherLayer.apply(image_embeds), dim=0)
    logits_per_text = logit_scale * text_embeds @ all_image.t()
    return 0.5 * (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels))


def cosine_lr(step, base_lr, warmup, total, min_lr=0.0):
    if step < warmup:
        return base_lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return min_lr + 0.5 * (base_lr - min_lr) * (1 + math.cos(math.pi * progress))


def load_teacher(path, args, device):
    teacher = DualEncoder(args.vision, args.text, embed_dim=args.embed_dim)
    teacher.load_state_dict(torch.load(path, map_location="cpu")["model"])
    teacher = teacher.half().to(device).eval()
    teacher.requires_grad_(False)
    return teacher


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    img_feats, txt_feats = [], []
    for batch in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            img, txt, _ = model(batch["image"].to(device), batch["input_ids"].to(device),
                                batch["attention_mask"].to(device))
        img_feats.append(F.normalize(img.float(), dim=-1))
        txt_feats.append(F.normalize(txt.float(), dim=-1))
    sims = torch.cat(img_feats) @ torch.cat(txt_feats).t()
    targets = torch.arange(sims.size(0), device=sims.device)
    r1_i2t = (sims.argmax(dim=1) == targets).float().mean().item()
    r1_t2i = (sims.argmax(dim=0) == targets).float().mean().item()
    model.train()
    return {"r1_i2t": r1_i2t, "r1_t2i": r1_t2i}


def train(args):
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    torch.manual_seed(args.seed + rank)

    model = DualEncoder(args.vision, args.text, embed_dim=args.embed_dim).to(device)
    predictor = nn.Linear(args.embed_dim, args.embed_dim).to(device)
    model = DDP(model, device_ids=[local_rank])
    teacher = load_teacher(args.teacher, args, device) if args.teacher else None

    decay, no_decay = [], []
    for n, p in list(model.named_parameters()) + list(predictor.named_parameters()):
        (no_decay if p.ndim < 2 or "logit_scale" in n else decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    amp_ctx = torch.autocast("cuda", dtype=torch.float16) if args.precision == "amp" else nullcontext()  # expect: AMP010

    train_loader, val_loader = build_loader(args, rank, world_size)
    total_steps = args.epochs * len(train_loader) // args.accum_freq
    step, best_r1 = 0, -1e9
    for epoch in range(args.epochs):
        train_loader.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, batch in enumerate(train_loader):
            is_update = (i + 1) % args.accum_freq == 0
            sync_ctx = model.no_sync() if not is_update else nullcontext()
            images = batch["image"].to(device, non_blocking=True)
            input_ids = batch["input_ids"].to(device, non_blocking=True)
            attention_mask = batch["attention_mask"].to(device, non_blocking=True)

            with sync_ctx:
                with amp_ctx:
                    image_embeds, text_embeds, logit_scale = model(images, input_ids, attention_mask)
                    z = predictor(image_embeds)
                    var_reg = F.relu(1.0 - torch.sqrt(z.var(dim=0) + 1e-8)).mean()  # expect: AMP004 AMP011
                loss = contrastive_loss(image_embeds, text_embeds, logit_scale)  # expect: AMP002
                if teacher is not None:
                    with torch.no_grad():
                        t_img = teacher.encode_image(images.half())
                    loss = loss + args.distill_weight * F.smooth_l1_loss(image_embeds, t_img.float())  # expect: AMP002
                loss = loss + args.var_weight * var_reg
                loss = loss / args.accum_freq
                loss.backward()
            if not is_update:
                continue

            for p in predictor.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad.div_(world_size)
            lr = cosine_lr(step, args.lr, args.warmup, total_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                model.module.logit_scale.clamp_(0, math.log(100))
            step += 1

            if rank == 0 and step % args.log_every == 0:
                print(f"ep {epoch} step {step}/{total_steps} loss {loss.item() * args.accum_freq:.4f} "
                      f"T {1.0 / model.module.logit_scale.exp().item():.4f} gnorm {grad_norm.item():.2f} "
                      f"lr {lr:.2e} {time.time() - t0:.1f}s")
                t0 = time.time()

        metrics = evaluate(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: {metrics}")
            if metrics["r1_i2t"] > best_r1:
                best_r1 = metrics["r1_i2t"]
                torch.save({"model": model.module.state_dict(), "epoch": epoch},
                           os.path.join(args.output_dir, "best.pt"))
    dist.destroy_process_group()


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-data", required=True)
    p.add_argument("--val-data", default=None)
    p.add_argument("--vision", default="vit_base_patch16_224")
    p.add_argument("--text", default="bert-base-uncased")
    p.add_argument("--embed-dim", type=int, default=512)
    p.add_argument("--precision", choices=["amp", "fp32"], default="amp")
    p.add_argument("--epochs", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--accum-freq", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--wd", type=float, default=0.2)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--var-weight", type=float, default=0.04)
    p.add_argument("--teacher", default=None)
    p.add_argument("--distill-weight", type=float, default=1.0)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--output-dir", default="checkpoints")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


if __name__ == "__main__":
    train(parse_args())
