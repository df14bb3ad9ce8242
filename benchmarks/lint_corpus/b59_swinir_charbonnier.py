"""SwinIR-style x4 super-resolution with hybrid attention blocks (window attention +
channel-attention convs, as in HAT), trained with Charbonnier, SSIM, gradient-variance
and perceptual Charbonnier losses; gradient accumulation and an fp16 EMA copy.
"""
import argparse
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader


def window_partition(x, ws):
    b, h, w, c = x.shape
    x = x.view(b, h // ws, ws, w // ws, ws, c)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, ws * ws, c)


def window_reverse(windows, ws, h, w):
    b = windows.shape[0] // ((h // ws) * (w // ws))
    x = windows.view(b, h // ws, w // ws, ws, ws, -1)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, -1)


class WindowAttention(nn.Module):
    def __init__(self, dim, ws, heads):
        super().__init__()
        self.ws, self.heads, self.scale = ws, heads, (dim // heads) ** -0.5
        self.rel_bias = nn.Parameter(torch.zeros((2 * ws - 1) ** 2, heads))
        coords = torch.stack(torch.meshgrid(torch.arange(ws), torch.arange(ws), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (ws - 1)
        self.register_buffer("rel_index", rel[..., 0] * (2 * ws - 1) + rel[..., 1])
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        b_, n, c = x.shape
        q, k, v = self.qkv(x).view(b_, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        bias = self.rel_bias[self.rel_index.view(-1)].view(n, n, -1).permute(2, 0, 1)
        attn = attn + bias.unsqueeze(0)
        if mask is not None:
            nw = mask.shape[0]
            attn = attn.view(b_ // nw, nw, self.heads, n, n) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.heads, n, n)
        attn = attn.softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b_, n, c))


class ChannelAttentionBlock(nn.Module):
    def __init__(self, c, compress=3, squeeze=30):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(c, c // compress, 3, 1, 1), nn.GELU(), nn.Conv2d(c // compress, c, 3, 1, 1))
        self.fc1 = nn.Conv2d(c, c // squeeze, 1)
        self.fc2 = nn.Conv2d(c // squeeze, c, 1)

    def forward(self, x):
        y = self.body(x)
        w = y.mean(dim=(2, 3), keepdim=True)  # expect: AMP004
        return y * torch.sigmoid(self.fc2(F.relu(self.fc1(w))))


class HybridAttentionBlock(nn.Module):
    def __init__(self, dim, res, heads, ws, shift, cab_weight=0.01):
        super().__init__()
        self.res, self.ws, self.shift, self.cab_weight = res, ws, shift, cab_weight
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, ws, heads)
        self.cab = ChannelAttentionBlock(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.register_buffer("attn_mask", self.calculate_mask(res) if shift > 0 else None, persistent=False)

    def calculate_mask(self, res):
        h, w = res
        img_mask = torch.zeros(1, h, w, 1)
        cnt = 0
        for hs in (slice(0, -self.ws), slice(-self.ws, -self.shift), slice(-self.shift, None)):
            for wsl in (slice(0, -self.ws), slice(-self.ws, -self.shift), slice(-self.shift, None)):
                img_mask[:, hs, wsl, :] = cnt
                cnt += 1
        mw = window_partition(img_mask, self.ws).squeeze(-1)
        attn_mask = mw.unsqueeze(1) - mw.unsqueeze(2)
        return attn_mask.masked_fill(attn_mask != 0, float(-100.0)).masked_fill(attn_mask == 0, 0.0)

    def forward(self, x, hw):
        h, w = hw
        b, _, c = x.shape
        shortcut = x
        x = self.norm1(x).view(b, h, w, c)
        conv_x = self.cab(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1).reshape(b, h * w, c)
        if self.shift > 0:
            x = torch.roll(x, shifts=(-self.shift, -self.shift), dims=(1, 2))
        win = self.attn(window_partition(x, self.ws), mask=self.attn_mask)
        x = window_reverse(win, self.ws, h, w)
        if self.shift > 0:
            x = torch.roll(x, shifts=(self.shift, self.shift), dims=(1, 2))
        x = shortcut + x.reshape(b, h * w, c) + self.cab_weight * conv_x
        return x + self.mlp(self.norm2(x))


class ResidualGroup(nn.Module):
    def __init__(self, dim, res, depth, heads, ws):
        super().__init__()
        self.blocks = nn.ModuleList([HybridAttentionBlock(dim, res, heads, ws, 0 if i % 2 == 0 else ws // 2)
                                     for i in range(depth)])
        self.conv = nn.Conv2d(dim, dim, 3, 1, 1)

    def forward(self, x, hw):
        b, n, c = x.shape
        y = x
        for blk in self.blocks:
            y = blk(y, hw)
        y = self.conv(y.transpose(1, 2).view(b, c, *hw)).flatten(2).transpose(1, 2)
        return x + y


class SwinIR(nn.Module):
    def __init__(self, upscale=4, dim=180, depths=(6, 6, 6, 6, 6, 6), heads=6, ws=16, patch=64, img_range=1.0):
        super().__init__()
        self.img_range = img_range
        self.register_buffer("mean", torch.tensor([0.4488, 0.4371, 0.4040]).view(1, 3, 1, 1))
        self.conv_first = nn.Conv2d(3, dim, 3, 1, 1)
        self.groups = nn.ModuleList([ResidualGroup(dim, (patch, patch), d, heads, ws) for d in depths])
        self.norm = nn.LayerNorm(dim)
        self.conv_after_body = nn.Conv2d(dim, dim, 3, 1, 1)
        self.upsample = nn.Sequential(nn.Conv2d(dim, 64, 3, 1, 1), nn.LeakyReLU(inplace=True),
                                      nn.Conv2d(64, 4 * 64, 3, 1, 1), nn.PixelShuffle(2),
                                      nn.Conv2d(64, 4 * 64, 3, 1, 1), nn.PixelShuffle(2))
        self.conv_last = nn.Conv2d(64, 3, 3, 1, 1)

    def forward(self, x):
        x = (x - self.mean) * self.img_range
        feat = self.conv_first(x)
        b, c, h, w = feat.shape
        y = feat.flatten(2).transpose(1, 2)
        for group in self.groups:
            y = group(y, (h, w))
        y = self.norm(y).transpose(1, 2).view(b, c, h, w)
        feat = self.conv_after_body(y) + feat
        out = self.conv_last(self.upsample(feat))
        return out / self.img_range + self.mean


class CharbonnierLoss(nn.Module):
    """BasicSR's Charbonnier; prediction and target are both fp32 here."""

    def __init__(self, eps=1e-12):
        super().__init__()
        self.eps = eps

    def forward(self, pred, target):
        return torch.mean(torch.sqrt((pred - target) ** 2 + self.eps))


def ssim_loss(img1, img2, window, c1=0.01 ** 2, c2=0.03 ** 2):
    ch = img1.shape[1]
    mu1 = F.conv2d(img1, window, padding=5, groups=ch)
    mu2 = F.conv2d(img2, window, padding=5, groups=ch)
    mu1_sq, mu2_sq, mu1_mu2 = mu1.pow(2), mu2.pow(2), mu1 * mu2  # pow: fp32 under CUDA autocast
    sigma1_sq = F.conv2d(img1 * img1, window, padding=5, groups=ch) - mu1_sq
    sigma2_sq = F.conv2d(img2 * img2, window, padding=5, groups=ch) - mu2_sq
    sigma12 = F.conv2d(img1 * img2, window, padding=5, groups=ch) - mu1_mu2
    ssim_map = ((2 * mu1_mu2 + c1) * (2 * sigma12 + c2)) / ((mu1_sq + mu2_sq + c1) * (sigma1_sq + sigma2_sq + c2))
    return 1.0 - ssim_map.mean()


class GradientVarianceLoss(nn.Module):
    def __init__(self, patch=8, edge_weight=0.1):
        super().__init__()
        self.patch, self.edge_weight = patch, edge_weight
        kx = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]])
        self.register_buffer("kx", kx.view(1, 1, 3, 3))
        self.register_buffer("ky", kx.t().contiguous().view(1, 1, 3, 3))

    def _grads(self, img):
        gray = 0.299 * img[:, 0:1] + 0.587 * img[:, 1:2] + 0.114 * img[:, 2:3]
        return F.conv2d(gray, self.kx, padding=1), F.conv2d(gray, self.ky, padding=1)

    def _patch_var(self, g):
        patches = g.unfold(2, self.patch, self.patch).unfold(3, self.patch, self.patch)
        return patches.flatten(-2).var(dim=-1)  # expect: AMP004

    def forward(self, sr, hr):
        gx_sr, gy_sr = self._grads(sr)
        gx_hr, gy_hr = self._grads(hr)
        gv = F.mse_loss(self._patch_var(gx_sr), self._patch_var(gx_hr)) + F.mse_loss(self._patch_var(gy_sr), self._patch_var(gy_hr))
        edge_sr = torch.sqrt(gx_sr ** 2 + gy_sr ** 2 + 1e-8)  # ** is pow: fp32 under CUDA autocast
        edge_hr = torch.sqrt(gx_hr ** 2 + gy_hr ** 2 + 1e-8)
        return gv + self.edge_weight * F.l1_loss(edge_sr, edge_hr)


class VGGFeatures(nn.Module):
    def __init__(self, widths=(64, 128, 256, 512)):
        super().__init__()
        self.stages = nn.ModuleList()
        c = 3
        for i, w in enumerate(widths):
            pool = [nn.MaxPool2d(2)] if i > 0 else []
            self.stages.append(nn.Sequential(*pool, nn.Conv2d(c, w, 3, 1, 1), nn.ReLU(inplace=True), nn.Conv2d(w, w, 3, 1, 1)))
            c = w
        self.register_buffer("norm_mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.register_buffer("norm_std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))

    def forward(self, x):
        x = (x - self.norm_mean) / self.norm_std
        feats = []
        for stage in self.stages:
            x = F.relu(stage(x))
            feats.append(x)
        return feats


class PerceptualCharbonnierLoss(nn.Module):
    def __init__(self, weights=(0.1, 0.1, 1.0, 1.0), vgg_path="weights/vgg19_feats.pth"):
        super().__init__()
        self.weights = weights
        self.vgg = VGGFeatures()
        self.vgg.load_state_dict(torch.load(vgg_path, map_location="cpu"))
        self.vgg.eval().requires_grad_(False)

    def forward(self, sr, hr):
        f_sr = self.vgg(sr)
        with torch.no_grad():
            f_hr = self.vgg(hr)
        loss = 0.0
        for w, a, b in zip(self.weights, f_sr, f_hr):
            diff = a - b
            loss = loss + w * torch.mean(torch.sqrt(diff * diff + 1e-12))  # expect: AMP004, AMP011
        return loss


def gaussian_window(size=11, sigma=1.5, channels=3):
    g = torch.exp(-((torch.arange(size) - size // 2) ** 2) / (2 * sigma ** 2))
    g = (g / g.sum()).unsqueeze(1)
    return (g @ g.t()).expand(channels, 1, size, size).contiguous()


def export_onnx(model, path, size=64):
    m = copy.deepcopy(model).half().eval()
    torch.onnx.export(m, torch.randn(1, 3, size, size, device=next(m.parameters()).device).half(), path, opset_version=17)


def train(args):
    device = torch.device("cuda")
    model = SwinIR(upscale=4, patch=args.patch).to(device)
    ema = copy.deepcopy(model).half().eval().requires_grad_(False)
    pix, gvl, perc = CharbonnierLoss().to(device), GradientVarianceLoss().to(device), PerceptualCharbonnierLoss().to(device)
    window = gaussian_window().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-4, betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [250_000, 400_000, 450_000, 475_000], 0.5)
    scaler = torch.amp.GradScaler("cuda")
    loader = DataLoader(torch.load(args.data), batch_size=args.batch_size, shuffle=True, num_workers=8, drop_last=True)
    it = 0
    for epoch in range(args.epochs):
        for lq, hr in loader:
            lq, hr = lq.to(device, non_blocking=True), hr.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                sr = model(lq)
                loss = pix(sr, hr) + 0.1 * ssim_loss(sr, hr, window) + 0.05 * gvl(sr, hr) + 0.01 * perc(sr, hr)
            loss = scaler.scale(loss / args.accum)
            loss.backward()
            it += 1
            if it % args.accum == 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                optimizer.step()  # expect: AMP006
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                with torch.no_grad():
                    for e, p in zip(ema.parameters(), model.parameters()):
                        e.mul_(0.999).add_(p.detach().half(), alpha=0.001)
        print(f"epoch {epoch} iter {it} loss {loss.item() / scaler.get_scale():.4f}")
    export_onnx(model, "swinir_x4.onnx")
    return model, ema


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/df2k_sub.pt")
    p.add_argument("--patch", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--epochs", type=int, default=1000)
    train(p.parse_args())
