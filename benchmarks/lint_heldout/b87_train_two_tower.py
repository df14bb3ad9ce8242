"""Joint training of a two-tower retrieval model and a pointwise CTR ranker.

Data: an .npz of interaction logs with user/item ids, K categorical features per
side and a click label. Retrieval uses in-batch negatives with a sigmoid loss.
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset


class InteractionLog(Dataset):
    def __init__(self, path):
        data = np.load(path)
        self.user_id = torch.from_numpy(data["user_id"]).long()
        self.item_id = torch.from_numpy(data["item_id"]).long()
        self.user_cats = torch.from_numpy(data["user_cats"]).long()
        self.item_cats = torch.from_numpy(data["item_cats"]).long()
        self.clicked = torch.from_numpy(data["clicked"]).float()

    def __len__(self):
        return self.user_id.numel()

    def __getitem__(self, i):
        return {
            "user_id": self.user_id[i], "item_id": self.item_id[i],
            "user_cats": self.user_cats[i], "item_cats": self.item_cats[i],
            "clicked": self.clicked[i],
        }


class Tower(nn.Module):
    def __init__(self, num_ids, num_cats, dim=64, hidden=256):
        super().__init__()
        self.id_emb = nn.Embedding(num_ids, dim)
        self.cat_emb = nn.Embedding(num_cats, dim, padding_idx=0)
        self.mlp = nn.Sequential(
            nn.Linear(2 * dim, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, dim),
        )

    def forward(self, ids, cats):
        x = torch.cat([self.id_emb(ids), self.cat_emb(cats).sum(dim=1)], dim=-1)
        return self.mlp(x)


class CTRRanker(nn.Module):
    def __init__(self, dim=64):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(3 * dim, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 1), nn.Sigmoid(),
        )

    def forward(self, u, v):
        return self.mlp(torch.cat([u, v, u * v], dim=-1)).squeeze(-1)


class RecModel(nn.Module):
    def __init__(self, num_users, num_items, num_user_cats, num_item_cats, dim=64):
        super().__init__()
        self.user_tower = Tower(num_users, num_user_cats, dim)
        self.item_tower = Tower(num_items, num_item_cats, dim)
        self.ranker = CTRRanker(dim)


def train_epoch(model, loader, optimizer, device, args, epoch):
    model.train()
    bce = nn.BCELoss()
    t0 = time.time()
    for step, batch in enumerate(loader):
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast(device_type="cuda", dtype=torch.float16):  # expect: AMP010
            u = model.user_tower(batch["user_id"], batch["user_cats"])
            v = model.item_tower(batch["item_id"], batch["item_cats"])
            logits = u @ v.t() / args.temperature
            probs = torch.sigmoid(logits)
            targets = torch.eye(logits.size(0), device=device)
            log_p = torch.log(probs + 1e-8)  # expect: AMP011
            log_not_p = torch.log(1 - probs + 1e-8)  # expect: AMP011
            retrieval_loss = -(targets * log_p + (1 - targets) * log_not_p).mean()
            ctr_loss = bce(model.ranker(u, v), batch["clicked"])  # expect: AMP003
            loss = retrieval_loss + args.ctr_weight * ctr_loss
            pos_logit = logits.diagonal().mean()  # expect: AMP004

        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()

        if step % args.log_every == 0:
            print(f"epoch {epoch} step {step} loss {loss.item():.4f} retr {retrieval_loss.item():.4f} "
                  f"ctr {ctr_loss.item():.4f} pos_logit {pos_logit.item():.3f} "
                  f"({(time.time() - t0) / (step + 1) * 1000:.1f} ms/it)")


@torch.no_grad()
def build_item_index(model, item_cats, device, chunk=8192):
    model.eval()
    vecs = []
    num_items = item_cats.size(0)
    for start in range(0, num_items, chunk):
        ids = torch.arange(start, min(start + chunk, num_items), device=device)
        v = model.item_tower(ids, item_cats[ids]).half()
        vecs.append(v / v.norm(dim=-1, keepdim=True))
    return torch.cat(vecs)


@torch.no_grad()
def recall_at_k(model, index, loader, device, k=50):
    model.eval()
    hits, total = 0, 0
    for batch in loader:
        batch = {key: val.to(device) for key, val in batch.items()}
        pos = batch["clicked"] > 0
        if not pos.any():
            continue
        u = model.user_tower(batch["user_id"][pos], batch["user_cats"][pos]).half()
        topk = (u @ index.t()).topk(k, dim=-1).indices
        hits += (topk == batch["item_id"][pos].unsqueeze(1)).any(dim=1).sum().item()
        total += int(pos.sum().item())
    model.train()
    return hits / max(1, total)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--valid", required=True)
    p.add_argument("--item-features", required=True, help=".npy with item_cats per item id")
    p.add_argument("--num-users", type=int, required=True)
    p.add_argument("--num-user-cats", type=int, default=5000)
    p.add_argument("--num-item-cats", type=int, default=20000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--temperature", type=float, default=0.05)
    p.add_argument("--ctr-weight", type=float, default=0.5)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--out", default="runs/two_tower")
    args = p.parse_args()

    device = torch.device("cuda")
    item_cats = torch.from_numpy(np.load(args.item_features)).long().to(device)
    model = RecModel(args.num_users, item_cats.size(0), args.num_user_cats, args.num_item_cats, args.dim).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    train_loader = DataLoader(InteractionLog(args.train), batch_size=args.batch_size, shuffle=True,
                              num_workers=4, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(InteractionLog(args.valid), batch_size=args.batch_size, num_workers=2)

    os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_epoch(model, train_loader, optimizer, device, args, epoch)
        index = build_item_index(model, item_cats, device)
        recall = recall_at_k(model, index, valid_loader, device)
        print(f"epoch {epoch}: recall@50 {recall:.4f}")
        if recall > best:
            best = recall
            torch.save({"model": model.state_dict(), "epoch": epoch, "recall@50": recall},
                       os.path.join(args.out, "best.pt"))


if __name__ == "__main__":
    main()
