"""Deep metric learning for image retrieval with the Proxy-Anchor loss.

Kim et al., "Proxy Anchor Loss for Deep Metric Learning", CVPR 2020.
ResNet-50 backbone with GeM pooling, trained in bf16 autocast on
CUB-200-2011 / Cars-196 / SOP; evaluated with Recall@K.
"""
import argparse
import os
from dataclasses import dataclass, field
from typing import Tuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torchvision import transforms


@dataclass
class Config:
    data_root: str = "data/CUB_200_2011"
    embedding_size: int = 512
    num_classes: int = 100
    batch_size: int = 180
    epochs: int = 60
    warm: int = 1
    lr: float = 1e-4
    lr_mult: float = 1.0
    proxy_lr_mult: float = 100.0
    weight_decay: float = 1e-4
    mrg: float = 0.1
    alpha: float = 32.0
    bn_freeze: bool = True
    recall_ks: Tuple[int, ...] = field(default=(1, 2, 4, 8))


def l2_norm(input):
    input_size = input.size()
    buffer = torch.pow(input, 2)
    normp = torch.sum(buffer, 1).add_(1e-12)
    norm = torch.sqrt(normp)
    _output = torch.div(input, norm.view(-1, 1).expand_as(input))
    return _output.view(input_size)


def binarize(T, nb_classes):
    return F.one_hot(T, nb_classes).float()


class ProxyAnchorLoss(nn.Module):
    def __init__(self, nb_classes, sz_embed, mrg=0.1, alpha=32.0):
        super().__init__()
        self.proxies = nn.Parameter(torch.randn(nb_classes, sz_embed))
        nn.init.kaiming_normal_(self.proxies, mode="fan_out")
        self.nb_classes, self.sz_embed = nb_classes, sz_embed
        self.mrg, self.alpha = mrg, alpha

    def forward(self, X, T):
        P = self.proxies
        cos = F.linear(l2_norm(X), l2_norm(P))  # cosine similarity, [B, nb_classes]
        P_one_hot = binarize(T, self.nb_classes)
        N_one_hot = 1 - P_one_hot

        pos_exp = torch.exp(-self.alpha * (cos - self.mrg))
        neg_exp = torch.exp(self.alpha * (cos + self.mrg))

        with_pos_proxies = torch.nonzero(P_one_hot.sum(dim=0) != 0).squeeze(dim=1)
        num_valid_proxies = len(with_pos_proxies)

        P_sim_sum = torch.where(P_one_hot == 1, pos_exp, torch.zeros_like(pos_exp)).sum(dim=0)
        N_sim_sum = torch.where(N_one_hot == 1, neg_exp, torch.zeros_like(neg_exp)).sum(dim=0)

        pos_term = torch.log(1 + P_sim_sum).sum() / num_valid_proxies
        neg_term = torch.log(1 + N_sim_sum).sum() / self.nb_classes
        return pos_term + neg_term


class GeM(nn.Module):
    def __init__(self, p=3.0, eps=1e-6):
        super().__init__()
        self.p = nn.Parameter(torch.ones(1) * p)
        self.eps = eps

    def forward(self, x):
        return F.avg_pool2d(x.clamp(min=self.eps).pow(self.p), (x.size(-2), x.size(-1))).pow(1.0 / self.p)


class EmbeddingStandardize(nn.Module):
    """Batch standardisation of the embedding (running statistics at test time)."""

    def __init__(self, dim, momentum=0.1, eps=1e-5):
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(dim))
        self.register_buffer("running_std", torch.ones(dim))
        self.momentum, self.eps = momentum, eps

    def forward(self, x):
        if self.training:
            mean = x.mean(dim=0)  # expect: AMP004
            std = x.std(dim=0)  # expect: AMP004
            with torch.no_grad():
                self.running_mean.lerp_(mean.float(), self.momentum)
                self.running_std.lerp_(std.float(), self.momentum)
        else:
            mean, std = self.running_mean, self.running_std
        return (x - mean) / (std + self.eps)


class EmbeddingNet(nn.Module):
    def __init__(self, embedding_size=512, pretrained=True, bn_freeze=True):
        super().__init__()
        backbone = torchvision.models.resnet50(weights="IMAGENET1K_V2" if pretrained else None)
        self.features = nn.Sequential(*list(backbone.children())[:-2])
        self.reduce = nn.Conv2d(2048, 1024, 1, bias=False)
        self.pool = GeM()
        self.embedding = nn.Linear(1024, embedding_size)
        self.standardize = EmbeddingStandardize(embedding_size)
        nn.init.kaiming_normal_(self.embedding.weight, mode="fan_out")
        nn.init.constant_(self.embedding.bias, 0)
        self.bn_freeze = bn_freeze

    def forward(self, x):
        feat = self.reduce(self.features(x))
        pooled = self.pool(feat).flatten(1)
        return self.standardize(self.embedding(pooled))

    def train(self, mode=True):
        super().train(mode)
        if self.bn_freeze:
            for m in self.features.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.eval()
                    m.weight.requires_grad_(False)
                    m.bias.requires_grad_(False)
        return self


def make_loaders(cfg):
    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalize])
    test_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), normalize])
    train_set = torchvision.datasets.ImageFolder(os.path.join(cfg.data_root, "train"), train_tf)
    test_set = torchvision.datasets.ImageFolder(os.path.join(cfg.data_root, "test"), test_tf)
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=cfg.batch_size, shuffle=True, num_workers=8, pin_memory=True, drop_last=True)
    test_loader = torch.utils.data.DataLoader(test_set, batch_size=256, num_workers=8, pin_memory=True)
    return train_loader, test_loader


def train(cfg, model, criterion, loader, optimizer, epoch, device):
    model.train()
    losses = []
    for images, labels in loader:
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            emb = model(images)
            loss = criterion(emb, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_value_(model.parameters(), 10.0)
        torch.nn.utils.clip_grad_value_(criterion.parameters(), 10.0)
        optimizer.step()
        losses.append(loss.item())
    return float(np.mean(losses))


@torch.no_grad()
def evaluate(model, loader, device, ks=(1, 2, 4, 8)):
    model.eval()
    feats, labels = [], []
    for images, y in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            emb = F.normalize(model(images.to(device, non_blocking=True)), dim=1)
        feats.append(emb.float().cpu())
        labels.append(y)
    feats = torch.cat(feats)
    labels = torch.cat(labels)
    sim = feats @ feats.t()
    sim.fill_diagonal_(-1e9)
    topk = sim.topk(max(ks), dim=1).indices
    matches = labels[topk] == labels[:, None]
    recalls = {k: matches[:, :k].any(dim=1).float().mean().item() for k in ks}
    model.train()
    return recalls


def export_embedding_model(net, path, image_size=224):
    net = net.eval().half().cuda()
    dummy = torch.randn(1, 3, image_size, image_size, device="cuda", dtype=torch.float16)
    torch.onnx.export(net, dummy, path, input_names=["image"], output_names=["embedding"], opset_version=17)


def main():
    parser = argparse.ArgumentParser(description="Proxy-Anchor metric learning")
    parser.add_argument("--data-root", default=Config.data_root)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--out", default="logs/proxy_anchor")
    parser.add_argument("--export", action="store_true")
    args = parser.parse_args()
    cfg = Config(data_root=args.data_root, num_classes=args.classes, epochs=args.epochs)
    os.makedirs(args.out, exist_ok=True)
    if not torch.cuda.is_bf16_supported():
        raise SystemExit("this recipe trains in bf16; use an Ampere or newer GPU")
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True

    train_loader, test_loader = make_loaders(cfg)
    net = EmbeddingNet(cfg.embedding_size, bn_freeze=cfg.bn_freeze).to(device)
    model = torch.compile(net)
    criterion = ProxyAnchorLoss(cfg.num_classes, cfg.embedding_size, cfg.mrg, cfg.alpha).to(device)
    param_groups = [
        {"params": net.features.parameters(), "lr": cfg.lr},
        {"params": list(net.reduce.parameters()) + list(net.pool.parameters()) + list(net.embedding.parameters()), "lr": cfg.lr * cfg.lr_mult},
        {"params": criterion.parameters(), "lr": cfg.lr * cfg.proxy_lr_mult},
    ]
    optimizer = torch.optim.AdamW(param_groups, lr=cfg.lr, weight_decay=cfg.weight_decay, eps=1e-8)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)

    best_recall = 0.0
    for epoch in range(cfg.epochs):
        frozen = epoch < cfg.warm
        for p in net.features.parameters():
            p.requires_grad_(not frozen)
        loss = train(cfg, model, criterion, train_loader, optimizer, epoch, device)
        scheduler.step()
        recalls = evaluate(model, test_loader, device, cfg.recall_ks)
        print(f"epoch {epoch}: loss {loss:.4f} " + " ".join(f"R@{k} {100 * r:.2f}" for k, r in recalls.items()))
        if recalls[1] > best_recall:
            best_recall = recalls[1]
            torch.save({"model": net.state_dict(), "proxies": criterion.proxies.detach().cpu(), "epoch": epoch}, os.path.join(args.out, "best.pth"))
    if args.export:
        export_embedding_model(net, os.path.join(args.out, "embedding.onnx"))


if __name__ == "__main__":
    main()
