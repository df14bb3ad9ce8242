"""Fine-tune an ImageNet ResNet on the PlantVillage leaf-disease dataset.

The whole network runs in half precision so batch 256 fits on a 16 GB card;
BatchNorm layers keep fp32 parameters and running statistics.
Stage 1 trains the new classifier only; from --unfreeze-epoch on, every layer is trained.

    python finetune_resnet_half.py --data /data/plantvillage --arch resnet50 --epochs 30
"""
import argparse
import json
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision import datasets, models, transforms

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def get_args():
    p = argparse.ArgumentParser(description="PlantVillage fine-tuning")
    p.add_argument("--data", required=True, help="folder with train/ and val/ subfolders")
    p.add_argument("--arch", default="resnet50", choices=["resnet18", "resnet34", "resnet50", "resnet101"])
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--unfreeze-epoch", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--mixup", type=float, default=0.2, help="Beta(a, a) mixup; 0 disables")
    p.add_argument("--smoothing", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--out", default="runs/plantvillage")
    return p.parse_args()


def build_model(arch, num_classes):
    model = getattr(models, arch)(weights="IMAGENET1K_V1")
    in_features = model.fc.in_features
    model.fc = nn.Sequential(nn.Dropout(0.2), nn.Linear(in_features, num_classes))
    for name, p in model.named_parameters():
        p.requires_grad = name.startswith("fc.")
    return model


def set_bn_fp32(model):
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.float()


def mixup(images, targets_onehot, alpha):
    lam = float(torch.distributions.Beta(alpha, alpha).sample())
    perm = torch.randperm(images.size(0), device=images.device)
    mixed_images = lam * images + (1 - lam) * images[perm]
    mixed_targets = lam * targets_onehot + (1 - lam) * targets_onehot[perm]
    return mixed_images, mixed_targets


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct, seen, loss_sum = 0, 0, 0.0
    for images, targets in loader:
        images = images.to(device, non_blocking=True).half()
        targets = targets.to(device, non_blocking=True)
        logits = model(images).float()
        loss_sum += F.cross_entropy(logits, targets, reduction="sum").item()
        correct += (logits.argmax(1) == targets).sum().item()
        seen += targets.numel()
    return loss_sum / max(seen, 1), correct / max(seen, 1)


def main():
    args = get_args()
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda")
    torch.backends.cudnn.benchmark = True

    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.5, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.RandomVerticalFlip(),
        transforms.ColorJitter(0.2, 0.2, 0.2),
        transforms.ToTensor(),
        transforms.Normalize(MEAN, STD),
    ])
    val_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224),
                                 transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    num_classes = len(train_set.classes)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, num_workers=args.workers, pin_memory=True)

    model = build_model(args.arch, num_classes)
    model = model.to(device).half()  # expect: AMP001
    set_bn_fp32(model)

    head_params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(head_params, lr=args.lr, eps=1e-8)  # expect: AMP011
    criterion = nn.CrossEntropyLoss(label_smoothing=args.smoothing)

    history = []
    best_acc = 0.0
    for epoch in range(args.epochs):
        if epoch == args.unfreeze_epoch:
            for p in model.parameters():
                p.requires_grad = True
            optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * 0.1, weight_decay=args.wd, eps=1e-8)  # expect: AMP011
            print(f"epoch {epoch}: backbone unfrozen")

        model.train()
        t0 = time.time()
        running, n_batches = 0.0, 0
        for images, targets in train_loader:
            images = images.to(device, non_blocking=True).half()  # expect: AMP001
            targets = targets.to(device, non_blocking=True)
            if args.mixup > 0:
                soft = F.one_hot(targets, num_classes).type(torch.cuda.HalfTensor)  # expect: AMP001
                images, soft = mixup(images, soft, args.mixup)
                logits = model(images)
                loss = torch.sum(-soft.float() * F.log_softmax(logits.float(), dim=-1), dim=-1).mean()
            else:
                loss = criterion(model(images).float(), targets)

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            running += loss.item()
            n_batches += 1

        val_loss, val_acc = evaluate(model, val_loader, device)
        record = {"epoch": epoch, "train_loss": running / max(n_batches, 1), "val_loss": val_loss,
                  "val_acc": val_acc, "time": time.time() - t0}
        history.append(record)
        print(json.dumps(record))
        if val_acc > best_acc:
            best_acc = val_acc
            torch.save({"model": model.state_dict(), "classes": train_set.classes, "arch": args.arch},
                       os.path.join(args.out, "best.pt"))

    with open(os.path.join(args.out, "history.json"), "w") as f:
        json.dump(history, f, indent=2)
    print(f"best val acc {best_acc:.4f}")


if __name__ == "__main__":
    main()
