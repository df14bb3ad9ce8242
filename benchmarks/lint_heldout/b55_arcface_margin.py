"""Face recognition with an additive angular margin head (ArcFace / CosFace).

arcface_torch-style train.py in one file: config dataclass, aligned-face dataset stub,
IResNet backbone, combined margin head, mixed-precision loop, verification, export.
The loop used to be written with torch.cuda.amp.GradScaler; see git history.
"""
import argparse
import copy
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


@dataclass
class Config:
    embedding_size: int = 512
    num_classes: int = 10572
    margin_list: tuple = (1.0, 0.5, 0.0)
    scale: float = 64.0
    lr: float = 1e-3
    weight_decay: float = 0.05
    lr_head: float = 0.1
    momentum: float = 0.9
    batch_size: int = 128
    num_epoch: int = 20
    warmup_epoch: int = 1
    fp16: bool = True
    clip_grad: float = 5.0
    verbose: int = 2000
    output: str = "work_dirs/casia_r50"


class FaceDataset(Dataset):
    """Stub for an aligned 112x112 face dataset (e.g. CASIA-WebFace in a record file)."""

    def __init__(self, num_images, num_classes):
        self.num_images, self.num_classes = num_images, num_classes

    def __len__(self):
        return self.num_images

    def __getitem__(self, idx):
        img = torch.rand(3, 112, 112) * 2.0 - 1.0
        if np.random.rand() < 0.5:
            img = torch.flip(img, dims=[2])
        return img, idx % self.num_classes


class PairDataset(Dataset):
    def __init__(self, n_pairs=600):
        self.n = n_pairs

    def __len__(self):
        return self.n

    def __getitem__(self, idx):
        return torch.rand(3, 112, 112) * 2 - 1, torch.rand(3, 112, 112) * 2 - 1, torch.tensor(idx % 2 == 0)


def conv3x3(in_planes, out_planes, stride=1):
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


class IBasicBlock(nn.Module):
    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(inplanes, eps=1e-05)
        self.conv1 = conv3x3(inplanes, planes)
        self.bn2 = nn.BatchNorm2d(planes, eps=1e-05)
        self.prelu = nn.PReLU(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn3 = nn.BatchNorm2d(planes, eps=1e-05)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.prelu(self.bn2(self.conv1(self.bn1(x))))
        out = self.bn3(self.conv2(out))
        return out + identity


class IResNet(nn.Module):
    def __init__(self, layers=(3, 4, 14, 3), num_features=512, dropout=0.0):
        super().__init__()
        self.inplanes = 64
        self.conv1 = conv3x3(3, 64)
        self.bn1 = nn.BatchNorm2d(64, eps=1e-05)
        self.prelu = nn.PReLU(64)
        self.layer1 = self._make_layer(64, layers[0], stride=2)
        self.layer2 = self._make_layer(128, layers[1], stride=2)
        self.layer3 = self._make_layer(256, layers[2], stride=2)
        self.layer4 = self._make_layer(512, layers[3], stride=2)
        self.bn2 = nn.BatchNorm2d(512, eps=1e-05)
        self.dropout = nn.Dropout(p=dropout, inplace=True)
        self.fc = nn.Linear(512 * 7 * 7, num_features)
        self.features = nn.BatchNorm1d(num_features, eps=1e-05)
        nn.init.constant_(self.features.weight, 1.0)
        self.features.weight.requires_grad = False

    def _make_layer(self, planes, blocks, stride):
        downsample = nn.Sequential(conv3x3(self.inplanes, planes, stride), nn.BatchNorm2d(planes, eps=1e-05))
        layers = [IBasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes
        layers += [IBasicBlock(planes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.prelu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = self.dropout(torch.flatten(self.bn2(x), 1))
        return self.features(self.fc(x))


class MarginHead(nn.Module):
    """Class centres + combined margin cos(m1 * theta + m2) - m3 (ArcFace: m2, CosFace: m3)."""

    def __init__(self, embedding_size, num_classes, s=64.0, m1=1.0, m2=0.5, m3=0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.normal(0, 0.01, (num_classes, embedding_size)))
        self.s, self.m1, self.m2, self.m3 = s, m1, m2, m3

    def forward(self, embeddings, labels):
        norm_embeddings = F.normalize(embeddings, dim=1)
        norm_weight = F.normalize(self.weight, dim=1)
        logits = F.linear(norm_embeddings, norm_weight)
        logits = logits.float().clamp(-1.0, 1.0)
        index_positive = torch.where(labels != -1)[0]
        target_logit = logits[index_positive, labels[index_positive]]
        if self.m1 == 1.0 and self.m3 == 0.0:
            with torch.no_grad():
                target_logit.arccos_()
                logits.arccos_()
                logits[index_positive, labels[index_positive]] = target_logit + self.m2
                logits.cos_()
        elif self.m3 > 0:
            logits[index_positive, labels[index_positive]] = target_logit - self.m3
        else:
            raise ValueError("unsupported margin combination")
        return logits * self.s


def train_one_epoch(backbone, head, loader, opt_backbone, opt_head, scaler, lr_sched, epoch, cfg, global_step):
    backbone.train()
    head.train()
    for img, labels in loader:
        global_step += 1
        img, labels = img.cuda(non_blocking=True), labels.cuda(non_blocking=True)
        with torch.cuda.amp.autocast(enabled=cfg.fp16):  # expect: AMP009
            embeddings = backbone(img)
            logits = head(embeddings, labels)
            loss = F.cross_entropy(logits, labels)
            scaler.scale(loss).backward()  # expect: AMP008
        scaler.unscale_(opt_backbone)
        torch.nn.utils.clip_grad_norm_(backbone.parameters(), cfg.clip_grad)
        scaler.step(opt_backbone)
        scaler.update()
        opt_head.step()  # expect: AMP006
        opt_backbone.zero_grad(set_to_none=True)
        opt_head.zero_grad(set_to_none=True)
        lr_sched.step()
        if global_step % cfg.verbose == 0:
            with torch.no_grad():
                feat_norm = embeddings.float().norm(dim=1).mean().item()
            print(f"epoch {epoch} step {global_step} loss {loss.item():.4f} "
                  f"feat_norm {feat_norm:.2f} scale {scaler.get_scale():.0f}")
    return global_step


@torch.no_grad()
def verification(backbone, loader):
    backbone.eval()
    sims, same = [], []
    half_weights = next(backbone.parameters()).dtype == torch.float16
    for img1, img2, issame in loader:
        img1, img2 = img1.cuda(), img2.cuda()
        if half_weights:
            img1, img2 = img1.half(), img2.half()
        e1 = backbone(img1) + backbone(torch.flip(img1, dims=[3]))
        e2 = backbone(img2) + backbone(torch.flip(img2, dims=[3]))
        e1, e2 = F.normalize(e1.float(), dim=1), F.normalize(e2.float(), dim=1)
        sims.append((e1 * e2).sum(dim=1).cpu())
        same.append(issame)
    backbone.train()
    sims, same = torch.cat(sims).numpy(), torch.cat(same).numpy().astype(bool)
    return max(float(np.mean((sims > th) == same)) for th in np.arange(-1.0, 1.0, 0.01))


def save_checkpoint(backbone, head, opt_backbone, opt_head, scaler, epoch, global_step, cfg):
    checkpoint = {
        "epoch": epoch + 1,
        "global_step": global_step,
        "state_dict_backbone": backbone.state_dict(),
        "state_dict_head": head.state_dict(),
        "opt_backbone": opt_backbone.state_dict(),
        "opt_head": opt_head.state_dict(),
        "scaler": scaler.state_dict(),
    }
    torch.save(checkpoint, os.path.join(cfg.output, "checkpoint_gpu_0.pt"))
    torch.save(backbone.state_dict(), os.path.join(cfg.output, "model.pt"))


def export_onnx(backbone, path, fp16_weights=True):
    model = copy.deepcopy(backbone).eval()
    if fp16_weights:
        model = model.half()
    dtype = torch.float16 if fp16_weights else torch.float32
    dummy = torch.randn(1, 3, 112, 112, device="cuda", dtype=dtype)
    torch.onnx.export(model, dummy, path, input_names=["data"], output_names=["fc1"], opset_version=17)


def main(args):
    margins = (1.0, 0.5, 0.0) if args.margin == "arcface" else (1.0, 0.0, 0.4)
    cfg = Config(fp16=not args.no_fp16, output=args.output, margin_list=margins)
    os.makedirs(cfg.output, exist_ok=True)
    torch.backends.cudnn.benchmark = True
    train_loader = DataLoader(FaceDataset(490623, cfg.num_classes), batch_size=cfg.batch_size, shuffle=True,
                              num_workers=8, pin_memory=True, drop_last=True)
    pair_loader = DataLoader(PairDataset(), batch_size=64)
    backbone = IResNet(num_features=cfg.embedding_size).cuda()
    if cfg.fp16:
        backbone = backbone.half()  # expect: AMP001
    m1, m2, m3 = cfg.margin_list
    head = MarginHead(cfg.embedding_size, cfg.num_classes, cfg.scale, m1, m2, m3).cuda()
    opt_backbone = torch.optim.AdamW(backbone.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)  # expect: AMP011
    opt_head = torch.optim.SGD(head.parameters(), lr=cfg.lr_head, momentum=cfg.momentum, weight_decay=5e-4)
    scaler = torch.amp.GradScaler("cuda", growth_interval=100, enabled=cfg.fp16)
    total_steps = cfg.num_epoch * len(train_loader)
    warmup_steps = cfg.warmup_epoch * len(train_loader)

    def poly(step):
        if step < warmup_steps:
            return step / max(1, warmup_steps)
        return (1 - (step - warmup_steps) / max(1, total_steps - warmup_steps)) ** 2

    lr_sched = torch.optim.lr_scheduler.LambdaLR(opt_backbone, poly)
    global_step, best_acc = 0, 0.0
    for epoch in range(cfg.num_epoch):
        global_step = train_one_epoch(backbone, head, train_loader, opt_backbone, opt_head, scaler,
                                      lr_sched, epoch, cfg, global_step)
        acc = verification(backbone, pair_loader)
        print(f"epoch {epoch}: verification accuracy {acc:.4f}")
        save_checkpoint(backbone, head, opt_backbone, opt_head, scaler, epoch, global_step, cfg)
        if acc > best_acc:
            best_acc = acc
            export_onnx(backbone, os.path.join(cfg.output, "best.onnx"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="ArcFace training")
    parser.add_argument("--output", default="work_dirs/casia_r50")
    parser.add_argument("--no-fp16", action="store_true")
    parser.add_argument("--seed", type=int, default=2048)
    parser.add_argument("--margin", default="arcface", choices=["arcface", "cosface"])
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    main(args)
