"""GwcNet-style stereo matching: group-wise correlation + variance cost volumes.

Model, loss and the SceneFlow training entry point live in one file so that a
run can be reproduced from the config alone:

    python train_stereo.py --model gwcnet-gv --datapath /data/sceneflow --amp
"""
from __future__ import annotations

import argparse
import logging
import os
import time
from typing import List, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from datasets.sceneflow import SceneFlowDataset
from utils.experiment import AverageMeterDict, adjust_learning_rate, tensor2float
from utils.metrics import D1_metric, EPE_metric, Thres_metric

logger = logging.getLogger("stereo")


# --------------------------------------------------------------------------- #
# building blocks
# --------------------------------------------------------------------------- #
def convbn(in_planes, out_planes, kernel_size, stride, pad, dilation):
    return nn.Sequential(
        nn.Conv2d(in_planes, out_planes, kernel_size=kernel_size, stride=stride,
                  padding=dilation if dilation > 1 else pad, dilation=dilation, bias=False),
        nn.BatchNorm2d(out_planes))


def convbn_3d(in_planes, out_planes, kernel_size, stride, pad):
    return nn.Sequential(
        nn.Conv3d(in_planes, out_planes, kernel_size=kernel_size, padding=pad, stride=stride, bias=False),
        nn.BatchNorm3d(out_planes))


class BasicBlock(nn.Module):
    expansion = 1

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


class Features(NamedTuple):
    gwc: torch.Tensor
    concat: torch.Tensor


class FeatureExtraction(nn.Module):
    def __init__(self, gwc_channels=320, concat_channels=12):
        super().__init__()
        self.inplanes = 32
        self.firstconv = nn.Sequential(convbn(3, 32, 3, 2, 1, 1), nn.ReLU(inplace=True),
                                       convbn(32, 32, 3, 1, 1, 1), nn.ReLU(inplace=True),
                                       convbn(32, 32, 3, 1, 1, 1), nn.ReLU(inplace=True))
        self.layer1 = self._make_layer(BasicBlock, 32, 3, 1, 1, 1)
        self.layer2 = self._make_layer(BasicBlock, 64, 16, 2, 1, 1)
        self.layer3 = self._make_layer(BasicBlock, 128, 3, 1, 1, 1)
        self.layer4 = self._make_layer(BasicBlock, 128, 3, 1, 1, 2)
        # 1x1 fusion of the three pyramid levels before the correlation
        self.fuse = nn.Conv2d(320, gwc_channels, kernel_size=1, bias=False)
        self.lastconv = nn.Sequential(convbn(320, 128, 3, 1, 1, 1), nn.ReLU(inplace=True),
                                      nn.Conv2d(128, concat_channels, kernel_size=1, padding=0, bias=False))

    def _make_layer(self, block, planes, blocks, stride, pad, dilation):
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * block.expansion, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(planes * block.expansion))
        layers = [block(self.inplanes, planes, stride, downsample, pad, dilation)]
        self.inplanes = planes * block.expansion
        for _ in range(1, blocks):
            layers.append(block(self.inplanes, planes, 1, None, pad, dilation))
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.firstconv(x)
        x = self.layer1(x)
        l2 = self.layer2(x)
        l3 = self.layer3(l2)
        l4 = self.layer4(l3)
        stacked = torch.cat((l2, l3, l4), dim=1)
        return Features(gwc=self.fuse(stacked), concat=self.lastconv(stacked))


# --------------------------------------------------------------------------- #
# cost volumes
# --------------------------------------------------------------------------- #
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
            volume[:, :, i, :, i:] = groupwise_correlation(refimg_fea[:, :, :, i:], targetimg_fea[:, :, :, :-i],
                                                           num_groups)
        else:
            volume[:, :, i, :, :] = groupwise_correlation(refimg_fea, targetimg_fea, num_groups)
    return volume.contiguous()


def build_var_volume(refimg_fea, targetimg_fea, maxdisp):
    """Two-view variance volume (MVSNet style) on the compact concat features."""
    B, C, H, W = refimg_fea.shape
    volume = refimg_fea.new_zeros([B, C, maxdisp, H, W])
    for i in range(maxdisp):
        if i > 0:
            pair = torch.stack([refimg_fea[:, :, :, i:], targetimg_fea[:, :, :, :-i]], dim=0)
        else:
            pair = torch.stack([refimg_fea, targetimg_fea], dim=0)
        volume[:, :, i, :, W - pair.shape[-1]:] = pair.var(dim=0, unbiased=False)  # expect: AMP004
    return volume.contiguous()


def norm_correlation(fea1, fea2):
    # CFNet-style normalised correlation, one channel per disparity
    cost = torch.mean((fea1 / (torch.norm(fea1, 2, 1, True) + 1e-05)) * (fea2 / (torch.norm(fea2, 2, 1, True) + 1e-05)),
                      dim=1, keepdim=True)
    return cost


def build_norm_volume(refimg_fea, targetimg_fea, maxdisp):
    B, C, H, W = refimg_fea.shape
    volume = refimg_fea.new_zeros([B, 1, maxdisp, H, W])
    for i in range(maxdisp):
        if i > 0:
            volume[:, :, i, :, i:] = norm_correlation(refimg_fea[:, :, :, i:], targetimg_fea[:, :, :, :-i])
        else:
            volume[:, :, i, :, :] = norm_correlation(refimg_fea, targetimg_fea)
    return volume.contiguous()


def disparity_regression(x, maxdisp):
    assert len(x.shape) == 4
    disp_values = torch.arange(0, maxdisp, dtype=x.dtype, device=x.device)
    disp_values = disp_values.view(1, maxdisp, 1, 1)
    return torch.sum(x * disp_values, 1, keepdim=False)


# --------------------------------------------------------------------------- #
# aggregation
# --------------------------------------------------------------------------- #
class Hourglass(nn.Module):
    def __init__(self, in_channels):
        super().__init__()
        self.conv1 = nn.Sequential(convbn_3d(in_channels, in_channels * 2, 3, 2, 1), nn.ReLU(inplace=True))
        self.conv2 = nn.Sequential(convbn_3d(in_channels * 2, in_channels * 2, 3, 1, 1), nn.ReLU(inplace=True))
        self.conv3 = nn.Sequential(convbn_3d(in_channels * 2, in_channels * 4, 3, 2, 1), nn.ReLU(inplace=True))
        self.conv4 = nn.Sequential(convbn_3d(in_channels * 4, in_channels * 4, 3, 1, 1), nn.ReLU(inplace=True))
        self.conv5 = nn.Sequential(
            nn.ConvTranspose3d(in_channels * 4, in_channels * 2, 3, padding=1, output_padding=1, stride=2, bias=False),
            nn.BatchNorm3d(in_channels * 2))
        self.conv6 = nn.Sequential(
            nn.ConvTranspose3d(in_channels * 2, in_channels, 3, padding=1, output_padding=1, stride=2, bias=False),
            nn.BatchNorm3d(in_channels))

    def forward(self, x):
        conv2 = self.conv2(self.conv1(x))
        conv4 = self.conv4(self.conv3(conv2))
        conv5 = F.relu(self.conv5(conv4) + conv2, inplace=True)
        return F.relu(self.conv6(conv5) + x, inplace=True)


def classifier(channels):
    return nn.Sequential(convbn_3d(channels, channels, 3, 1, 1), nn.ReLU(inplace=True),
                         nn.Conv3d(channels, 1, kernel_size=3, padding=1, stride=1, bias=False))


class StereoOutput(NamedTuple):
    disp_ests: List[torch.Tensor]
    confidence: torch.Tensor


class GwcNet(nn.Module):
    def __init__(self, maxdisp, volume="gwc", num_groups=40, concat_channels=12):
        super().__init__()
        self.maxdisp = maxdisp
        self.num_groups = num_groups
        self.use_var = "var" in volume
        self.use_norm = "norm" in volume
        self.feature_extraction = FeatureExtraction(gwc_channels=320, concat_channels=concat_channels)
        in_ch = num_groups + (concat_channels if self.use_var else 0) + (1 if self.use_norm else 0)
        self.dres0 = nn.Sequential(convbn_3d(in_ch, 32, 3, 1, 1), nn.ReLU(inplace=True),
                                   convbn_3d(32, 32, 3, 1, 1), nn.ReLU(inplace=True))
        self.dres1 = nn.Sequential(convbn_3d(32, 32, 3, 1, 1), nn.ReLU(inplace=True), convbn_3d(32, 32, 3, 1, 1))
        self.hourglasses = nn.ModuleList([Hourglass(32) for _ in range(3)])
        self.classifiers = nn.ModuleList([classifier(32) for _ in range(4)])

    def _regress(self, cost, H, W):
        cost = F.interpolate(cost, [self.maxdisp, H, W], mode="trilinear", align_corners=False)
        prob = F.softmax(torch.squeeze(cost, 1), dim=1)
        return prob, disparity_regression(prob, self.maxdisp)

    def forward(self, left, right):
        H, W = left.shape[-2:]
        feat_l = self.feature_extraction(left)
        feat_r = self.feature_extraction(right)
        volume = build_gwc_volume(feat_l.gwc, feat_r.gwc, self.maxdisp // 4, self.num_groups)
        if self.use_var:
            var_volume = build_var_volume(feat_l.concat, feat_r.concat, self.maxdisp // 4)
            volume = torch.cat((volume, var_volume), dim=1)
        if self.use_norm:
            norm_volume = build_norm_volume(feat_l.gwc, feat_r.gwc, self.maxdisp // 4)
            volume = torch.cat((volume, norm_volume), dim=1)

        cost0 = self.dres0(volume)
        cost0 = self.dres1(cost0) + cost0
        costs = [cost0]
        out = cost0
        for hg in self.hourglasses:
            out = hg(out)
            costs.append(out)

        disp_ests = []
        prob = None
        heads = self.classifiers if self.training else self.classifiers[-1:]
        stages = costs if self.training else costs[-1:]
        for head, cost in zip(heads, stages):
            prob, disp = self._regress(head(cost), H, W)
            disp_ests.append(disp)
        # per-pixel entropy of the final distribution, used for the confidence maps
        entropy = -(prob * torch.log(prob + 1e-8)).sum(dim=1)
        return StereoOutput(disp_ests=disp_ests, confidence=torch.exp(-entropy))


MODELS = {
    "gwcnet-g": lambda args: GwcNet(args.maxdisp, volume="gwc"),
    "gwcnet-gv": lambda args: GwcNet(args.maxdisp, volume="gwc+var"),
    "gwcnet-gn": lambda args: GwcNet(args.maxdisp, volume="gwc+norm"),
}


def model_loss(disp_ests, disp_gt, mask):
    weights = [0.5, 0.5, 0.7, 1.0]
    all_losses = []
    for disp_est, weight in zip(disp_ests, weights):
        all_losses.append(weight * F.smooth_l1_loss(disp_est[mask], disp_gt[mask], reduction="mean"))
    return sum(all_losses)


# --------------------------------------------------------------------------- #
# training
# --------------------------------------------------------------------------- #
def train_sample(model, optimizer, scaler, sample, args):
    model.train()
    imgL, imgR = sample["left"].cuda(non_blocking=True), sample["right"].cuda(non_blocking=True)
    disp_gt = sample["disparity"].cuda(non_blocking=True)
    optimizer.zero_grad(set_to_none=True)

    with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
        out = model(imgL, imgR)
        mask = (disp_gt < args.maxdisp) & (disp_gt > 0)
        loss = model_loss(out.disp_ests, disp_gt, mask)

    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
    scaler.step(optimizer)
    scaler.update()

    scalar_outputs = {"loss": loss.detach(), "grad_norm": grad_norm}
    with torch.no_grad():
        est = out.disp_ests[-1].float()
        scalar_outputs["EPE"] = EPE_metric(est, disp_gt, mask)
        scalar_outputs["D1"] = D1_metric(est, disp_gt, mask)
    return tensor2float(scalar_outputs)


@torch.no_grad()
def test_sample(model, sample, args):
    model.eval()
    imgL, imgR = sample["left"].cuda(), sample["right"].cuda()
    disp_gt = sample["disparity"].cuda()
    out = model(imgL, imgR)
    mask = (disp_gt < args.maxdisp) & (disp_gt > 0)
    est = out.disp_ests[-1]
    return tensor2float({
        "EPE": EPE_metric(est, disp_gt, mask),
        "D1": D1_metric(est, disp_gt, mask),
        "Thres3": Thres_metric(est, disp_gt, mask, 3.0),
        "conf_mean": out.confidence.mean(),
    })


def save_checkpoint(path, model, optimizer, scaler, epoch):
    torch.save({"epoch": epoch, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict()}, path)


def main():
    parser = argparse.ArgumentParser(description="Group-wise correlation stereo network")
    parser.add_argument("--model", default="gwcnet-g", choices=sorted(MODELS))
    parser.add_argument("--maxdisp", type=int, default=192)
    parser.add_argument("--datapath", required=True)
    parser.add_argument("--trainlist", default="./filenames/sceneflow_train.txt")
    parser.add_argument("--testlist", default="./filenames/sceneflow_test.txt")
    parser.add_argument("--lr", type=float, default=0.001)
    parser.add_argument("--lrepochs", default="10,12,14,16:2")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=16)
    parser.add_argument("--clip_grad", type=float, default=10.0)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--logdir", default="./checkpoints/gwc")
    parser.add_argument("--resume", default="")
    args = parser.parse_args()

    os.makedirs(args.logdir, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    train_set = SceneFlowDataset(args.datapath, args.trainlist, training=True)
    test_set = SceneFlowDataset(args.datapath, args.testlist, training=False)
    train_loader = DataLoader(train_set, args.batch_size, shuffle=True, num_workers=8, drop_last=True)
    test_loader = DataLoader(test_set, 1, shuffle=False, num_workers=4)

    model = MODELS[args.model](args).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)  # expect: AMP009

    start_epoch = 0
    if args.resume:
        state = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        start_epoch = state["epoch"] + 1

    best_epe = 1e9
    for epoch in range(start_epoch, args.epochs):
        adjust_learning_rate(optimizer, epoch, args.lr, args.lrepochs)
        tic = time.time()
        for batch_idx, sample in enumerate(train_loader):
            scalars = train_sample(model, optimizer, scaler, sample, args)
            if batch_idx % 50 == 0:
                logger.info("epoch %d iter %d/%d loss %.3f EPE %.3f (%.2fs)", epoch, batch_idx,
                            len(train_loader), scalars["loss"], scalars["EPE"], time.time() - tic)
        meters = AverageMeterDict()
        for sample in test_loader:
            meters.update(test_sample(model, sample, args))
        results = meters.mean()
        logger.info("epoch %d test %s", epoch, results)
        save_checkpoint(os.path.join(args.logdir, f"checkpoint_{epoch:06d}.ckpt"), model, optimizer, scaler, epoch)
        if results["EPE"] < best_epe:
            best_epe = results["EPE"]
            save_checkpoint(os.path.join(args.logdir, "best.ckpt"), model, optimizer, scaler, epoch)


if __name__ == "__main__":
    main()
