"""HRNet-W32-style pose estimator: attentional multi-resolution fusion, heatmap + integral loss.

Old checkpoints were trained with torch.cuda.amp; this loop uses torch.amp (fp16 + GradScaler).
"""
import argparse
import copy
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


@dataclass
class PoseConfig:
    arch: str = "hrnet_w32"
    num_joints: int = 17
    widths: tuple = (32, 64, 128, 256)
    blocks_per_branch: int = 2
    num_stages: int = 3
    use_fusion_gate: bool = True
    image_size: tuple = (256, 192)
    integral_weight: float = 0.1
    softargmax_beta: float = 50.0
    lr: float = 1e-3
    epochs: int = 140
    clip_grad: float = 5.0
    amp: bool = True


def conv_bn(cin, cout, k=3, s=1):
    return nn.Sequential(nn.Conv2d(cin, cout, k, s, k // 2, bias=False), nn.BatchNorm2d(cout))


class BasicBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = conv_bn(c, c)
        self.conv2 = conv_bn(c, c)

    def forward(self, x):
        out = self.conv2(F.relu(self.conv1(x), inplace=True))
        return F.relu(out + x)


class FusionGate(nn.Module):
    """Squeeze-excitation style channel gate applied to each fused branch."""

    def __init__(self, c, r=4):
        super().__init__()
        self.proj = nn.Conv2d(c, c, 1)
        self.fc = nn.Sequential(nn.Conv2d(c, c // r, 1), nn.ReLU(inplace=True), nn.Conv2d(c // r, c, 1))

    def forward(self, y):
        y = self.proj(y)
        w = y.mean(dim=(2, 3), keepdim=True)  # expect: AMP004
        return y * torch.sigmoid(self.fc(w))


class HRModule(nn.Module):
    """Parallel branches followed by all-to-all exchange between resolutions."""

    def __init__(self, widths, n_blocks, use_gate):
        super().__init__()
        self.branches = nn.ModuleList(
            nn.Sequential(*[BasicBlock(c) for _ in range(n_blocks)]) for c in widths
        )
        self.fuse = nn.ModuleList()
        for i, ci in enumerate(widths):
            row = nn.ModuleList()
            for j, cj in enumerate(widths):
                if j > i:
                    row.append(nn.Sequential(conv_bn(cj, ci, k=1), nn.Upsample(scale_factor=2 ** (j - i))))
                elif j == i:
                    row.append(nn.Identity())
                else:
                    downs = [nn.Sequential(conv_bn(cj, cj, s=2), nn.ReLU()) for _ in range(i - j - 1)]
                    row.append(nn.Sequential(*downs, conv_bn(cj, ci, s=2)))
            self.fuse.append(row)
        self.gates = nn.ModuleList(FusionGate(c) if use_gate else nn.Identity() for c in widths)

    def forward(self, xs):
        xs = [branch(x) for branch, x in zip(self.branches, xs)]
        out = []
        for i, row in enumerate(self.fuse):
            y = xs[i]
            for j, op in enumerate(row):
                if j != i:
                    y = y + op(xs[j])
            out.append(self.gates[i](F.relu(y)))
        return out


class BranchAttention(nn.Module):
    """Scale attention over the upsampled branches (HRNetV2-style aggregation)."""

    def __init__(self, widths):
        super().__init__()
        self.score = nn.Conv2d(sum(widths), len(widths), 1)

    def forward(self, feats):
        g = torch.sigmoid(self.score(torch.cat(feats, dim=1)))
        g = g / (g.mean(dim=1, keepdim=True) + 1e-8)  # expect: AMP004, AMP011
        return [f * g[:, i : i + 1] for i, f in enumerate(feats)]


class HeatmapHead(nn.Module):
    def __init__(self, cin, num_joints):
        super().__init__()
        self.final = nn.Conv2d(cin, num_joints, 1)

    def forward(self, feat):
        heat = self.final(feat)
        peak = heat.flatten(2).amax(dim=-1)
        spread = heat.flatten(2).std(dim=-1)  # expect: AMP004
        conf = torch.sigmoid(peak / (spread + 1e-6))
        return heat, conf


def normalise_heatmaps(heat):
    heat = F.relu(heat)
    return heat / (heat.amax(dim=(2, 3), keepdim=True) + 1e-10)  # expect: AMP011


class SoftArgmax2d(nn.Module):
    """Integral pose regression: soft-argmax (x, y) of each joint heatmap."""

    def __init__(self, beta):
        super().__init__()
        self.beta = beta

    def forward(self, heat):
        b, k, h, w = heat.shape
        prob = F.softmax(heat.flatten(2) * self.beta, dim=-1)
        ys = torch.linspace(0.0, 1.0, h, device=heat.device)
        xs = torch.linspace(0.0, 1.0, w, device=heat.device)
        gy, gx = torch.meshgrid(ys, xs, indexing="ij")
        x = (prob * gx.reshape(-1)).sum(dim=-1)
        y = (prob * gy.reshape(-1)).sum(dim=-1)
        mass = prob.sum(dim=-1) + 1e-8
        return torch.stack([x / mass, y / mass], dim=-1)


class PoseHRNet(nn.Module):
    def __init__(self, cfg: PoseConfig):
        super().__init__()
        w = cfg.widths
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 3, 2, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
            nn.Conv2d(64, w[0], 3, 2, 1, bias=False), nn.BatchNorm2d(w[0]), nn.ReLU(inplace=True),
        )
        self.transitions = nn.ModuleList(
            nn.Sequential(*[conv_bn(w[0] if k == 0 else c, c, s=2) for k in range(i)]) if i else nn.Identity()
            for i, c in enumerate(w)
        )
        self.stages = nn.Sequential(
            *[HRModule(w, cfg.blocks_per_branch, cfg.use_fusion_gate) for _ in range(cfg.num_stages)]
        )
        self.branch_attn = BranchAttention(w)
        self.aggregate = nn.Sequential(nn.Conv2d(sum(w), w[0], 1), nn.BatchNorm2d(w[0]), nn.ReLU(inplace=True))
        self.head = HeatmapHead(w[0], cfg.num_joints)
        self.integral = SoftArgmax2d(cfg.softargmax_beta)

    def forward(self, img):
        x = self.stem(img)
        xs = self.stages([t(x) for t in self.transitions])
        size = xs[0].shape[-2:]
        ups = [xs[0]] + [F.interpolate(f, size=size, mode="bilinear", align_corners=False) for f in xs[1:]]
        feat = self.aggregate(torch.cat(self.branch_attn(ups), dim=1))
        heat, conf = self.head(feat)
        coords = self.integral(normalise_heatmaps(heat))
        return {"heatmaps": heat, "coords": coords, "confidence": conf}


MODELS = {
    "hrnet_w32": lambda cfg: PoseHRNet(cfg),
    "hrnet_w48": lambda cfg: PoseHRNet(PoseConfig(**{**vars(cfg), "widths": (48, 96, 192, 384)})),
}


def build_model(cfg):
    return MODELS[cfg.arch](cfg)


class JointsMSELoss(nn.Module):
    def __init__(self, use_target_weight=True):
        super().__init__()
        self.criterion = nn.MSELoss(reduction="none")
        self.use_target_weight = use_target_weight

    def forward(self, output, target, target_weight):
        b, k = output.shape[:2]
        loss = self.criterion(output.reshape(b, k, -1), target.reshape(b, k, -1)).mean(dim=-1)
        if self.use_target_weight:
            loss = loss * target_weight.squeeze(-1)
        return 0.5 * loss.mean()


def random_pose_loader(n, cfg, batch_size, shuffle=False):
    h, w = cfg.image_size
    k = cfg.num_joints
    data = TensorDataset(torch.randn(n, 3, h, w), torch.rand(n, k, h // 4, w // 4), torch.ones(n, k, 1), torch.rand(n, k, 2))
    return DataLoader(data, batch_size=batch_size, shuffle=shuffle, num_workers=4)


def train_one_epoch(model, loader, criterion, optimizer, scaler, cfg, epoch):
    model.train()
    for it, batch in enumerate(loader):
        img, target, target_weight, joints = (t.cuda(non_blocking=True) for t in batch)

        with torch.autocast("cuda", dtype=torch.float16, enabled=cfg.amp):
            out = model(img)
            hm_loss = criterion(out["heatmaps"], target, target_weight)
            vis = target_weight.squeeze(-1)
            coord_err = F.l1_loss(out["coords"], joints, reduction="none").sum(dim=-1)
            coord_loss = (coord_err * vis).sum() / vis.sum().clamp(min=1.0)
            loss = hm_loss + cfg.integral_weight * coord_loss

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if cfg.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()
        if it % 100 == 0:
            print(f"epoch {epoch} it {it} loss {loss.item():.5f} hm {hm_loss.item():.5f}")


@torch.no_grad()
def validate(model, loader):
    model.eval()
    total_conf, total_err, n = 0.0, 0.0, 0
    for img, _, _, joints in loader:
        img, joints = img.cuda(), joints.cuda()
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(img)
        heat = out["heatmaps"]
        total_conf += heat.flatten(2).mean(dim=-1).float().sum().item()
        err = (out["coords"] - joints).norm(dim=-1)
        total_err += err.mean().item() * img.size(0)
        n += img.size(0)
    return total_err / max(n, 1), total_conf / max(n, 1)


def export_onnx(model, path, cfg):
    m = copy.deepcopy(model).eval().half()
    dummy = torch.randn(1, 3, *cfg.image_size, device="cuda", dtype=torch.float16)
    torch.onnx.export(m, dummy, path, opset_version=17)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="hrnet_w32")
    parser.add_argument("--epochs", type=int, default=140)
    parser.add_argument("--no-amp", action="store_true")
    args = parser.parse_args()
    cfg = PoseConfig(arch=args.arch, epochs=args.epochs, amp=not args.no_amp)

    model = build_model(cfg).cuda()
    criterion = JointsMSELoss(use_target_weight=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, eps=1e-8, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[90, 120], gamma=0.1)
    scaler = torch.amp.GradScaler("cuda", enabled=cfg.amp)
    train_loader = random_pose_loader(1024, cfg, batch_size=32, shuffle=True)
    val_loader = random_pose_loader(128, cfg, batch_size=64)

    best_err = 1e9
    for epoch in range(cfg.epochs):
        train_one_epoch(model, train_loader, criterion, optimizer, scaler, cfg, epoch)
        scheduler.step()
        err, conf = validate(model, val_loader)
        if err < best_err:
            best_err = err; torch.save({"model": model.state_dict(), "epoch": epoch}, "hrnet_best.pth")
        print(f"epoch {epoch}: mean joint error {err:.4f}, mean heat {conf:.4f}")
    export_onnx(model, "hrnet.onnx", cfg)


if __name__ == "__main__":
    main()
