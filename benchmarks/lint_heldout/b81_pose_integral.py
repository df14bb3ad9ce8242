"""Top-down 2D human pose: simple-baseline heatmaps + SimCC coordinate classification.

Heads on a shared ResNet trunk:
  * deconv heatmap head (MSE to Gaussian targets), decoded by soft-argmax (integral
    regression) for the RLE term and at test time,
  * SimCC head (1-D classification per axis, KL to smoothed labels),
  * sigma head for residual log-likelihood estimation (RLE, Laplace prior),
  * per-joint visibility head.
"""
import argparse
import copy
import logging
import math
import os
from collections import namedtuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from posekit.data import build_coco_loaders, build_adapt_loader, flip_back
from posekit.eval import keypoint_ap
from posekit.utils import load_config, save_checkpoint

logger = logging.getLogger("pose")
BN_MOMENTUM = 0.1

PoseOutput = namedtuple("PoseOutput", ["heatmaps", "simcc_x", "simcc_y", "sigma", "vis_logits"])


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes, momentum=BN_MOMENTUM)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes, momentum=BN_MOMENTUM)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4, momentum=BN_MOMENTUM)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


def make_backbone(layers=(3, 4, 6, 3)):
    stem = nn.Sequential(
        nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False),
        nn.BatchNorm2d(64, momentum=BN_MOMENTUM),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, stride=2, padding=1),
    )
    stages, inplanes = [stem], 64
    for i, (planes, n) in enumerate(zip((64, 128, 256, 512), layers)):
        stride = 1 if i == 0 else 2
        downsample = nn.Sequential(nn.Conv2d(inplanes, planes * 4, 1, stride=stride, bias=False),
                                   nn.BatchNorm2d(planes * 4, momentum=BN_MOMENTUM))
        blocks = [Bottleneck(inplanes, planes, stride, downsample)]
        inplanes = planes * 4
        blocks += [Bottleneck(inplanes, planes) for _ in range(1, n)]
        stages.append(nn.Sequential(*blocks))
    return nn.Sequential(*stages), inplanes


class DeconvHead(nn.Module):
    def __init__(self, in_ch, num_joints, num_deconv=3, deconv_ch=256):
        super().__init__()
        layers = []
        for _ in range(num_deconv):
            layers += [nn.ConvTranspose2d(in_ch, deconv_ch, 4, stride=2, padding=1, bias=False),
                       nn.BatchNorm2d(deconv_ch, momentum=BN_MOMENTUM), nn.ReLU(inplace=True)]
            in_ch = deconv_ch
        self.deconv = nn.Sequential(*layers)
        self.final = nn.Conv2d(deconv_ch, num_joints, 1)

    def forward(self, x):
        return self.final(self.deconv(x))


class SimCCHead(nn.Module):
    def __init__(self, in_ch, num_joints, feat_hw, input_size, split_ratio=2.0):
        super().__init__()
        self.conv = nn.Conv2d(in_ch, num_joints, 1)
        flat = feat_hw[0] * feat_hw[1]
        self.mlp_x = nn.Linear(flat, int(input_size[0] * split_ratio))
        self.mlp_y = nn.Linear(flat, int(input_size[1] * split_ratio))

    def forward(self, x):
        x = self.conv(x).flatten(2)
        return self.mlp_x(x), self.mlp_y(x)


class PoseNet(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.num_joints = cfg.num_joints
        self.backbone, c5 = make_backbone(cfg.layers)
        self.neck = nn.Conv2d(c5, cfg.neck_ch, 1)
        self.heatmap_head = DeconvHead(cfg.neck_ch, cfg.num_joints)
        self.simcc_head = SimCCHead(cfg.neck_ch, cfg.num_joints, cfg.feat_hw, cfg.input_size)
        self.sigma_fc = nn.Linear(cfg.neck_ch, cfg.num_joints * 2)
        self.vis_fc = nn.Linear(cfg.neck_ch, cfg.num_joints)

    def forward(self, images):
        feat = self.neck(self.backbone(images))
        pooled = feat.mean(dim=(2, 3))  # expect: AMP004
        heatmaps = self.heatmap_head(feat)
        sx, sy = self.simcc_head(feat)
        sigma = self.sigma_fc(pooled).view(-1, self.num_joints, 2).sigmoid()
        vis_logits = self.vis_fc(pooled)
        return PoseOutput(heatmaps, sx, sy, sigma, vis_logits)


def soft_argmax_2d(heatmaps, beta=100.0):
    """Integral regression: expected (x, y) in heatmap pixels under softmax(beta * h)."""
    n, k, h, w = heatmaps.shape
    probs = F.softmax(heatmaps.reshape(n, k, -1) * beta, dim=-1).view(n, k, h, w)
    xs = torch.arange(w, device=heatmaps.device, dtype=probs.dtype)
    ys = torch.arange(h, device=heatmaps.device, dtype=probs.dtype)
    x = (probs.sum(dim=2) * xs).sum(dim=-1)
    y = (probs.sum(dim=3) * ys).sum(dim=-1)
    return torch.stack([x, y], dim=-1)


# --------------------------------------------------------------------------- losses

class JointsMSELoss(nn.Module):
    def __init__(self, use_target_weight=True):
        super().__init__()
        self.criterion = nn.MSELoss(reduction="mean")
        self.use_target_weight = use_target_weight

    def forward(self, output, target, target_weight):
        n, k = output.shape[:2]
        pred = output.reshape(n, k, -1)
        gt = target.reshape(n, k, -1)
        if self.use_target_weight:
            w = target_weight.reshape(n, k, 1)
            return 0.5 * self.criterion(pred * w, gt * w)
        return 0.5 * self.criterion(pred, gt)


class RLELoss(nn.Module):
    """Residual log-likelihood with a Laplace prior; coordinates normalised to [-0.5, 0.5]."""

    def __init__(self, size_average=True):
        super().__init__()
        self.size_average = size_average

    def forward(self, pred, sigma, target, target_weight):
        log_sigma = torch.log(sigma)
        residual = torch.abs(target - pred) / (math.sqrt(2) * sigma + 1e-9)  # expect: AMP011
        loss = (log_sigma + residual + math.log(2.0)) * target_weight
        return loss.sum() / len(loss) if self.size_average else loss.sum()


class KLDiscretLoss(nn.Module):
    """KL between SimCC predictions and Gaussian-smoothed 1-D labels (RTMPose)."""

    def __init__(self, beta=10.0, label_softmax=True):
        super().__init__()
        self.beta = beta
        self.label_softmax = label_softmax
        self.log_softmax = nn.LogSoftmax(dim=1)
        self.kl = nn.KLDivLoss(reduction="none")

    def criterion(self, dec_outs, labels):
        log_pt = self.log_softmax(dec_outs * self.beta)
        if self.label_softmax:
            labels = F.softmax(labels * self.beta, dim=1)
        return torch.mean(self.kl(log_pt, labels), dim=1)

    def forward(self, pred_x, pred_y, gt_x, gt_y, target_weight):
        num_joints = pred_x.size(1)
        weight = target_weight.reshape(-1)
        loss = 0.0
        for pred, gt in ((pred_x, gt_x), (pred_y, gt_y)):
            pred = pred.reshape(-1, pred.size(-1))
            gt = gt.reshape(-1, gt.size(-1))
            loss = loss + self.criterion(pred, gt).mul(weight).sum()
        return loss / num_joints


class PoseCriterion(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.heatmap = JointsMSELoss(use_target_weight=True)
        self.rle = RLELoss()
        self.hm_size = cfg.heatmap_size

    def forward(self, out, targets):
        tw = targets["target_weight"]
        losses = {"heatmap": self.heatmap(out.heatmaps, targets["heatmaps"], tw)}
        coords = soft_argmax_2d(out.heatmaps) / coords_scale(self.hm_size, out.heatmaps.device) - 0.5
        losses["rle"] = self.rle(coords, out.sigma, targets["joints_norm"], tw)
        vis_prob = torch.sigmoid(out.vis_logits)
        losses["vis"] = F.binary_cross_entropy(vis_prob, targets["visible"])  # expect: AMP003
        return losses


def coords_scale(hm_size, device):
    return torch.tensor([hm_size[0], hm_size[1]], dtype=torch.float32, device=device)


# --------------------------------------------------------------------------- loops

def train_one_epoch(cfg, model, loader, criterion, simcc_criterion, optimizer, scaler, epoch):
    model.train()
    for i, (images, targets, meta) in enumerate(loader):
        images = images.cuda(non_blocking=True)
        targets = {k: v.cuda(non_blocking=True) for k, v in targets.items()}
        with torch.amp.autocast(device_type="cuda", dtype=torch.float16, enabled=cfg.amp):
            out = model(images)
            losses = criterion(out, targets)
        losses["simcc"] = simcc_criterion(out.simcc_x, out.simcc_y, targets["simcc_x"], targets["simcc_y"], targets["target_weight"])  # expect: AMP002
        loss = sum(cfg.loss_weights[k] * v for k, v in losses.items())

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
        scaler.step(optimizer)
        scaler.update()
        if i % cfg.print_freq == 0:
            logger.info("epoch %d [%d/%d] loss %.5f %s gnorm %.2f", epoch, i, len(loader), loss.item(),
                        {k: round(v.item(), 5) for k, v in losses.items()}, float(grad_norm))


def finetune_heads(cfg, model, loader, criterion, epochs=5):
    """Adapt the prediction heads to a new keypoint layout with the trunk frozen."""
    model.backbone.requires_grad_(False)
    params = [p for n, p in model.named_parameters() if not n.startswith("backbone.")]
    optimizer = torch.optim.AdamW(params, lr=cfg.head_lr, weight_decay=1e-4)
    model.train()
    for epoch in range(epochs):
        for images, targets, _ in loader:
            images = images.cuda(non_blocking=True)
            targets = {k: v.cuda(non_blocking=True) for k, v in targets.items()}
            with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
                out = model(images)
                losses = criterion(out, targets)
                loss = sum(cfg.loss_weights[k] * v for k, v in losses.items() if k != "simcc")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        logger.info("head adaptation epoch %d loss %.5f", epoch, loss.item())


@torch.no_grad()
def evaluate(cfg, model, loader, flip_pairs):
    model.eval()
    preds, metas = [], []
    for images, _, meta in loader:
        images = images.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(images)
            out_flip = model(images.flip(3))
        hm = 0.5 * (out.heatmaps.float() + flip_back(out_flip.heatmaps.float(), flip_pairs))
        coords = soft_argmax_2d(hm)
        conf = hm.flatten(2).amax(dim=-1) * torch.sigmoid(out.vis_logits.float())
        preds.append(torch.cat([coords, conf[..., None]], dim=-1).cpu())
        metas.extend(meta)
    model.train()
    return keypoint_ap(torch.cat(preds), metas, cfg)


def export_onnx(model, path, input_size):
    serving = copy.deepcopy(model).eval().half().cuda()
    dummy = torch.randn(1, 3, input_size[1], input_size[0], device="cuda", dtype=torch.float16)
    torch.onnx.export(serving, dummy, path, opset_version=17, input_names=["image"],
                      output_names=list(PoseOutput._fields))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cfg", required=True)
    parser.add_argument("--out", default="work_dirs/pose_simcc")
    parser.add_argument("--export", action="store_true")
    args = parser.parse_args()
    cfg = load_config(args.cfg)
    logging.basicConfig(level=logging.INFO)
    os.makedirs(args.out, exist_ok=True)

    model = PoseNet(cfg).cuda()
    criterion = PoseCriterion(cfg).cuda()
    simcc_criterion = KLDiscretLoss(beta=cfg.simcc_beta, label_softmax=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=cfg.lr_steps, gamma=0.1)
    scaler = torch.amp.GradScaler("cuda", enabled=cfg.amp)
    train_loader, val_loader, flip_pairs = build_coco_loaders(cfg)

    best_ap = -1.0
    for epoch in range(cfg.epochs):
        train_one_epoch(cfg, model, train_loader, criterion, simcc_criterion, optimizer, scaler, epoch)
        scheduler.step()
        if (epoch + 1) % cfg.val_interval == 0:
            ap = evaluate(cfg, model, val_loader, flip_pairs)
            logger.info("epoch %d AP %.4f", epoch, ap)
            if ap > best_ap:
                best_ap = ap
                save_checkpoint({"state_dict": model.state_dict(), "epoch": epoch, "ap": ap},
                                os.path.join(args.out, "best.pth"))

    if cfg.get("adapt_layout"):
        finetune_heads(cfg, model, build_adapt_loader(cfg), criterion, epochs=cfg.adapt_epochs)
    if args.export:
        export_onnx(model, os.path.join(args.out, "pose_fp16.onnx"), cfg.input_size)


if __name__ == "__main__":
    main()
