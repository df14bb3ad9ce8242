"""Knowledge distillation from a frozen fp16 teacher into a smaller student.

Stage 1 (FitNets) regresses teacher features, stage 2 distils logits with learned
loss weights, and a label-only baseline gives the reference accuracy.
"""
import argparse
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class ConvNet(nn.Module):
    def __init__(self, width=64, num_classes=100):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(2 * width),
            nn.ReLU(inplace=True),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.features(x)), 1))


def attention_map(feat):
    """Zagoruyko & Komodakis attention transfer map."""
    return F.normalize(feat.pow(2).mean(1).flatten(1))


def build_teacher(ckpt_path, device):
    teacher = ConvNet(width=128)
    teacher.load_state_dict(torch.load(ckpt_path, map_location="cpu"))
    teacher = teacher.half().to(device).eval()
    teacher.requires_grad_(False)
    return teacher


def train_hint_stage(student, teacher, regressor, loader, optimizer, scaler, device):
    """FitNets stage 1: regress the teacher's feature maps from the student's."""
    student.train()
    for images, _ in loader:
        images = images.to(device, non_blocking=True)
        with torch.no_grad():
            t_feat = teacher.features(images.half())
        with torch.autocast("cuda", dtype=torch.float16):
            s_feat = regressor(student.features(images))
            loss = F.mse_loss(s_feat, t_feat.float()) + (attention_map(s_feat) - attention_map(t_feat)).pow(2).mean()
            scaler.scale(loss).backward()  # expect: AMP008
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)


def distill_epoch(student, teacher, loader, optimizer, weight_opt, log_vars, scaler, device, T=4.0):
    student.train()
    for images, labels in loader:
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        weight_opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            teacher_logits = teacher(images.half())
        with torch.autocast("cuda", dtype=torch.float16):
            student_logits = student(images)
            ce = F.cross_entropy(student_logits, labels)
        kd = F.kl_div(F.log_softmax(student_logits / T, dim=1), F.softmax(teacher_logits.float() / T, dim=1), reduction="batchmean")  # expect: AMP002
        loss = torch.exp(-log_vars[0]) * kd * T * T + log_vars[0] + torch.exp(-log_vars[1]) * ce + log_vars[1]
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(student.parameters(), 5.0)
        scaler.step(optimizer)
        scaler.update()
        weight_opt.step()  # expect: AMP006


def train_baseline(student, loader, optimizer, device, epochs=1):
    """Student trained on labels alone: the reference for the distillation gain."""
    student.train()
    for _ in range(epochs):
        for images, labels in loader:
            with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
                loss = F.cross_entropy(student(images.to(device)), labels.to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()


def finetune_half_copy(model, loader, device, epochs=1, lr=1e-4):
    """Compress the distilled student and fine-tune the compressed copy on the target set."""
    student = copy.deepcopy(model).half()  # expect: AMP001
    student.train()
    optimizer = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=0.05)  # expect: AMP011
    param_dtype = next(student.parameters()).dtype
    for _ in range(epochs):
        for images, labels in loader:
            logits = student(images.to(device, dtype=param_dtype))
            loss = F.cross_entropy(logits.float(), labels.to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return student


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = total = 0
    for images, labels in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(images.to(device))
        correct += (logits.argmax(1) == labels.to(device)).sum().item()
        total += labels.numel()
    model.train()
    return correct / max(total, 1)


def predict(student, images, device):
    model = copy.deepcopy(student).half().eval()
    return model(images.to(device).half()).argmax(dim=1)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--teacher_ckpt", default="teacher.pt")
    p.add_argument("--epochs", type=int, default=30)
    args = p.parse_args(argv)
    device = torch.device("cuda")
    data = TensorDataset(torch.randn(1024, 3, 32, 32), torch.randint(0, 100, (1024,)))
    loader = DataLoader(data, batch_size=128, shuffle=True, drop_last=True)
    teacher = build_teacher(args.teacher_ckpt, device)
    student = ConvNet(width=64).to(device)
    regressor = nn.Conv2d(128, 256, 1).to(device)
    scaler = torch.amp.GradScaler("cuda")
    hint_opt = torch.optim.SGD(list(student.features.parameters()) + list(regressor.parameters()), lr=0.05, momentum=0.9)
    train_hint_stage(student, teacher, regressor, loader, hint_opt, scaler, device)
    optimizer = torch.optim.SGD(student.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4, nesterov=True)
    log_vars = nn.Parameter(torch.zeros(2, device=device))
    weight_opt = torch.optim.SGD([log_vars], lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    for epoch in range(args.epochs):
        distill_epoch(student, teacher, loader, optimizer, weight_opt, log_vars, scaler, device)
        sched.step()
        print(f"epoch {epoch}: student acc {evaluate(student, loader, device):.3f}")
    baseline = ConvNet(width=64).to(device)
    train_baseline(baseline, loader, torch.optim.SGD(baseline.parameters(), lr=0.05, momentum=0.9), device)
    compact = finetune_half_copy(student, loader, device)
    print(predict(compact, torch.randn(4, 3, 32, 32), device))


if __name__ == "__main__":
    main()
