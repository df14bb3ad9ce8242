"""
Knowledge distillation: a frozen teacher (e.g. ViT-L/16 fine-tuned on the task) into a
small student (ResNet-18 / MobileNetV3), with logit KD plus a relational term on the
batch similarity structure (RKD-style, in-batch contrastive).

    python distill.py --teacher ckpt/vitl_in1k.pth --student resnet18 --data /data/imagenet
"""
import argparse
import copy
import json
import logging
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from kd.data import build_multicrop_loader, build_val_loader
from kd.models import build_teacher, create_model
from kd.utils import AverageMeter, accuracy, cosine_lr

logger = logging.getLogger("distill")


def parse_args():
    p = argparse.ArgumentParser("distillation")
    p.add_argument("--data", required=True)
    p.add_argument("--teacher", required=True)
    p.add_argument("--teacher-arch", default="vit_large_patch16_224")
    p.add_argument("--student", default="resnet18")
    p.add_argument("--student-init", choices=["scratch", "teacher"], default="scratch")
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--wd", type=float, default=5e-5)
    p.add_argument("--temperature", type=float, default=4.0)
    p.add_argument("--alpha", type=float, default=0.9, help="weight of the KD term")
    p.add_argument("--beta", type=float, default=0.5, help="weight of the relational term")
    p.add_argument("--tau", type=float, default=0.1)
    p.add_argument("--out", default="runs/kd")
    p.add_argument("--workers", type=int, default=12)
    return p.parse_args()


class Projector(nn.Module):
    """Maps student features to the teacher's embedding width for the relational term."""

    def __init__(self, in_dim, out_dim, hidden=2048):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(in_dim, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(inplace=True),
            nn.Linear(hidden, out_dim),
        )

    def forward(self, x):
        return self.net(x)


def kd_loss(student_logits, teacher_logits, T):
    return F.kl_div(
        F.log_softmax(student_logits / T, dim=-1),
        F.softmax(teacher_logits / T, dim=-1),
        reduction="batchmean",
    ) * (T * T)


def train_one_epoch(student, projector, teacher, loader, optimizer, epoch, args, lr_schedule):
    student.train()
    projector.train()
    meters = {k: AverageMeter() for k in ("loss", "ce", "kd", "rel")}
    steps = len(loader)
    t0 = time.time()
    for it, (crops, target) in enumerate(loader):
        for group in optimizer.param_groups:
            group["lr"] = lr_schedule[epoch * steps + it]
        crops = [c.cuda(non_blocking=True).half() for c in crops]  # expect: AMP001
        target = target.cuda(non_blocking=True)
        images = crops[0]

        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            t_feats = teacher.forward_features(images)
            t_logits = teacher.forward_head(t_feats)
            t_emb = F.normalize(t_feats[:, 0].float(), dim=-1)

        with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
            s_feats = student.forward_features(images)
            s_logits = student.forward_head(s_feats)
            s_pooled = student.forward_head(s_feats, pre_logits=True)
            s_emb = F.normalize(projector(s_pooled), dim=-1)
            ce = F.cross_entropy(s_logits, target)
            kd = kd_loss(s_logits, t_logits, args.temperature)

            # in-batch relational term; the diagonal is the trivial positive
            sim = s_emb @ t_emb.t() / args.tau
            eye = torch.eye(sim.size(0), dtype=torch.bool, device=sim.device)
            sim = sim.masked_fill(eye, -1e9)  # expect: AMP007
            rel = F.cross_entropy(sim, torch.arange(sim.size(0), device=sim.device).roll(1))
            loss = (1 - args.alpha) * ce + args.alpha * kd + args.beta * rel

        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 5.0)
        optimizer.step()

        n = images.size(0)
        meters["loss"].update(loss.item(), n)
        meters["ce"].update(ce.item(), n)
        meters["kd"].update(kd.item(), n)
        meters["rel"].update(rel.item(), n)
        if it % 100 == 0:
            logger.info("ep %d it %d/%d %s %.1fs", epoch, it, steps,
                        " ".join(f"{k}={m.avg:.4f}" for k, m in meters.items()), time.time() - t0)
    return {k: m.avg for k, m in meters.items()}


@torch.no_grad()
def validate(model, loader, amp=True):
    model.eval()
    top1, top5 = AverageMeter(), AverageMeter()
    for images, target in loader:
        images = images.cuda(non_blocking=True).half()
        target = target.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
            logits = model(images)
        acc1, acc5 = accuracy(logits.float(), target, topk=(1, 5))
        top1.update(acc1.item(), images.size(0))
        top5.update(acc5.item(), images.size(0))
    return {"acc1": top1.avg, "acc5": top5.avg}


def export_student(student, path):
    frozen = copy.deepcopy(student).eval()
    torch.save({"state_dict": {k: v.half() for k, v in frozen.state_dict().items()}}, path)


def main():
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cudnn.benchmark = True

    teacher = build_teacher(args.teacher_arch, args.teacher, num_classes=args.num_classes)
    if args.student_init == "teacher":
        # same-architecture self-distillation: start from the teacher's weights
        student = copy.deepcopy(teacher).half()  # expect: AMP001
    else:
        student = create_model(args.student, num_classes=args.num_classes)
    teacher = teacher.half().eval()
    teacher.requires_grad_(False)
    teacher.cuda()
    student.cuda()

    projector = Projector(student.num_features, teacher.embed_dim).cuda()
    params = list(student.parameters()) + list(projector.parameters())
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=args.wd, nesterov=True)

    train_loader = build_multicrop_loader(args.data, args.batch_size, args.workers)
    val_loader = build_val_loader(args.data, args.batch_size, args.workers)
    lr_schedule = cosine_lr(args.lr, args.epochs, len(train_loader), warmup_epochs=5)

    t_stats = validate(teacher, val_loader)
    logger.info("teacher: %s", t_stats)

    best = 0.0
    history = []
    for epoch in range(args.epochs):
        train_stats = train_one_epoch(student, projector, teacher, train_loader, optimizer, epoch, args, lr_schedule)
        val_stats = validate(student, val_loader)
        history.append({"epoch": epoch, **train_stats, **val_stats})
        logger.info("epoch %d: %s", epoch, val_stats)
        torch.save({"student": student.state_dict(), "projector": projector.state_dict(),
                    "optimizer": optimizer.state_dict(), "epoch": epoch}, out / "last.pth")
        if val_stats["acc1"] > best:
            best = val_stats["acc1"]
            export_student(student, out / "student_best_fp16.pth")
    (out / "history.json").write_text(json.dumps(history, indent=2))
    logger.info("best student top-1 %.2f (teacher %.2f)", best, t_stats["acc1"])


if __name__ == "__main__":
    main()
