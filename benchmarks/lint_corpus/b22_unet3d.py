"""3D U-Net for volumetric segmentation with residual stages, squeeze-excitation,
instance normalisation, deep supervision and a Dice + BCE objective."""
import torch
import torch.nn.functional as F
from torch import nn


class ConvNormAct(nn.Module):
    def __init__(self, c_in, c_out, stride=1):
        super().__init__()
        self.conv = nn.Conv3d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.norm = nn.InstanceNorm3d(c_out, affine=True, eps=1e-5)
        self.act = nn.LeakyReLU(0.01, inplace=True)

    def forward(self, x):
        return self.act(self.norm(self.conv(x)))


class InstanceNorm3dExportable(nn.Module):
    """Instance norm written with plain tensor ops (the ONNX exporter of the target
    runtime has no InstanceNormalization for 5-D inputs)."""

    def __init__(self, channels):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x):
        mean = x.mean(dim=(2, 3, 4), keepdim=True)  # expect: AMP004
        var = x.var(dim=(2, 3, 4), keepdim=True, unbiased=False)  # expect: AMP004
        x = (x - mean) / torch.sqrt(var + 1e-10)  # expect: AMP011
        return x * self.weight.view(1, -1, 1, 1, 1) + self.bias.view(1, -1, 1, 1, 1)


class ChannelSE3d(nn.Module):
    def __init__(self, channels, reduction=4):
        super().__init__()
        self.fc1 = nn.Conv3d(channels, channels // reduction, 1)
        self.fc2 = nn.Conv3d(channels // reduction, channels, 1)

    def forward(self, x):
        s = x.mean(dim=(2, 3, 4), keepdim=True)  # expect: AMP004
        s = torch.sigmoid(self.fc2(F.relu(self.fc1(s))))
        return x * s


class ResidualStage(nn.Module):
    def __init__(self, c_in, c_out):
        super().__init__()
        self.conv1 = ConvNormAct(c_in, c_out)
        self.conv2 = nn.Conv3d(c_out, c_out, 3, padding=1, bias=False)
        self.se = ChannelSE3d(c_out)
        self.norm2 = nn.InstanceNorm3d(c_out, affine=True)
        self.skip = nn.Conv3d(c_in, c_out, 1, bias=False) if c_in != c_out else nn.Identity()

    def forward(self, x):
        out = self.conv1(x)
        out = self.se(self.conv2(out))
        out = self.norm2(out)
        return F.leaky_relu(out + self.skip(x), 0.01)


class PadMaxPool3d(nn.Module):
    """2x max pooling that keeps odd-sized borders instead of dropping them."""

    def forward(self, x):
        d, h, w = x.shape[-3:]
        pad = (0, w % 2, 0, h % 2, 0, d % 2)
        if any(pad):
            x = F.pad(x, pad, value=-1e9)  # expect: AMP007
        return F.max_pool3d(x, kernel_size=2, stride=2)


class UNet3D(nn.Module):
    def __init__(self, in_channels=1, n_classes=3, widths=(32, 64, 128, 256), deep_supervision=True):
        super().__init__()
        self.deep_supervision = deep_supervision
        self.pool = PadMaxPool3d()
        self.encoders = nn.ModuleList()
        c_prev = in_channels
        for w in widths:
            self.encoders.append(ResidualStage(c_prev, w))
            c_prev = w
        self.bottleneck = nn.Sequential(
            nn.Conv3d(widths[-1], 2 * widths[-1], 3, padding=1, bias=False),
            InstanceNorm3dExportable(2 * widths[-1]),
            nn.LeakyReLU(0.01, inplace=True),
            nn.Conv3d(2 * widths[-1], widths[-1], 3, padding=1, bias=False),
            InstanceNorm3dExportable(widths[-1]),
            nn.LeakyReLU(0.01, inplace=True),
        )
        self.upsamples = nn.ModuleList()
        self.decoders = nn.ModuleList()
        self.seg_heads = nn.ModuleList()
        for w_skip, w_in in zip(reversed(widths), [widths[-1]] + list(reversed(widths))[:-1]):
            self.upsamples.append(nn.ConvTranspose3d(w_in, w_skip, kernel_size=2, stride=2))
            self.decoders.append(ResidualStage(2 * w_skip, w_skip))
            self.seg_heads.append(nn.Conv3d(w_skip, n_classes, 1))

    def forward(self, x):
        skips = []
        for enc in self.encoders:
            x = enc(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottleneck(x)
        seg_outputs = []
        for up, dec, head, skip in zip(self.upsamples, self.decoders, self.seg_heads, reversed(skips)):
            x = up(x)
            x = x[..., : skip.shape[-3], : skip.shape[-2], : skip.shape[-1]]
            x = dec(torch.cat([x, skip], dim=1))
            seg_outputs.append(head(x))
        seg_outputs = seg_outputs[::-1]
        if self.deep_supervision and self.training:
            return tuple(seg_outputs)
        return seg_outputs[0]


class SoftDiceLoss(nn.Module):
    def __init__(self, smooth=1e-5, batch_dice=True):
        super().__init__()
        self.smooth = smooth
        self.batch_dice = batch_dice

    def forward(self, probs, target):
        axes = (0, 2, 3, 4) if self.batch_dice else (2, 3, 4)
        tp = (probs * target).sum(axes)
        fp = (probs * (1 - target)).sum(axes)
        fn = ((1 - probs) * target).sum(axes)
        dc = (2 * tp + self.smooth) / (2 * tp + fp + fn + self.smooth + 1e-8)
        return 1 - dc.mean()


class DiceBCELoss(nn.Module):
    def __init__(self, weight_bce=1.0, weight_dice=1.0):
        super().__init__()
        self.bce = nn.BCELoss()
        self.dice = SoftDiceLoss()
        self.weight_bce = weight_bce
        self.weight_dice = weight_dice

    def forward(self, net_output, target):
        probs = torch.sigmoid(net_output)
        bce = self.bce(probs, target)  # expect: AMP003
        return self.weight_bce * bce + self.weight_dice * self.dice(probs, target)


class DeepSupervisionLoss(nn.Module):
    def __init__(self, loss, weights):
        super().__init__()
        self.loss = loss
        self.weights = weights

    def forward(self, outputs, targets):
        return sum(w * self.loss(o, t) for w, o, t in zip(self.weights, outputs, targets) if w != 0)


def deep_supervision_weights(n_scales):
    weights = [1 / (2 ** i) for i in range(n_scales)]
    weights[-1] = 0.0
    total = sum(weights)
    return [w / total for w in weights]


def downsample_targets(target, n_scales):
    return [target] + [F.interpolate(target, scale_factor=0.5 ** i, mode="nearest") for i in range(1, n_scales)]


def poly_lr(epoch, max_epochs, initial_lr, exponent=0.9):
    return initial_lr * (1 - epoch / max_epochs) ** exponent


def train_epoch(model, loader, loss_fn, optimizer, scaler, device, n_scales, use_amp=True):
    model.train()
    running = 0.0
    for batch in loader:
        image = batch["image"].to(device, non_blocking=True)
        targets = downsample_targets(batch["label"].to(device, non_blocking=True).float(), n_scales)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=use_amp):
            outputs = model(image)
            loss = loss_fn(outputs, targets)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 12.0)
        scaler.step(optimizer)
        scaler.update()
        running += loss.item()
    return running / max(len(loader), 1)


@torch.no_grad()
def validate(model, loader, device, threshold=0.5):
    model.eval()
    dices = []
    for batch in loader:
        image = batch["image"].to(device)
        label = batch["label"].to(device).float()
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(image)
            pred = (torch.sigmoid(logits) > threshold).float()
        inter = (pred * label).sum(dim=(2, 3, 4))
        denom = pred.sum(dim=(2, 3, 4)) + label.sum(dim=(2, 3, 4))
        dices.append(((2 * inter + 1e-5) / (denom + 1e-5)).mean(0).cpu())
    return torch.stack(dices).mean(0)


def main(train_loader, val_loader, max_epochs=1000, initial_lr=1e-2, device="cuda", use_amp=True):
    model = UNet3D().to(device)
    n_scales = len(model.seg_heads)
    loss_fn = DeepSupervisionLoss(DiceBCELoss(), deep_supervision_weights(n_scales))
    optimizer = torch.optim.SGD(model.parameters(), lr=initial_lr, momentum=0.99, nesterov=True,
                                weight_decay=3e-5)
    scaler = torch.amp.GradScaler("cuda", enabled=use_amp)
    best_dice = 0.0
    for epoch in range(max_epochs):
        for group in optimizer.param_groups:
            group["lr"] = poly_lr(epoch, max_epochs, initial_lr)
        train_loss = train_epoch(model, train_loader, loss_fn, optimizer, scaler, device, n_scales, use_amp)
        dice = validate(model, val_loader, device).mean().item()
        if dice > best_dice:
            best_dice = dice
            torch.save(model.state_dict(), "unet3d_best.pt")
        print(f"epoch {epoch}: loss {train_loss:.4f} dice {dice:.4f}")
