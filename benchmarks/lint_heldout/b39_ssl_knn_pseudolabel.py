"""Self-supervised pre-training (SimCLR loss + a VICReg-style variance term), a kNN
monitor, and noisy-student pseudo-labelling of an unlabelled pool.

Pre-training runs under fp16 autocast with a GradScaler. A frozen fp16 feature
extractor (an off-the-shelf backbone) provides the features for the pseudo-label
heads; images are cast to fp16 on the GPU inside its no_grad `extract`.
"""
import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision

from ssl_data import build_pretrain_loader, build_knn_loaders, build_pool_loader


def make_scaler(enabled=True):
    try:
        return torch.amp.GradScaler("cuda", enabled=enabled)
    except (AttributeError, TypeError):  # torch < 2.3
        return torch.cuda.amp.GradScaler(enabled=enabled)


class SSLNet(nn.Module):
    def __init__(self, arch="resnet18", proj_dim=128, hidden=2048):
        super().__init__()
        backbone = torchvision.models.__dict__[arch](weights=None)
        self.feat_dim = backbone.fc.in_features
        backbone.fc = nn.Identity()
        self.backbone = backbone
        self.projector = nn.Sequential(
            nn.Linear(self.feat_dim, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(inplace=True),
            nn.Linear(hidden, proj_dim),
        )

    def forward(self, x):
        return self.projector(self.backbone(x))


class FrozenFeatureExtractor(nn.Module):
    """Pretrained backbone used only to produce features; fp16, eval mode, no grads."""

    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone.eval().requires_grad_(False).half()
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))

    @torch.no_grad()
    def extract(self, images_uint8):
        x = images_uint8.cuda(non_blocking=True).half().div_(255)
        x = (x - self.mean.half()) / self.std.half()
        return self.backbone(x)


def nt_xent(z1, z2, temperature=0.1):
    z = F.normalize(torch.cat([z1, z2], dim=0), dim=1)
    sim = z @ z.t() / temperature
    n = z1.size(0)
    self_mask = torch.eye(2 * n, dtype=torch.bool, device=z.device)
    sim = sim.masked_fill(self_mask, -1e9)  # expect: AMP007
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]).to(z.device)
    return F.cross_entropy(sim, targets)


def train_one_epoch(model, loader, optimizer, scaler, args):
    model.train()
    for step, (x1, x2) in enumerate(loader):
        x1 = x1.cuda(non_blocking=True)
        x2 = x2.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            z1 = model(x1)
            z2 = model(x2)
            loss = nt_xent(z1, z2, args.temperature)
            # variance term (VICReg) against dimensional collapse
            z1c = z1 - z1.mean(dim=0)  # expect: AMP004
            std1 = torch.sqrt(z1c.var(dim=0) + 1e-4)  # expect: AMP004
            var_loss = F.relu(1.0 - std1).float().mean()
            loss = loss + args.var_weight * var_loss
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 3.0)
        scaler.step(optimizer)
        scaler.update()
        if step % 100 == 0:
            with torch.no_grad():
                collapse = F.normalize(z1.float(), dim=1).std(dim=0).mean()
            print(f"step {step}: loss {loss.item():.4f} std {collapse.item():.4f}")


@torch.no_grad()
def knn_monitor(backbone, memory_loader, test_loader, num_classes, k=200, t=0.1):
    backbone.eval()
    feature_bank, label_bank = [], []
    for images, labels in memory_loader:
        with torch.autocast("cuda", dtype=torch.float16):
            feat = backbone(images.cuda(non_blocking=True))
        feature_bank.append(F.normalize(feat.float(), dim=1))
        label_bank.append(labels.cuda(non_blocking=True))
    feature_bank = torch.cat(feature_bank).t().contiguous().half()
    label_bank = torch.cat(label_bank)
    correct = total = 0
    for images, labels in test_loader:
        with torch.autocast("cuda", dtype=torch.float16):
            feat = backbone(images.cuda(non_blocking=True))
        feat = F.normalize(feat.float(), dim=1).half()
        sim_weight, sim_idx = (feat @ feature_bank).topk(k, dim=-1)
        sim_labels = torch.gather(label_bank.expand(feat.size(0), -1), -1, sim_idx)
        sim_weight = (sim_weight.float() / t).exp()
        one_hot = F.one_hot(sim_labels, num_classes).float()
        pred_scores = torch.sum(one_hot * sim_weight.unsqueeze(-1), dim=1)
        pred = pred_scores.argmax(dim=-1)
        correct += (pred.cpu() == labels).sum().item()
        total += labels.size(0)
    backbone.train()
    return 100.0 * correct / total


@torch.no_grad()
def generate_pseudo_labels(extractor, head, loader, threshold=0.7):
    head.eval()
    out = []
    for idx, images in loader:
        feats = extractor.extract(images).float()
        with torch.autocast("cuda", dtype=torch.float16):
            logits = head(feats)
        probs = torch.sigmoid(logits.float())
        pseudo = (probs > threshold).to(torch.float16)
        out.append((idx, pseudo.cpu()))
    head.train()
    return out


def train_student_head(extractor, pseudo_loader, in_dim, num_classes, epochs=10, lr=1e-3, ent_weight=0.1):
    head = nn.Linear(in_dim, num_classes).cuda()
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=1e-4)
    scaler = make_scaler()
    head.train()
    for _ in range(epochs):
        for images, pseudo in pseudo_loader:
            feats = extractor.extract(images).float()
            pseudo = pseudo.cuda(non_blocking=True).float()
            with torch.autocast("cuda", dtype=torch.float16):
                logits = head(feats)
                loss = F.binary_cross_entropy_with_logits(logits, pseudo)
                p = torch.sigmoid(logits)
                log_p = torch.log(p + 1e-8)  # expect: AMP011
                ent = -(p.float() * log_p.float()).sum(dim=1).mean()
                with torch.autocast("cuda", enabled=False):
                    agree = F.binary_cross_entropy(p.float(), pseudo)
                loss = loss + ent_weight * ent + 0.1 * agree
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    return head


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="resnet18")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--lr", type=float, default=0.3)
    p.add_argument("--temperature", type=float, default=0.2)
    p.add_argument("--var_weight", type=float, default=1.0)
    p.add_argument("--num_classes", type=int, default=100)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()

    model = SSLNet(args.arch).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-6)
    scaler = make_scaler()
    loader = build_pretrain_loader(batch_size=256)
    memory_loader, test_loader = build_knn_loaders(batch_size=512)
    best_acc = -math.inf
    for epoch in range(args.epochs):
        train_one_epoch(model, loader, optimizer, scaler, args)
        if epoch % 10 == 0:
            acc = knn_monitor(model.backbone, memory_loader, test_loader, args.num_classes)
            best_acc = max(best_acc, acc)
            print(f"epoch {epoch}: kNN top-1 {acc:.2f} (best {best_acc:.2f})")

    extractor = FrozenFeatureExtractor(torchvision.models.resnet50(weights="IMAGENET1K_V2"))
    extractor.backbone.fc = nn.Identity()
    extractor.cuda()
    pool_loader = build_pool_loader(batch_size=256)
    teacher_head = nn.Linear(2048, args.num_classes).cuda()
    for _ in range(args.rounds):
        pseudo = generate_pseudo_labels(extractor, teacher_head, pool_loader)
        pseudo_loader = build_pool_loader(batch_size=256, labels=pseudo)
        teacher_head = train_student_head(extractor, pseudo_loader, 2048, args.num_classes)


if __name__ == "__main__":
    main()
