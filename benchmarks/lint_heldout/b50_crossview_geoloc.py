"""Cross-view geo-localisation (ground panorama -> satellite tile) with a
SAFA-style spatial-aware aggregation head and a soft-margin triplet loss.
Trains in pure fp16 to fit the large batches the in-batch negatives need."""
import argparse
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision


class SpatialAwareHead(nn.Module):
    """Spatial-aware feature aggregation: a few learned spatial embeddings pool the map."""

    def __init__(self, hw, n_maps=8):
        super().__init__()
        self.fc1 = nn.Linear(hw, hw // 2)
        self.fc2 = nn.Linear(hw // 2, hw * n_maps)
        self.n_maps = n_maps

    def forward(self, feat, valid=None):
        b, c, h, w = feat.shape
        pooled = feat.amax(dim=1).flatten(1)
        attn = self.fc2(F.relu(self.fc1(pooled))).view(b, self.n_maps, h * w)
        if valid is not None:
            attn = attn.masked_fill(~valid[:, None, :], -1e9)  # expect: AMP007
        attn = attn.softmax(dim=-1)
        desc = torch.einsum("bkn,bcn->bkc", attn, feat.flatten(2))
        return desc.flatten(1)


class CrossViewNet(nn.Module):
    def __init__(self, sat_hw=64, grd_hw=128, n_maps=8):
        super().__init__()
        self.sat_backbone = torchvision.models.vgg16(weights="DEFAULT").features[:-1]
        self.grd_backbone = torchvision.models.vgg16(weights="DEFAULT").features[:-1]
        self.sat_head = SpatialAwareHead(sat_hw, n_maps)
        self.grd_head = SpatialAwareHead(grd_hw, n_maps)

    def forward(self, sat, grd, grd_valid=None):
        return self.sat_head(self.sat_backbone(sat)), self.grd_head(self.grd_backbone(grd), grd_valid)


def soft_margin_triplet(sat_desc, grd_desc, alpha=10.0):
    sat_desc = F.normalize(sat_desc.float(), dim=-1)
    grd_desc = F.normalize(grd_desc.float(), dim=-1)
    dist = 2.0 - 2.0 * grd_desc @ sat_desc.t()
    pos = dist.diag()
    n = dist.shape[0]
    off = ~torch.eye(n, dtype=torch.bool, device=dist.device)
    loss_g2s = torch.log1p(torch.exp(alpha * (pos[:, None] - dist)))[off].mean()
    loss_s2g = torch.log1p(torch.exp(alpha * (pos[None, :] - dist)))[off].mean()
    return 0.5 * (loss_g2s + loss_s2g)


def recall_at_k(sat_desc, grd_desc, ks=(1, 5, 10)):
    dist = torch.cdist(grd_desc.float(), sat_desc.float())
    dist.fill_diagonal_(dist.diag().min().item() - 1.0)
    ranks = dist.argsort(dim=1)
    target = torch.arange(dist.shape[0], device=dist.device)[:, None]
    return {k: (ranks[:, :k] == target).any(1).float().mean().item() for k in ks}


def train(args):
    model = CrossViewNet().cuda()
    model = model.half()  # expect: AMP001
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)  # expect: AMP011
    loader = build_loader(args.root, args.batch_size, split="train")
    best_r1 = 0.0
    for epoch in range(args.epochs):
        model.train()
        for sat, grd, grd_valid in loader:
            sat = sat.cuda(non_blocking=True).half()  # expect: AMP001
            grd = grd.cuda(non_blocking=True)
            sat_desc, grd_desc = model(sat, grd, grd_valid.cuda())
            loss = soft_margin_triplet(sat_desc, grd_desc, args.alpha)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        r = evaluate(model, build_loader(args.root, 256, split="val"))
        if r[1] > best_r1:
            best_r1 = r[1]
            export_descriptor_model(model, f"{args.out}/safa_best.pt")
        print(f"epoch {epoch} loss {loss.item():.4f} r@1 {r[1]:.4f} best {best_r1:.4f}")


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    sats, grds = [], []
    for sat, grd, grd_valid in loader:
        with torch.cuda.amp.autocast():  # expect: AMP009
            s, g = model(sat.cuda(), grd.cuda(), grd_valid.cuda())
        sats.append(F.normalize(s.float(), dim=-1))
        grds.append(F.normalize(g.float(), dim=-1))
    return recall_at_k(torch.cat(sats), torch.cat(grds))


def export_descriptor_model(model, path):
    half_model = copy.deepcopy(model).half().eval()
    torch.save({"state_dict": half_model.state_dict()}, path)


def build_loader(root, batch_size, split):
    from cvusa import CVUSADataset  # project-local dataset

    ds = CVUSADataset(root, split=split, polar=True)
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=split == "train",
                                       num_workers=8, drop_last=split == "train")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", default="runs")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--alpha", type=float, default=10.0)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=32)
    train(p.parse_args())
