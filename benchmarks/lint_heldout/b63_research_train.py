"""
Train a ViT / ConvNeXt classifier on an ImageNet subset (IN-100 by default).

Single-file research script: argparse config, optional torch.compile, optional
linear-probe stage on the frozen backbone at the end. Launch with torchrun:

    torchrun --nproc_per_node=8 train.py --model vit_small --data /data/in100 --amp
"""
import argparse
import copy
import json
import logging
import math
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from data import build_loader, build_probe_loader
from models import create_model
from utils import AverageMeter, cosine_scheduler, init_distributed, is_main_process

logger = logging.getLogger("train")

HALF = torch.float16
LOG_EVERY = 50


def parse_args():
    p = argparse.ArgumentParser("ViT training")
    p.add_argument("--model", default="vit_small")
    p.add_argument("--data", required=True)
    p.add_argument("--num-classes", type=int, default=100)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=1e-6)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--drop-path", type=float, default=0.1)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--pure-fp16", action="store_true",
                   help="keep the weights in fp16 (memory experiments only)")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--probe-epochs", type=int, default=0)
    p.add_argument("--resume", default="")
    p.add_argument("--out", default="runs/vit")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


@torch.no_grad()
def evaluate(model, loader, ctx, device):
    model.eval()
    losses, top1 = AverageMeter(), AverageMeter()
    for images, target in loader:
        images = images.to(device, non_blocking=True).to(HALF)
        target = target.to(device, non_blocking=True)
        with ctx:
            output = model(images)
            loss = F.cross_entropy(output, target)
        acc1 = (output.argmax(dim=-1) == target).float().mean() * 100.0
        losses.update(loss.item(), images.size(0))
        top1.update(acc1.item(), images.size(0))
    return {"loss": losses.avg, "acc1": top1.avg}


def save_checkpoint(model, optimizer, epoch, path, half=False):
    state = model.state_dict()
    if half:
        state = {k: v.half() for k, v in state.items()}
    torch.save({"model": state, "optimizer": optimizer.state_dict(), "epoch": epoch}, path)


def load_checkpoint(model, optimizer, path):
    ckpt = torch.load(path, map_location="cpu")
    state = {k: v.float() for k, v in ckpt["model"].items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        logger.warning("missing=%s unexpected=%s", missing, unexpected)
    if optimizer is not None and "optimizer" in ckpt:
        optimizer.load_state_dict(ckpt["optimizer"])
    return ckpt.get("epoch", -1) + 1


def export_torchscript(model, example, path):
    deploy_model = copy.deepcopy(model).half().eval()
    traced = torch.jit.trace(deploy_model, example.to(HALF))
    traced.save(str(path))
    return path


def train(args):
    init_distributed(args)
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(args.seed + args.rank)
    np.random.seed(args.seed + args.rank)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    out_dir = Path(args.out)
    if is_main_process():
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "args.json").write_text(json.dumps(vars(args), indent=2))

    train_loader, val_loader = build_loader(args)
    model = create_model(args.model, num_classes=args.num_classes, drop_path_rate=args.drop_path)
    model.to(device)
    if args.pure_fp16:
        model.half()

    # no weight decay on norms, biases and position embeddings
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2 and "pos_embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and (p.ndim < 2 or "pos_embed" in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))  # expect: AMP011

    start_epoch = 0
    if args.resume:
        start_epoch = load_checkpoint(model, optimizer, args.resume)
        logger.info("resumed from %s at epoch %d", args.resume, start_epoch)

    model_without_ddp = model
    if args.compile:
        model = torch.compile(model)
    if args.distributed:
        model = DDP(model, device_ids=[args.local_rank])

    ctx = torch.autocast(device_type="cuda", dtype=torch.float16) if args.amp else nullcontext()  # expect: AMP010
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    steps_per_epoch = len(train_loader)
    lr_schedule = cosine_scheduler(args.lr, args.min_lr, args.epochs, steps_per_epoch,
                                   warmup_epochs=args.warmup_epochs)

    best_acc = 0.0
    history = []
    for epoch in range(start_epoch, args.epochs):
        model.train()
        if args.distributed:
            train_loader.sampler.set_epoch(epoch)
        meter = AverageMeter()
        t0 = time.time()
        for it, (images, target) in enumerate(train_loader):
            global_step = epoch * steps_per_epoch + it
            for group in optimizer.param_groups:
                group["lr"] = lr_schedule[global_step]

            images = images.to(device, non_blocking=True).to(HALF)  # expect: AMP001
            target = target.to(device, non_blocking=True)

            with ctx:
                output = model(images)
                loss = criterion(output, target)

            loss_value = loss.item()
            if not math.isfinite(loss_value):
                logger.error("loss is %s at step %d, stopping", loss_value, global_step)
                sys.exit(1)

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if args.clip_grad:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            optimizer.step()

            meter.update(loss_value, images.size(0))
            if it % LOG_EVERY == 0 and is_main_process():
                logger.info("epoch %d it %d/%d loss %.4f lr %.2e (%.1fs)", epoch, it, steps_per_epoch,
                            meter.avg, optimizer.param_groups[0]["lr"], time.time() - t0)

        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            stats = evaluate(model, val_loader, ctx, device)
            stats.update(epoch=epoch, train_loss=meter.avg)
            history.append(stats)
            if is_main_process():
                logger.info("eval epoch %d: %s", epoch, stats)
                save_checkpoint(model_without_ddp, optimizer, epoch, out_dir / "last.pth")
                if stats["acc1"] > best_acc:
                    best_acc = stats["acc1"]
                    save_checkpoint(model_without_ddp, optimizer, epoch, out_dir / "best.pth", half=True)

    if is_main_process():
        (out_dir / "history.json").write_text(json.dumps(history, indent=2))
        logger.info("best top-1 %.2f", best_acc)
    if args.distributed:
        dist.barrier()
    return model_without_ddp


def train_linear_probe(backbone, args, device):
    """Fit a linear classifier on the frozen [CLS] features of the trained backbone."""
    probe_loader, probe_val_loader = build_probe_loader(args)
    backbone = backbone.half().eval()
    backbone.requires_grad_(False)

    head = nn.Linear(backbone.num_features, args.num_classes)
    nn.init.trunc_normal_(head.weight, std=0.01)
    nn.init.zeros_(head.bias)
    head = head.to(device).bfloat16()  # expect: AMP001
    optimizer = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(args.probe_epochs, 1))

    for epoch in range(args.probe_epochs):
        head.train()
        running = 0.0
        for images, target in probe_loader:
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            with torch.no_grad():
                feats = backbone.forward_features(images.half())
                feats = feats[:, 0].float()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = head(feats)
                loss = F.cross_entropy(logits, target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            running += loss.item()
        scheduler.step()

        head.eval()
        correct = total = 0
        with torch.no_grad():
            for images, target in probe_val_loader:
                images = images.to(device, non_blocking=True)
                target = target.to(device, non_blocking=True)
                feats = backbone.forward_features(images.half())[:, 0].float()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pred = head(feats).argmax(dim=-1)
                correct += (pred == target).sum().item()
                total += target.numel()
        if is_main_process():
            logger.info("probe epoch %d loss %.4f acc %.2f", epoch,
                        running / max(len(probe_loader), 1), 100.0 * correct / max(total, 1))
    return head


def main():
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    model = train(args)
    if args.probe_epochs > 0:
        train_linear_probe(model, args, torch.device("cuda", args.local_rank))
    if is_main_process() and os.environ.get("EXPORT_TS"):
        example = torch.randn(1, 3, 224, 224, device=next(model.parameters()).device)
        export_torchscript(model, example, Path(args.out) / "model_fp16.ts")


if __name__ == "__main__":
    main()
