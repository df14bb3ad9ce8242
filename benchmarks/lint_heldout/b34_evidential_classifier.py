"""Evidential deep learning for classification uncertainty (Sensoy et al., 2018).

The network outputs non-negative evidence e_k; alpha = e + 1 parameterises a
Dirichlet over class probabilities, and K / sum(alpha) is the vacuity
(uncertainty) of the prediction. --fp16 trains a half-precision model.

    python b34_evidential_classifier.py --epochs 20 --fp16
"""
import argparse
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision import datasets, transforms


class EvidentialLeNet(nn.Module):
    def __init__(self, num_classes=10, dropout=0.5):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 20, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(20, 50, 5), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(800, 500), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(500, num_classes),
        )

    def forward(self, x):
        logits = self.classifier(self.features(x))
        evidence = F.relu(logits)
        return evidence + 1.0


def build_model(args):
    return EvidentialLeNet(num_classes=args.num_classes, dropout=args.dropout)


def edl_digamma_loss(alpha, target, epoch, num_classes, annealing_step):
    """Expected cross-entropy under Dir(alpha) plus an annealed KL(Dir(alpha~) || Dir(1))."""
    y = F.one_hot(target, num_classes).to(alpha.dtype)
    strength = alpha.sum(dim=1, keepdim=True)
    nll = (y * (torch.digamma(strength) - torch.digamma(alpha))).sum(dim=1, keepdim=True)
    # remove the evidence of the true class before regularising towards the uniform Dirichlet
    alpha_t = y + (1.0 - y) * alpha
    s_t = alpha_t.sum(dim=1, keepdim=True)
    kl = (
        torch.lgamma(s_t)
        - math.lgamma(num_classes)
        - torch.lgamma(alpha_t).sum(dim=1, keepdim=True)
        + ((alpha_t - 1.0) * (torch.digamma(alpha_t) - torch.digamma(s_t))).sum(dim=1, keepdim=True)
    )
    coef = min(1.0, epoch / annealing_step)
    return (nll + coef * kl).mean()


def train(args, train_loader, test_loader):
    device = torch.device("cuda")
    model = build_model(args).to(device)
    if args.fp16:
        model = model.half()  # expect: AMP001
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)  # expect: AMP011
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.1)
    scaler = torch.amp.GradScaler("cuda", enabled=args.fp16)

    for epoch in range(args.epochs):
        model.train()
        running, vacuities = 0.0, []
        for images, targets in train_loader:
            images, targets = images.to(device), targets.to(device)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
                alpha = model(images)
            loss = edl_digamma_loss(alpha, targets, epoch, args.num_classes, args.annealing_step)  # expect: AMP002
            optimizer.zero_grad(set_to_none=True)
            loss = scaler.scale(loss)
            loss.backward()
            optimizer.step()  # expect: AMP006
            running += loss.item() / scaler.get_scale()

            with torch.no_grad():
                strength = alpha.detach().sum(dim=1)  # expect: AMP004
                vacuity = args.num_classes / (strength + 1e-10)  # expect: AMP011
                vacuities.append(vacuity.cpu().numpy())
        scheduler.step()

        vac = np.concatenate(vacuities)
        acc, vac_right, vac_wrong = evaluate(model, test_loader, device, args.num_classes, fp16=args.fp16)
        print(f"epoch {epoch}: loss {running / len(train_loader):.4f} | train vacuity {vac.mean():.3f} "
              f"| test acc {acc:.4f} | vacuity right {vac_right:.3f} wrong {vac_wrong:.3f}")
    return model


@torch.no_grad()
def evaluate(model, loader, device, num_classes, fp16=False):
    """Accuracy and the mean vacuity of correct vs. wrong predictions."""
    model.eval()
    right, wrong, correct, seen = [], [], 0, 0
    for images, targets in loader:
        images, targets = images.to(device), targets.to(device)
        with torch.autocast("cuda", dtype=torch.float16, enabled=fp16):
            alpha = model(images)
            probs = alpha / alpha.sum(dim=1, keepdim=True)
            vacuity = num_classes / (alpha.sum(dim=1) + 1e-10)
        pred = probs.argmax(dim=1)
        ok = pred == targets
        correct += ok.sum().item()
        seen += targets.numel()
        right.append(vacuity[ok].float().cpu())
        wrong.append(vacuity[~ok].float().cpu())
    right, wrong = torch.cat(right), torch.cat(wrong)
    return correct / seen, right.mean().item(), (wrong.mean().item() if wrong.numel() else float("nan"))


@torch.no_grad()
def rotation_experiment(model, image, device, steps=12):
    """Vacuity as a digit is rotated from 0 to 180 degrees (Fig. 1 of the paper)."""
    model.eval()
    out = []
    for k in range(steps + 1):
        angle = 180.0 * k / steps
        rotated = transforms.functional.rotate(image, angle).unsqueeze(0).to(device)
        alpha = model(rotated.to(next(model.parameters()).dtype))
        out.append((angle, (alpha.size(1) / alpha.sum()).item()))
    return out


def main():
    parser = argparse.ArgumentParser(description="Evidential LeNet on MNIST")
    parser.add_argument("--data", default="./data")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=5e-3)
    parser.add_argument("--dropout", type=float, default=0.5)
    parser.add_argument("--num-classes", type=int, default=10)
    parser.add_argument("--annealing-step", type=int, default=10)
    parser.add_argument("--fp16", action="store_true")
    args = parser.parse_args()

    tf = transforms.ToTensor()
    train_loader = DataLoader(datasets.MNIST(args.data, train=True, download=True, transform=tf),
                              batch_size=args.batch_size, shuffle=True, num_workers=4)
    test_set = datasets.MNIST(args.data, train=False, transform=tf)
    test_loader = DataLoader(test_set, batch_size=args.batch_size)
    model = train(args, train_loader, test_loader)
    for angle, u in rotation_experiment(model, test_set[0][0], torch.device("cuda")):
        print(f"{angle:6.1f} deg  vacuity {u:.3f}")
    torch.save(model.state_dict(), "edl_lenet.pt")


if __name__ == "__main__":
    main()
