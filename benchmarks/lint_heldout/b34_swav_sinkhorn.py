"""SwAV (Caron et al., 2020) with a small normaliser-free ResNet backbone.

Online clustering: the codes of one crop are computed with Sinkhorn-Knopp from the
prototype scores and predicted from the other crops (swapped prediction).

    python b34_swav_sinkhorn.py /data/imagenet100/train --epochs 100 --nmb-crops 2 4
"""
import argparse
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision import datasets, transforms


class WSConv2d(nn.Conv2d):
    """Conv2d with scaled weight standardisation (Brock et al., NF-ResNets)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gain = nn.Parameter(torch.ones(self.out_channels, 1, 1, 1))

    def standardized_weight(self):
        w = self.weight
        fan_in = w[0].numel()
        mean = w.mean(dim=(1, 2, 3), keepdim=True)
        var = w.var(dim=(1, 2, 3), keepdim=True, unbiased=False)
        return (w - mean) / torch.sqrt(var * fan_in + 1e-8) * self.gain

    def forward(self, x):
        return F.conv2d(x, self.standardized_weight(), self.bias, self.stride, self.padding, self.dilation, self.groups)


class SqueezeExcite(nn.Module):
    def __init__(self, channels, reduction=8):
        super().__init__()
        self.fc1 = nn.Conv2d(channels, channels // reduction, 1)
        self.fc2 = nn.Conv2d(channels // reduction, channels, 1)

    def forward(self, x):
        s = x.mean(dim=(2, 3), keepdim=True)  # expect: AMP004
        s = torch.sigmoid(self.fc2(F.relu(self.fc1(s))))
        return 2.0 * x * s


class NFBlock(nn.Module):
    def __init__(self, cin, cout, stride=1, beta=1.0, alpha=0.2, use_se=True):
        super().__init__()
        self.conv1 = WSConv2d(cin, cout, 3, stride, 1)
        self.conv2 = WSConv2d(cout, cout, 3, 1, 1)
        self.se = SqueezeExcite(cout) if use_se else nn.Identity()
        self.shortcut = WSConv2d(cin, cout, 1, stride) if (stride != 1 or cin != cout) else nn.Identity()
        self.beta, self.alpha = beta, alpha
        self.skip_gain = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        out = F.relu(x) / self.beta
        shortcut = self.shortcut(out)
        out = self.conv2(F.relu(self.conv1(out)))
        out = self.se(out)
        return out * self.skip_gain * self.alpha + shortcut


class NFResNetSmall(nn.Module):
    def __init__(self, width=64, use_se=True):
        super().__init__()
        self.stem = WSConv2d(3, width, 3, 2, 1)
        self.block1 = NFBlock(width, width, 1, use_se=use_se)
        self.block2 = NFBlock(width, 2 * width, 2, use_se=use_se)
        self.block3 = NFBlock(2 * width, 4 * width, 2, use_se=use_se)
        self.block4 = NFBlock(4 * width, 8 * width, 2, use_se=use_se)
        self.final_conv = WSConv2d(8 * width, 16 * width, 1)
        self.out_dim = 16 * width

    def forward(self, x):
        x = self.stem(x)
        x = self.block4(self.block3(self.block2(self.block1(x))))
        x = F.relu(self.final_conv(x))
        return x.mean(dim=(2, 3))  # expect: AMP004


class SwAVModel(nn.Module):
    def __init__(self, width=64, hidden=2048, proj_dim=128, n_prototypes=3000):
        super().__init__()
        self.backbone = NFResNetSmall(width)
        self.projection_head = nn.Sequential(
            nn.Linear(self.backbone.out_dim, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(inplace=True),
            nn.Linear(hidden, proj_dim),
        )
        self.prototypes = nn.Linear(proj_dim, n_prototypes, bias=False)

    def forward(self, inputs):
        # run crops of the same resolution together
        sizes = torch.tensor([inp.shape[-1] for inp in inputs])
        idx_crops = torch.cumsum(torch.unique_consecutive(sizes, return_counts=True)[1], 0)
        start, feats = 0, []
        for end in idx_crops.tolist():
            feats.append(self.backbone(torch.cat(inputs[start:end]).cuda(non_blocking=True)))
            start = end
        z = F.normalize(self.projection_head(torch.cat(feats)), dim=1)
        return z, self.prototypes(z)


@torch.no_grad()
def sinkhorn_knopp(scores, epsilon=0.05, n_iters=3):
    """Equipartitioned soft assignment of B samples to K prototypes."""
    Q = torch.exp(scores / epsilon).t()
    K, B = Q.shape
    Q /= Q.sum()
    for _ in range(n_iters):
        Q /= Q.sum(dim=1, keepdim=True)
        Q /= K
        Q /= Q.sum(dim=0, keepdim=True)
        Q /= B
    return (Q * B).t()


def swav_loss(scores, bs, nmb_crops, crops_for_assign=(0, 1), temperature=0.1, epsilon=0.05):
    n_crops = sum(nmb_crops)
    loss = 0.0
    for crop_id in crops_for_assign:
        q = sinkhorn_knopp(scores[bs * crop_id: bs * (crop_id + 1)].detach(), epsilon)
        sub = 0.0
        for v in np.delete(np.arange(n_crops), crop_id):
            p = F.log_softmax(scores[bs * v: bs * (v + 1)] / temperature, dim=1)
            sub -= torch.mean(torch.sum(q * p, dim=1))
        loss += sub / (n_crops - 1)
    return loss / len(crops_for_assign)


class MultiCrop:
    def __init__(self, size_crops, nmb_crops, min_scale, max_scale):
        color = transforms.Compose([
            transforms.RandomApply([transforms.ColorJitter(0.8, 0.8, 0.8, 0.2)], p=0.8),
            transforms.RandomGrayscale(p=0.2),
        ])
        self.trans = []
        for size, n, lo, hi in zip(size_crops, nmb_crops, min_scale, max_scale):
            t = transforms.Compose([
                transforms.RandomResizedCrop(size, scale=(lo, hi)),
                transforms.RandomHorizontalFlip(),
                color,
                transforms.ToTensor(),
                transforms.Normalize((0.485, 0.456, 0.406), (0.228, 0.224, 0.225)),
            ])
            self.trans.extend([t] * n)

    def __call__(self, img):
        return [t(img) for t in self.trans]


def train(args):
    dataset = datasets.ImageFolder(args.data, transform=MultiCrop(args.size_crops, args.nmb_crops, args.min_scale, args.max_scale))
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True,
                                         num_workers=args.workers, pin_memory=True, drop_last=True)
    model = SwAVModel(args.width, n_prototypes=args.nmb_prototypes).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.base_lr, momentum=0.9, weight_decay=1e-6)
    total_steps = args.epochs * len(loader)
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010

    step = 0
    for epoch in range(args.epochs):
        model.train()
        for it, (crops, _) in enumerate(loader):
            lr = args.final_lr + 0.5 * (args.base_lr - args.final_lr) * (1 + math.cos(math.pi * step / total_steps))
            for g in optimizer.param_groups:
                g["lr"] = lr
            # keep the prototypes on the unit sphere
            with torch.no_grad():
                w = F.normalize(model.prototypes.weight.data.clone(), dim=1, p=2)
                model.prototypes.weight.copy_(w)

            bs = crops[0].size(0)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, scores = model(crops)
                loss = swav_loss(scores, bs, args.nmb_crops, temperature=args.temperature, epsilon=args.epsilon)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if step < args.freeze_prototypes_niters:
                model.prototypes.weight.grad = None
            scaler.step(optimizer)  # expect: AMP006
            step += 1
            if it % 50 == 0:
                print(f"epoch {epoch} it {it} loss {loss.item():.4f} lr {lr:.4f}")
        torch.save({"epoch": epoch + 1, "state_dict": model.state_dict()}, args.checkpoint)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--nmb-prototypes", type=int, default=3000)
    p.add_argument("--size-crops", type=int, nargs="+", default=[224, 96])
    p.add_argument("--nmb-crops", type=int, nargs="+", default=[2, 6])
    p.add_argument("--min-scale", type=float, nargs="+", default=[0.14, 0.05])
    p.add_argument("--max-scale", type=float, nargs="+", default=[1.0, 0.14])
    p.add_argument("--temperature", type=float, default=0.1)
    p.add_argument("--epsilon", type=float, default=0.05)
    p.add_argument("--base-lr", type=float, default=0.6)
    p.add_argument("--final-lr", type=float, default=0.0006)
    p.add_argument("--freeze-prototypes-niters", type=int, default=313)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--checkpoint", default="swav_last.pt")
    train(p.parse_args())


if __name__ == "__main__":
    main()
