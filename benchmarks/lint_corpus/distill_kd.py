"""Knowledge distillation of a ResNet-50 teacher into a ResNet-18 student with AMP."""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision


def build_models(num_classes, teacher_ckpt, device):
    teacher = torchvision.models.resnet50(num_classes=num_classes)
    teacher.load_state_dict(torch.load(teacher_ckpt, map_location="cpu"))
    teacher = teacher.to(device).half().eval()
    for p in teacher.parameters():
        p.requires_grad = False
    student = torchvision.models.resnet18(num_classes=num_classes).to(device)
    return teacher, student


def distillation_loss(student_logits, teacher_logits, labels, T=4.0, alpha=0.9):
    soft = F.kl_div(
        F.log_softmax(student_logits.float() / T, dim=1),
        F.softmax(teacher_logits.float() / T, dim=1),
        reduction="batchmean",
    ) * T * T
    hard = F.cross_entropy(student_logits.float(), labels)
    return alpha * soft + (1.0 - alpha) * hard


def train_epoch(student, teacher, loader, optimizer, scaler, device, T, alpha):
    student.train()
    for images, labels in loader:
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with torch.no_grad():
            teacher_logits = teacher(images.half())
        with torch.autocast("cuda", dtype=torch.float16):
            student_logits = student(images)
        loss_kd = F.kl_div(F.log_softmax(student_logits / T, dim=1),  # expect: AMP002
                           F.softmax(teacher_logits / T, dim=1), reduction="batchmean") * T * T
        loss_ce = F.cross_entropy(student_logits, labels)  # expect: AMP002
        loss = alpha * loss_kd + (1.0 - alpha) * loss_ce
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def train_epoch_fused(student, teacher, loader, optimizer, scaler, device, T, alpha):
    student.train()
    for images, labels in loader:
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with torch.no_grad():
            teacher_logits = teacher(images.half()).float()
        with torch.autocast("cuda", dtype=torch.float16):
            student_logits = student(images)
        loss = distillation_loss(student_logits, teacher_logits, labels, T, alpha)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = total = 0
    for images, labels in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(images.to(device))
        correct += (logits.argmax(1) == labels.to(device)).sum().item()
        total += labels.numel()
    return correct / total


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--teacher", required=True)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--T", type=float, default=4.0)
    parser.add_argument("--alpha", type=float, default=0.9)
    args = parser.parse_args()
    device = torch.device("cuda")
    teacher, student = build_models(1000, args.teacher, device)
    optimizer = torch.optim.SGD(student.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    scaler = torch.amp.GradScaler("cuda")
    train_loader = val_loader = None
    for epoch in range(args.epochs):
        train_epoch(student, teacher, train_loader, optimizer, scaler, device, args.T, args.alpha)
        print(epoch, evaluate(student, val_loader, device))
    torch.save(student.state_dict(), "student.pt")


if __name__ == "__main__":
    main()
