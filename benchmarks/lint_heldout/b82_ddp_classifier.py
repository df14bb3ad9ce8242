"""Image classification with DistributedDataParallel, gradient accumulation and resume.

    torchrun --nproc_per_node=8 train_ddp.py --data /datasets/imagenet --arch resnet50 \
        --batch-size 128 --accum-steps 2 --fp16 --clip-grad 5.0 --mixup 0.2
"""
import argparse
import copy
import datetime
import logging
import math
import os
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

from models import build_backbone
from utils.meters import AverageMeter, accuracy

logger = logging.getLogger("train")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--accum-steps", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--head-warmup-epochs", type=int, default=0)
    p.add_argument("--fixres-epochs", type=int, default=0, help="FixRes fine-tuning at --fixres-size after training")
    p.add_argument("--fixres-size", type=int, default=288)
    p.add_argument("--smoothing", type=float, default=0.1)
    p.add_argument("--mixup", type=float, default=0.0)
    p.add_argument("--clip-grad", type=float, default=None)
    p.add_argument("--fp16", action="store_true", help="mixed precision")
    p.add_argument("--pure-bf16", action="store_true", help="experimental: bf16 weights, no autocast")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--ema-decay", type=float, default=0.0)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--print-freq", type=int, default=100)
    p.add_argument("--output", default="checkpoints")
    p.add_argument("--resume", default="")
    return p.parse_args()


# ---------------------------------------------------------------- distributed helpers
def setup_distributed():
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ["LOCAL_RANK"])
    else:
        rank, world_size, local_rank = 0, 1, 0
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", world_size=world_size, rank=rank,
                            timeout=datetime.timedelta(minutes=30))
    dist.barrier()
    return rank, world_size, local_rank


def is_main_process():
    return not dist.is_initialized() or dist.get_rank() == 0


def reduce_mean(t):
    rt = t.detach().clone()
    dist.all_reduce(rt, op=dist.ReduceOp.SUM)
    return rt / dist.get_world_size()


# ---------------------------------------------------------------- model / loss
class ImageClassifier(nn.Module):
    def __init__(self, arch, num_classes, drop=0.0):
        super().__init__()
        self.backbone = build_backbone(arch, pretrained=True)
        self.dropout = nn.Dropout(drop)
        self.head = nn.Linear(self.backbone.num_features, num_classes)
        nn.init.zeros_(self.head.bias)

    def forward(self, x):
        return self.head(self.dropout(self.backbone(x)))


class SoftTargetCrossEntropy(nn.Module):
    def forward(self, x, target):
        loss = torch.sum(-target * F.log_softmax(x, dim=-1), dim=-1)
        return loss.mean()


def mixup_batch(images, target, num_classes, alpha, smoothing):
    lam = float(np.random.beta(alpha, alpha))
    perm = torch.randperm(images.size(0), device=images.device)
    images = lam * images + (1 - lam) * images[perm]
    off = smoothing / num_classes
    y = torch.full((target.size(0), num_classes), off, device=target.device)
    y.scatter_(1, target[:, None], 1.0 - smoothing + off)
    return images, lam * y + (1 - lam) * y[perm]


class ModelEMA:
    def __init__(self, model, decay):
        self.module = copy.deepcopy(model).eval()
        self.module.requires_grad_(False)
        self.decay = decay

    @torch.no_grad()
    def update(self, model):
        for ema_v, v in zip(self.module.state_dict().values(), model.state_dict().values()):
            if ema_v.dtype.is_floating_point:
                ema_v.mul_(self.decay).add_(v.detach(), alpha=1.0 - self.decay)
            else:
                ema_v.copy_(v)


def cosine_lr_lambda(args, steps_per_epoch):
    warmup, total = args.warmup_epochs * steps_per_epoch, args.epochs * steps_per_epoch

    def fn(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    return fn


# ---------------------------------------------------------------- checkpointing
def save_checkpoint(state, is_best, out_dir):
    if not is_main_process():
        return
    path = os.path.join(out_dir, "checkpoint.pth")
    torch.save(state, path)
    if is_best:
        shutil.copyfile(path, os.path.join(out_dir, "model_best.pth"))


def load_checkpoint(path, model, optimizer, scaler, scheduler, ema, device):
    ckpt = torch.load(path, map_location=device)
    model.module.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    scheduler.load_state_dict(ckpt["scheduler"])
    if "scaler" in ckpt:
        scaler.load_state_dict(ckpt["scaler"])
    if ema is not None and "ema" in ckpt:
        ema.module.load_state_dict({k: v.float() for k, v in ckpt["ema"].items()})
    return ckpt["epoch"] + 1, ckpt.get("best_acc1", 0.0)


# ---------------------------------------------------------------- loops
def warmup_head(model, loader, args, device):
    """Linear-probe warm-up of the new head with the backbone frozen."""
    backbone, head = model.module.backbone, model.module.head
    backbone.requires_grad_(False)
    head_opt = torch.optim.SGD(head.parameters(), lr=args.lr, momentum=args.momentum)
    model.train()
    for epoch in range(args.head_warmup_epochs):
        loader.sampler.set_epoch(epoch)
        for images, target in loader:
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):  # expect: AMP010
                loss = F.cross_entropy(model(images), target, label_smoothing=args.smoothing)
            head_opt.zero_grad(set_to_none=True)
            loss.backward()
            head_opt.step()
        if is_main_process():
            logger.info("head warm-up epoch %d loss %.4f", epoch, loss.item())
    backbone.requires_grad_(True)


def train_one_epoch(model, loader, criterion, optimizer, scheduler, scaler, ema, epoch, args, device):
    model.train()
    loader.sampler.set_epoch(epoch)
    losses, batch_time = AverageMeter(), AverageMeter()
    optimizer.zero_grad(set_to_none=True)
    end = time.time()
    for i, (images, target) in enumerate(loader):
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        if args.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        if args.mixup > 0:
            images, target = mixup_batch(images, target, args.num_classes, args.mixup, args.smoothing)
        if args.fp16:
            images = images.half()  # expect: AMP001

        sync_step = (i + 1) % args.accum_steps == 0 or (i + 1) == len(loader)
        if not sync_step:
            # accumulate locally, no gradient all-reduce on this micro-batch
            with model.no_sync(), torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
                loss = criterion(model(images), target) / args.accum_steps
                scaler.scale(loss).backward()  # expect: AMP008
            continue

        with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
            output = model(images)
            loss = criterion(output, target) / args.accum_steps
        scaler.scale(loss).backward()
        if args.clip_grad is not None:
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if ema is not None:
            ema.update(model.module)

        losses.update(reduce_mean(loss).item() * args.accum_steps, images.size(0))
        batch_time.update(time.time() - end)
        end = time.time()
        if is_main_process() and i % args.print_freq == 0:
            logger.info("epoch %d [%d/%d] loss %.4f (%.4f) lr %.4f scale %.0f %.3fs/it", epoch, i, len(loader),
                        losses.val, losses.avg, scheduler.get_last_lr()[0], scaler.get_scale(), batch_time.avg)
    return losses.avg


def finetune_fixres(model, loader, optimizer, scaler, args, device):
    """FixRes: fine-tune head + BN statistics at the test resolution."""
    model.train()
    for epoch in range(args.fixres_epochs):
        loader.sampler.set_epoch(1000 + epoch)
        for images, target in loader:
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            if args.fp16:
                images = images.type(torch.cuda.HalfTensor)  # expect: AMP001
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
                loss = F.cross_entropy(model(images), target)
            optimizer.zero_grad(set_to_none=True)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
            optimizer.step()  # expect: AMP006
        if is_main_process():
            logger.info("fixres epoch %d loss %.4f", epoch, loss.item())


@torch.no_grad()
def validate(model, loader, args, device):
    model.eval()
    correct = torch.zeros(2, device=device)
    count = torch.zeros(1, device=device)
    for images, target in loader:
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        if args.fp16:
            images = images.half()
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
            output = model(images)
        acc1, acc5 = accuracy(output.float(), target, topk=(1, 5))
        correct += torch.stack([acc1, acc5]) * images.size(0) / 100.0
        count += images.size(0)
    dist.all_reduce(correct)
    dist.all_reduce(count)
    return (100.0 * correct / count).tolist()


def build_loaders(args, world_size, rank, train_size=224):
    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), transforms.Compose([
        transforms.RandomResizedCrop(train_size), transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalize]))
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), normalize]))
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    val_sampler = DistributedSampler(val_set, num_replicas=world_size, rank=rank, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler, num_workers=args.workers,
                            pin_memory=True)
    return train_loader, val_loader


def main():
    args = parse_args()
    rank, world_size, local_rank = setup_distributed()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN, format="%(asctime)s %(message)s")
    torch.backends.cudnn.benchmark = True
    os.makedirs(args.output, exist_ok=True)

    train_loader, val_loader = build_loaders(args, world_size, rank)
    model = ImageClassifier(args.arch, args.num_classes).to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if args.pure_bf16:
        model = model.to(torch.bfloat16)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    ema = ModelEMA(model, args.ema_decay) if args.ema_decay > 0 else None
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=args.head_warmup_epochs > 0)

    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    lr = args.lr * args.batch_size * args.accum_steps * world_size / 256
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=lr, momentum=args.momentum, nesterov=True)
    steps_per_epoch = math.ceil(len(train_loader) / args.accum_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_lr_lambda(args, steps_per_epoch))
    try:
        scaler = torch.amp.GradScaler("cuda", enabled=args.fp16)
    except (AttributeError, TypeError):  # torch < 2.3
        scaler = torch.cuda.amp.GradScaler(enabled=args.fp16)
    if args.mixup > 0:
        criterion = SoftTargetCrossEntropy()
    else:
        criterion = nn.CrossEntropyLoss(label_smoothing=args.smoothing)

    start_epoch, best_acc1 = 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        start_epoch, best_acc1 = load_checkpoint(args.resume, model, optimizer, scaler, scheduler, ema, device)
        logger.info("resumed from %s at epoch %d (best acc@1 %.2f)", args.resume, start_epoch, best_acc1)
    elif args.head_warmup_epochs > 0:
        warmup_head(model, train_loader, args, device)

    for epoch in range(start_epoch, args.epochs):
        train_loss = train_one_epoch(model, train_loader, criterion, optimizer, scheduler, scaler, ema, epoch,
                                     args, device)
        acc1, acc5 = validate(model, val_loader, args, device)
        is_best = acc1 > best_acc1
        best_acc1 = max(acc1, best_acc1)
        logger.info("epoch %d train loss %.4f val acc@1 %.2f acc@5 %.2f", epoch, train_loss, acc1, acc5)
        state = {
            "epoch": epoch, "arch": args.arch, "best_acc1": best_acc1,
            "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
        }
        if ema is not None:
            state["ema"] = {k: v.half() for k, v in ema.module.state_dict().items()}
        save_checkpoint(state, is_best, args.output)

    if args.fixres_epochs > 0:
        fixres_loader, _ = build_loaders(args, world_size, rank, train_size=args.fixres_size)
        head_and_bn = [p for n, p in model.module.named_parameters() if n.startswith("head.") or p.ndim == 1]
        ft_optimizer = torch.optim.SGD(head_and_bn, lr=1e-3, momentum=args.momentum)
        finetune_fixres(model, fixres_loader, ft_optimizer, scaler if args.fp16 else None, args, device)
        acc1, acc5 = validate(model, val_loader, args, device)
        logger.info("after FixRes: val acc@1 %.2f acc@5 %.2f", acc1, acc5)
        save_checkpoint({"epoch": args.epochs, "arch": args.arch, "best_acc1": acc1,
                         "model": model.module.state_dict()}, False, args.output)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
