"""Multi-task dense prediction (semantic seg + depth + surface normals) with learned task weights."""
import math
from functools import partial
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

NormLayer = partial(nn.BatchNorm2d, eps=1e-3, momentum=0.03)
ActLayer = partial(nn.SiLU, inplace=True)


class ConvNormAct(nn.Sequential):
    def __init__(self, cin, cout, k=3, stride=1, groups=1, norm_layer=NormLayer, act_layer=ActLayer):
        super().__init__(
            nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False),
            norm_layer(cout),
            act_layer() if act_layer is not None else nn.Identity(),
        )


class CoordStem(ConvNormAct):
    """Appends normalised x/y coordinate planes before the first conv (CoordConv)."""

    def __init__(self, cin, cout):
        super().__init__(cin + 2, cout, k=3, stride=2)

    def forward(self, x):
        b, _, h, w = x.shape
        ys = torch.linspace(-1, 1, h, device=x.device, dtype=x.dtype).view(1, 1, h, 1).expand(b, 1, h, w)
        xs = torch.linspace(-1, 1, w, device=x.device, dtype=x.dtype).view(1, 1, 1, w).expand(b, 1, h, w)
        return super().forward(torch.cat([x, xs, ys], dim=1))


class InvertedResidual(nn.Module):
    def __init__(self, cin, cout, stride, expand=4):
        super().__init__()
        mid = cin * expand
        self.use_res = stride == 1 and cin == cout
        self.block = nn.Sequential(
            ConvNormAct(cin, mid, k=1),
            ConvNormAct(mid, mid, k=3, stride=stride, groups=mid),
            ConvNormAct(mid, cout, k=1, act_layer=None),
        )

    def forward(self, x):
        out = self.block(x)
        return x + out if self.use_res else out


class Backbone(nn.Module):
    def __init__(self, widths=(32, 64, 128, 256), depths=(2, 2, 3, 2)):
        super().__init__()
        self.stem = CoordStem(3, widths[0])
        cin = widths[0]
        for i, (w, d) in enumerate(zip(widths, depths)):
            blocks = [InvertedResidual(cin, w, stride=1 if i == 0 else 2)]
            blocks += [InvertedResidual(w, w, 1) for _ in range(d - 1)]
            setattr(self, f"stage{i}", nn.Sequential(*blocks))
            cin = w
        self.num_stages = len(widths)
        self.out_channels = list(widths)

    def forward(self, x):
        x = self.stem(x)
        feats = []
        for i in range(self.num_stages):
            x = getattr(self, f"stage{i}")(x)
            feats.append(x)
        return feats


class SimpleFPN(nn.Module):
    def __init__(self, in_channels, dim=128):
        super().__init__()
        self.lateral = nn.ModuleList(nn.Conv2d(c, dim, 1) for c in in_channels)
        self.fuse = ConvNormAct(dim, dim)

    def forward(self, feats):
        size = feats[0].shape[-2:]
        fused = sum(F.interpolate(l(f), size=size, mode="bilinear", align_corners=False) for l, f in zip(self.lateral, feats))
        return self.fuse(fused)


class SqueezeExcite(nn.Module):
    def __init__(self, channels, rd_ratio=0.25, act_layer=nn.ReLU, gate_layer=nn.Sigmoid):
        super().__init__()
        rd = max(8, int(channels * rd_ratio))
        self.fc1 = nn.Conv2d(channels, rd, 1)
        self.act = act_layer(inplace=True)
        self.fc2 = nn.Conv2d(rd, channels, 1)
        self.gate = gate_layer()

    def forward(self, x):
        s = x.mean((2, 3), keepdim=True)  # expect: AMP004
        s = self.fc2(self.act(self.fc1(s)))
        return x * self.gate(s)


class SegHead(nn.Module):
    def __init__(self, dim, num_classes, use_se=True, absent_classes=(), upsample=4):
        super().__init__()
        self.conv = nn.Conv2d(dim, dim, 3, padding=1)
        self.se = SqueezeExcite(dim) if use_se else nn.Identity()
        self.act = nn.SiLU(inplace=True)
        self.classifier = nn.Conv2d(dim, num_classes, 1)
        self.absent_classes = list(absent_classes)
        self.upsample = upsample

    def forward(self, x):
        x = self.act(self.se(self.conv(x)))
        logits = self.classifier(x)
        if self.absent_classes:
            # multi-dataset training: labels this dataset never uses must not be predicted
            logits[:, self.absent_classes] = -1e9  # expect: AMP007
        return F.interpolate(logits, scale_factor=self.upsample, mode="bilinear", align_corners=False)


class SmoothnessMixin:
    """Edge-unaware disparity smoothness (Monodepth2 style, normalised by mean disparity)."""

    def smoothness_loss(self, disp):
        mean_disp = disp.mean(2, True).mean(3, True)  # expect: AMP004
        norm_disp = disp / (mean_disp + 1e-7)
        dx = (norm_disp[:, :, :, :-1] - norm_disp[:, :, :, 1:]).abs()
        dy = (norm_disp[:, :, :-1, :] - norm_disp[:, :, 1:, :]).abs()
        return dx.mean() + dy.mean()  # expect: AMP004


class DepthHead(SmoothnessMixin, nn.Module):
    def __init__(self, dim, max_depth=80.0, use_se=True, upsample=4):
        super().__init__()
        self.conv = nn.Conv2d(dim, dim, 3, padding=1)
        self.se = SqueezeExcite(dim) if use_se else nn.Identity()
        self.act = nn.SiLU(inplace=True)
        self.pred = nn.Conv2d(dim, 1, 3, padding=1)
        self.max_depth = max_depth
        self.upsample = upsample
        self.aux = {}

    def forward(self, x):
        x = self.act(self.se(self.conv(x)))
        disp = torch.sigmoid(self.pred(x))
        if self.training:
            self.aux = {"smooth": self.smoothness_loss(disp)}
        depth = 1.0 / (disp + 1e-8)  # expect: AMP011
        depth = depth.clamp(max=self.max_depth)
        return F.interpolate(depth, scale_factor=self.upsample, mode="bilinear", align_corners=False)


class NormalHead(nn.Module):
    def __init__(self, dim, upsample=4):
        super().__init__()
        self.conv = ConvNormAct(dim, dim)
        self.pred = nn.Conv2d(dim, 3, 1)
        self.upsample = upsample

    def forward(self, x):
        n = self.pred(self.conv(x))
        n = n / (n.norm(dim=1, keepdim=True) + 1e-8)
        return F.interpolate(n, scale_factor=self.upsample, mode="bilinear", align_corners=False)


class MultiTaskNet(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.backbone = Backbone()
        self.fpn = SimpleFPN(self.backbone.out_channels, cfg.dim)
        self.heads = nn.ModuleDict({
            "seg": SegHead(cfg.dim, cfg.num_classes, cfg.use_se, cfg.absent_classes),
            "depth": DepthHead(cfg.dim, cfg.max_depth, cfg.use_se),
            "normal": NormalHead(cfg.dim),
        })
        for name in list(self.heads):
            if name not in cfg.tasks:
                del self.heads[name]

    def forward(self, images):
        fused = self.fpn(self.backbone(images))
        return {name: head(fused) for name, head in self.heads.items()}


class UncertaintyWeightingMixin:
    """Kendall et al. 2018: L = sum_i exp(-s_i) * L_i + s_i with learned s_i = log sigma_i^2."""

    def init_task_weights(self, tasks):
        self.task_index = {t: i for i, t in enumerate(tasks)}
        self.log_vars = nn.Parameter(torch.zeros(len(tasks)))

    def weigh(self, losses):
        total = 0.0
        for name, value in losses.items():
            s = self.log_vars[self.task_index[name]]
            total = total + torch.exp(-s) * value + s
        return total


class MultiTaskLoss(UncertaintyWeightingMixin, nn.Module):
    def __init__(self, tasks, ignore_index=255):
        super().__init__()
        self.tasks = tuple(tasks)
        self.ignore_index = ignore_index
        self.init_task_weights(self.tasks)

    def forward(self, preds, targets):
        losses = {}
        if "seg" in preds:
            losses["seg"] = F.cross_entropy(preds["seg"], targets["seg"], ignore_index=self.ignore_index)
        if "depth" in preds:
            valid = targets["depth"] > 0
            d = torch.log(preds["depth"][valid]) - torch.log(targets["depth"][valid])
            losses["depth"] = torch.sqrt(d.pow(2).mean() - 0.85 * d.mean().pow(2) + 1e-8)
        if "normal" in preds:
            losses["normal"] = (1 - F.cosine_similarity(preds["normal"], targets["normal"], dim=1)).mean()
        return self.weigh(losses), {k: v.detach() for k, v in losses.items()}


class ModelWithLoss(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.net = MultiTaskNet(cfg)
        self.criterion = MultiTaskLoss(cfg.tasks)
        self.smooth_weight = cfg.smooth_weight

    def forward(self, batch):
        preds = self.net(batch["image"])
        loss, stats = self.criterion(preds, batch)
        for head in self.net.heads.values():
            for name, aux in getattr(head, "aux", {}).items():
                loss = loss + self.smooth_weight * aux
                stats[f"aux_{name}"] = aux.detach()
        return loss, stats


def default_cfg(**overrides):
    cfg = SimpleNamespace(dim=128, num_classes=19, use_se=True, absent_classes=(), max_depth=80.0,
                          tasks=("seg", "depth", "normal"), smooth_weight=1e-3, lr=6e-4, weight_lr=1e-2,
                          clip=1.0, epochs=30, warmup=500)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def train(cfg, loader):
    model = ModelWithLoss(cfg)
    model.cuda()
    optimizer = torch.optim.AdamW(model.net.parameters(), lr=cfg.lr, weight_decay=0.05)
    weight_opt = torch.optim.SGD(model.criterion.parameters(), lr=cfg.weight_lr)
    scaler = torch.amp.GradScaler("cuda")
    total = cfg.epochs * len(loader)
    for epoch in range(cfg.epochs):
        model.train()
        for it, batch in enumerate(loader):
            step = epoch * len(loader) + it
            lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * step / total))
            for g in optimizer.param_groups:
                g["lr"] = lr
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16):
                loss, stats = model(batch)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.net.parameters(), cfg.clip)
            scaler.step(optimizer)
            scaler.update()
            weight_opt.step()  # expect: AMP006
            optimizer.zero_grad(set_to_none=True)
            weight_opt.zero_grad(set_to_none=True)
            if it % 100 == 0:
                print(epoch, it, f"{loss.item():.4f}", {k: round(float(v), 4) for k, v in stats.items()})
    return model


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    inter = union = 0
    for batch in loader:
        preds = model.net(batch["image"].cuda())
        seg = preds["seg"].argmax(1)
        gt = batch["seg"].cuda()
        valid = gt != 255
        inter += ((seg == gt) & valid).sum().item()
        union += valid.sum().item()
    return inter / max(union, 1)
