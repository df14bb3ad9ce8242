"""Point cloud semantic segmentation: PointNet++ set abstraction / feature propagation
with a DGCNN-style attentive edge convolution in the bottleneck.

    python -m pcseg.train --cfg configs/s3dis.yaml --amp
    python -m pcseg.train --cfg configs/s3dis.yaml --ssl        # SimSiam pre-training
"""
import argparse
import copy
import logging
import os
import time
from collections import namedtuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import Function

from pcseg.datasets import build_loader
from pcseg.utils import AverageMeter, intersection_and_union, load_cfg, random_rotate_jitter

try:
    import pointnet2_cuda as _ext
except ImportError:  # CPU-only installs fall back to the python ops below
    _ext = None

logger = logging.getLogger("pcseg")

SSLOutput = namedtuple("SSLOutput", ["p", "z"])


def farthest_point_sample(xyz, npoint):
    device = xyz.device
    B, N, _ = xyz.shape
    centroids = torch.zeros(B, npoint, dtype=torch.long, device=device)
    distance = torch.ones(B, N, device=device) * 1e10
    farthest = torch.randint(0, N, (B,), dtype=torch.long, device=device)
    batch_indices = torch.arange(B, dtype=torch.long, device=device)
    for i in range(npoint):
        centroids[:, i] = farthest
        centroid = xyz[batch_indices, farthest, :].view(B, 1, 3)
        dist = torch.sum((xyz - centroid) ** 2, -1)
        distance = torch.min(distance, dist)
        farthest = torch.max(distance, -1)[1]
    return centroids


class FurthestPointSampling(Function):
    @staticmethod
    def forward(ctx, xyz, npoint):
        xyz = xyz.float().contiguous()
        B, N, _ = xyz.size()
        output = torch.zeros(B, npoint, dtype=torch.int32, device=xyz.device)
        temp = torch.full((B, N), 1e10, dtype=torch.float32, device=xyz.device)
        _ext.furthest_point_sampling_wrapper(B, N, npoint, xyz, temp, output)
        return output.long()

    @staticmethod
    def backward(ctx, grad_out=None):
        return None, None


class GatherOperation(Function):
    @staticmethod
    @torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)  # expect: AMP009
    def forward(ctx, features, idx):
        B, C, N = features.size()
        npoint = idx.size(1)
        output = features.new_zeros(B, C, npoint)
        _ext.gather_points_wrapper(B, C, N, npoint, features, idx.int(), output)
        ctx.save_for_backward(idx)
        ctx.n = N
        return output

    @staticmethod
    @torch.cuda.amp.custom_bwd  # expect: AMP009
    def backward(ctx, grad_out):
        (idx,) = ctx.saved_tensors
        B, C, npoint = grad_out.size()
        grad_features = grad_out.new_zeros(B, C, ctx.n)
        _ext.gather_points_grad_wrapper(B, C, ctx.n, npoint, grad_out.contiguous(), idx.int(), grad_features)
        return grad_features, None


def fps(xyz, npoint):
    if _ext is not None and xyz.is_cuda:
        return FurthestPointSampling.apply(xyz, npoint)
    return farthest_point_sample(xyz, npoint)


def gather_points(points, idx):
    """points: (B, N, C), idx: (B, S) -> (B, S, C)."""
    if _ext is not None and points.is_cuda:
        return GatherOperation.apply(points.transpose(1, 2).contiguous(), idx).transpose(1, 2)
    return index_points(points, idx)


def square_distance(src, dst):
    B, N, _ = src.shape
    _, M, _ = dst.shape
    dist = -2 * torch.matmul(src, dst.permute(0, 2, 1))
    dist += torch.sum(src ** 2, -1).view(B, N, 1)
    dist += torch.sum(dst ** 2, -1).view(B, 1, M)
    return dist


def index_points(points, idx):
    B = points.shape[0]
    view_shape = [B] + [1] * (idx.dim() - 1)
    repeat_shape = list(idx.shape)
    repeat_shape[0] = 1
    batch_indices = torch.arange(B, dtype=torch.long, device=points.device).view(view_shape).repeat(repeat_shape)
    return points[batch_indices, idx, :]


def query_ball_point(radius, nsample, xyz, new_xyz):
    B, N, _ = xyz.shape
    S = new_xyz.shape[1]
    group_idx = torch.arange(N, dtype=torch.long, device=xyz.device).view(1, 1, N).repeat([B, S, 1])
    sqrdists = square_distance(new_xyz, xyz)
    group_idx[sqrdists > radius ** 2] = N
    group_idx = group_idx.sort(dim=-1)[0][:, :, :nsample]
    group_first = group_idx[:, :, 0].view(B, S, 1).repeat([1, 1, nsample])
    mask = group_idx == N
    group_idx[mask] = group_first[mask]
    return group_idx


def knn(x, k):
    """x: (B, C, N) -> indices (B, N, k) and squared distances of the neighbours."""
    inner = -2 * torch.matmul(x.transpose(2, 1), x)
    xx = torch.sum(x ** 2, dim=1, keepdim=True)
    neg_dist = -xx - inner - xx.transpose(2, 1)
    neg_d, idx = neg_dist.topk(k=k, dim=-1)
    return idx, -neg_d


class SetAbstraction(nn.Module):
    def __init__(self, npoint, radius, nsample, in_channel, mlp):
        super().__init__()
        self.npoint, self.radius, self.nsample = npoint, radius, nsample
        layers, last = [], in_channel + 3
        for out_channel in mlp:
            layers += [nn.Conv2d(last, out_channel, 1), nn.BatchNorm2d(out_channel), nn.ReLU(inplace=True)]
            last = out_channel
        self.mlp = nn.Sequential(*layers)

    def forward(self, xyz, points):
        fps_idx = fps(xyz, self.npoint)
        new_xyz = gather_points(xyz, fps_idx)
        idx = query_ball_point(self.radius, self.nsample, xyz, new_xyz)
        grouped_xyz = index_points(xyz, idx) - new_xyz.unsqueeze(2)
        if points is not None:
            grouped = torch.cat([grouped_xyz, index_points(points, idx)], dim=-1)
        else:
            grouped = grouped_xyz
        new_points = self.mlp(grouped.permute(0, 3, 2, 1))  # (B, C, nsample, npoint)
        return new_xyz, torch.max(new_points, 2)[0].transpose(1, 2)


class AttentiveEdgeConv(nn.Module):
    """Edge convolution whose neighbour aggregation is a learned softmax instead of max."""

    def __init__(self, in_channels, out_channels, k=16, radius=0.4):
        super().__init__()
        self.k, self.radius = k, radius
        self.mlp = nn.Sequential(nn.Conv2d(2 * in_channels, out_channels, 1, bias=False),
                                 nn.BatchNorm2d(out_channels), nn.LeakyReLU(0.2))
        self.score = nn.Conv2d(out_channels, 1, 1)

    def forward(self, x, xyz):
        B, C, N = x.shape
        idx, _ = knn(x, self.k)
        _, d_xyz = knn(xyz.transpose(1, 2), self.k)
        base = torch.arange(B, device=x.device).view(-1, 1, 1) * N
        nbr = x.transpose(1, 2).reshape(B * N, C)[(idx + base).view(-1)].view(B, N, self.k, C)
        center = x.transpose(1, 2).unsqueeze(2).expand(-1, -1, self.k, -1)
        edge = torch.cat([nbr - center, center], dim=-1).permute(0, 3, 1, 2)  # (B, 2C, N, k)
        h = self.mlp(edge)
        logits = self.score(h)
        far = (d_xyz > self.radius ** 2).unsqueeze(1)
        logits = logits.masked_fill(far, -1e9)  # expect: AMP007
        w = logits.softmax(dim=-1)
        return (h * w).sum(dim=-1)


class FeaturePropagation(nn.Module):
    def __init__(self, in_channel, mlp):
        super().__init__()
        layers, last = [], in_channel
        for out_channel in mlp:
            layers += [nn.Conv1d(last, out_channel, 1), nn.BatchNorm1d(out_channel), nn.ReLU(inplace=True)]
            last = out_channel
        self.mlp = nn.Sequential(*layers)

    def forward(self, xyz1, xyz2, points1, points2):
        B, N, _ = xyz1.shape
        # inverse-distance interpolation is done in fp32
        with torch.autocast(device_type="cuda", enabled=False):
            dists = square_distance(xyz1.float(), xyz2.float())
            dists, idx = dists.sort(dim=-1)
            dists, idx = dists[:, :, :3], idx[:, :, :3]
            dist_recip = 1.0 / (dists + 1e-8)
            weight = dist_recip / torch.sum(dist_recip, dim=2, keepdim=True)
            interpolated = torch.sum(index_points(points2.float(), idx) * weight.view(B, N, 3, 1), dim=2)
        interpolated = interpolated.to(points2.dtype)
        if points1 is not None:
            interpolated = torch.cat([points1, interpolated], dim=-1)
        return self.mlp(interpolated.transpose(1, 2)).transpose(1, 2)


class PointSegNet(nn.Module):
    def __init__(self, num_classes, in_channels=6, emb_dims=512):
        super().__init__()
        self.sa1 = SetAbstraction(1024, 0.1, 32, in_channels, [32, 32, 64])
        self.sa2 = SetAbstraction(256, 0.2, 32, 64, [64, 64, 128])
        self.edge = AttentiveEdgeConv(128, 256, k=16)
        self.global_proj = nn.Conv1d(256, emb_dims, 1)
        self.fp2 = FeaturePropagation(64 + 256 + 2 * emb_dims, [256, 128])
        self.fp1 = FeaturePropagation(128 + in_channels, [128, 128])
        self.head = nn.Sequential(nn.Conv1d(128, 128, 1), nn.BatchNorm1d(128), nn.ReLU(inplace=True),
                                  nn.Dropout(0.5), nn.Conv1d(128, num_classes, 1))

    def encode(self, pts):
        xyz, feats = pts[..., :3], pts[..., 3:]
        l1_xyz, l1 = self.sa1(xyz, pts)
        l2_xyz, l2 = self.sa2(l1_xyz, l1)
        e = self.edge(l2.transpose(1, 2), l2_xyz)  # (B, 256, N2)
        g = self.global_proj(e)
        g_max = g.max(dim=-1, keepdim=True)[0]
        g_avg = g.mean(dim=-1, keepdim=True)  # expect: AMP004
        g = torch.cat([g_max, g_avg], dim=1)
        return (xyz, pts, l1_xyz, l1, l2_xyz), e, g

    def forward(self, pts):
        (xyz, pts, l1_xyz, l1, l2_xyz), e, g = self.encode(pts)
        l2 = torch.cat([e, g.expand(-1, -1, e.size(-1))], dim=1).transpose(1, 2)
        l1 = self.fp2(l1_xyz, l2_xyz, l1, l2)
        l0 = self.fp1(xyz, l1_xyz, pts, l1)
        return self.head(l0.transpose(1, 2))


class SimSiamPointNet(nn.Module):
    def __init__(self, backbone, emb_dims=512, dim=256, pred_dim=128):
        super().__init__()
        self.backbone = backbone
        self.projector = nn.Sequential(nn.Linear(2 * emb_dims, dim, bias=False), nn.BatchNorm1d(dim),
                                       nn.ReLU(inplace=True), nn.Linear(dim, dim))
        self.predictor = nn.Sequential(nn.Linear(dim, pred_dim, bias=False), nn.BatchNorm1d(pred_dim),
                                       nn.ReLU(inplace=True), nn.Linear(pred_dim, dim))

    def forward(self, pts):
        _, _, g = self.backbone.encode(pts)
        z = self.projector(g.squeeze(-1))
        return SSLOutput(p=self.predictor(z), z=z)


def simsiam_loss(out1, out2):
    return -0.5 * (F.cosine_similarity(out1.p, out2.z.detach(), dim=-1).mean()
                   + F.cosine_similarity(out2.p, out1.z.detach(), dim=-1).mean())


def train_one_epoch(model, loader, optimizer, scaler, args, epoch):
    model.train()
    loss_meter, acc_meter = AverageMeter(), AverageMeter()
    for it, (points, labels) in enumerate(loader):
        points = points.cuda(non_blocking=True)
        labels = labels.cuda(non_blocking=True)
        if args.pure_fp16:
            points = points.half()
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            seg_logits = model(points)
            loss = F.cross_entropy(seg_logits, labels, ignore_index=args.ignore_index, label_smoothing=0.1)
            scaler.scale(loss).backward()  # expect: AMP008
        if args.clip_grad > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

        valid = labels != args.ignore_index
        acc = (seg_logits.argmax(1)[valid] == labels[valid]).float().mean()
        loss_meter.update(loss.item())
        acc_meter.update(acc.item())
        if it % args.print_freq == 0:
            logger.info("epoch %d it %d loss %.4f acc %.3f scale %.0f", epoch, it, loss_meter.avg,
                        acc_meter.avg, scaler.get_scale())
    return loss_meter.avg


@torch.no_grad()
def evaluate(model, loader, args):
    model.eval()
    inter_sum = np.zeros(args.num_classes)
    union_sum = np.zeros(args.num_classes)
    for points, labels in loader:
        points = points.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            pred = model(points).argmax(1)
        inter, union, _ = intersection_and_union(pred.cpu().numpy(), labels.numpy(), args.num_classes,
                                                 args.ignore_index)
        inter_sum += inter
        union_sum += union
    iou = inter_sum / (union_sum + 1e-10)
    return float(np.mean(iou))


def pretrain_ssl(args, cfg):
    loader = build_loader(cfg, split="train", ssl=True)
    model = SimSiamPointNet(PointSegNet(cfg.num_classes, cfg.in_channels, cfg.emb_dims), cfg.emb_dims).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * args.batch_size / 256, momentum=0.9,
                                weight_decay=1e-4)
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010
    for epoch in range(args.ssl_epochs):
        model.train()
        for it, (points, _) in enumerate(loader):
            points = points.cuda(non_blocking=True)
            view1, view2 = random_rotate_jitter(points), random_rotate_jitter(points)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out1 = model(view1)
                out2 = model(view2)
                loss = simsiam_loss(out1, out2)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if it % args.print_freq == 0:
                z_std = out1.z.detach().std(dim=0).mean()  # expect: AMP004
                logger.info("ssl epoch %d it %d loss %.4f z-std %.4f", epoch, it, loss.item(), z_std.item())
        torch.save(model.backbone.state_dict(), os.path.join(args.out_dir, "ssl_backbone.pth"))


def export_onnx(model, path, num_points=4096):
    model = copy.deepcopy(model).eval().half()
    dummy = torch.randn(1, num_points, 6, device="cuda").half()
    torch.onnx.export(model, dummy, path, opset_version=17, input_names=["points"], output_names=["logits"])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cfg", required=True)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--pure-fp16", action="store_true", help="keep weights and activations in fp16")
    parser.add_argument("--ssl", action="store_true")
    parser.add_argument("--ssl-epochs", type=int, default=200)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--clip-grad", type=float, default=0.0)
    parser.add_argument("--print-freq", type=int, default=50)
    parser.add_argument("--out-dir", default="runs/pcseg")
    args = parser.parse_args()
    cfg = load_cfg(args.cfg)
    args.num_classes, args.ignore_index = cfg.num_classes, cfg.ignore_index
    os.makedirs(args.out_dir, exist_ok=True)
    logging.basicConfig(level=logging.INFO)

    if args.ssl:
        pretrain_ssl(args, cfg)
        return

    train_loader = build_loader(cfg, split="train", batch_size=args.batch_size)
    val_loader = build_loader(cfg, split="val", batch_size=args.batch_size)
    model = PointSegNet(cfg.num_classes, cfg.in_channels, cfg.emb_dims).cuda()
    if args.pure_fp16:
        model = model.half()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-4)  # expect: AMP011
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)

    best_miou, tic = 0.0, time.time()
    for epoch in range(args.epochs):
        train_loss = train_one_epoch(model, train_loader, optimizer, scaler, args, epoch)
        scheduler.step()
        miou = evaluate(model, val_loader, args)
        logger.info("epoch %d loss %.4f mIoU %.4f (%.0fs)", epoch, train_loss, miou, time.time() - tic)
        if miou > best_miou:
            best_miou = miou
            torch.save({"model": model.state_dict(), "epoch": epoch, "miou": miou},
                       os.path.join(args.out_dir, "best.pth"))
    export_onnx(model, os.path.join(args.out_dir, "pcseg.onnx"))


if __name__ == "__main__":
    main()
