"""Lightweight HRNet for top-down 2D human pose estimation (COCO, 17 joints).

Stage 1 trains the whole network on heatmaps, joint visibility and the
offsets of the joint-relation module.  Stage 2 fine-tunes the heads at a
higher input resolution with the stem frozen.
"""
import argparse
import math
import os
from typing import List

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

BN_MOMENTUM = 0.1
NUM_JOINTS = 17
FLIP_PAIRS = [(1, 2), (3, 4), (5, 6), (7, 8), (9, 10), (11, 12), (13, 14), (15, 16)]
SKELETON = [(15, 13), (13, 11), (16, 14), (14, 12), (11, 12), (5, 11), (6, 12), (5, 6), (5, 7),
            (6, 8), (7, 9), (8, 10), (1, 2), (0, 1), (0, 2), (1, 3), (2, 4), (3, 5), (4, 6)]


def conv_bn_relu(in_ch, out_ch, stride=1):
    return nn.Sequential(
        nn.Conv2d(in_ch, out_ch, 3, stride, 1, bias=False),
        nn.BatchNorm2d(out_ch, momentum=BN_MOMENTUM),
        nn.ReLU(inplace=True),
    )


def mean_std_pool(x):
    """Statistics pooling: per-channel spatial mean and standard deviation."""
    mu = x.mean(dim=(2, 3))  # expect: AMP004
    sigma = x.std(dim=(2, 3))  # expect: AMP004
    return mu, sigma


def skeleton_adjacency(num_joints, hops=2):
    adj = torch.eye(num_joints, dtype=torch.bool)
    for a, b in SKELETON:
        adj[a, b] = adj[b, a] = True
    reach = adj.clone()
    for _ in range(hops - 1):
        reach = reach | ((reach.float() @ adj.float()) > 0)
    return reach


class BasicBlock(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.conv1 = nn.Conv2d(ch, ch, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(ch, momentum=BN_MOMENTUM)
        self.conv2 = nn.Conv2d(ch, ch, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(ch, momentum=BN_MOMENTUM)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)), inplace=True)
        out = self.bn2(self.conv2(out))
        return F.relu(out + x, inplace=True)


class HighResolutionModule(nn.Module):
    def __init__(self, channels: List[int], num_blocks: int = 2):
        super().__init__()
        self.num_branches = len(channels)
        for i, ch in enumerate(channels):
            self.add_module(f"branch{i}", nn.Sequential(*[BasicBlock(ch) for _ in range(num_blocks)]))
        self.fuse_layers = nn.ModuleList()
        for i in range(self.num_branches):
            row = nn.ModuleList()
            for j in range(self.num_branches):
                if j > i:
                    row.append(nn.Sequential(
                        nn.Conv2d(channels[j], channels[i], 1, bias=False),
                        nn.BatchNorm2d(channels[i], momentum=BN_MOMENTUM),
                        nn.Upsample(scale_factor=2 ** (j - i), mode="nearest"),
                    ))
                elif j == i:
                    row.append(nn.Identity())
                else:
                    downs = []
                    for k in range(i - j):
                        last = k == i - j - 1
                        out_ch = channels[i] if last else channels[j]
                        downs += [nn.Conv2d(channels[j], out_ch, 3, 2, 1, bias=False), nn.BatchNorm2d(out_ch, momentum=BN_MOMENTUM)]
                        if not last:
                            downs.append(nn.ReLU(inplace=True))
                    row.append(nn.Sequential(*downs))
            self.fuse_layers.append(row)

    def forward(self, xs):
        xs = [getattr(self, f"branch{i}")(x) for i, x in enumerate(xs)]
        out = []
        for i, row in enumerate(self.fuse_layers):
            y = xs[i]
            for j in range(self.num_branches):
                if j != i:
                    y = y + row[j](xs[j])
            out.append(F.relu(y))
        return out


class HeatmapHead(nn.Module):
    def __init__(self, in_ch, num_joints):
        super().__init__()
        self.refine = conv_bn_relu(in_ch, in_ch)
        self.final = nn.Conv2d(in_ch, num_joints, 1)

    def forward(self, x):
        return self.final(self.refine(x))


class VisibilityHead(nn.Module):
    def __init__(self, in_ch, num_joints):
        super().__init__()
        self.conv = nn.Conv2d(in_ch, 64, 3, padding=1)
        self.fc = nn.Linear(128, num_joints)

    def forward(self, x):
        h = F.relu(self.conv(x))
        mu, sigma = mean_std_pool(h)
        return self.fc(torch.cat([mu, sigma], dim=1))


class JointRelationModule(nn.Module):
    """Self-attention over per-joint tokens pooled from the heatmaps; predicts sub-pixel offsets."""

    def __init__(self, in_ch, num_joints, dim=128, num_heads=4):
        super().__init__()
        self.num_heads, self.dim = num_heads, dim
        self.token_proj = nn.Linear(in_ch, dim)
        self.joint_embed = nn.Parameter(torch.zeros(1, num_joints, dim))
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.offset = nn.Linear(dim, 2)
        self.register_buffer("adjacency", skeleton_adjacency(num_joints), persistent=False)

    def forward(self, feat, heat, joint_valid):
        peak = F.relu(heat).flatten(2).amax(dim=-1)[..., None, None]
        weights = F.relu(heat) / (peak + 1e-12)  # expect: AMP011
        tokens = torch.einsum("bjhw,bchw->bjc", weights, feat)
        tokens = tokens / weights.flatten(2).sum(-1, keepdim=True).clamp(min=1.0)
        x = self.token_proj(tokens) + self.joint_embed
        B, J, _ = x.shape
        q, k, v = self.qkv(x).view(B, J, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
        scores = scores.masked_fill(~self.adjacency, torch.finfo(scores.dtype).min)
        scores = scores.masked_fill(~joint_valid[:, None, None, :], -1e9)  # expect: AMP007
        ctx = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(B, J, self.dim)
        ctx = self.out(ctx)
        g = ctx.mean(dim=1, keepdim=True)  # expect: AMP004
        return self.offset(ctx + g)


class PoseHRNet(nn.Module):
    def __init__(self, channels=(32, 64, 128), num_joints=NUM_JOINTS, num_modules=3):
        super().__init__()
        self.stem = nn.Sequential(conv_bn_relu(3, 64, 2), conv_bn_relu(64, 64, 2))
        self.transitions = nn.ModuleList(
            [conv_bn_relu(64, channels[0])] + [conv_bn_relu(channels[i - 1], channels[i], 2) for i in range(1, len(channels))]
        )
        self.stages = nn.ModuleList([HighResolutionModule(list(channels)) for _ in range(num_modules)])
        self.final_layer = HeatmapHead(channels[0], num_joints)
        self.aux_heads = nn.ModuleDict({"visibility": VisibilityHead(channels[0], num_joints)})
        self.relation = JointRelationModule(channels[0], num_joints)

    def forward(self, images, joint_valid=None):
        x = self.stem(images)
        xs = [self.transitions[0](x)]
        for t in self.transitions[1:]:
            xs.append(t(xs[-1]))
        for stage in self.stages:
            xs = stage(xs)
        feat = xs[0]
        heat = self.final_layer(feat)
        if joint_valid is None:
            joint_valid = torch.ones(heat.shape[:2], dtype=torch.bool, device=heat.device)
        out = {"heatmap": heat, "offsets": self.relation(feat, heat, joint_valid)}
        out.update({name: head(feat) for name, head in self.aux_heads.items()})
        return out


class JointsMSELoss(nn.Module):
    def __init__(self, use_target_weight=True):
        super().__init__()
        self.criterion, self.use_target_weight = nn.MSELoss(reduction="mean"), use_target_weight

    def forward(self, output, target, target_weight):
        batch_size, num_joints = output.size(0), output.size(1)
        heatmaps_pred = output.reshape(batch_size, num_joints, -1).split(1, 1)
        heatmaps_gt = target.reshape(batch_size, num_joints, -1).split(1, 1)
        loss = 0.0
        for idx in range(num_joints):
            pred, gt = heatmaps_pred[idx].squeeze(1), heatmaps_gt[idx].squeeze(1)
            if self.use_target_weight:
                w = target_weight[:, idx]
                loss += 0.5 * self.criterion(pred.mul(w), gt.mul(w))
            else:
                loss += 0.5 * self.criterion(pred, gt)
        return loss / num_joints


class JointsOHKMMSELoss(nn.Module):
    """Online hard keypoint mining: average of the top-k joint losses per sample."""

    def __init__(self, use_target_weight=True, topk=8):
        super().__init__()
        self.criterion = nn.MSELoss(reduction="none")
        self.use_target_weight, self.topk = use_target_weight, topk

    def forward(self, output, target, target_weight):
        B, J = output.size(0), output.size(1)
        pred, gt = output.reshape(B, J, -1), target.reshape(B, J, -1)
        if self.use_target_weight:
            pred, gt = pred * target_weight, gt * target_weight
        per_joint = 0.5 * self.criterion(pred, gt).mean(dim=2)
        topk_loss, _ = per_joint.topk(self.topk, dim=1, sorted=False)
        return topk_loss.sum(dim=1).div(self.topk).mean()


class PoseLoss(nn.Module):
    def __init__(self, vis_weight=0.1, offset_weight=0.05, use_ohkm=False):
        super().__init__()
        self.heatmap_loss = JointsOHKMMSELoss() if use_ohkm else JointsMSELoss()
        self.vis_criterion = nn.BCELoss()
        self.vis_weight, self.offset_weight = vis_weight, offset_weight

    def forward(self, outputs, target, target_weight, vis_target, offset_target):
        loss_hm = self.heatmap_loss(outputs["heatmap"], target, target_weight)
        vis_prob = torch.sigmoid(outputs["visibility"])
        loss_vis = self.vis_criterion(vis_prob, vis_target)  # expect: AMP003
        loss_off = F.smooth_l1_loss(outputs["offsets"].float(), offset_target, reduction="none")
        loss_off = (loss_off.sum(-1) * target_weight.squeeze(-1)).mean()
        return loss_hm + self.vis_weight * loss_vis + self.offset_weight * loss_off


def get_max_preds(batch_heatmaps):
    batch_size, num_joints, _, width = batch_heatmaps.shape
    flat = batch_heatmaps.reshape((batch_size, num_joints, -1))
    idx = np.argmax(flat, 2).reshape((batch_size, num_joints, 1))
    maxvals = np.amax(flat, 2).reshape((batch_size, num_joints, 1))
    preds = np.tile(idx, (1, 1, 2)).astype(np.float32)
    preds[:, :, 0] = preds[:, :, 0] % width
    preds[:, :, 1] = np.floor(preds[:, :, 1] / width)
    return preds * np.tile(np.greater(maxvals, 0.0), (1, 1, 2)).astype(np.float32), maxvals


def flip_back(output_flipped, matched_parts):
    output_flipped = output_flipped.flip(3)
    for a, b in matched_parts:
        output_flipped[:, [a, b]] = output_flipped[:, [b, a]]
    return output_flipped


def build_loaders(root, batch_size=32, workers=8):
    """Loaders over person crops pre-processed into ``{split}.pt`` tensor shards."""

    def loader(split, shuffle):
        ds = torch.utils.data.StackDataset(**torch.load(os.path.join(root, f"{split}.pt")))
        return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=shuffle, num_workers=workers, pin_memory=True, drop_last=shuffle)

    return loader("train", True), loader("val", False), loader("train_384x288", True)


def _unpack(batch, device):
    return [batch[k].to(device, non_blocking=True) for k in ("image", "target", "target_weight", "visible", "offset", "joint_valid")]


def train_one_epoch(model, loader, criterion, optimizer, scaler, epoch, device, print_freq=50):
    model.train()
    for i, batch in enumerate(loader):
        images, target, target_weight, vis_target, offset_target, joint_valid = _unpack(batch, device)
        with torch.autocast("cuda", dtype=torch.float16):
            outputs = model(images, joint_valid)
            loss = criterion(outputs, target, target_weight, vis_target, offset_target)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        scaler.step(optimizer)
        scaler.update()
        if i % print_freq == 0:
            print(f"epoch {epoch} [{i}/{len(loader)}] loss {loss.item():.5f} scale {scaler.get_scale():.0f}")


def train_refine_epoch(model, loader, joints_loss, optimizer, device):
    """Stage 2: heads only, 384x288 crops."""
    model.train()
    model.stem.eval()
    for batch in loader:
        images, target, target_weight, _, _, joint_valid = _unpack(batch, device)
        with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
            outputs = model(images, joint_valid)
        loss = joints_loss(outputs["heatmap"], target, target_weight)  # expect: AMP002
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    all_preds = []
    for batch in loader:
        images = batch["image"].to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            heat = model(images)["heatmap"]
            heat_flip = model(images.flip(3))["heatmap"]
        heat = (heat.float() + flip_back(heat_flip.float(), FLIP_PAIRS)) * 0.5
        preds, maxvals = get_max_preds(heat.cpu().numpy())
        all_preds.append(np.concatenate([preds, maxvals], axis=2))
    model.train()
    return np.concatenate(all_preds, axis=0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--coco", required=True)
    parser.add_argument("--epochs", type=int, default=140)
    parser.add_argument("--refine-epochs", type=int, default=20)
    parser.add_argument("--ohkm", action="store_true")
    parser.add_argument("--out", default="output/hrnet_lite")
    args = parser.parse_args()
    device = torch.device("cuda")

    train_loader, val_loader, refine_loader = build_loaders(args.coco)
    model = PoseHRNet().to(device)
    criterion = PoseLoss(use_ohkm=args.ohkm).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[90, 120], gamma=0.1)
    scaler = torch.amp.GradScaler("cuda")
    for epoch in range(args.epochs):
        train_one_epoch(model, train_loader, criterion, optimizer, scaler, epoch, device)
        scheduler.step()
        if epoch % 10 == 0:
            np.save(os.path.join(args.out, f"preds_{epoch}.npy"), validate(model, val_loader, device))

    for p in model.stem.parameters():
        p.requires_grad_(False)
    head_params = [p for n, p in model.named_parameters() if not n.startswith("stem")]
    refine_opt = torch.optim.Adam(head_params, lr=1e-4)
    for epoch in range(args.refine_epochs):
        train_refine_epoch(model, refine_loader, JointsMSELoss(), refine_opt, device)
    torch.save(model.state_dict(), os.path.join(args.out, "final_state.pth"))


if __name__ == "__main__":
    main()
