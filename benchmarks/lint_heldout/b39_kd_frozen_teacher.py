"""Knowledge distillation from a frozen fp16 teacher into a small student.

The teacher (a torchvision model) is frozen and cast to fp16 once; the student trains
in fp32 under fp16 autocast with a GradScaler. Single-label (KL + CE) and multi-label
(soft-target BCE) variants share the same helpers; the best EMA student is exported.
"""
import argparse
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision

from kd_data import build_loaders


class ConvBNReLU(nn.Sequential):
    def __init__(self, cin, cout, stride=1, groups=1):
        super().__init__(
            nn.Conv2d(cin, cout, 3, stride, 1, groups=groups, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU6(inplace=True),
        )


class StudentNet(nn.Module):
    def __init__(self, num_classes=1000, width=32):
        super().__init__()
        self.features = nn.Sequential(
            ConvBNReLU(3, width, 2),
            ConvBNReLU(width, width, 1, groups=width),
            ConvBNReLU(width, width * 2, 2),
            ConvBNReLU(width * 2, width * 4, 2),
            ConvBNReLU(width * 4, width * 8, 2),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(0.2)
        self.fc = nn.Linear(width * 8, num_classes)

    def forward(self, x):
        x = self.pool(self.features(x)).flatten(1)
        return self.fc(self.dropout(x))


def build_teacher(arch, ckpt_path, num_classes, device="cuda"):
    teacher = torchvision.models.__dict__[arch](num_classes=num_classes)
    teacher.load_state_dict(torch.load(ckpt_path, map_location="cpu"))
    teacher.eval()
    teacher.requires_grad_(False)
    return teacher.to(device).half()


@torch.no_grad()
def precompute_teacher_logits(teacher, loader, device="cuda"):
    """Cache teacher logits (fp16, on the CPU) for the fixed-augmentation epochs."""
    cache = {}
    for idx, images, _ in loader:
        logits = teacher(images.to(device, non_blocking=True).half())
        for i, row in zip(idx.tolist(), logits.cpu()):
            cache[i] = row
    return cache


def kd_loss(student_logits, teacher_logits, T=4.0):
    p_t = F.softmax(teacher_logits / T, dim=1)
    log_p_s = F.log_softmax(student_logits / T, dim=1)
    return F.kl_div(log_p_s, p_t, reduction="batchmean") * (T * T)


@torch.no_grad()
def update_ema(ema_model, model, decay):
    for e, p in zip(ema_model.parameters(), model.parameters()):
        e.mul_(decay).add_(p.detach(), alpha=1.0 - decay)
    for e, b in zip(ema_model.buffers(), model.buffers()):
        e.copy_(b)


def train_epoch(student, teacher, loader, optimizer, scaler, args):
    student.train()
    for images, labels in loader:
        images = images.cuda(non_blocking=True).to(memory_format=torch.channels_last)
        labels = labels.cuda(non_blocking=True)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            t_logits = teacher(images.half()).float()
        with torch.autocast("cuda", dtype=torch.float16):
            s_logits = student(images)
            ce = F.cross_entropy(s_logits, labels, label_smoothing=args.smoothing)
        kd = kd_loss(s_logits, t_logits, args.T)  # expect: AMP002
        loss = (1.0 - args.alpha) * ce + args.alpha * kd
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if args.clip_grad > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(student.parameters(), args.clip_grad)
        scaler.step(optimizer)
        scaler.update()


def train_cached_epoch(student, cache, loader, optimizer, scaler, args):
    """Same as train_epoch, but with teacher logits read from the fp16 cache."""
    student.train()
    for idx, images, labels in loader:
        images = images.cuda(non_blocking=True)
        labels = labels.cuda(non_blocking=True)
        t_logits = torch.stack([cache[i] for i in idx.tolist()]).cuda(non_blocking=True).float()
        with torch.autocast("cuda", dtype=torch.float16):
            s_logits = student(images)
        kd = kd_loss(s_logits.float(), t_logits, args.T)
        ce = F.cross_entropy(s_logits.float(), labels)
        loss = (1.0 - args.alpha) * ce + args.alpha * kd
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def train_multilabel_epoch(student, teacher, loader, optimizer, scaler, args):
    student.train()
    for images, targets in loader:
        images = images.cuda(non_blocking=True)
        targets = targets.cuda(non_blocking=True).float()
        with torch.no_grad():
            soft_targets = torch.sigmoid(teacher(images.half()).float())
        mixed = args.beta * targets + (1.0 - args.beta) * soft_targets
        with torch.autocast("cuda", dtype=torch.float16):
            s_logits = student(images)
            loss = F.binary_cross_entropy(torch.sigmoid(s_logits), mixed)  # expect: AMP003
        loss = scaler.scale(loss)
        loss.backward()
        optimizer.step()  # expect: AMP006
        optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def validate(student, teacher, loader):
    student.eval()
    correct = agree = total = 0
    for images, labels in loader:
        images = images.cuda(non_blocking=True)
        labels = labels.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            s_logits = student(images)
        t_pred = teacher(images.half()).argmax(dim=1)
        s_pred = s_logits.argmax(dim=1)
        correct += (s_pred == labels).sum().item()
        agree += (s_pred == t_pred).sum().item()
        total += labels.numel()
    student.train()
    return 100.0 * correct / total, 100.0 * agree / total


def export_student(student, path):
    torch.save(copy.deepcopy(student).half().state_dict(), path)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--teacher_arch", default="resnet50")
    p.add_argument("--teacher_ckpt", required=True)
    p.add_argument("--num_classes", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--T", type=float, default=4.0)
    p.add_argument("--alpha", type=float, default=0.9)
    p.add_argument("--beta", type=float, default=0.5)
    p.add_argument("--smoothing", type=float, default=0.1)
    p.add_argument("--clip_grad", type=float, default=0.0)
    p.add_argument("--ema_decay", type=float, default=0.999)
    p.add_argument("--multilabel", action="store_true")
    p.add_argument("--cache_teacher", action="store_true")
    p.add_argument("--out", default="student_fp16.pt")
    return p.parse_args()


def main():
    args = parse_args()
    train_loader, val_loader, indexed_loader = build_loaders(args.data, multilabel=args.multilabel)
    teacher = build_teacher(args.teacher_arch, args.teacher_ckpt, args.num_classes)
    student = StudentNet(num_classes=args.num_classes).cuda().to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(student.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    scaler = torch.amp.GradScaler("cuda")
    ema_student = copy.deepcopy(student).eval().requires_grad_(False)
    cache = precompute_teacher_logits(teacher, indexed_loader) if args.cache_teacher else None

    best_acc = 0.0
    for epoch in range(args.epochs):
        if args.multilabel:
            train_multilabel_epoch(student, teacher, train_loader, optimizer, scaler, args)
        elif cache is not None:
            train_cached_epoch(student, cache, indexed_loader, optimizer, scaler, args)
        else:
            train_epoch(student, teacher, train_loader, optimizer, scaler, args)
        update_ema(ema_student, student, args.ema_decay)
        acc, agreement = validate(ema_student, teacher, val_loader)
        print(f"epoch {epoch}: acc {acc:.2f} teacher agreement {agreement:.2f}")
        if acc > best_acc:
            best_acc = acc
            export_student(ema_student, args.out)


if __name__ == "__main__":
    main()
