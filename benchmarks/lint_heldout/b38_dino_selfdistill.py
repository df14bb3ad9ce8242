"""Self-distillation with no labels (DINO-style) on a tiny ViT.

Student sees 2 global + N local crops, the EMA teacher only the global ones;
the teacher output is centered and sharpened. A small fp16 feature bank of
teacher embeddings is kept to monitor collapse.

    python b38_dino_selfdistill.py --epochs 100 --local-crops 6 --use-fp16 --clip-grad 3.0
"""
import argparse
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


# ----------------------------------------------------------------------------- backbone
class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(b, n, c))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViTTiny(nn.Module):
    def __init__(self, img_size=64, patch=8, dim=192, depth=6, heads=3):
        super().__init__()
        self.patch = patch
        self.patch_embed = nn.Conv2d(3, dim, patch, patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, (img_size // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)

    def interpolate_pos_encoding(self, n, w, h):
        cls_pos, patch_pos = self.pos_embed[:, :1], self.pos_embed[:, 1:]
        side = int(math.sqrt(patch_pos.shape[1]))
        if n == patch_pos.shape[1]:
            return self.pos_embed
        patch_pos = patch_pos.reshape(1, side, side, -1).permute(0, 3, 1, 2)
        patch_pos = F.interpolate(patch_pos, size=(w // self.patch, h // self.patch), mode="bicubic")
        return torch.cat([cls_pos, patch_pos.flatten(2).transpose(1, 2)], dim=1)

    def forward(self, x):
        b, _, w, h = x.shape
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(b, -1, -1), x], dim=1)
        x = x + self.interpolate_pos_encoding(x.shape[1] - 1, w, h)
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)[:, 0]


class DINOHead(nn.Module):
    def __init__(self, in_dim, out_dim, hidden=512, bottleneck=128):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(in_dim, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                                 nn.Linear(hidden, bottleneck))
        self.last_layer = nn.Linear(bottleneck, out_dim, bias=False)

    def forward(self, x):
        x = self.mlp(x)
        x = F.normalize(x, dim=-1, p=2)
        return self.last_layer(x)


class DINOModel(nn.Module):
    """Backbone + head; runs each group of same-resolution crops through the backbone once."""

    def __init__(self, args):
        super().__init__()
        self.backbone = ViTTiny(img_size=args.global_size)
        self.head = DINOHead(192, args.out_dim)

    def forward(self, crops):
        if not isinstance(crops, (list, tuple)):
            crops = [crops]
        sizes = torch.tensor([c.shape[-1] for c in crops])
        idx_crops = torch.cumsum(torch.unique_consecutive(sizes, return_counts=True)[1], 0)
        start, feats = 0, []
        for end in idx_crops.tolist():
            feats.append(self.backbone(torch.cat(crops[start:end])))
            start = end
        return self.head(torch.cat(feats))


# ----------------------------------------------------------------------------- loss + monitor
class DINOLoss(nn.Module):
    def __init__(self, out_dim, ncrops, warmup_teacher_temp, teacher_temp, warmup_epochs, nepochs,
                 student_temp=0.1, center_momentum=0.9):
        super().__init__()
        self.student_temp, self.center_momentum, self.ncrops = student_temp, center_momentum, ncrops
        self.register_buffer("center", torch.zeros(1, out_dim))
        self.teacher_temp_schedule = np.concatenate((
            np.linspace(warmup_teacher_temp, teacher_temp, warmup_epochs),
            np.ones(nepochs - warmup_epochs) * teacher_temp))

    def forward(self, student_output, teacher_output, epoch):
        student_out = (student_output / self.student_temp).chunk(self.ncrops)
        temp = self.teacher_temp_schedule[epoch]
        teacher_out = F.softmax((teacher_output - self.center) / temp, dim=-1).detach().chunk(2)
        total_loss, n_loss_terms = 0, 0
        for iq, q in enumerate(teacher_out):
            for v in range(len(student_out)):
                if v == iq:
                    continue
                loss = torch.sum(-q * F.log_softmax(student_out[v], dim=-1), dim=-1)
                total_loss += loss.mean()
                n_loss_terms += 1
        total_loss /= n_loss_terms
        self.update_center(teacher_output)
        return total_loss

    @torch.no_grad()
    def update_center(self, teacher_output):
        batch_center = teacher_output.mean(dim=0, keepdim=True)  # expect: AMP004
        self.center = self.center * self.center_momentum + batch_center * (1 - self.center_momentum)


class FeatureBank:
    """Ring buffer of teacher outputs, stored in fp16 to keep it small."""

    def __init__(self, dim, size, device):
        bank = torch.randn(size, dim, device=device, dtype=torch.float16)
        self.bank = F.normalize(bank, dim=1)  # expect: AMP011
        self.ptr, self.size = 0, size

    @torch.no_grad()
    def push(self, feats):
        feats = F.normalize(feats.float(), dim=1)
        n = min(feats.shape[0], self.size - self.ptr)
        self.bank[self.ptr:self.ptr + n] = feats[:n].to(self.bank.dtype)
        self.ptr = (self.ptr + n) % self.size

    def collapse_stat(self):
        return self.bank.float().std(dim=0).mean().item()


# ----------------------------------------------------------------------------- utils
def cosine_scheduler(base, final, epochs, niter_per_ep, warmup_epochs=0, start_warmup=0):
    warmup = np.linspace(start_warmup, base, warmup_epochs * niter_per_ep)
    iters = np.arange(epochs * niter_per_ep - len(warmup))
    schedule = final + 0.5 * (base - final) * (1 + np.cos(np.pi * iters / len(iters)))
    return np.concatenate((warmup, schedule))


def clip_gradients(model, clip):
    norms = []
    for _, p in model.named_parameters():
        if p.grad is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(p, clip).item())
    return norms


def cancel_gradients_last_layer(epoch, model, freeze_last_layer):
    if epoch >= freeze_last_layer:
        return
    for n, p in model.named_parameters():
        if "last_layer" in n:
            p.grad = None


def multicrop(batch, args):
    crops = [F.interpolate(batch, size=args.global_size, mode="bilinear") for _ in range(2)]
    for _ in range(args.local_crops):
        i, j = np.random.randint(0, batch.shape[-1] - args.local_size, 2)
        crops.append(batch[..., i:i + args.local_size, j:j + args.local_size])
    return crops


# ----------------------------------------------------------------------------- training
def train_one_epoch(student, teacher, dino_loss, data_loader, optimizer, lr_schedule, wd_schedule,
                    momentum_schedule, epoch, fp16_scaler, bank, args):
    student.train()
    t0 = time.time()
    for it, (batch,) in enumerate(data_loader):
        it = len(data_loader) * epoch + it
        for i, param_group in enumerate(optimizer.param_groups):
            param_group["lr"] = lr_schedule[it]
            if i == 0:
                param_group["weight_decay"] = wd_schedule[it]
        images = [im.cuda(non_blocking=True).half() for im in multicrop(batch, args)]  # expect: AMP001
        with torch.autocast("cuda", dtype=torch.float16, enabled=fp16_scaler is not None):
            teacher_output = teacher(images[:2])
            student_output = student(images)
            loss = dino_loss(student_output, teacher_output, epoch)
        if not math.isfinite(loss.item()):
            print(f"Loss is {loss.item()}, stopping training")
            sys.exit(1)

        optimizer.zero_grad()
        param_norms = None
        if fp16_scaler is None:
            loss.backward()
            if args.clip_grad:
                param_norms = clip_gradients(student, args.clip_grad)
            cancel_gradients_last_layer(epoch, student, args.freeze_last_layer)
            optimizer.step()
        else:
            fp16_scaler.scale(loss).backward()
            if args.clip_grad:
                param_norms = clip_gradients(student, args.clip_grad)  # expect: AMP005
            cancel_gradients_last_layer(epoch, student, args.freeze_last_layer)
            fp16_scaler.step(optimizer)
            fp16_scaler.update()

        with torch.no_grad():
            m = momentum_schedule[it]
            for param_q, param_k in zip(student.parameters(), teacher.parameters()):
                param_k.data.mul_(m).add_((1 - m) * param_q.detach().data)
            bank.push(teacher_output.detach())
        if it % args.log_every == 0:
            print(f"ep {epoch} it {it} loss {loss.item():.4f} lr {lr_schedule[it]:.2e} "
                  f"clip {np.max(param_norms) if param_norms else 0:.2f} bank_std {bank.collapse_stat():.4f} "
                  f"{time.time() - t0:.1f}s")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--min-lr", type=float, default=1e-6)
    p.add_argument("--warmup-epochs", type=int, default=10)
    p.add_argument("--weight-decay", type=float, default=0.04)
    p.add_argument("--weight-decay-end", type=float, default=0.4)
    p.add_argument("--momentum-teacher", type=float, default=0.996)
    p.add_argument("--out-dim", type=int, default=4096)
    p.add_argument("--global-size", type=int, default=64)
    p.add_argument("--local-size", type=int, default=32)
    p.add_argument("--local-crops", type=int, default=6)
    p.add_argument("--warmup-teacher-temp", type=float, default=0.04)
    p.add_argument("--teacher-temp", type=float, default=0.07)
    p.add_argument("--warmup-teacher-temp-epochs", type=int, default=30)
    p.add_argument("--clip-grad", type=float, default=3.0)
    p.add_argument("--freeze-last-layer", type=int, default=1)
    p.add_argument("--use-fp16", action="store_true")
    p.add_argument("--bank-size", type=int, default=8192)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--output-dir", default="runs/dino")
    args = p.parse_args()
    os.makedirs(args.output_dir, exist_ok=True)

    data = torch.rand(10000, 3, 96, 96)
    data_loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=args.batch_size,
                                              shuffle=True, drop_last=True, num_workers=4)
    student = DINOModel(args)
    teacher = DINOModel(args)
    student.cuda()
    teacher.cuda()
    teacher.load_state_dict(student.state_dict())
    teacher.requires_grad_(False)
    dino_loss = DINOLoss(args.out_dim, args.local_crops + 2, args.warmup_teacher_temp, args.teacher_temp,
                         args.warmup_teacher_temp_epochs, args.epochs)
    dino_loss.cuda()

    regularized = [p for n, p in student.named_parameters() if not n.endswith(".bias") and p.ndim > 1]
    not_regularized = [p for n, p in student.named_parameters() if n.endswith(".bias") or p.ndim <= 1]
    optimizer = torch.optim.AdamW([{"params": regularized}, {"params": not_regularized, "weight_decay": 0.0}])
    fp16_scaler = torch.amp.GradScaler("cuda") if args.use_fp16 else None
    niter = len(data_loader)
    lr_schedule = cosine_scheduler(args.lr * args.batch_size / 256.0, args.min_lr, args.epochs, niter,
                                   warmup_epochs=args.warmup_epochs)
    wd_schedule = cosine_scheduler(args.weight_decay, args.weight_decay_end, args.epochs, niter)
    momentum_schedule = cosine_scheduler(args.momentum_teacher, 1, args.epochs, niter)
    bank = FeatureBank(args.out_dim, args.bank_size, "cuda")

    start_epoch = 0
    ckpt_path = os.path.join(args.output_dir, "checkpoint.pth")
    if os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        student.load_state_dict(ckpt["student"])
        teacher.load_state_dict(ckpt["teacher"])
        optimizer.load_state_dict(ckpt["optimizer"])
        dino_loss.load_state_dict(ckpt["dino_loss"])
        if fp16_scaler is not None and "fp16_scaler" in ckpt:
            fp16_scaler.load_state_dict(ckpt["fp16_scaler"])
        start_epoch = ckpt["epoch"]

    for epoch in range(start_epoch, args.epochs):
        train_one_epoch(student, teacher, dino_loss, data_loader, optimizer, lr_schedule, wd_schedule,
                        momentum_schedule, epoch, fp16_scaler, bank, args)
        save = {"student": student.state_dict(), "teacher": teacher.state_dict(),
                "optimizer": optimizer.state_dict(), "dino_loss": dino_loss.state_dict(), "epoch": epoch + 1}
        if fp16_scaler is not None:
            save["fp16_scaler"] = fp16_scaler.state_dict()
        torch.save(save, ckpt_path)


if __name__ == "__main__":
    main()
