"""PointNet++ semantic segmentation on S3DIS-style blocks (yanx27/Pointnet_Pointnet2_pytorch flavour) with AMP."""
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import Function


def square_distance(src, dst):
    B, N, _ = src.shape
    _, M, _ = dst.shape
    dist = -2 * torch.matmul(src, dst.permute(0, 2, 1))
    dist += torch.sum(src**2, -1).view(B, N, 1)
    dist += torch.sum(dst**2, -1).view(B, 1, M)
    return dist


def index_points(points, idx):
    B = points.shape[0]
    view_shape = [B] + [1] * (idx.dim() - 1)
    batch_indices = torch.arange(B, dtype=torch.long, device=points.device).view(view_shape).expand_as(idx)
    return points[batch_indices, idx, :]


class FurthestPointSampling(Function):
    @staticmethod
    @torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)  # expect: AMP009
    def forward(ctx, xyz, npoint):
        B, N, _ = xyz.shape
        centroids = torch.zeros(B, npoint, dtype=torch.long, device=xyz.device)
        distance = torch.ones(B, N, device=xyz.device) * 1e10
        farthest = torch.randint(0, N, (B,), dtype=torch.long, device=xyz.device)
        batch_indices = torch.arange(B, dtype=torch.long, device=xyz.device)
        for i in range(npoint):
            centroids[:, i] = farthest
            centroid = xyz[batch_indices, farthest, :].view(B, 1, 3)
            dist = torch.sum((xyz - centroid) ** 2, -1)
            distance = torch.min(distance, dist)
            farthest = torch.max(distance, -1)[1]
        return centroids

    @staticmethod
    def backward(ctx, grad=None):
        return None, None


furthest_point_sample = FurthestPointSampling.apply


def query_ball_point(radius, nsample, xyz, new_xyz):
    sqrdists = square_distance(new_xyz, xyz)
    sqrdists = sqrdists.masked_fill(sqrdists > radius**2, 1e10)  # expect: AMP007
    dist, group_idx = sqrdists.topk(nsample, dim=-1, largest=False)
    group_first = group_idx[:, :, :1].expand_as(group_idx)
    return torch.where(dist > radius**2, group_first, group_idx)


class SetAbstraction(nn.Module):
    def __init__(self, npoint, radius, nsample, in_channel, mlp):
        super().__init__()
        self.npoint, self.radius, self.nsample = npoint, radius, nsample
        layers, last = [], in_channel + 3
        for out in mlp:
            layers += [nn.Conv2d(last, out, 1), nn.BatchNorm2d(out), nn.ReLU(inplace=True)]
            last = out
        self.mlp = nn.Sequential(*layers)

    def forward(self, xyz, points):
        fps_idx = furthest_point_sample(xyz, self.npoint)
        new_xyz = index_points(xyz, fps_idx)
        idx = query_ball_point(self.radius, self.nsample, xyz, new_xyz)
        grouped_xyz = index_points(xyz, idx) - new_xyz.unsqueeze(2)
        grouped = torch.cat([grouped_xyz, index_points(points, idx)], dim=-1) if points is not None else grouped_xyz
        new_points = self.mlp(grouped.permute(0, 3, 2, 1))
        return new_xyz, torch.max(new_points, 2)[0].transpose(1, 2)


class FeaturePropagation(nn.Module):
    def __init__(self, in_channel, mlp):
        super().__init__()
        layers, last = [], in_channel
        for out in mlp:
            layers += [nn.Conv1d(last, out, 1), nn.BatchNorm1d(out), nn.ReLU(inplace=True)]
            last = out
        self.mlp = nn.Sequential(*layers)

    def forward(self, xyz1, xyz2, points1, points2):
        B, N, _ = xyz1.shape
        dists = square_distance(xyz1, xyz2)
        dists, idx = dists.sort(dim=-1)
        dists, idx = dists[:, :, :3], idx[:, :, :3]
        dist_recip = 1.0 / (dists + 1e-8)  # expect: AMP011
        norm = torch.sum(dist_recip, dim=2, keepdim=True)
        weight = dist_recip / norm
        interpolated = torch.sum(index_points(points2, idx) * weight.view(B, N, 3, 1), dim=2)
        new_points = torch.cat([points1, interpolated], dim=-1) if points1 is not None else interpolated
        return self.mlp(new_points.transpose(1, 2)).transpose(1, 2)


class PointNet2SemSeg(nn.Module):
    def __init__(self, num_classes, num_scene_types=13):
        super().__init__()
        self.sa1 = SetAbstraction(1024, 0.1, 32, 6, [32, 32, 64])
        self.sa2 = SetAbstraction(256, 0.2, 32, 64, [64, 64, 128])
        self.sa3 = SetAbstraction(64, 0.4, 32, 128, [128, 128, 256])
        self.fp3 = FeaturePropagation(384, [256, 256])
        self.fp2 = FeaturePropagation(320, [256, 128])
        self.fp1 = FeaturePropagation(128, [128, 128, 128])
        self.conv_g = nn.Conv1d(256, 256, 1)
        self.scene_head = nn.Linear(256, num_scene_types)
        self.conv1 = nn.Conv1d(128, 128, 1)
        self.bn1 = nn.BatchNorm1d(128)
        self.conv2 = nn.Conv1d(128, num_classes, 1)

    def forward(self, points):
        xyz = points[:, :3, :].transpose(1, 2)
        feats = points.transpose(1, 2)
        l1_xyz, l1 = self.sa1(xyz, feats)
        l2_xyz, l2 = self.sa2(l1_xyz, l1)
        l3_xyz, l3 = self.sa3(l2_xyz, l2)
        global_feat = torch.mean(self.conv_g(l3.transpose(1, 2)), 2)  # expect: AMP004
        l2 = self.fp3(l2_xyz, l3_xyz, l2, l3)
        l1 = self.fp2(l1_xyz, l2_xyz, l1, l2)
        l0 = self.fp1(xyz, l1_xyz, None, l1)
        x = F.dropout(F.relu(self.bn1(self.conv1(l0.transpose(1, 2)))), 0.5, self.training)
        x = F.log_softmax(self.conv2(x), dim=1)
        return x.permute(0, 2, 1), self.scene_head(global_feat)


@torch.no_grad()
def evaluate(classifier, loader, num_classes):
    classifier.eval()
    correct, seen = 0, 0
    for points, target in loader:
        points = points.float().cuda().transpose(2, 1).half()
        seg_pred, _ = classifier.half()(points)
        pred = seg_pred.argmax(-1).cpu()
        correct += (pred == target).sum().item()
        seen += target.numel()
    classifier.float()
    return correct / max(seen, 1)


def train(args, train_loader, test_loader, num_classes, class_weights):
    classifier = PointNet2SemSeg(num_classes).cuda()
    weights = torch.from_numpy(np.asarray(class_weights, dtype=np.float32)).cuda()
    optimizer = torch.optim.Adam(classifier.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-08, weight_decay=1e-4)
    scaler = torch.amp.GradScaler("cuda")
    for epoch in range(args.epoch):
        classifier.train()
        for points, target, scene in train_loader:
            points = points.transpose(2, 1).type(torch.cuda.HalfTensor)  # expect: AMP001
            target, scene = target.view(-1).long().cuda(), scene.long().cuda()
            optimizer.zero_grad()
            with torch.cuda.amp.autocast():  # expect: AMP009
                seg_pred, scene_logits = classifier(points)
                loss = F.nll_loss(seg_pred.contiguous().view(-1, num_classes), target, weight=weights)
                loss = loss + 0.1 * F.cross_entropy(scene_logits, scene)
                scaler.scale(loss).backward()  # expect: AMP008
            scaler.step(optimizer)
            scaler.update()
        acc = evaluate(classifier, test_loader, num_classes)
        print(f"epoch {epoch}: test acc {acc:.4f}")
    return classifier


def finetune_on_target(classifier, loader, num_classes, epochs=5, lr=1e-4):
    optimizer = torch.optim.SGD(classifier.parameters(), lr=lr, momentum=0.9)
    classifier.train()
    for _ in range(epochs):
        for points, target, _scene in loader:
            points, target = points.cuda().transpose(2, 1), target.view(-1).long().cuda()
            with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
                seg_pred, _ = classifier(points)
                loss = F.nll_loss(seg_pred.reshape(-1, num_classes), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return classifier
