"""Knowledge distillation (Hinton KD + FitNets hint) on CPU with bfloat16 autocast.

Runs on CPU-only training nodes (Sapphire Rapids, AMX): autocast("cpu", bf16),
no loss scaling needed.
"""
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from cifar import build_cifar100  # local


class ConvStage(nn.Module):
    def __init__(self, cin, cout, stride=2):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1, stride=stride)

    def forward(self, x):
        h = F.relu(self.conv1(x))
        return F.relu(self.conv2(h) + self.skip(x))


class AttnPool(nn.Module):
    """Attention pooling over spatial tokens."""

    def __init__(self, dim):
        super().__init__()
        self.score = nn.Linear(dim, 1)

    def forward(self, tokens, mask=None):
        scores = self.score(tokens)
        if mask is not None:
            scores = scores.masked_fill(~mask[..., None], torch.finfo(scores.dtype).min)
        w = scores.softmax(dim=1)
        return (w * tokens).sum(dim=1)  # expect: AMP004


class StudentNet(nn.Module):
    def __init__(self, num_classes=100, width=32, hint_dim=512):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.stages = nn.ModuleList([ConvStage(width * 2 ** i, width * 2 ** (i + 1)) for i in range(3)])
        dim = width * 8
        self.attn_pool = AttnPool(dim)
        self.hint = nn.Conv2d(dim, hint_dim, 1)
        self.fc = nn.Linear(2 * dim, num_classes)

    def forward(self, x):
        x = F.relu(self.stem(x))
        for stage in self.stages:
            x = stage(x)
        hint = self.hint(x)
        gap = x.mean(dim=(2, 3))  # expect: AMP004
        att = self.attn_pool(x.flatten(2).transpose(1, 2))
        return self.fc(torch.cat([gap, att], dim=1)), hint


class TeacherNet(nn.Module):
    def __init__(self, num_classes=100, width=64):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.stages = nn.ModuleList([ConvStage(width * 2 ** i, width * 2 ** (i + 1)) for i in range(3)])
        self.head = nn.Linear(width * 8, num_classes)

    def forward(self, x):
        x = F.relu(self.stem(x))
        for stage in self.stages:
            x = stage(x)
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1)), x


def build_student(args):
    return StudentNet(args.num_classes, width=args.student_width, hint_dim=args.teacher_width * 8)


def build_teacher(args):
    return TeacherNet(args.num_classes, width=args.teacher_width)


def kd_loss(student_logits, teacher_logits, T):
    log_p = F.log_softmax(student_logits / T, dim=-1)
    q = F.softmax(teacher_logits / T, dim=-1)
    return F.kl_div(log_p, q, reduction="batchmean") * (T * T)


def accuracy(logits, target, topk=(1,)):
    maxk = max(topk)
    _, pred = logits.topk(maxk, dim=1)
    correct = pred.eq(target[:, None])
    return [correct[:, :k].any(dim=1).float().mean().item() * 100 for k in topk]


def train_one_epoch(student, teacher, loader, optimizer, scheduler, epoch, args):
    student.train()
    teacher.eval()
    t0 = time.time()
    for step, (images, labels) in enumerate(loader):
        images = images.to(memory_format=torch.channels_last)
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16, enabled=args.amp):
            s_logits, s_hint = student(images)
            with torch.no_grad():
                t_logits, t_feat = teacher(images)
            ce = F.cross_entropy(s_logits, labels, label_smoothing=args.smoothing)
            hint = F.mse_loss(s_hint, t_feat)
        kd = kd_loss(s_logits, t_logits, args.temperature)  # expect: AMP002
        loss = (1.0 - args.alpha) * ce + args.alpha * kd + args.hint_weight * hint
        (loss / args.accum_steps).backward()

        if (step + 1) % args.accum_steps == 0:
            torch.nn.utils.clip_grad_norm_(student.parameters(), args.clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()

        if step % args.print_freq == 0:
            top1, = accuracy(s_logits.float(), labels)
            hint_energy = s_hint.detach().float().pow(2).mean().item()
            print(f"ep {epoch} [{step}/{len(loader)}] loss {loss.item():.3f} ce {ce.item():.3f} "
                  f"kd {kd.item():.3f} hint {hint.item():.3f} |h|^2 {hint_energy:.2f} top1 {top1:.1f} ({time.time() - t0:.0f}s)")


@torch.inference_mode()
def evaluate(model, loader, args):
    model.eval()
    correct, total, nll = 0, 0, 0.0
    for images, labels in loader:
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16, enabled=args.amp):
            logits, _ = model(images)
            probs = logits.softmax(dim=-1)
            nll += -torch.log(probs.gather(1, labels[:, None]) + 1e-8).sum().item()
        correct += (logits.argmax(dim=-1) == labels).sum().item()
        total += labels.numel()
    return 100.0 * correct / total, nll / total


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="./data")
    p.add_argument("--teacher-ckpt", dest="teacher_ckpt", required=True)
    p.add_argument("--num-classes", dest="num_classes", type=int, default=100)
    p.add_argument("--student-width", dest="student_width", type=int, default=32)
    p.add_argument("--teacher-width", dest="teacher_width", type=int, default=64)
    p.add_argument("--temperature", type=float, default=4.0)
    p.add_argument("--alpha", type=float, default=0.9)
    p.add_argument("--hint-weight", dest="hint_weight", type=float, default=100.0)
    p.add_argument("--smoothing", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=5.0)
    p.add_argument("--accum-steps", dest="accum_steps", type=int, default=2)
    p.add_argument("--batch-size", dest="batch_size", type=int, default=128)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--print-freq", dest="print_freq", type=int, default=50)
    p.add_argument("--threads", type=int, default=32)
    p.add_argument("--amp", action="store_true", default=True)
    return p.parse_args()


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    train_set, val_set = build_cifar100(args.data)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=8, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=256, num_workers=8)

    student = build_student(args)
    student = student.to(memory_format=torch.channels_last)
    student = student.to(torch.bfloat16)  # expect: AMP001
    teacher = build_teacher(args)
    teacher.load_state_dict(torch.load(args.teacher_ckpt, map_location="cpu"))
    teacher = teacher.to(torch.bfloat16).eval().requires_grad_(False)

    optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr, weight_decay=0.05)
    steps_per_epoch = len(train_loader) // args.accum_steps
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.epochs * steps_per_epoch)

    t_acc, _ = evaluate(teacher, val_loader, args)
    print(f"teacher top1 {t_acc:.2f}")
    best = 0.0
    for epoch in range(args.epochs):
        train_one_epoch(student, teacher, train_loader, optimizer, scheduler, epoch, args)
        acc, nll = evaluate(student, val_loader, args)
        print(f"epoch {epoch}: student top1 {acc:.2f} nll {nll:.3f}")
        if acc > best:
            best = acc
            torch.save(student.state_dict(), "student_best.pt")


if __name__ == "__main__":
    main()
