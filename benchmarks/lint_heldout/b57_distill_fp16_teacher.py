"""Knowledge distillation on ImageNet with a frozen fp16 teacher.

Stage 1 distils logits (Hinton KD) over several "born-again" generations, each
generation's student becoming the next teacher.  Stage 2 (optional) matches
intermediate features through a trainable projector.
"""

import argparse
import copy
import os
import time

import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder


def build_loaders(args):
    normalize = T.Normalize(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    train_tf = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), normalize])
    val_tf = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), normalize])
    train_set = ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = ImageFolder(os.path.join(args.data, "val"), val_tf)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=2 * args.batch_size, num_workers=args.workers, pin_memory=True)
    return train_loader, val_loader


def load_teacher(arch, ckpt, device):
    teacher = timm.create_model(arch, num_classes=1000)
    teacher.load_state_dict(torch.load(ckpt, map_location="cpu")["model"])
    teacher.requires_grad_(False)
    teacher.eval()
    return teacher.to(device).half()


def build_student(args):
    return timm.create_model(args.student, num_classes=1000, drop_path_rate=args.drop_path)


def accuracy(output, target, topk=(1, 5)):
    maxk = max(topk)
    _, pred = output.topk(maxk, 1, True, True)
    correct = pred.t().eq(target.view(1, -1).expand_as(pred.t()))
    return [correct[:k].reshape(-1).float().sum(0) * 100.0 / target.size(0) for k in topk]


def evaluate(model, loader, device):
    model.eval()
    top1 = top5 = n = 0.0
    with torch.inference_mode():
        for images, targets in loader:
            images = images.to(device, non_blocking=True).half()
            targets = targets.to(device, non_blocking=True)
            output = model(images).float()
            a1, a5 = accuracy(output, targets)
            top1 += a1.item() * images.size(0)
            top5 += a5.item() * images.size(0)
            n += images.size(0)
    return top1 / n, top5 / n


def precompute_teacher_logits(teacher, loader, path, device):
    """Cache the teacher's logits once (stored in fp16: 2 bytes x 1000 classes per image)."""
    chunks = []
    with torch.inference_mode():
        for images, _ in loader:
            logits = teacher(images.to(device).half())
            chunks.append(logits.half().cpu())
    torch.save(torch.cat(chunks), path)


def train_generation(student, teacher, loader, optimizer, scaler, lr_sched, device, epoch, args):
    student.train()
    T_kd = args.temperature
    t0 = time.time()
    for it, (images, targets) in enumerate(loader):
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with torch.no_grad():
            teacher_logits = teacher(images.half()).float()
        with torch.autocast("cuda", dtype=torch.float16):
            student_logits = student(images)
            ce = F.cross_entropy(student_logits, targets, label_smoothing=args.smoothing)
        # distillation term (temperature-scaled KL)
        loss_kd = F.kl_div(F.log_softmax(student_logits / T_kd, dim=1), F.softmax(teacher_logits / T_kd, dim=1), reduction="batchmean") * (T_kd * T_kd)  # expect: AMP002
        loss = (1.0 - args.alpha) * ce + args.alpha * loss_kd

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(student.parameters(), args.clip_grad)
        scaler.step(optimizer)
        scaler.update()
        lr_sched.step()
        if it % args.print_freq == 0:
            print(f"epoch {epoch} it {it}/{len(loader)} ce {ce.item():.3f} kd {loss_kd.item():.3f} "
                  f"scale {scaler.get_scale():.0f} {time.time() - t0:.1f}s")


def train_from_cache(student, cached_logits, loader, optimizer, scaler, device, args):
    """Same objective, teacher logits read back from the fp16 cache (no teacher forward)."""
    student.train()
    offset = 0
    for images, targets in loader:
        bs = images.size(0)
        teacher_logits = cached_logits[offset:offset + bs].to(device, non_blocking=True).float()
        offset += bs
        images = images.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            student_logits = student(images)
            log_p = F.log_softmax(student_logits.float() / args.temperature, dim=1)
            q = F.softmax(teacher_logits.half().float() / args.temperature, dim=1)
            loss = F.kl_div(log_p, q, reduction="batchmean") * args.temperature ** 2
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def distill_generations(args, teacher, train_loader, val_loader, device):
    init_student = build_student(args)
    scaler = torch.cuda.amp.GradScaler()  # expect: AMP009
    best = 0.0
    for generation in range(args.generations):
        student = copy.deepcopy(init_student).half()  # expect: AMP001
        student.to(device, memory_format=torch.channels_last)
        optimizer = torch.optim.SGD(student.parameters(), lr=args.lr, momentum=0.9, nesterov=True,
                                    weight_decay=args.weight_decay)
        lr_sched = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, epochs=args.epochs,
                                                       steps_per_epoch=len(train_loader))
        for epoch in range(args.epochs):
            train_generation(student, teacher, train_loader, optimizer, scaler, lr_sched, device, epoch, args)
            top1, top5 = evaluate(copy.deepcopy(student).half(), val_loader, device)
            print(f"generation {generation} epoch {epoch}: top1 {top1:.2f} top5 {top5:.2f}")
            if top1 > best:
                best = top1
                torch.save({"generation": generation, "epoch": epoch,
                            "model": copy.deepcopy(student).half().state_dict(), "top1": top1},
                           os.path.join(args.output_dir, "best.pth"))
        # born-again: the trained student teaches the next generation
        teacher = copy.deepcopy(student).half().eval()
        teacher.requires_grad_(False)
    return teacher


class FeatureProjector(nn.Module):
    def __init__(self, c_in, c_out):
        super().__init__()
        self.proj = nn.Sequential(nn.Conv2d(c_in, c_out, 1, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        return self.proj(x)


def train_feature_kd(student, teacher, projector, loader, optimizer, scaler, device, args):
    """FitNets-style stage: regress the teacher's last feature map."""
    student.train()
    projector.train()
    for images, targets in loader:
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with torch.no_grad():
            teacher_feat = teacher.forward_features(images.half())
        with torch.autocast("cuda", dtype=torch.float16):
            feats = student.forward_features(images)
            student_feat = projector(feats).type(torch.cuda.HalfTensor)  # expect: AMP001
            logits = student.forward_head(feats)
            loss = F.cross_entropy(logits, targets) + args.beta * F.mse_loss(student_feat, teacher_feat)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def benchmark_teacher(teacher, device, batch_size=256, iters=50):
    x = torch.randn(batch_size, 3, 224, 224, device=device, dtype=torch.float16)
    with torch.inference_mode():
        for _ in range(10):
            teacher(x)
        torch.cuda.synchronize()
        t0 = time.time()
        for _ in range(iters):
            teacher(x)
        torch.cuda.synchronize()
    return batch_size * iters / (time.time() - t0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--teacher", default="regnety_160")
    p.add_argument("--teacher-ckpt", required=True)
    p.add_argument("--student", default="deit_small_patch16_224")
    p.add_argument("--output-dir", default="out/kd")
    p.add_argument("--generations", type=int, default=2)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=5e-5)
    p.add_argument("--drop-path", type=float, default=0.1)
    p.add_argument("--smoothing", type=float, default=0.1)
    p.add_argument("--temperature", type=float, default=4.0)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--beta", type=float, default=1.0)
    p.add_argument("--clip-grad", type=float, default=5.0)
    p.add_argument("--print-freq", type=int, default=100)
    p.add_argument("--feature-kd", action="store_true")
    p.add_argument("--cache-logits", action="store_true")
    args = p.parse_args()
    os.makedirs(args.output_dir, exist_ok=True)

    device = torch.device("cuda")
    train_loader, val_loader = build_loaders(args)
    teacher = load_teacher(args.teacher, args.teacher_ckpt, device)
    print(f"teacher throughput: {benchmark_teacher(teacher, device):.0f} img/s")

    if args.cache_logits:
        cache = os.path.join(args.output_dir, "teacher_logits.pt")
        cache_loader = DataLoader(train_loader.dataset, batch_size=args.batch_size, shuffle=False,
                                  num_workers=args.workers, pin_memory=True)
        precompute_teacher_logits(teacher, cache_loader, cache, device)
        student = build_student(args).to(device)
        optimizer = torch.optim.AdamW(student.parameters(), lr=5e-4, weight_decay=0.05)
        scaler = torch.amp.GradScaler("cuda")
        for _ in range(args.epochs):
            train_from_cache(student, torch.load(cache), cache_loader, optimizer, scaler, device, args)
        return

    final_teacher = distill_generations(args, teacher, train_loader, val_loader, device)
    if args.feature_kd:
        student = build_student(args).to(device)
        projector = FeatureProjector(student.num_features, final_teacher.num_features).to(device)
        params = list(student.parameters()) + list(projector.parameters())
        optimizer = torch.optim.AdamW(params, lr=5e-4, weight_decay=0.05)
        scaler = torch.amp.GradScaler("cuda")
        for _ in range(args.epochs):
            train_feature_kd(student, final_teacher, projector, train_loader, optimizer, scaler, device, args)


if __name__ == "__main__":
    main()
