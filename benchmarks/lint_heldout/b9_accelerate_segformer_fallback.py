#!/usr/bin/env python
"""Fine-tune SegFormer on a binary-boundary-augmented semantic segmentation set.

Runs through `accelerate launch` when accelerate is installed; on the shared cluster nodes
where it is not, `--no-accelerate` (or a missing import) falls back to a plain PyTorch loop.
"""
import argparse
import json
import math
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from transformers import SegformerForSemanticSegmentation, get_polynomial_decay_schedule_with_warmup

from data import build_seg_datasets  # local module: returns (train_ds, val_ds) of dicts

try:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    HAS_ACCELERATE = True
except ImportError:  # pragma: no cover
    HAS_ACCELERATE = False

PRECISION_TO_DTYPE = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def make_grad_scaler(enabled):
    try:
        return torch.amp.GradScaler("cuda", enabled=enabled)
    except (AttributeError, TypeError):  # torch < 2.3
        return torch.cuda.amp.GradScaler(enabled=enabled)


class BoundaryHead(nn.Module):
    """Predicts class boundaries from the decode-head logits (auxiliary task)."""

    def __init__(self, num_classes, hidden=64):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(num_classes, hidden, 3, padding=1),
            nn.BatchNorm2d(hidden),
            nn.ReLU(inplace=True),
            nn.Conv2d(hidden, 1, 1),
        )

    def forward(self, seg_logits):
        return self.net(seg_logits)


def dice_ce_loss(logits, labels, ignore_index=255, smooth=1.0, dice_weight=0.5):
    ce = F.cross_entropy(logits, labels, ignore_index=ignore_index)
    valid = (labels != ignore_index).unsqueeze(1)
    probs = logits.softmax(dim=1)
    onehot = F.one_hot(labels.clamp(0, logits.size(1) - 1), logits.size(1)).permute(0, 3, 1, 2)
    probs = probs * valid
    onehot = onehot * valid
    inter = (probs * onehot).sum(dim=(0, 2, 3))
    union = probs.sum(dim=(0, 2, 3)) + onehot.sum(dim=(0, 2, 3))
    dice = 1.0 - ((2.0 * inter + smooth) / (union + smooth)).mean()
    return ce + dice_weight * dice


@torch.no_grad()
def evaluate(model, loader, num_classes, device, amp_ctx, ignore_index=255):
    model.eval()
    hist = torch.zeros(num_classes, num_classes, dtype=torch.long, device=device)
    for batch in loader:
        pixel_values = batch["pixel_values"].to(device)
        labels = batch["labels"].to(device)
        with amp_ctx:
            logits = model(pixel_values=pixel_values).logits
        logits = F.interpolate(logits.float(), size=labels.shape[-2:], mode="bilinear", align_corners=False)
        pred = logits.argmax(dim=1)
        keep = labels != ignore_index
        idx = labels[keep] * num_classes + pred[keep]
        hist += torch.bincount(idx, minlength=num_classes**2).view(num_classes, num_classes)
    iou = hist.diag().float() / (hist.sum(0) + hist.sum(1) - hist.diag()).float().clamp(min=1)
    model.train()
    return iou.mean().item()


def build_optimizer(model, boundary_head, args):
    decay, no_decay = [], []
    for n, p in list(model.named_parameters()) + list(boundary_head.named_parameters()):
        (no_decay if p.ndim < 2 or "norm" in n else decay).append(p)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.999),
    )


def train_with_accelerate(args, model, boundary_head, train_ds, val_ds):
    accelerator = Accelerator(mixed_precision=args.mixed_precision, gradient_accumulation_steps=args.grad_accum)
    set_seed(args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, num_workers=args.workers)
    optimizer = build_optimizer(model, boundary_head, args)
    total = args.epochs * math.ceil(len(train_loader) / args.grad_accum)
    scheduler = get_polynomial_decay_schedule_with_warmup(optimizer, args.warmup_steps, total, power=1.0)
    model, boundary_head, optimizer, train_loader, val_loader, scheduler = accelerator.prepare(
        model, boundary_head, optimizer, train_loader, val_loader, scheduler
    )
    best = 0.0
    for epoch in range(args.epochs):
        for batch in train_loader:
            with accelerator.accumulate(model):
                outputs = model(pixel_values=batch["pixel_values"])
                logits = F.interpolate(outputs.logits, size=batch["labels"].shape[-2:], mode="bilinear", align_corners=False)
                loss = dice_ce_loss(logits, batch["labels"], args.ignore_index)
                edge_logits = boundary_head(outputs.logits)
                edges = F.interpolate(batch["edges"], size=edge_logits.shape[-2:], mode="nearest")
                loss = loss + args.edge_weight * F.binary_cross_entropy_with_logits(edge_logits, edges)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        # the prepared model already runs its forward under accelerate's autocast
        miou = evaluate(model, val_loader, args.num_classes, accelerator.device, nullcontext(), args.ignore_index)
        accelerator.print(f"epoch {epoch} mIoU {miou:.4f}")
        if miou > best:
            best = miou
            accelerator.save_state(os.path.join(args.output_dir, "best"))
    return best


def train_plain(args, model, boundary_head, train_ds, val_ds):
    is_ddp = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if is_ddp:
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    amp_dtype = PRECISION_TO_DTYPE[args.mixed_precision]
    use_amp = args.mixed_precision != "no" and device.type == "cuda"
    scaler = make_grad_scaler(enabled=use_amp and args.mixed_precision == "fp16")

    model.to(device)
    boundary_head.to(device)
    optimizer = build_optimizer(model, boundary_head, args)
    if is_ddp:
        model = DDP(model, device_ids=[device.index])
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=not is_ddp, num_workers=args.workers, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, num_workers=args.workers)
    total = args.epochs * math.ceil(len(train_loader) / args.grad_accum)
    scheduler = get_polynomial_decay_schedule_with_warmup(optimizer, args.warmup_steps, total, power=1.0)
    eval_ctx = torch.cuda.amp.autocast(dtype=amp_dtype) if use_amp else nullcontext()  # expect: AMP009

    best, t0 = 0.0, time.time()
    for epoch in range(args.epochs):
        for step, batch in enumerate(train_loader):
            pixel_values = batch["pixel_values"].to(device, non_blocking=True)
            labels = batch["labels"].to(device, non_blocking=True)
            edges = batch["edges"].to(device, non_blocking=True)
            last_micro = (step + 1) % args.grad_accum == 0
            sync_ctx = model.no_sync if (is_ddp and not last_micro) else nullcontext
            with torch.autocast(device_type=device.type, dtype=amp_dtype, enabled=use_amp):
                outputs = model(pixel_values=pixel_values)
                edge_prob = torch.sigmoid(boundary_head(outputs.logits))
                edges = F.interpolate(edges, size=edge_prob.shape[-2:], mode="nearest")
                edge_loss = F.binary_cross_entropy(edge_prob, edges)  # expect: AMP003
            logits = F.interpolate(outputs.logits, size=labels.shape[-2:], mode="bilinear", align_corners=False)
            loss = dice_ce_loss(logits, labels, args.ignore_index) + args.edge_weight * edge_loss  # expect: AMP002
            log_loss = loss.item()
            loss = scaler.scale(loss / args.grad_accum)
            with sync_ctx():
                loss.backward()
            if last_micro:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)  # expect: AMP005
                optimizer.step()  # expect: AMP006
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            if step % 100 == 0 and (not is_ddp or dist.get_rank() == 0):
                print(f"ep {epoch} it {step} loss {log_loss:.4f} {time.time() - t0:.0f}s", flush=True)
        if not is_ddp or dist.get_rank() == 0:
            core = model.module if is_ddp else model
            miou = evaluate(core, val_loader, args.num_classes, device, eval_ctx, args.ignore_index)
            print(f"epoch {epoch} mIoU {miou:.4f}")
            if miou > best:
                best = miou
                torch.save(
                    {"model": core.state_dict(), "boundary_head": boundary_head.state_dict(), "epoch": epoch, "miou": miou},
                    os.path.join(args.output_dir, "best.pt"),
                )
    if is_ddp:
        dist.destroy_process_group()
    return best


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="nvidia/mit-b2")
    p.add_argument("--data", required=True)
    p.add_argument("--output_dir", default="out/segformer")
    p.add_argument("--num_classes", type=int, default=19)
    p.add_argument("--ignore_index", type=int, default=255)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--grad_accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=6e-5)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--warmup_steps", type=int, default=1500)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--edge_weight", type=float, default=0.2)
    p.add_argument("--mixed_precision", default="fp16", choices=list(PRECISION_TO_DTYPE))
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-accelerate", dest="no_accelerate", action="store_true")
    return p.parse_args()


def main():
    args = parse_args()
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "args.json"), "w") as f:
        json.dump(vars(args), f, indent=2)
    train_ds, val_ds = build_seg_datasets(args.data, with_edges=True)
    model = SegformerForSemanticSegmentation.from_pretrained(
        args.model, num_labels=args.num_classes, ignore_mismatched_sizes=True
    )
    boundary_head = BoundaryHead(args.num_classes)
    if HAS_ACCELERATE and not args.no_accelerate:
        best = train_with_accelerate(args, model, boundary_head, train_ds, val_ds)
    else:
        best = train_plain(args, model, boundary_head, train_ds, val_ds)
    print(f"best mIoU {best:.4f}")


if __name__ == "__main__":
    main()
