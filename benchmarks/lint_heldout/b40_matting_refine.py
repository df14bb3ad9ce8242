"""Background matting with a coarse encoder-decoder and a full-resolution refiner
(BackgroundMattingV2-style). The coarse net sees (src, bgr) at 1/4 resolution and
predicts alpha, premultiplied foreground, an error map and hidden features; the refiner
corrects the regions where the predicted error is high.
"""
import argparse
import copy
from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


def conv_bn(cin, cout, stride=1):
    return nn.Sequential(OrderedDict([
        ("conv", nn.Conv2d(cin, cout, 3, stride, 1, bias=False)),
        ("bn", nn.BatchNorm2d(cout)),
        ("relu", nn.ReLU(inplace=True)),
    ]))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = conv_bn(cin, cout, stride)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.down is None else self.down(x)
        return F.relu(self.bn2(self.conv2(self.conv1(x))) + identity)


class Bottleneck(BasicBlock):
    def __init__(self, cin, cout, stride=1):
        super().__init__(cin, cout, stride)
        mid = cout // 4
        self.conv1 = nn.Sequential(conv_bn(cin, mid), conv_bn(mid, mid, stride))
        self.conv2 = nn.Conv2d(mid, cout, 1, bias=False)


BLOCKS = {"basic": BasicBlock, "bottleneck": Bottleneck}


class Backbone(nn.Module):
    def __init__(self, block="basic", widths=(32, 64, 128, 256), in_ch=6):
        super().__init__()
        block_cls = BLOCKS[block]
        self.stem = conv_bn(in_ch, widths[0], stride=2)
        self.num_stages = len(widths)
        cin = widths[0]
        for i, w in enumerate(widths):
            stage = nn.Sequential(block_cls(cin, w, stride=1 if i == 0 else 2), block_cls(w, w))
            setattr(self, f"layer{i}", stage)
            cin = w
        self.out_channels = (widths[0],) + tuple(widths)

    def forward(self, x):
        feats = [self.stem(x)]
        for i in range(self.num_stages):
            feats.append(getattr(self, f"layer{i}")(feats[-1]))
        return feats


class Decoder(nn.Module):
    def __init__(self, chs, width=64):
        super().__init__()
        rev = chs[::-1]
        self.convs = nn.ModuleList()
        cin = rev[0]
        for skip in rev[1:]:
            self.convs.append(conv_bn(cin + skip, width))
            cin = width
        self.out_channels = width

    def forward(self, feats):
        x = feats[-1]
        for conv, skip in zip(self.convs, reversed(feats[:-1])):
            x = F.interpolate(x, size=skip.shape[-2:], mode="bilinear", align_corners=False)
            x = conv(torch.cat([x, skip], dim=1))
        return x


@dataclass
class MattingOutput:
    pha: torch.Tensor
    fgr: torch.Tensor
    err: torch.Tensor
    pha_coarse: torch.Tensor
    ref_mask: torch.Tensor


class MattingBase(nn.Module):
    """Coarse network; subclasses turn the raw prediction into outputs."""

    def __init__(self, backbone="basic", hidden=16):
        super().__init__()
        self.backbone = Backbone(backbone)
        self.decoder = Decoder(self.backbone.out_channels)
        self.project = nn.Conv2d(self.decoder.out_channels, 1 + 3 + 1 + hidden, 3, padding=1)

    def forward(self, src, bgr):
        x = F.interpolate(torch.cat([src, bgr], dim=1), scale_factor=0.25, mode="bilinear", align_corners=False)
        raw = self.project(self.decoder(self.backbone(x)))
        return self._postprocess(raw, src, bgr)

    def _postprocess(self, raw, src, bgr):
        raise NotImplementedError


class MattingRefine(MattingBase):
    def __init__(self, backbone="basic", hidden=16, refine_channels=(24, 16, 12)):
        super().__init__(backbone, hidden)
        chs = (1 + 3 + hidden + 6,) + tuple(refine_channels)
        refiner = nn.Sequential()
        for i, (cin, cout) in enumerate(zip(chs[:-1], chs[1:])):
            refiner.add_module(f"conv{i}", nn.Conv2d(cin, cout, 3, padding=1, bias=False))
            refiner.add_module(f"bn{i}", nn.BatchNorm2d(cout))
            refiner.add_module(f"relu{i}", nn.ReLU(inplace=True))
        refiner.add_module("out", nn.Conv2d(chs[-1], 4, 3, padding=1))
        self.refiner = refiner

    def _select_regions(self, err):
        thresh = err.mean(dim=(2, 3), keepdim=True)  # expect: AMP004
        return err > thresh

    def _postprocess(self, raw, src, bgr):
        pha = raw[:, 0:1].clamp(0.0, 1.0)
        premult = raw[:, 1:4].clamp(0.0, 1.0)
        err = raw[:, 4:5].clamp(0.0, 1.0)
        hid = raw[:, 5:].relu()
        fgr_sm = premult / (pha + 1e-8)  # expect: AMP011
        ref_mask = self._select_regions(err)
        size = src.shape[-2:]
        up = F.interpolate(torch.cat([pha, fgr_sm, hid], dim=1), size=size, mode="bilinear", align_corners=False)
        refined = self.refiner(torch.cat([up, src, bgr], dim=1))
        mask = F.interpolate(ref_mask.float(), size=size, mode="nearest").bool()
        pha_full = torch.where(mask, refined[:, :1], up[:, :1]).clamp(0.0, 1.0)
        fgr_full = torch.where(mask, refined[:, 1:4], up[:, 1:4]).clamp(0.0, 1.0)
        return MattingOutput(pha=pha_full, fgr=fgr_full, err=err, pha_coarse=pha, ref_mask=mask)


def sobel(x):
    kx = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]], device=x.device)
    kernel = torch.stack([kx, kx.t()]).unsqueeze(1).to(x.dtype)
    g = F.conv2d(x, kernel, padding=1)
    return torch.sqrt(g.pow(2).sum(dim=1, keepdim=True) + 1e-12)


class MattingLoss(nn.Module):
    def __init__(self, err_weight=1.0):
        super().__init__()
        self.err_weight = err_weight
        self.bce = nn.BCELoss()

    def forward(self, out, true_pha, true_fgr):
        l_pha = F.l1_loss(out.pha, true_pha) + F.l1_loss(sobel(out.pha), sobel(true_pha))
        fg = true_pha > 0
        l_fgr = F.l1_loss(out.fgr * fg, true_fgr * fg)
        true_pha_sm = F.interpolate(true_pha, size=out.err.shape[-2:], mode="bilinear", align_corners=False)
        true_err = (out.pha_coarse.detach() - true_pha_sm).abs().clamp(0.0, 1.0)
        l_err = self.bce(out.err, true_err)  # expect: AMP003
        return l_pha + l_fgr + self.err_weight * l_err


class SyntheticMattingSet(Dataset):
    def __init__(self, n=256, size=256):
        self.n, self.size = n, size

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        bgr = torch.rand(3, self.size, self.size, generator=g)
        fgr = torch.rand(3, self.size, self.size, generator=g)
        yy, xx = torch.meshgrid(torch.linspace(-1, 1, self.size), torch.linspace(-1, 1, self.size), indexing="ij")
        pha = torch.sigmoid(8 * (0.5 - (xx ** 2 + yy ** 2).sqrt()))[None]
        trimap = torch.where(pha > 0.95, 1.0, torch.where(pha < 0.05, 0.0, 0.5))
        return {"src": pha * fgr + (1 - pha) * bgr, "bgr": bgr, "pha": pha, "fgr": fgr, "trimap": trimap}


def train_one_epoch(model, loader, criterion, optimizer, scaler, args, epoch):
    amp_ctx = torch.autocast("cuda", dtype=torch.float16) if args.amp else nullcontext()
    model.train()
    for it, batch in enumerate(loader):
        src = batch["src"].cuda(non_blocking=True)
        bgr = batch["bgr"].cuda(non_blocking=True)
        true_pha = batch["pha"].cuda(non_blocking=True)
        true_fgr = batch["fgr"].cuda(non_blocking=True)
        trimap = batch["trimap"].cuda(non_blocking=True).half()  # expect: AMP001
        with amp_ctx:
            out = model(src, bgr)
            loss = criterion(out, true_pha, true_fgr)
        unknown = trimap == 0.5
        aux = F.l1_loss(out.pha[unknown], true_pha[unknown])  # expect: AMP002
        loss = loss + args.unknown_weight * aux
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        scaler.step(optimizer)
        scaler.update()
        if it % 20 == 0:
            print(f"epoch {epoch} it {it} loss {loss.item():.4f} refined {out.ref_mask.float().mean().item():.3f}")


def finetune_refiner(model, loader, args):
    """Second stage: freeze the coarse network and train only the refiner."""
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("refiner."))
    optimizer = torch.optim.Adam(model.refiner.parameters(), lr=args.lr * 0.1)
    criterion = nn.L1Loss()
    model.train()
    for batch in loader:
        src, bgr, true_pha, true_fgr = (batch[k].cuda(non_blocking=True) for k in ("src", "bgr", "pha", "fgr"))
        with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
            out = model(src, bgr)
            loss = criterion(out.pha, true_pha) + criterion(out.fgr * true_pha, true_fgr * true_pha)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    for p in model.parameters():
        p.requires_grad_(True)


@torch.no_grad()
def validate(model, loader, args):
    model.eval()
    sad, mse, n = 0.0, 0.0, 0
    for batch in loader:
        src, bgr, true_pha = (batch[k].cuda() for k in ("src", "bgr", "pha"))
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            out = model(src, bgr)
        pha = out.pha.float()
        sad += (pha - true_pha).abs().sum().item() / 1000
        mse += F.mse_loss(pha, true_pha).item()
        n += 1
    model.train()
    return sad / n, mse / n


def export_onnx(model, path, size=(1080, 1920)):
    model = copy.deepcopy(model).eval().half()
    dummy = torch.rand(1, 3, *size, device="cuda", dtype=torch.float16)
    torch.onnx.export(model, (dummy, dummy), path, input_names=["src", "bgr"], opset_version=17)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backbone", choices=sorted(BLOCKS), default="basic")
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--clip", type=float, default=5.0)
    parser.add_argument("--unknown-weight", type=float, default=0.5)
    args = parser.parse_args()

    model = MattingRefine(backbone=args.backbone).cuda()
    optimizer = torch.optim.Adam([
        {"params": model.backbone.parameters(), "lr": args.lr * 0.5},
        {"params": [p for n, p in model.named_parameters() if not n.startswith("backbone.")]},
    ], lr=args.lr)
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
    criterion = MattingLoss()
    loader = DataLoader(SyntheticMattingSet(), batch_size=8, shuffle=True, num_workers=2, drop_last=True)
    val_loader = DataLoader(SyntheticMattingSet(n=32), batch_size=8)
    for epoch in range(args.epochs):
        train_one_epoch(model, loader, criterion, optimizer, scaler, args, epoch)
        print("val sad/mse", validate(model, val_loader, args))
        raw = model.module if hasattr(model, "module") else model
        torch.save(raw.state_dict(), f"matting_{epoch:02d}.pth")
    finetune_refiner(model, loader, args)
    export_onnx(model, "matting_refine.onnx")


if __name__ == "__main__":
    main()
