"""GwcNet-style stereo matching: group-wise correlation + concatenation cost volume,
stacked 3D hourglasses, soft-argmin disparity regression.

An optional coarse 1-D correlation branch (``--corr-branch``) gives an extra cheap
prediction that is supervised like the others; ``--lean-corr`` computes it with a
custom autograd function that never materialises the (B, C, D, H, W) product.
"""
import argparse
import logging
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import autocast
from torch.utils.data import DataLoader

from stereo.datasets import SceneFlowDataset, KITTI2015Dataset
from stereo.utils import AverageMeter, save_checkpoint

logger = logging.getLogger("gwcnet")


# --------------------------------------------------------------------------- cost volumes

def groupwise_correlation(fea1, fea2, num_groups):
    B, C, H, W = fea1.shape
    assert C % num_groups == 0
    channels_per_group = C // num_groups
    cost = (fea1 * fea2).view([B, num_groups, channels_per_group, H, W]).mean(dim=2)  # expect: AMP004
    assert cost.shape == (B, num_groups, H, W)
    return cost


def build_gwc_volume(refimg_fea, targetimg_fea, maxdisp, num_groups):
    B, C, H, W = refimg_fea.shape
    volume = refimg_fea.new_zeros([B, num_groups, maxdisp, H, W])
    for i in range(maxdisp):
        if i > 0:
            volume[:, :, i, :, i:] = groupwise_correlation(refimg_fea[:, :, :, i:], targetimg_fea[:, :, :, :-i], num_groups)
        else:
            volume[:, :, i, :, :] = groupwise_correlation(refimg_fea, targetimg_fea, num_groups)
    return volume.contiguous()


def build_concat_volume(refimg_fea, targetimg_fea, maxdisp):
    B, C, H, W = refimg_fea.shape
    volume = refimg_fea.new_zeros([B, 2 * C, maxdisp, H, W])
    for i in range(maxdisp):
        if i > 0:
            volume[:, :C, i, :, i:] = refimg_fea[:, :, :, i:]
            volume[:, C:, i, :, i:] = targetimg_fea[:, :, :, :-i]
        else:
            volume[:, :C, i, :, :] = refimg_fea
            volume[:, C:, i, :, :] = targetimg_fea
    return volume.contiguous()


def build_corr_volume(left, right, max_disp):
    b, c, h, w = left.shape
    volume = left.new_zeros(b, max_disp, h, w)
    for d in range(max_disp):
        if d > 0:
            volume[:, d, :, d:] = (left[:, :, :, d:] * right[:, :, :, :-d]).mean(dim=1)  # expect: AMP004
        else:
            volume[:, d] = (left * right).mean(dim=1)  # expect: AMP004
    return volume.contiguous()


class DisparityCorrelation(torch.autograd.Function):
    """Memory-lean 1-D correlation (same result as ``build_corr_volume``)."""

    @staticmethod
    @torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)  # expect: AMP009
    def forward(ctx, left, right, max_disp):
        ctx.save_for_backward(left, right)
        ctx.max_disp = max_disp
        b, c, h, w = left.shape
        out = left.new_zeros(b, max_disp, h, w)
        for d in range(max_disp):
            if d > 0:
                out[:, d, :, d:] = (left[:, :, :, d:] * right[:, :, :, :-d]).sum(1) / c
            else:
                out[:, d] = (left * right).sum(1) / c
        return out

    @staticmethod
    @torch.cuda.amp.custom_bwd  # expect: AMP009
    def backward(ctx, grad_out):
        left, right = ctx.saved_tensors
        c = left.shape[1]
        grad_left = torch.zeros_like(left)
        grad_right = torch.zeros_like(right)
        for d in range(ctx.max_disp):
            g = grad_out[:, d:d + 1] / c
            if d > 0:
                grad_left[:, :, :, d:] += g[:, :, :, d:] * right[:, :, :, :-d]
                grad_right[:, :, :, :-d] += g[:, :, :, d:] * left[:, :, :, d:]
            else:
                grad_left += g * right
                grad_right += g * left
        return grad_left, grad_right, None


def disparity_regression(prob, maxdisp):
    disp_values = torch.arange(0, maxdisp, dtype=prob.dtype, device=prob.device).view(1, maxdisp, 1, 1)
    return torch.sum(prob * disp_values, 1, keepdim=False)


# --------------------------------------------------------------------------- network

def convbn(in_planes, out_planes, kernel_size, stride, pad, dilation):
    return nn.Sequential(
        nn.Conv2d(in_planes, out_planes, kernel_size, stride=stride,
                  padding=dilation if dilation > 1 else pad, dilation=dilation, bias=False),
        nn.BatchNorm2d(out_planes),
    )


def convbn_3d(in_planes, out_planes, kernel_size, stride, pad):
    return nn.Sequential(nn.Conv3d(in_planes, out_planes, kernel_size, stride=stride, padding=pad, bias=False),
                         nn.BatchNorm3d(out_planes))


class BasicBlock(nn.Module):
    def __init__(self, inplanes, planes, stride, downsample, pad, dilation):
        super().__init__()
        self.conv1 = nn.Sequential(convbn(inplanes, planes, 3, stride, pad, dilation), nn.ReLU(inplace=True))
        self.conv2 = convbn(planes, planes, 3, 1, pad, dilation)
        self.downsample = downsample

    def forward(self, x):
        out = self.conv2(self.conv1(x))
        if self.downsample is not None:
            x = self.downsample(x)
        return out + x


class FeatureExtraction(nn.Module):
    def __init__(self, gwc_channels=320, concat_channels=12):
        super().__init__()
        self.inplanes = 32
        self.firstconv = nn.Sequential(convbn(3, 32, 3, 2, 1, 1), nn.ReLU(inplace=True),
                                       convbn(32, 32, 3, 1, 1, 1), nn.ReLU(inplace=True),
                                       convbn(32, 32, 3, 1, 1, 1), nn.ReLU(inplace=True))
        self.layer1 = self._make_layer(32, 3, 1, 1, 1)
        self.layer2 = self._make_layer(64, 16, 2, 1, 1)
        self.layer3 = self._make_layer(128, 3, 1, 1, 1)
        self.layer4 = self._make_layer(128, 3, 1, 1, 2)
        self.gwc_proj = nn.Sequential(convbn(320, 320, 3, 1, 1, 1), nn.ReLU(inplace=True),
                                      nn.Conv2d(320, gwc_channels, 1, bias=False))
        self.lastconv = nn.Sequential(convbn(320, 128, 3, 1, 1, 1), nn.ReLU(inplace=True),
                                      nn.Conv2d(128, concat_channels, 1, bias=False))

    def _make_layer(self, planes, blocks, stride, pad, dilation):
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes, 1, stride=stride, bias=False),
                                       nn.BatchNorm2d(planes))
        layers = [BasicBlock(self.inplanes, planes, stride, downsample, pad, dilation)]
        self.inplanes = planes
        layers += [BasicBlock(planes, planes, 1, None, pad, dilation) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.firstconv(x)
        l2 = self.layer2(self.layer1(x))
        l3 = self.layer3(l2)
        l4 = self.layer4(l3)
        feat = torch.cat((l2, l3, l4), dim=1)
        return self.gwc_proj(feat), self.lastconv(feat)


class Hourglass(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Sequential(convbn_3d(c, 2 * c, 3, 2, 1), nn.ReLU(inplace=True))
        self.conv2 = nn.Sequential(convbn_3d(2 * c, 2 * c, 3, 1, 1), nn.ReLU(inplace=True))
        self.conv3 = nn.Sequential(convbn_3d(2 * c, 4 * c, 3, 2, 1), nn.ReLU(inplace=True))
        self.conv4 = nn.Sequential(convbn_3d(4 * c, 4 * c, 3, 1, 1), nn.ReLU(inplace=True))
        self.conv5 = nn.Sequential(nn.ConvTranspose3d(4 * c, 2 * c, 3, padding=1, output_padding=1, stride=2, bias=False),
                                   nn.BatchNorm3d(2 * c))
        self.conv6 = nn.Sequential(nn.ConvTranspose3d(2 * c, c, 3, padding=1, output_padding=1, stride=2, bias=False),
                                   nn.BatchNorm3d(c))
        self.redir1 = convbn_3d(c, c, 1, 1, 0)
        self.redir2 = convbn_3d(2 * c, 2 * c, 1, 1, 0)

    def forward(self, x):
        conv2 = self.conv2(self.conv1(x))
        conv4 = self.conv4(self.conv3(conv2))
        conv5 = F.relu(self.conv5(conv4) + self.redir2(conv2), inplace=True)
        return F.relu(self.conv6(conv5) + self.redir1(x), inplace=True)


class GwcNetLite(nn.Module):
    def __init__(self, maxdisp=192, num_groups=40, concat_channels=12, corr_branch=False, lean_corr=False):
        super().__init__()
        self.maxdisp = maxdisp
        self.num_groups = num_groups
        self.corr_branch = corr_branch
        self.lean_corr = lean_corr
        self.feature_extraction = FeatureExtraction(concat_channels=concat_channels)
        self.dres0 = nn.Sequential(convbn_3d(num_groups + 2 * concat_channels, 32, 3, 1, 1), nn.ReLU(inplace=True),
                                   convbn_3d(32, 32, 3, 1, 1), nn.ReLU(inplace=True))
        self.hourglasses = nn.ModuleList([Hourglass(32) for _ in range(2)])
        self.classifiers = nn.ModuleList([
            nn.Sequential(convbn_3d(32, 32, 3, 1, 1), nn.ReLU(inplace=True), nn.Conv3d(32, 1, 3, padding=1, bias=False))
            for _ in range(3)
        ])
        d4 = maxdisp // 4
        self.corr_head = nn.Sequential(convbn(d4, 64, 3, 1, 1, 1), nn.ReLU(inplace=True), nn.Conv2d(64, d4, 3, padding=1))

    def _regress(self, cost, H, W):
        cost = F.interpolate(cost, [self.maxdisp, H, W], mode="trilinear", align_corners=False)
        cost = torch.squeeze(cost, 1)
        disp_idx = torch.arange(self.maxdisp, device=cost.device)
        x_idx = torch.arange(W, device=cost.device)
        invalid = disp_idx[:, None] > x_idx[None, :]
        cost = cost.masked_fill(invalid[None, :, None, :], -1e9)  # expect: AMP007
        return disparity_regression(F.softmax(cost, dim=1), self.maxdisp)

    def _coarse(self, gwc_l, gwc_r, H, W):
        d4 = self.maxdisp // 4
        if self.lean_corr:
            corr = DisparityCorrelation.apply(gwc_l, gwc_r, d4)
        else:
            corr = build_corr_volume(gwc_l, gwc_r, d4)
        c = self.corr_head(corr)
        w4 = c.shape[-1]
        invalid = torch.arange(d4, device=c.device)[:, None] > torch.arange(w4, device=c.device)[None, :]
        c = c.masked_fill(invalid[None, :, None, :], torch.finfo(c.dtype).min)
        disp = disparity_regression(F.softmax(c, dim=1), d4)
        return F.interpolate(disp[:, None] * 4, size=(H, W), mode="bilinear", align_corners=False)[:, 0]

    def forward(self, left, right):
        H, W = left.shape[-2:]
        gwc_l, cat_l = self.feature_extraction(left)
        gwc_r, cat_r = self.feature_extraction(right)
        gwc_volume = build_gwc_volume(gwc_l, gwc_r, self.maxdisp // 4, self.num_groups)
        concat_volume = build_concat_volume(cat_l, cat_r, self.maxdisp // 4)
        cost0 = self.dres0(torch.cat((gwc_volume, concat_volume), 1))
        outs, x = [cost0], cost0
        for hg in self.hourglasses:
            x = hg(x)
            outs.append(x)
        preds = [self._regress(cls(o), H, W) for cls, o in zip(self.classifiers, outs)]
        if self.corr_branch:
            preds.insert(0, self._coarse(gwc_l, gwc_r, H, W))
        if self.training:
            return preds
        return preds[-1]


# --------------------------------------------------------------------------- training

def disp_smoothness(disp, img):
    """Edge-aware first-order smoothness on mean-normalised disparity (Monodepth)."""
    mean_disp = disp.mean(2, True).mean(3, True)
    norm_disp = disp / (mean_disp + 1e-7)
    grad_x = torch.abs(norm_disp[:, :, :, :-1] - norm_disp[:, :, :, 1:])
    grad_y = torch.abs(norm_disp[:, :, :-1, :] - norm_disp[:, :, 1:, :])
    grad_img_x = torch.mean(torch.abs(img[:, :, :, :-1] - img[:, :, :, 1:]), 1, keepdim=True)
    grad_img_y = torch.mean(torch.abs(img[:, :, :-1, :] - img[:, :, 1:, :]), 1, keepdim=True)
    return (grad_x * torch.exp(-grad_img_x)).mean() + (grad_y * torch.exp(-grad_img_y)).mean()


def model_loss(disp_ests, disp_gt, mask, weights):
    all_losses = [w * F.smooth_l1_loss(d[mask], disp_gt[mask], reduction="mean") for d, w in zip(disp_ests, weights)]
    return sum(all_losses)


def train_one_epoch(model, loader, optimizer, scaler, epoch, args):
    model.train()
    meter = AverageMeter()
    t0 = time.time()
    for it, sample in enumerate(loader):
        left = sample["left"].cuda(non_blocking=True)
        right = sample["right"].cuda(non_blocking=True)
        disp_gt = sample["disparity"].cuda(non_blocking=True)
        mask = (disp_gt < args.maxdisp) & (disp_gt > 0)
        if not mask.any():
            continue

        with autocast("cuda", dtype=torch.float16, enabled=args.amp):
            disp_ests = model(left, right)
            loss = model_loss(disp_ests, disp_gt, mask, args.loss_weights)
            if args.smooth_weight > 0:
                loss = loss + args.smooth_weight * disp_smoothness(disp_ests[-1][:, None], left)

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()

        meter.update(loss.item())
        if it % args.summary_freq == 0:
            logger.info("epoch %d iter %d/%d loss %.4f scale %.0f time %.2fs", epoch, it, len(loader),
                        meter.avg, scaler.get_scale(), time.time() - t0)
    return meter.avg


@torch.no_grad()
def evaluate(model, loader, args):
    model.eval()
    epe_sum, d1_sum, n = 0.0, 0.0, 0
    for sample in loader:
        left, right = sample["left"].cuda(non_blocking=True), sample["right"].cuda(non_blocking=True)
        disp_gt = sample["disparity"].cuda(non_blocking=True)
        mask = (disp_gt < args.maxdisp) & (disp_gt > 0)
        with autocast("cuda", dtype=torch.float16, enabled=args.amp):
            disp_est = model(left, right)
        disp_est = disp_est.float()
        err = (disp_est - disp_gt).abs()
        epe_sum += F.l1_loss(disp_est[mask], disp_gt[mask]).item()
        d1_sum += ((err > 3) & (err / disp_gt.abs().clamp(min=1e-6) > 0.05))[mask].float().mean().item()
        n += 1
    model.train()
    return epe_sum / max(n, 1), d1_sum / max(n, 1)


def main():
    p = argparse.ArgumentParser(description="GwcNet-lite")
    p.add_argument("--dataset", choices=("sceneflow", "kitti"), default="sceneflow")
    p.add_argument("--datapath", required=True)
    p.add_argument("--maxdisp", type=int, default=192)
    p.add_argument("--corr-branch", action="store_true")
    p.add_argument("--lean-corr", action="store_true")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--epochs", type=int, default=16)
    p.add_argument("--lrepochs", default="10,12,14:2")
    p.add_argument("--loss-weights", type=float, nargs="+", default=[0.5, 0.5, 0.7, 1.0])
    p.add_argument("--smooth-weight", type=float, default=0.0)
    p.add_argument("--clip", type=float, default=0.0)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--logdir", default="checkpoints/gwcnet")
    p.add_argument("--summary-freq", type=int, default=20)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    os.makedirs(args.logdir, exist_ok=True)

    dataset_cls = SceneFlowDataset if args.dataset == "sceneflow" else KITTI2015Dataset
    train_loader = DataLoader(dataset_cls(args.datapath, "train"), batch_size=args.batch_size, shuffle=True,
                              num_workers=8, drop_last=True, pin_memory=True)
    test_loader = DataLoader(dataset_cls(args.datapath, "test"), batch_size=1, shuffle=False, num_workers=4)

    model = GwcNetLite(args.maxdisp, corr_branch=args.corr_branch, lean_corr=args.lean_corr).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)  # expect: AMP009
    milestones, gamma = args.lrepochs.split(":")
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [int(e) for e in milestones.split(",")],
                                                     gamma=1.0 / float(gamma))

    best_epe, history = 1e9, {"epe": [], "d1": []}
    for epoch in range(args.epochs):
        train_loss = train_one_epoch(model, train_loader, optimizer, scaler, epoch, args)
        scheduler.step()
        epe, d1 = evaluate(model, test_loader, args)
        history["epe"].append(epe)
        history["d1"].append(d1)
        logger.info("epoch %d train %.4f EPE %.4f D1 %.4f", epoch, train_loss, epe, d1)
        ckpt = {"epoch": epoch, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict()}
        save_checkpoint(ckpt, os.path.join(args.logdir, f"checkpoint_{epoch:06d}.ckpt"))
        if epe < best_epe:
            best_epe = epe
            save_checkpoint(ckpt, os.path.join(args.logdir, "best.ckpt"))
    np.save(os.path.join(args.logdir, "history.npy"), history)


if __name__ == "__main__":
    main()
