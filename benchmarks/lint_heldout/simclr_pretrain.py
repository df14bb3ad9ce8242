"""SimCLR pre-training on ImageNet with an online kNN monitor and a final linear probe."""
import argparse
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.utils import clip_grad_value_ as clip_grads

from augment import TwoCropsTransform, simclr_augmentation  # local


class ProjectionHead(nn.Module):
    def __init__(self, in_dim, hidden_dim=2048, out_dim=128):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_dim, hidden_dim, bias=False), nn.BatchNorm1d(hidden_dim), nn.ReLU(inplace=True), nn.Linear(hidden_dim, out_dim))

    def forward(self, x):
        return self.net(x)


class SimCLR(nn.Module):
    def __init__(self, arch="resnet50", proj_dim=128):
        super().__init__()
        backbone = torchvision.models.__dict__[arch](weights=None)
        self.feat_dim = backbone.fc.in_features
        backbone.fc = nn.Identity()
        self.backbone = backbone
        self.head = ProjectionHead(self.feat_dim, 2048, proj_dim)

    def forward(self, x):
        return self.head(self.backbone(x))


class NTXentLoss(nn.Module):
    def __init__(self, temperature=0.2):
        super().__init__()
        self.temperature = temperature

    def forward(self, z1, z2):
        n = z1.size(0)
        z = F.normalize(torch.cat([z1, z2], dim=0), dim=1)
        sim = torch.matmul(z, z.T) / self.temperature
        self_mask = torch.eye(2 * n, dtype=torch.bool, device=z.device)
        sim.masked_fill_(self_mask, -1e9)  # expect: AMP007
        targets = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]).to(z.device)
        return F.cross_entropy(sim, targets)


def adjust_learning_rate(optimizer, epoch, args):
    lr = args.lr * epoch / args.warmup if epoch < args.warmup else args.lr * 0.5 * (1.0 + math.cos(math.pi * (epoch - args.warmup) / (args.epochs - args.warmup)))
    for group in optimizer.param_groups:
        group["lr"] = lr


def train_one_epoch(model, criterion, loader, optimizer, scaler, epoch, args):
    model.train()
    running = 0.0
    for step, ((x1, x2), _) in enumerate(loader):
        x1, x2 = x1.cuda(non_blocking=True), x2.cuda(non_blocking=True)
        adjust_learning_rate(optimizer, epoch + step / len(loader), args)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = criterion(model(x1), model(x2))
        running += loss.item()
        optimizer.zero_grad(set_to_none=True)
        loss = scaler.scale(loss)
        loss.backward()
        clip_grads(model.parameters(), args.clip_value)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()
    return running / len(loader)


@torch.no_grad()
def knn_monitor(model, memory_loader, test_loader, k=200, t=0.1, num_classes=1000):
    model.eval()
    feats, labels = [], []
    for x, y in memory_loader:
        with torch.autocast("cuda", dtype=torch.float16):
            feats.append(model.backbone(x.cuda(non_blocking=True)))
        labels.append(y.cuda(non_blocking=True))
    # 1.28M x 2048 bank: keep it in half precision
    feature_bank = F.normalize(torch.cat(feats).half(), dim=1).t().contiguous()  # expect: AMP011
    feature_labels = torch.cat(labels)
    correct, total = 0, 0
    for x, y in test_loader:
        f = F.normalize(model.backbone(x.cuda(non_blocking=True)), dim=1).half()
        sim = torch.mm(f, feature_bank)
        sim_weight, sim_indices = sim.topk(k=k, dim=-1)
        sim_labels = torch.gather(feature_labels.expand(f.size(0), -1), dim=-1, index=sim_indices)
        sim_weight = (sim_weight / t).exp()
        one_hot = torch.zeros(f.size(0) * k, num_classes, device=sim_labels.device, dtype=sim_weight.dtype)
        one_hot.scatter_(dim=-1, index=sim_labels.view(-1, 1), value=1.0)
        pred_scores = torch.sum(one_hot.view(f.size(0), -1, num_classes) * sim_weight.unsqueeze(-1), dim=1)  # not labelled: AMP004 leaves evaluation code alone (model.eval(), nothing trained here)
        correct += (pred_scores.argmax(dim=-1) == y.cuda()).sum().item()
        total += y.size(0)
    return correct / total


def train_linear_probe(backbone, feat_dim, train_loader, epochs=90, lr=0.1, num_classes=1000):
    backbone.eval()
    backbone.requires_grad_(False)
    classifier = nn.Linear(feat_dim, num_classes).cuda()
    optimizer = torch.optim.SGD(classifier.parameters(), lr=lr, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    for epoch in range(epochs):
        for x, y in train_loader:
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
                feats = backbone(x)
            with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
                logits = classifier(feats)
            loss = criterion(logits, y)  # expect: AMP002
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return classifier


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.3 * 512 / 256)
    parser.add_argument("--temperature", type=float, default=0.2)
    parser.add_argument("--clip-value", type=float, default=3.0)
    args = parser.parse_args()

    train_set = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), TwoCropsTransform(simclr_augmentation()))
    loader = torch.utils.data.DataLoader(train_set, batch_size=512, shuffle=True, num_workers=16, drop_last=True, pin_memory=True)
    model = SimCLR().cuda().to(memory_format=torch.channels_last)
    criterion = NTXentLoss(args.temperature).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-6)
    scaler = torch.amp.GradScaler("cuda")
    for epoch in range(args.epochs):
        loss = train_one_epoch(model, criterion, loader, optimizer, scaler, epoch, args)
        print(f"epoch {epoch} loss {loss:.4f}")
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()}, "simclr.pth")


if __name__ == "__main__":
    main()
