"""ConvNeXt / EfficientNet hybrid: NF-MBConv stages with squeeze-excite, ConvNeXt stages with GRN."""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F


def drop_path(x, drop_prob=0.0, training=False):
    if drop_prob == 0.0 or not training:
        return x
    keep_prob = 1.0 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    random_tensor = x.new_empty(shape).bernoulli_(keep_prob)
    return x * random_tensor.div_(keep_prob)


class DropPath(nn.Module):
    """Stochastic depth per sample."""

    def __init__(self, drop_prob=0.0):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x):
        return drop_path(x, self.drop_prob, self.training)


class ScaledStdConv2d(nn.Conv2d):
    """Weight-standardised conv (NFNet); the statistics are taken over the fp32 weights."""

    def __init__(self, in_ch, out_ch, kernel_size, stride=1, groups=1, eps=1e-6):
        super().__init__(in_ch, out_ch, kernel_size, stride=stride, padding=kernel_size // 2, groups=groups)
        self.gain = nn.Parameter(torch.ones(out_ch, 1, 1, 1))
        self.scale = (self.weight[0].numel()) ** -0.5
        self.eps = eps

    def forward(self, x):
        w = self.weight
        mean = w.mean(dim=(1, 2, 3), keepdim=True)
        var = w.var(dim=(1, 2, 3), keepdim=True, unbiased=False)
        w = (w - mean) * torch.rsqrt(var + self.eps) * self.gain * self.scale
        return F.conv2d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)


class LayerNorm2d(nn.Module):
    """LayerNorm over the channel axis of an NCHW tensor."""

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


class SqueezeExcite(nn.Module):
    def __init__(self, channels, rd_ratio=0.25):
        super().__init__()
        rd = max(8, int(channels * rd_ratio))
        self.conv_reduce = nn.Conv2d(channels, rd, 1)
        self.act = nn.SiLU(inplace=True)
        self.conv_expand = nn.Conv2d(rd, channels, 1)

    def forward(self, x):
        s = x.mean((2, 3), keepdim=True)  # expect: AMP004
        s = self.conv_expand(self.act(self.conv_reduce(s)))
        return x * s.sigmoid()


class NFMBConv(nn.Module):
    """Normalizer-free inverted residual: expand, depthwise, SE, project."""

    def __init__(self, in_ch, out_ch, expand=4, kernel_size=3, stride=1, drop_path_rate=0.0, alpha=0.2):
        super().__init__()
        mid = in_ch * expand
        self.conv_pw = ScaledStdConv2d(in_ch, mid, 1)
        self.conv_dw = nn.Conv2d(mid, mid, kernel_size, stride=stride, padding=kernel_size // 2, groups=mid)
        self.se = SqueezeExcite(mid)
        self.conv_pwl = ScaledStdConv2d(mid, out_ch, 1)
        self.has_skip = stride == 1 and in_ch == out_ch
        self.drop_path = DropPath(drop_path_rate)
        self.alpha = alpha
        self.skip_gain = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        shortcut = x
        x = F.silu(self.conv_pw(x))
        x = F.silu(self.conv_dw(x))
        x = self.se(x)
        x = self.conv_pwl(x) * self.alpha
        if self.has_skip:
            x = shortcut + self.drop_path(x) * self.skip_gain
        return x


class GlobalResponseNorm(nn.Module):
    """ConvNeXt-V2 GRN for channels-last input."""

    def __init__(self, dim):
        super().__init__()
        self.gamma = nn.Parameter(torch.zeros(1, 1, 1, dim))
        self.beta = nn.Parameter(torch.zeros(1, 1, 1, dim))

    def forward(self, x):
        gx = torch.norm(x, p=2, dim=(1, 2), keepdim=True)
        nx = gx / (gx.mean(dim=-1, keepdim=True) + 1e-6)
        return self.gamma * (x * nx) + self.beta + x


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim, drop_path_rate=0.0, ls_init_value=1e-6):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.grn = GlobalResponseNorm(4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(ls_init_value * torch.ones(dim))
        self.drop_path = DropPath(drop_path_rate)

    def forward(self, x):
        shortcut = x
        x = self.dwconv(x).permute(0, 2, 3, 1)
        x = self.norm(x)
        x = self.grn(self.act(self.pwconv1(x)))
        x = self.gamma * self.pwconv2(x)
        return shortcut + self.drop_path(x.permute(0, 3, 1, 2))


class MaskedPoolHead(nn.Module):
    """Max-pools only the valid (unpadded) positions of variable-size images."""

    def __init__(self, in_ch, hidden, num_classes, drop=0.2):
        super().__init__()
        self.proj = nn.Conv2d(in_ch, hidden, 1)
        self.norm = nn.LayerNorm(hidden)
        self.drop = nn.Dropout(drop)
        self.fc = nn.Linear(hidden, num_classes)

    def forward(self, x, valid_mask=None):
        x = self.proj(x)
        if valid_mask is not None:
            x = x.masked_fill(~valid_mask[:, None], -1e9)  # expect: AMP007
        x = x.amax(dim=(2, 3))
        return self.fc(self.drop(self.norm(x)))


class ConvNeXtE(nn.Module):
    def __init__(self, num_classes=1000, dims=(48, 96, 192, 384), mb_depth=3, cn_depths=(3, 9, 3),
                 drop_path_rate=0.1):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dims[0], kernel_size=4, stride=4), LayerNorm2d(dims[0]))
        rates = torch.linspace(0, drop_path_rate, mb_depth + sum(cn_depths)).tolist()
        self.mb_blocks = nn.ModuleList([NFMBConv(dims[0], dims[0], drop_path_rate=rates[i]) for i in range(mb_depth)])
        self.downsamples = nn.ModuleList()
        self.stages = nn.ModuleList()
        k = mb_depth
        for i, depth in enumerate(cn_depths):
            self.downsamples.append(nn.Sequential(nn.GroupNorm(1, dims[i]), nn.Conv2d(dims[i], dims[i + 1], 2, 2)))
            self.stages.append(nn.ModuleList([ConvNeXtBlock(dims[i + 1], rates[k + j]) for j in range(depth)]))
            k += depth
        self.num_features = dims[-1]
        self.head = MaskedPoolHead(dims[-1], 2 * dims[-1], num_classes)

    def forward_features(self, x):
        x = self.stem(x)
        for blk in self.mb_blocks:
            x = blk(x)
        for down, stage in zip(self.downsamples, self.stages):
            x = down(x)
            for blk in stage:
                x = blk(x)
        return x

    def forward(self, x, valid_mask=None):
        feats = self.forward_features(x)
        if valid_mask is not None:
            valid_mask = F.interpolate(valid_mask[:, None].float(), size=feats.shape[-2:])[:, 0] > 0.5
        return self.head(feats, valid_mask)


class LabelSmoothingLoss(nn.Module):
    def __init__(self, num_classes, smoothing=0.1):
        super().__init__()
        self.num_classes = num_classes
        self.smoothing = smoothing

    def forward(self, pred, target):
        logp = F.log_softmax(pred, dim=-1)
        true_dist = torch.full_like(logp, self.smoothing / (self.num_classes - 1))
        true_dist.scatter_(1, target.unsqueeze(1), 1.0 - self.smoothing)
        return torch.sum(-true_dist * logp, dim=-1).mean()


class LinearProbe(nn.Module):
    def __init__(self, in_features, num_classes):
        super().__init__()
        self.drop = nn.Dropout(0.1)
        self.fc = nn.Linear(in_features, num_classes)

    def forward(self, feats):
        return self.fc(self.drop(feats))


def train_one_epoch(model, loader, criterion, optimizer, scaler, device, clip=1.0):
    model.train()
    running = 0.0
    for images, valid_mask, targets in loader:
        images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        valid_mask = valid_mask.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            outputs = model(images, valid_mask)
        loss = criterion(outputs, targets)  # expect: AMP002
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(optimizer)
        scaler.update()
        running += loss.item()
    return running / max(1, len(loader))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = total = 0
    for images, valid_mask, targets in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(images.to(device), valid_mask.to(device))
        correct += (logits.argmax(1) == targets.to(device)).sum().item()
        total += targets.numel()
    return correct / max(1, total)


def finetune_linear_probe(feature_loader, in_features, num_classes, epochs=10):
    probe = LinearProbe(in_features, num_classes).cuda().half()  # expect: AMP001
    optimizer = torch.optim.Adam(probe.parameters(), lr=1e-3)  # expect: AMP011
    for _ in range(epochs):
        for feats, targets in feature_loader:
            logits = probe(feats.cuda(non_blocking=True).half())  # expect: AMP001
            loss = F.cross_entropy(logits, targets.cuda(non_blocking=True))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return probe


def export_for_serving(model, path):
    serving = copy.deepcopy(model).eval().half()
    torch.save(serving.state_dict(), path)


def main(train_loader, val_loader, num_classes=1000, epochs=100):
    device = torch.device("cuda")
    model = ConvNeXtE(num_classes=num_classes).to(device)
    criterion = LabelSmoothingLoss(num_classes, smoothing=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=4e-3, weight_decay=0.05, eps=1e-8)
    scaler = torch.amp.GradScaler("cuda")
    best = 0.0
    for epoch in range(epochs):
        train_one_epoch(model, train_loader, criterion, optimizer, scaler, device)
        acc = evaluate(model, val_loader, device)
        if acc > best:
            best = acc
            export_for_serving(model, "convnext_e_fp16.pt")
    return best
