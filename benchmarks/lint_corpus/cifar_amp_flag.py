"""CIFAR-10 ResNet training with an --amp switch (fp16 autocast, no loss scaling)."""
import argparse
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--amp", action="store_true")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--bs", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.1)
    return p.parse_args()


def loaders(bs):
    tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor()])
    train = torchvision.datasets.CIFAR10("data", train=True, download=True, transform=tf)
    test = torchvision.datasets.CIFAR10("data", train=False, download=True, transform=T.ToTensor())
    return (torch.utils.data.DataLoader(train, bs, shuffle=True, num_workers=4),
            torch.utils.data.DataLoader(test, 256, num_workers=4))


def main():
    args = get_args()
    device = "cuda"
    model = torchvision.models.resnet18(num_classes=10).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    ctx = torch.autocast("cuda", dtype=torch.float16) if args.amp else nullcontext()  # expect: AMP010
    train_loader, test_loader = loaders(args.bs)
    for epoch in range(args.epochs):
        model.train()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with ctx:
                out = model(x)
                loss = F.cross_entropy(out, y, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        scheduler.step()
        model.eval()
        correct = 0
        with torch.no_grad(), ctx:
            for x, y in test_loader:
                correct += (model(x.to(device)).argmax(1) == y.to(device)).sum().item()
        print(f"epoch {epoch} acc {correct / 10000:.4f}")


def finetune(model, loader, epochs, use_amp=True):
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    for _ in range(epochs):
        for x, y in loader:
            with torch.autocast(device_type="cuda", enabled=use_amp):  # expect: AMP010
                loss = criterion(model(x.cuda()), y.cuda())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


def finetune_bf16(model, loader, epochs, use_amp=True):
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    for _ in range(epochs):
        for x, y in loader:
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=use_amp):
                loss = criterion(model(x.cuda()), y.cuda())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


if __name__ == "__main__":
    main()
