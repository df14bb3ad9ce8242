"""ConvNeXt (V2 flavour: GRN, layer-scale, stochastic depth) with a dict of output heads.

Built by name from ``MODELS``, compiled, trained with fp16 autocast; optional timm distillation.
"""
import argparse

import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision import datasets, transforms


def drop_path(x, drop_prob: float = 0.0, training: bool = False):
    """Per-sample stochastic depth, as in timm."""
    if drop_prob == 0.0 or not training:
        return x
    keep_prob = 1.0 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    random_tensor = x.new_empty(shape).bernoulli_(keep_prob)
    return x * random_tensor / keep_prob


class LayerNorm2d(nn.Module):
    """LayerNorm over the channels of an NCHW map; only ever placed right after a strided conv."""

    def __init__(self, num_channels, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_channels))
        self.bias = nn.Parameter(torch.zeros(num_channels))
        self.eps = eps

    def forward(self, x):
        u = x.mean(1, keepdim=True)  # expect: AMP004
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class GRN(nn.Module):
    """Global response normalisation (ConvNeXt-V2), channels-last input."""
    def __init__(self, dim):
        super().__init__()
        self.gamma = nn.Parameter(torch.zeros(1, 1, 1, dim))
        self.beta = nn.Parameter(torch.zeros(1, 1, 1, dim))

    def forward(self, x):
        gx = torch.norm(x, p=2, dim=(1, 2), keepdim=True)
        nx = gx / (gx.mean(dim=-1, keepdim=True) + 1e-6)
        return self.gamma * (x * nx) + self.beta + x


class Block(nn.Module):
    def __init__(self, dim, drop_prob=0.0, layer_scale_init_value=1e-6, act="GELU"):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = getattr(nn, act)()
        self.grn = GRN(4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(layer_scale_init_value * torch.ones(dim)) if layer_scale_init_value > 0 else None
        self.drop_prob = drop_prob

    def forward(self, x):
        shortcut = x
        x = self.dwconv(x).permute(0, 2, 3, 1)
        x = self.act(self.pwconv1(self.norm(x)))
        x = self.pwconv2(self.grn(x))
        if self.gamma is not None:
            x = self.gamma * x
        return shortcut + drop_path(x.permute(0, 3, 1, 2), self.drop_prob, self.training)


class EmbeddingHead(nn.Module):
    """Metric-learning branch: projection standardised per sample."""
    def __init__(self, in_dim, emb_dim):
        super().__init__()
        self.proj = nn.Linear(in_dim, emb_dim)

    def forward(self, x):
        z = self.proj(x)
        mu = z.mean(dim=-1, keepdim=True)  # expect: AMP004
        sd = z.std(dim=-1, keepdim=True)  # expect: AMP004
        return (z - mu) / (sd + 1e-8)  # expect: AMP011


class ConfidenceHead(nn.Module):
    """Learned confidence (DeVries & Taylor, 2018); returns log c for the confidence penalty."""
    def __init__(self, in_dim):
        super().__init__()
        self.fc = nn.Linear(in_dim, 1)

    def forward(self, x):
        conf = torch.sigmoid(self.fc(x))
        return torch.log(conf + 1e-12)  # expect: AMP011


class ConvNeXt(nn.Module):
    def __init__(self, in_chans=3, num_classes=1000, depths=(3, 3, 9, 3), dims=(96, 192, 384, 768),
                 drop_path_rate=0.0, layer_scale_init_value=1e-6, act="GELU", emb_dim=128):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_chans, dims[0], kernel_size=4, stride=4), LayerNorm2d(dims[0]))
        self.downsamples = nn.ModuleList(
            [nn.Sequential(nn.Conv2d(dims[i], dims[i + 1], kernel_size=2, stride=2), LayerNorm2d(dims[i + 1]))
             for i in range(3)]
        )
        dp_rates = [r.item() for r in torch.linspace(0, drop_path_rate, sum(depths))]
        self.stages = nn.ModuleList()
        cur = 0
        for i in range(4):
            self.stages.append(nn.Sequential(*[
                Block(dims[i], drop_prob=dp_rates[cur + j], layer_scale_init_value=layer_scale_init_value, act=act)
                for j in range(depths[i])
            ]))
            cur += depths[i]
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.norm = nn.LayerNorm(dims[-1], eps=1e-6)
        self.heads = nn.ModuleDict({
            "cls": nn.Linear(dims[-1], num_classes),
            "emb": EmbeddingHead(dims[-1], emb_dim),
            "conf": ConfidenceHead(dims[-1]),
        })

    def forward_features(self, x):
        x = self.stages[0](self.stem(x))
        for down, stage in zip(self.downsamples, self.stages[1:]):
            x = stage(down(x))
        return self.norm(self.pool(x).flatten(1))

    def forward(self, x):
        feats = self.forward_features(x)
        return {name: head(feats) for name, head in self.heads.items()}


def convnext_atto(cfg):
    return ConvNeXt(num_classes=cfg.num_classes, depths=(2, 2, 6, 2), dims=(40, 80, 160, 320),
                    drop_path_rate=cfg.drop_path, act=cfg.act)


MODELS = {
    "convnext_atto": convnext_atto,
    "convnext_tiny": lambda cfg: ConvNeXt(num_classes=cfg.num_classes, drop_path_rate=cfg.drop_path, act=cfg.act),
}


def train_one_epoch(model, loader, optimizer, scaler, cfg, device):
    model.train()
    for step, (images, targets) in enumerate(loader):
        images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(images)
            loss = F.cross_entropy(out["cls"], targets, label_smoothing=cfg.smoothing)
            loss = loss - cfg.conf_weight * out["conf"].mean()
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
        scaler.step(optimizer)
        scaler.update()
        if step % cfg.log_every == 0:
            spread = out["emb"].float().std(dim=0).mean()
            print(f"step {step} loss {loss.item():.4f} emb-spread {spread.item():.3f}")


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct, total, conf = 0, 0, 0.0
    for images, targets in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(images.to(device))["cls"]
        conf += logits.softmax(dim=-1).max(dim=-1).values.mean().item()
        correct += (logits.argmax(-1) == targets.to(device)).sum().item()
        total += targets.numel()
    return correct / total, conf / len(loader)


def finetune_distill(model, teacher, loader, optimizer, cfg, device):
    """Short logit-distillation phase from a (frozen) timm teacher."""
    teacher.eval()
    model.train()
    for images, _ in loader:
        images = images.to(device, non_blocking=True)
        with torch.no_grad():
            t_logits = teacher(images)
        with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
            s_logits = model(images)["cls"]
            loss = F.kl_div(F.log_softmax(s_logits / cfg.tau, dim=-1), F.log_softmax(t_logits / cfg.tau, dim=-1),
                            reduction="batchmean", log_target=True) * cfg.tau ** 2
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


DEFAULTS = dict(arch="convnext_atto", data="data/imagenette", num_classes=10, act="GELU", drop_path=0.1, lr=4e-3,
                epochs=100, clip_grad=5.0, conf_weight=0.1, log_every=50, distill_from="", tau=2.0, smoothing=0.1)


def main():
    p = argparse.ArgumentParser()
    for key, value in DEFAULTS.items():
        p.add_argument("--" + key.replace("_", "-"), type=type(value), default=value)
    cfg = p.parse_args()
    device = torch.device("cuda")
    tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.ToTensor()])
    val_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor()])
    loader = torch.utils.data.DataLoader(datasets.ImageFolder(f"{cfg.data}/train", tf), batch_size=128,
                                         shuffle=True, num_workers=8, drop_last=True)
    val_loader = torch.utils.data.DataLoader(datasets.ImageFolder(f"{cfg.data}/val", val_tf), batch_size=256)
    model = MODELS[cfg.arch](cfg)
    model.to(device)
    model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.05)
    scaler = torch.amp.GradScaler("cuda")
    for epoch in range(cfg.epochs):
        train_one_epoch(model, loader, optimizer, scaler, cfg, device)
        acc, conf = evaluate(model, val_loader, device)
        print(f"epoch {epoch} acc {acc:.4f} mean-conf {conf:.3f}")
    if cfg.distill_from:
        teacher = timm.create_model(cfg.distill_from, pretrained=True, num_classes=cfg.num_classes).to(device)
        finetune_distill(model, teacher, loader, optimizer, cfg, device)


if __name__ == "__main__":
    main()
