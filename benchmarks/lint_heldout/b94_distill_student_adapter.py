"""Distil a fine-tuned ViT-L/16 teacher into a ResNet-50 student with a residual adapter.

Teacher targets are computed once on centre crops and kept on the host, so the
teacher can be dropped from the GPU before the student starts training.

    python distill_student_adapter.py --data /data/food101 --teacher-ckpt teacher_vitl.pt
"""
import argparse
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision import datasets, transforms
from torchvision.models import ResNet50_Weights, ViT_L_16_Weights, resnet50, vit_l_16


class IndexedImageFolder(datasets.ImageFolder):
    def __getitem__(self, index):
        image, target = super().__getitem__(index)
        return image, target, index


class ResidualAdapter(nn.Module):
    def __init__(self, dim, bottleneck=256):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.down = nn.Linear(dim, bottleneck)
        self.up = nn.Linear(bottleneck, dim)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, x):
        return x + self.up(F.gelu(self.down(self.norm(x))))


class Student(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        backbone = resnet50(weights=ResNet50_Weights.IMAGENET1K_V2)
        self.features = nn.Sequential(*list(backbone.children())[:-1])
        self.adapter = ResidualAdapter(2048)
        self.head = nn.Linear(2048, num_classes)

    def forward(self, x):
        f = torch.flatten(self.features(x), 1)
        return self.head(self.adapter(f))


@torch.no_grad()
def build_soft_labels(teacher, loader, temperature, device):
    """Returns {sample index: teacher log-probabilities at the given temperature}."""
    teacher.eval()
    table = {}
    for images, _, idx in loader:
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            logits = teacher(images.to(device, non_blocking=True))
        probs = F.softmax(logits.float() / temperature, dim=-1).half()
        log_probs = torch.log(probs + 1e-8)  # expect: AMP011
        for i, row in zip(idx.tolist(), log_probs.cpu()):
            table[i] = row
    return table


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = total = 0
    for images, labels, _ in loader:
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            logits = model(images.to(device, non_blocking=True))
        correct += (logits.argmax(-1).cpu() == labels).sum().item()
        total += labels.numel()
    model.train()
    return correct / max(total, 1)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--teacher-ckpt", required=True)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--temperature", type=float, default=4.0)
    p.add_argument("--alpha", type=float, default=0.7, help="weight of the distillation term")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--out", default="student.pt")
    return p.parse_args()


def train(args):
    device = torch.device("cuda")
    norm = transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    centre = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm])
    augment = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                  transforms.TrivialAugmentWide(), transforms.ToTensor(), norm])
    train_set = IndexedImageFolder(os.path.join(args.data, "train"), augment)
    label_set = IndexedImageFolder(os.path.join(args.data, "train"), centre)
    val_set = IndexedImageFolder(os.path.join(args.data, "val"), centre)
    num_classes = len(train_set.classes)
    train_loader = DataLoader(train_set, args.batch_size, shuffle=True, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    label_loader = DataLoader(label_set, args.batch_size * 2, num_workers=args.workers, pin_memory=True)
    val_loader = DataLoader(val_set, args.batch_size * 2, num_workers=args.workers, pin_memory=True)

    teacher = vit_l_16(weights=ViT_L_16_Weights.IMAGENET1K_V1)
    teacher.heads = nn.Linear(teacher.hidden_dim, num_classes)
    teacher.load_state_dict(torch.load(args.teacher_ckpt, map_location="cpu"))
    teacher.requires_grad_(False).to(device)
    t0 = time.time()
    soft_labels = build_soft_labels(teacher, label_loader, args.temperature, device)
    print(f"teacher targets for {len(soft_labels)} images in {time.time() - t0:.0f}s")
    del teacher
    torch.cuda.empty_cache()

    student = Student(num_classes).to(device).to(memory_format=torch.channels_last)
    param_groups = [
        {"params": student.features.parameters(), "lr": args.lr * 0.1},
        {"params": list(student.adapter.parameters()) + list(student.head.parameters()), "lr": args.lr},
    ]
    optimizer = torch.optim.AdamW(param_groups, lr=args.lr, weight_decay=args.wd)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader))
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010

    best = 0.0
    for epoch in range(args.epochs):
        student.train()
        for step, (images, labels, idx) in enumerate(train_loader):
            images = images.to(device, dtype=torch.bfloat16, non_blocking=True)  # expect: AMP001
            labels = labels.to(device, non_blocking=True)
            teacher_logp = torch.stack([soft_labels[i] for i in idx.tolist()]).to(device).float()
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                logits = student(images)
                log_p = F.log_softmax(logits / args.temperature, dim=-1)
                kd = F.kl_div(log_p, teacher_logp, reduction="batchmean", log_target=True) * args.temperature ** 2
                ce = F.cross_entropy(logits, labels)
                loss = args.alpha * kd + (1 - args.alpha) * ce

            optimizer.zero_grad(set_to_none=True)
            loss = scaler.scale(loss)
            loss.backward()
            optimizer.step()  # expect: AMP006
            scaler.update()
            scheduler.step()
            if step % 100 == 0:
                print(f"epoch {epoch} step {step}: kd {kd.item():.4f} ce {ce.item():.4f}")

        acc = evaluate(student, val_loader, device)
        print(f"epoch {epoch}: val acc {acc:.4f}")
        if acc > best:
            best = acc
            torch.save({"model": student.state_dict(), "epoch": epoch, "acc": acc}, args.out)


if __name__ == "__main__":
    train(parse_args())
