"""DGCNN point-cloud classifier (ModelNet40 / ScanObjectNN) with a learned-affine point
embedding and an attentive last EdgeConv, trained with fp16 autocast.

Based on the reference DGCNN implementation (Wang et al., 2019).
"""
import argparse
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


def knn(x, k, valid=None):
    # x: (B, C, N) -> indices of the k nearest neighbours of every point, (B, N, k)
    inner = -2 * torch.matmul(x.transpose(2, 1), x)
    xx = torch.sum(x ** 2, dim=1, keepdim=True)
    pairwise_distance = -xx - inner - xx.transpose(2, 1)
    if valid is not None:
        # never pick padding points as neighbours
        pairwise_distance = pairwise_distance.masked_fill(~valid[:, None, :], float("-inf"))
    return pairwise_distance.topk(k=k, dim=-1)[1]


def gather_neighbors(points, idx):
    # points: (B, N, C), idx: (B, N, k) -> (B, N, k, C)
    B, N, k = idx.shape
    offset = torch.arange(B, device=points.device).view(B, 1, 1) * points.size(1)
    flat = (idx + offset).reshape(-1)
    return points.reshape(B * points.size(1), -1)[flat].view(B, N, k, -1)


def get_graph_feature(x, k, valid=None):
    # x: (B, C, N) -> edge features (B, 2C, N, k) and the neighbour indices
    idx = knn(x, k, valid)
    pts = x.transpose(2, 1).contiguous()
    nbrs = gather_neighbors(pts, idx)
    center = pts.unsqueeze(2).expand(-1, -1, k, -1)
    feature = torch.cat((nbrs - center, center), dim=3)
    return feature.permute(0, 3, 1, 2).contiguous(), idx


def channel_standardize(f):
    # per-shape standardisation of the lifted point features; a learned affine follows
    mu = f.mean(dim=-1, keepdim=True)  # expect: AMP004
    sigma = f.std(dim=-1, keepdim=True)  # expect: AMP004
    return (f - mu) / (sigma + 1e-8)  # expect: AMP011


class EdgeConv(nn.Module):
    def __init__(self, in_ch, out_ch, k=20):
        super().__init__()
        self.k = k
        self.conv = nn.Sequential(
            nn.Conv2d(in_ch * 2, out_ch, kernel_size=1, bias=False),
            nn.BatchNorm2d(out_ch),
            nn.LeakyReLU(negative_slope=0.2),
        )

    def forward(self, x, valid=None):
        feat, _ = get_graph_feature(x, self.k, valid)
        return self.conv(feat).max(dim=-1)[0]


class AttentiveEdgeConv(nn.Module):
    """EdgeConv whose neighbourhood aggregation is a learned softmax instead of a max."""

    def __init__(self, in_ch, out_ch, k=20):
        super().__init__()
        self.k = k
        self.conv = nn.Sequential(
            nn.Conv2d(in_ch * 2, out_ch, kernel_size=1, bias=False),
            nn.BatchNorm2d(out_ch),
            nn.LeakyReLU(negative_slope=0.2),
        )
        self.score = nn.Linear(out_ch, out_ch)

    def forward(self, x, valid=None):
        feat, idx = get_graph_feature(x, self.k, valid)
        h = self.conv(feat).permute(0, 2, 3, 1)  # (B, N, k, C)
        logits = self.score(h)
        if valid is not None:
            nbr_valid = torch.gather(valid.unsqueeze(1).expand(-1, valid.size(1), -1), 2, idx)
            logits = logits.masked_fill(~nbr_valid.unsqueeze(-1), -1e9)  # expect: AMP007
        w = logits.softmax(dim=2)
        out = (w * h).sum(dim=2)
        return out.transpose(1, 2).contiguous()


class DGCNNCls(nn.Module):
    def __init__(self, num_classes=40, k=20, emb_dims=1024, dropout=0.5):
        super().__init__()
        self.embed = nn.Conv1d(3, 64, kernel_size=1, bias=False)
        self.alpha = nn.Parameter(torch.ones(1, 64, 1))
        self.beta = nn.Parameter(torch.zeros(1, 64, 1))
        self.ec1 = EdgeConv(64, 64, k)
        self.ec2 = EdgeConv(64, 64, k)
        self.ec3 = EdgeConv(64, 128, k)
        self.ec4 = AttentiveEdgeConv(128, 256, k)
        self.conv5 = nn.Conv1d(512, emb_dims, kernel_size=1, bias=False)
        self.linear1 = nn.Linear(emb_dims * 2, 512, bias=False)
        self.bn6 = nn.BatchNorm1d(512)
        self.dp1 = nn.Dropout(p=dropout)
        self.linear2 = nn.Linear(512, 256)
        self.bn7 = nn.BatchNorm1d(256)
        self.dp2 = nn.Dropout(p=dropout)
        self.linear3 = nn.Linear(256, num_classes)

    def forward(self, pts, valid=None):
        f0 = self.alpha * channel_standardize(self.embed(pts)) + self.beta
        x1 = self.ec1(f0, valid)
        x2 = self.ec2(x1, valid)
        x3 = self.ec3(x2, valid)
        x4 = self.ec4(x3, valid)
        h = self.conv5(torch.cat((x1, x2, x3, x4), dim=1))
        if valid is None:
            g_avg = h.mean(dim=-1)  # expect: AMP004
            g_max = h.amax(dim=-1)
        else:
            m = valid.unsqueeze(1)
            g_avg = (h * m).sum(dim=-1) / m.sum(dim=-1).clamp(min=1)
            g_max = h.masked_fill(~m, float("-inf")).amax(dim=-1)
        x = torch.cat((g_max, g_avg), dim=1)
        x = self.dp1(F.leaky_relu(self.bn6(self.linear1(x)), negative_slope=0.2))
        x = self.dp2(F.leaky_relu(self.bn7(self.linear2(x)), negative_slope=0.2))
        return self.linear3(x)


def cal_loss(pred, gold, smoothing=True):
    """Cross-entropy with label smoothing, as in the reference DGCNN code."""
    gold = gold.contiguous().view(-1)
    if smoothing:
        eps = 0.2
        n_class = pred.size(1)
        one_hot = torch.zeros_like(pred).scatter(1, gold.view(-1, 1), 1)
        one_hot = one_hot * (1 - eps) + (1 - one_hot) * eps / (n_class - 1)
        log_prb = F.log_softmax(pred, dim=1)
        loss = -(one_hot * log_prb).sum(dim=1).mean()
    else:
        loss = F.cross_entropy(pred, gold, reduction="mean")
    return loss


class PointCloudDataset(Dataset):
    def __init__(self, root, split, num_points=1024, augment=False):
        blob = np.load(os.path.join(root, f"{split}.npz"))
        self.points = blob["points"].astype(np.float32)
        self.labels = blob["labels"].astype(np.int64).reshape(-1)
        self.num_points = num_points
        self.augment = augment

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        pts = self.points[i][: self.num_points].copy()
        if self.augment:
            scale = np.random.uniform(2.0 / 3.0, 3.0 / 2.0, size=[3]).astype(np.float32)
            shift = np.random.uniform(-0.2, 0.2, size=[3]).astype(np.float32)
            pts = pts * scale + shift
            np.random.shuffle(pts)
        return torch.from_numpy(pts.T.copy()), int(self.labels[i])


@torch.no_grad()
def test(model, loader, device):
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    per_class = np.zeros((2, 64), dtype=np.int64)
    for data, label in loader:
        data, label = data.to(device), label.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(data)
        loss_sum += cal_loss(logits.float(), label, smoothing=False).item() * data.size(0)
        pred = logits.argmax(dim=1)
        correct += (pred == label).sum().item()
        total += data.size(0)
        for p, t in zip(pred.cpu().numpy(), label.cpu().numpy()):
            per_class[0, t] += int(p == t)
            per_class[1, t] += 1
    model.train()
    seen = per_class[1] > 0
    return correct / total, float(np.mean(per_class[0, seen] / per_class[1, seen])), loss_sum / total


def train(args):
    device = torch.device("cuda")
    train_loader = DataLoader(
        PointCloudDataset(args.data, "train", args.num_points, augment=True),
        batch_size=args.batch_size, shuffle=True, drop_last=True, num_workers=8,
    )
    test_loader = DataLoader(PointCloudDataset(args.data, "test", args.num_points), batch_size=args.test_batch_size, num_workers=8)

    model = DGCNNCls(num_classes=args.num_classes, k=args.k, emb_dims=args.emb_dims, dropout=args.dropout).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * 100, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs, eta_min=args.lr)
    scaler = torch.amp.GradScaler("cuda")

    best_acc = 0.0
    for epoch in range(args.epochs):
        model.train()
        train_loss, count, correct = 0.0, 0, 0
        for data, label in train_loader:
            data, label = data.to(device, non_blocking=True), label.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(data)
            loss = cal_loss(logits, label)  # expect: AMP002
            scaler.scale(loss).backward()
            scaler.step(opt)  # expect: AMP006
            count += data.size(0)
            train_loss += loss.item() * data.size(0)
            correct += (logits.argmax(dim=1) == label).sum().item()
        scheduler.step()

        acc, avg_acc, test_loss = test(model, test_loader, device)
        print(f"epoch {epoch}: train loss {train_loss / count:.4f} train acc {correct / count:.4f} "
              f"test loss {test_loss:.4f} test acc {acc:.4f} avg acc {avg_acc:.4f}")
        if acc >= best_acc:
            best_acc = acc
            torch.save(model.state_dict(), os.path.join(args.out_dir, "model.t7"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="DGCNN point cloud classification")
    parser.add_argument("--data", type=str, default="data/modelnet40")
    parser.add_argument("--out_dir", type=str, default="checkpoints/dgcnn")
    parser.add_argument("--num_classes", type=int, default=40)
    parser.add_argument("--num_points", type=int, default=1024)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--test_batch_size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=250)
    parser.add_argument("--lr", type=float, default=0.001)
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--emb_dims", type=int, default=1024)
    parser.add_argument("--dropout", type=float, default=0.5)
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    train(args)
