"""Knowledge distillation on ImageNet: ResNet-50 teacher -> ResNet-18 student.

Loss = (1 - alpha) * CE(student, y) + alpha * KD(student, teacher) + beta * hint,
where the hint term (FitNets) matches an adapted student feature map to the
teacher's.  The teacher is frozen and runs in half precision under no_grad.
"""
import argparse
import copy
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from kd.data import build_imagenet
from kd.models import build_model, feature_dim


def parse_args():
    p = argparse.ArgumentParser("kd")
    p.add_argument("--data", default="/datasets/imagenet")
    p.add_argument("--teacher-arch", default="resnet50")
    p.add_argument("--teacher-ckpt", required=True)
    p.add_argument("--student-arch", default="resnet18")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--alpha", type=float, default=0.9)
    p.add_argument("--beta", type=float, default=50.0)
    p.add_argument("--temperature", type=float, default=4.0)
    p.add_argument("--smoothing", type=float, default=0.0)
    p.add_argument("--kd-mode", choices=["soft", "logits"], default="soft")
    p.add_argument("--adapter-warmup", type=int, default=500)
    p.add_argument("--clip-grad", type=float, default=5.0)
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--out", default="runs/kd")
    return p.parse_args()


def distillation_loss(student_logits, teacher_logits, temperature):
    """Hinton et al. KD term, computed in fp32 whatever precision the caller runs in."""
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    t = F.softmax(teacher_logits.float() / temperature, dim=-1)
    return F.kl_div(s, t, reduction="batchmean") * temperature ** 2


def pretrain_adapter(student, teacher, adapter, loader, steps, lr):
    """FitNets stage 1: fit the 1x1 adapter alone before joint distillation."""
    opt = torch.optim.SGD(adapter.parameters(), lr=lr, momentum=0.9)
    adapter.train()
    for i, (images, _) in enumerate(loader):
        if i >= steps:
            break
        images = images.cuda(non_blocking=True)
        with torch.no_grad():
            t_feat, _ = teacher(images.half(), return_features=True)
            s_feat, _ = student(images, return_features=True)
        with torch.amp.autocast("cuda", dtype=torch.float16):  # expect: AMP010
            loss = F.mse_loss(adapter(s_feat), t_feat.float())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i % 100 == 0:
            print(f"adapter warmup {i}/{steps} loss {loss.item():.4f}")


def train_one_epoch(student, teacher, adapter, loader, optimizer, scaler, epoch, args):
    student.train()
    adapter.train()
    T = args.temperature
    t0 = time.time()
    for step, (images, targets) in enumerate(loader):
        images = images.cuda(non_blocking=True)
        targets = targets.cuda(non_blocking=True)
        if args.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)

        with torch.no_grad():
            t_feat, teacher_logits = teacher(images.half(), return_features=True)
        teacher_logits = teacher_logits.float()

        with torch.autocast("cuda", dtype=torch.float16):
            s_feat, student_logits = student(images, return_features=True)
            s_hint = adapter(s_feat)
            ce = F.cross_entropy(student_logits, targets, label_smoothing=args.smoothing)

        if args.kd_mode == "soft":
            kd = distillation_loss(student_logits, teacher_logits, T)
        else:
            kd = F.kl_div(F.log_softmax(student_logits / T, dim=1), F.log_softmax(teacher_logits / T, dim=1), reduction="batchmean", log_target=True) * (T * T)  # expect: AMP002
        hint = F.mse_loss(s_hint, t_feat)  # expect: AMP002
        loss = (1.0 - args.alpha) * ce + args.alpha * kd + args.beta * hint

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = nn.utils.clip_grad_norm_(
            list(student.parameters()) + list(adapter.parameters()), args.clip_grad
        )
        scaler.step(optimizer)
        scaler.update()

        if step % 50 == 0:
            print(
                f"epoch {epoch} step {step}/{len(loader)} ce {ce.item():.3f} kd {kd.item():.3f} "
                f"hint {hint.item():.4f} |g| {grad_norm.item():.2f} scale {scaler.get_scale():.0f} "
                f"{time.time() - t0:.1f}s"
            )


@torch.no_grad()
def validate(model, loader, half_inputs=False):
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    for images, targets in loader:
        images = images.cuda(non_blocking=True)
        targets = targets.cuda(non_blocking=True)
        if half_inputs:
            images = images.half()
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(images)
            loss_sum += F.cross_entropy(logits, targets, reduction="sum").item()
        correct += (logits.argmax(1) == targets).sum().item()
        total += targets.numel()
    return loss_sum / total, 100.0 * correct / total


def export_student(student, path):
    """Release artefact: fp16 weights only."""
    export = copy.deepcopy(student).half().eval()
    torch.save(export.state_dict(), path)


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    train_set, val_set = build_imagenet(args.data)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                              num_workers=12, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, num_workers=12, pin_memory=True)

    teacher = build_model(args.teacher_arch, num_classes=1000)
    teacher.load_state_dict(torch.load(args.teacher_ckpt, map_location="cpu"))
    teacher = teacher.cuda().eval().half()
    teacher.requires_grad_(False)

    student = build_model(args.student_arch, num_classes=1000).cuda()
    if args.channels_last:
        student = student.to(memory_format=torch.channels_last)

    s_dim, t_dim = feature_dim(args.student_arch), feature_dim(args.teacher_arch)
    # the teacher's features are fp16, so the adapter is made fp16 to match them
    adapter = nn.Conv2d(s_dim, t_dim, kernel_size=1, bias=False).cuda().half()  # expect: AMP001

    optimizer = torch.optim.SGD(
        [
            {"params": student.parameters()},
            {"params": adapter.parameters(), "weight_decay": 0.0},
        ],
        lr=args.lr, momentum=0.9, weight_decay=args.wd, nesterov=True,
    )
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    scaler = torch.cuda.amp.GradScaler(init_scale=2.0 ** 14)  # expect: AMP009

    t_loss, t_acc = validate(teacher, val_loader, half_inputs=True)
    print(f"teacher: loss {t_loss:.3f} acc {t_acc:.2f}")

    if args.adapter_warmup > 0:
        pretrain_adapter(student, teacher, adapter, train_loader, args.adapter_warmup, lr=0.01)

    best_acc = 0.0
    for epoch in range(args.epochs):
        train_one_epoch(student, teacher, adapter, train_loader, optimizer, scaler, epoch, args)
        scheduler.step()
        val_loss, val_acc = validate(student, val_loader)
        print(f"epoch {epoch}: val loss {val_loss:.3f} acc {val_acc:.2f}")
        torch.save(
            {
                "student": student.state_dict(),
                "adapter": adapter.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(),
                "epoch": epoch,
            },
            os.path.join(args.out, "last.pth"),
        )
        if val_acc > best_acc:
            best_acc = val_acc
            export_student(student, os.path.join(args.out, "student_best_fp16.pth"))


if __name__ == "__main__":
    main()
