"""ImageNet training with DistributedDataParallel, gradient accumulation and resume.

Launch:  torchrun --nproc_per_node=8 b52_ddp_resume.py --data /imagenet --accum-steps 2
Resume:  ... --resume runs/r50/last.pth   (also reads checkpoints saved with fp16 weights)

History: the first version of this script wrapped the forward in
``torch.cuda.amp.autocast()``; checkpoints from that time carry the same scaler state.
"""
import argparse
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from imagenet.data import build_dataset
from imagenet.models import build_model

INPUT_DTYPE = torch.float16  # dtype the fp16 evaluation pipeline feeds the network


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--accum-steps", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--wd", type=float, default=5e-5)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--clip-grad", type=float, default=None)
    p.add_argument("--sync-bn", action="store_true")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--resume", default="")
    p.add_argument("--find-lr", action="store_true")
    p.add_argument("--half-ckpt", action="store_true", help="store weights as fp16")
    p.add_argument("--out", default="runs/r50")
    return p.parse_args()


def setup_distributed():
    dist.init_process_group(backend="nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    return local_rank


def make_scaler():
    try:
        return torch.amp.GradScaler("cuda", init_scale=2.0 ** 16, growth_interval=2000)
    except (AttributeError, TypeError):  # torch < 2.3
        return torch.cuda.amp.GradScaler(init_scale=2.0 ** 16, growth_interval=2000)


def train_one_epoch(model, loader, optimizer, scaler, scheduler, epoch, args, device):
    model.train()
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    optimizer.zero_grad(set_to_none=True)
    t0 = time.time()
    for i, (images, targets) in enumerate(loader):
        images = images.to(device, non_blocking=True).to(INPUT_DTYPE)  # expect: AMP001
        targets = targets.to(device, non_blocking=True)
        if args.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)

        sync = (i + 1) % args.accum_steps == 0 or (i + 1) == len(loader)
        ctx = model.no_sync() if not sync else nullcontext()
        with ctx:
            with torch.amp.autocast("cuda", dtype=torch.float16):
                output = model(images)
                loss = criterion(output, targets)
            scaler.scale(loss / args.accum_steps).backward()

        if sync:
            if args.clip_grad is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()

        if dist.get_rank() == 0 and i % 100 == 0:
            print(f"epoch {epoch} [{i}/{len(loader)}] loss {loss.item():.4f} "
                  f"scale {scaler.get_scale():.0f} {(time.time() - t0) / (i + 1):.3f}s/it")


def lr_range_test(model, loader, optimizer, scaler, args, device, start_lr=1e-5, end_lr=10.0, num_iters=200):
    """Smith's LR range test: exponential LR sweep, one optimizer step per batch."""
    criterion = nn.CrossEntropyLoss()
    gamma = (end_lr / start_lr) ** (1.0 / num_iters)
    for group in optimizer.param_groups:
        group["lr"] = start_lr
    history = []
    model.train()
    for it, (images, targets) in enumerate(loader):
        if it >= num_iters:
            break
        images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():  # expect: AMP009
            loss = criterion(model(images), targets)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # expect: AMP006
        history.append((optimizer.param_groups[0]["lr"], loss.item()))
        for group in optimizer.param_groups:
            group["lr"] *= gamma
    return history


@torch.no_grad()
@torch.cuda.amp.autocast()  # expect: AMP009
def evaluate(model, loader, device):
    model.eval()
    correct = torch.zeros((), device=device)
    total = torch.zeros((), device=device)
    for images, targets in loader:
        images = images.to(device, non_blocking=True).to(INPUT_DTYPE)
        targets = targets.to(device, non_blocking=True)
        output = model(images)
        correct += (output.argmax(1) == targets).sum()
        total += targets.numel()
    dist.all_reduce(correct)
    dist.all_reduce(total)
    return (correct / total).item()


def save_checkpoint(model, optimizer, scaler, scheduler, epoch, path, half_weights=False):
    state = model.module.state_dict()
    if half_weights:
        state = {k: v.half() if v.is_floating_point() else v for k, v in state.items()}
    torch.save(
        {
            "model": state,
            "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict(),
            "scheduler": scheduler.state_dict(),
            "epoch": epoch,
        },
        path,
    )


def resume(path, model, optimizer, scaler, scheduler, device):
    ckpt = torch.load(path, map_location=device)
    # fp16 checkpoints are upcast before loading into the fp32 model
    state = {k: v.float() if v.is_floating_point() else v for k, v in ckpt["model"].items()}
    model.module.load_state_dict(state)
    optimizer.load_state_dict(ckpt["optimizer"])
    scheduler.load_state_dict(ckpt["scheduler"])
    if ckpt.get("scaler"):
        scaler.load_state_dict(ckpt["scaler"])
    return ckpt["epoch"] + 1


def main():
    args = parse_args()
    local_rank = setup_distributed()
    device = torch.device("cuda", local_rank)
    train_set, val_set = build_dataset(args.data)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=10, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=10, pin_memory=True)

    model = build_model(args.arch).to(device)
    if args.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)

    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.wd, nesterov=True)
    steps_per_epoch = len(train_loader) // args.accum_steps
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, epochs=args.epochs,
                                                    steps_per_epoch=steps_per_epoch, pct_start=0.05)
    scaler = make_scaler()

    if args.find_lr:
        history = lr_range_test(model, train_loader, optimizer, scaler, args, device)
        if dist.get_rank() == 0:
            torch.save(history, os.path.join(args.out, "lr_range.pt"))
        return

    start_epoch = 0
    if args.resume and os.path.isfile(args.resume):
        start_epoch = resume(args.resume, model, optimizer, scaler, scheduler, device)

    best_acc = 0.0
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        train_one_epoch(model, train_loader, optimizer, scaler, scheduler, epoch, args, device)
        acc = evaluate(model, val_loader, device)
        if dist.get_rank() == 0:
            os.makedirs(args.out, exist_ok=True)
            save_checkpoint(model, optimizer, scaler, scheduler, epoch, os.path.join(args.out, "last.pth"),
                            half_weights=args.half_ckpt)
            if acc > best_acc:
                best_acc = acc
                save_checkpoint(model, optimizer, scaler, scheduler, epoch, os.path.join(args.out, "best.pth"),
                                half_weights=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
