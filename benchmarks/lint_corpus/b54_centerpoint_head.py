"""CenterPoint-style multi-task 3D detection on BEV features (mmdet3d layout).

SECOND backbone, SECOND-FPN neck with selective-kernel fusion, task attention on the shared
feature, one heatmap branch per task group plus a SeparateHead that returns a dict of
regression maps; Gaussian focal loss on heatmaps, L1 on boxes.  DDP + fp16 autocast.
"""
import argparse
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

TASKS = [
    dict(class_names=["car"]),
    dict(class_names=["truck", "construction_vehicle"]),
    dict(class_names=["bus", "trailer"]),
    dict(class_names=["barrier"]),
    dict(class_names=["motorcycle", "bicycle"]),
    dict(class_names=["pedestrian", "traffic_cone"]),
]
COMMON_HEADS = {"reg": (2, 2), "height": (1, 2), "dim": (3, 2), "rot": (2, 2), "vel": (2, 2)}
BEV = dict(pc_range=(-51.2, -51.2), voxel_size=(0.1, 0.1), out_size_factor=8, grid=(1024, 1024), max_objs=500)


def conv_bn_relu(cin, cout, k=3, stride=1):
    return [nn.Conv2d(cin, cout, k, stride, padding=k // 2, bias=False),
            nn.BatchNorm2d(cout, eps=1e-3, momentum=0.01), nn.ReLU(inplace=True)]


class SECOND(nn.Module):
    def __init__(self, in_channels=256, out_channels=(128, 256), layer_nums=(5, 5), strides=(1, 2)):
        super().__init__()
        blocks, cin = [], in_channels
        for cout, n, s in zip(out_channels, layer_nums, strides):
            layers = conv_bn_relu(cin, cout, 3, s)
            for _ in range(n):
                layers += conv_bn_relu(cout, cout)
            blocks.append(nn.Sequential(*layers))
            cin = cout
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        outs = []
        for block in self.blocks:
            x = block(x)
            outs.append(x)
        return outs


class SKFPN(nn.Module):
    """SECOND-FPN whose upsampled scales are fused by selective-kernel attention."""

    def __init__(self, in_channels=(128, 256), out_channels=256, upsample_strides=(1, 2), reduction=8):
        super().__init__()
        self.deblocks = nn.ModuleList()
        for cin, s in zip(in_channels, upsample_strides):
            up = (nn.ConvTranspose2d(cin, out_channels, s, stride=s, bias=False) if s > 1
                  else nn.Conv2d(cin, out_channels, 1, bias=False))
            self.deblocks.append(nn.Sequential(up, nn.BatchNorm2d(out_channels, eps=1e-3, momentum=0.01), nn.ReLU(inplace=True)))
        self.laterals = nn.ModuleList(nn.Conv2d(out_channels, out_channels, 3, padding=1) for _ in in_channels)
        self.fc_reduce = nn.Sequential(nn.Linear(out_channels, out_channels // reduction), nn.ReLU(inplace=True))
        self.fc_select = nn.ModuleList(nn.Linear(out_channels // reduction, out_channels) for _ in in_channels)
        self.spatial = nn.Conv2d(2, 1, 7, padding=3)

    def forward(self, feats):
        ups = [deblock(f) for deblock, f in zip(self.deblocks, feats)]
        laterals = [lat(u) for lat, u in zip(self.laterals, ups)]
        u = laterals[0] + laterals[1]
        gap = u.mean(dim=(2, 3))  # expect: AMP004
        a = torch.stack([fc(self.fc_reduce(gap)) for fc in self.fc_select], dim=1).softmax(dim=1)
        out = laterals[0] * a[:, 0, :, None, None] + laterals[1] * a[:, 1, :, None, None]
        desc = torch.cat([out.mean(dim=1, keepdim=True), out.amax(dim=1, keepdim=True)], dim=1)
        return out * torch.sigmoid(self.spatial(desc))


class SeparateHead(nn.Module):
    def __init__(self, in_channels, heads, head_conv=64, final_kernel=3):
        super().__init__()
        self.branches = nn.ModuleDict({
            name: self.branch(in_channels, head_conv, out_ch, num_conv, final_kernel)
            for name, (out_ch, num_conv) in heads.items()
        })

    @staticmethod
    def branch(cin, head_conv, out_ch, num_conv, k=3):
        layers = []
        for _ in range(num_conv - 1):
            layers += conv_bn_relu(cin, head_conv, k)
            cin = head_conv
        return nn.Sequential(*layers, nn.Conv2d(cin, out_ch, k, padding=k // 2))

    def forward(self, x):
        return {name: branch(x) for name, branch in self.branches.items()}


def gaussian_radius(det_size, min_overlap=0.5):
    height, width = det_size
    b1, c1 = height + width, width * height * (1 - min_overlap) / (1 + min_overlap)
    r1 = (b1 + math.sqrt(b1 ** 2 - 4 * c1)) / 2
    b2, c2 = 2 * (height + width), (1 - min_overlap) * width * height
    r2 = (b2 + math.sqrt(b2 ** 2 - 16 * c2)) / 2
    a3, b3, c3 = 4 * min_overlap, -2 * min_overlap * (height + width), (min_overlap - 1) * width * height
    r3 = (b3 + math.sqrt(b3 ** 2 - 4 * a3 * c3)) / 2
    return min(r1, r2, r3)


def draw_heatmap_gaussian(heatmap, center, radius):
    sigma = (2 * radius + 1) / 6
    m = np.arange(-radius, radius + 1)
    gaussian = np.exp(-(m[:, None] ** 2 + m[None, :] ** 2) / (2 * sigma * sigma))
    gaussian[gaussian < np.finfo(gaussian.dtype).eps * gaussian.max()] = 0
    x, y = int(center[0]), int(center[1])
    height, width = heatmap.shape
    left, right, top, bottom = min(x, radius), min(width - x, radius + 1), min(y, radius), min(height - y, radius + 1)
    masked_heatmap = heatmap[y - top:y + bottom, x - left:x + right]
    masked_gaussian = torch.from_numpy(gaussian[radius - top:radius + bottom, radius - left:radius + right]).to(heatmap)
    if min(masked_gaussian.shape) > 0 and min(masked_heatmap.shape) > 0:
        torch.max(masked_heatmap, masked_gaussian, out=masked_heatmap)


def gather_feat(feat, ind):
    b, c = feat.shape[:2]
    return feat.view(b, c, -1).permute(0, 2, 1).gather(1, ind.unsqueeze(-1).expand(-1, -1, c))


def clamp_sigmoid(x, eps=1e-4):
    return torch.clamp(x.sigmoid(), min=eps, max=1 - eps)


def gaussian_focal_loss(pred, gaussian_target, alpha=2.0, gamma=4.0):
    pos_weights = gaussian_target.eq(1)
    neg_weights = (1 - gaussian_target).pow(gamma)
    pos_loss = -(pred + 1e-12).log() * (1 - pred).pow(alpha) * pos_weights  # expect: AMP011
    neg_loss = -(1 - pred + 1e-12).log() * pred.pow(alpha) * neg_weights  # expect: AMP011
    return pos_loss + neg_loss


class CenterHead(nn.Module):
    def __init__(self, in_channels, tasks, common_heads, share_conv_channel=64):
        super().__init__()
        self.num_classes = [len(t["class_names"]) for t in tasks]
        self.code_weights = [1.0] * 8 + [0.2, 0.2]
        self.shared_conv = nn.Sequential(*conv_bn_relu(in_channels, share_conv_channel))
        self.task_attn = nn.ModuleList(nn.Conv2d(share_conv_channel, 1, 1) for _ in tasks)
        self.hm_heads = nn.ModuleList(SeparateHead.branch(share_conv_channel, 64, n, 2) for n in self.num_classes)
        self.task_heads = nn.ModuleList(SeparateHead(share_conv_channel, common_heads) for _ in tasks)
        for hm in self.hm_heads:
            hm[-1].bias.data.fill_(-2.19)

    def forward(self, x):
        x = self.shared_conv(x)
        heatmaps, preds_dicts = [], []
        for attn_conv, hm_head, task_head in zip(self.task_attn, self.hm_heads, self.task_heads):
            w = torch.sigmoid(attn_conv(x))
            x_t = x * w / (w.mean(dim=(2, 3), keepdim=True) + 1e-6)  # expect: AMP004
            heatmaps.append(hm_head(x_t))
            preds_dicts.append(task_head(x_t))
        return heatmaps, preds_dicts

    @torch.no_grad()
    def get_targets(self, gt_boxes, gt_labels):
        """gt_boxes: per sample (N, 9) [x, y, z, l, w, h, yaw, vx, vy]; gt_labels: (N,) global class ids."""
        osf, (vx, vy), (x0, y0) = BEV["out_size_factor"], BEV["voxel_size"], BEV["pc_range"]
        H, W, max_objs = BEV["grid"][0] // osf, BEV["grid"][1] // osf, BEV["max_objs"]
        per_task = [([], [], [], []) for _ in self.num_classes]
        for boxes, labels in zip(gt_boxes, gt_labels):
            offset = 0
            for task_id, n_cls in enumerate(self.num_classes):
                hm = boxes.new_zeros((n_cls, H, W))
                anno, ind = boxes.new_zeros((max_objs, 10)), labels.new_zeros(max_objs)
                mask = boxes.new_zeros(max_objs, dtype=torch.uint8)
                sel = (labels >= offset) & (labels < offset + n_cls)
                for k, (box, cls) in enumerate(zip(boxes[sel][:max_objs], labels[sel][:max_objs] - offset)):
                    length, width = box[3].item() / vx / osf, box[4].item() / vy / osf
                    ct = torch.stack([(box[0] - x0) / vx / osf, (box[1] - y0) / vy / osf])
                    ct_int = ct.int()
                    if length <= 0 or width <= 0 or not (0 <= ct_int[0] < W and 0 <= ct_int[1] < H):
                        continue
                    draw_heatmap_gaussian(hm[cls], ct_int, max(2, int(gaussian_radius((length, width), 0.1))))
                    ind[k], mask[k] = ct_int[1] * W + ct_int[0], 1
                    anno[k] = torch.cat([ct - ct_int, box[2:3], box[3:6].log(), box[6:7].sin(), box[6:7].cos(), box[7:9]])
                for store, value in zip(per_task[task_id], (hm, anno, ind, mask)):
                    store.append(value)
                offset += n_cls
        return [[torch.stack(v) for v in task] for task in zip(*per_task)]

    def loss(self, heatmaps, preds_dicts, gt_boxes, gt_labels):
        hm_targets, anno_boxes, inds, masks = self.get_targets(gt_boxes, gt_labels)
        losses = {}
        for task_id, (hm, preds) in enumerate(zip(heatmaps, preds_dicts)):
            num_pos = max(hm_targets[task_id].eq(1).float().sum().item(), 1.0)
            loss_hm = gaussian_focal_loss(clamp_sigmoid(hm), hm_targets[task_id]).sum() / num_pos
            pred = torch.cat([preds[k] for k in ("reg", "height", "dim", "rot", "vel")], dim=1).float()
            pred = gather_feat(pred, inds[task_id])
            mask = masks[task_id].unsqueeze(-1).expand_as(anno_boxes[task_id]).float()
            weights = mask * pred.new_tensor(self.code_weights)
            loss_bbox = F.l1_loss(pred * weights, anno_boxes[task_id] * weights, reduction="sum") / (mask.sum() + 1e-4)
            losses[f"task{task_id}.loss_heatmap"] = loss_hm
            losses[f"task{task_id}.loss_bbox"] = 0.25 * loss_bbox
        return losses

    def decode(self, heatmaps, preds_dicts, k=100):
        results = []
        for hm, preds in zip(heatmaps, preds_dicts):
            heat = torch.sigmoid(hm)
            keep = (F.max_pool2d(heat, 3, stride=1, padding=1) == heat).to(heat.dtype)
            b, c, h, w = heat.shape
            scores, idx = (heat * keep).view(b, -1).topk(k)
            labels, pix = idx // (h * w), idx % (h * w)
            reg, rot = gather_feat(preds["reg"], pix), gather_feat(preds["rot"], pix)
            results.append(dict(xs=(pix % w).to(heat.dtype) + reg[..., 0], ys=(pix // w).to(heat.dtype) + reg[..., 1],
                                dims=gather_feat(preds["dim"], pix).exp(), yaw=torch.atan2(rot[..., 0], rot[..., 1]),
                                scores=scores, labels=labels))
        return results


class CenterPointBEV(nn.Module):
    def __init__(self, in_channels=256):
        super().__init__()
        self.backbone = SECOND(in_channels)
        self.neck = SKFPN()
        self.head = CenterHead(256, TASKS, COMMON_HEADS)

    def forward(self, bev, gt_boxes=None, gt_labels=None):
        heatmaps, preds_dicts = self.head(self.neck(self.backbone(bev)))
        if self.training:
            return self.head.loss(heatmaps, preds_dicts, gt_boxes, gt_labels)
        return self.head.decode(heatmaps, preds_dicts)


def parse_losses(losses):
    log_vars = {name: value.mean() for name, value in losses.items()}
    loss = sum(v for k, v in log_vars.items() if "loss" in k)
    return loss, {k: v.item() for k, v in log_vars.items()}


def train(args):
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    model = DDP(CenterPointBEV(args.in_channels).cuda(), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.95, 0.99), weight_decay=0.01)
    scaler = torch.amp.GradScaler("cuda")
    from datasets import build_bev_dataloader  # project-local nuScenes BEV cache
    loader = build_bev_dataloader(args.data_root, batch_size=args.batch_size, distributed=True)
    for epoch in range(args.epochs):
        loader.sampler.set_epoch(epoch)
        for it, batch in enumerate(loader):
            bev = batch["bev"].cuda(non_blocking=True)
            gt_boxes = [b.cuda() for b in batch["gt_boxes"]]
            gt_labels = [lbl.cuda() for lbl in batch["gt_labels"]]
            with torch.autocast("cuda", dtype=torch.float16):
                losses = model(bev, gt_boxes, gt_labels)
                loss, log_vars = parse_losses(losses)
                scaler.scale(loss / args.accum_steps).backward()  # expect: AMP008
            if (it + 1) % args.accum_steps == 0:
                scaler.unscale_(optimizer)
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 35.0)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                if local_rank == 0 and (it + 1) % (50 * args.accum_steps) == 0:
                    print(f"epoch {epoch} iter {it + 1} loss {loss.item():.3f} grad_norm {grad_norm:.2f} {log_vars}")
        if local_rank == 0:
            torch.save(model.module.state_dict(), os.path.join(args.work_dir, f"epoch_{epoch + 1}.pth"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_root", default="data/nuscenes_bev")
    parser.add_argument("--work_dir", default="work_dirs/centerpoint_sk")
    parser.add_argument("--in_channels", type=int, default=256)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--accum_steps", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-4)
    train(parser.parse_args())
