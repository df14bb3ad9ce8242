"""Two-tower retrieval model with an auxiliary pointwise CTR head.

Sparse id features go through EmbeddingBag(sparse=True) tables trained with SparseAdam,
the dense towers with AdamW. bf16 autocast on A100/H100.
"""
import argparse
import logging

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.utils.data import DataLoader

from features import ClickLogDataset, collate_clicks  # project-local

logger = logging.getLogger("two_tower")


class Tower(nn.Module):
    def __init__(self, num_ids, num_dense, dim=128, hidden=512):
        super().__init__()
        self.emb = nn.EmbeddingBag(num_ids, dim, mode="sum", sparse=True)
        self.mlp = nn.Sequential(nn.Linear(dim + num_dense, hidden), nn.ReLU(), nn.Linear(hidden, dim))

    def forward(self, ids, offsets, dense):
        return self.mlp(torch.cat([self.emb(ids, offsets), dense], dim=1))


class TwoTower(nn.Module):
    def __init__(self, num_user_ids, num_item_ids, num_user_dense, num_item_dense, dim=128):
        super().__init__()
        self.user = Tower(num_user_ids, num_user_dense, dim)
        self.item = Tower(num_item_ids, num_item_dense, dim)
        self.ctr_head = nn.Sequential(nn.Linear(2 * dim, 256), nn.ReLU(), nn.Linear(256, 1), nn.Sigmoid())

    def forward(self, batch):
        u = self.user(batch["user_ids"], batch["user_offsets"], batch["user_dense"])
        i = self.item(batch["item_ids"], batch["item_offsets"], batch["item_dense"])
        ctr = self.ctr_head(torch.cat([u, i], dim=1)).squeeze(1)
        return u, i, ctr


def split_params(model):
    sparse = [p for n, p in model.named_parameters() if ".emb." in n]
    dense = [p for n, p in model.named_parameters() if ".emb." not in n]
    return sparse, dense


class RetrievalTrainer:
    def __init__(self, model, args):
        self.model = model
        self.args = args
        sparse, dense = split_params(model)
        self.sparse_opt = torch.optim.SparseAdam(sparse, lr=args.sparse_lr)
        self.dense_opt = torch.optim.AdamW(dense, lr=args.lr, weight_decay=args.wd)
        self.click_loss = nn.BCELoss()
        self.scaler = torch.amp.GradScaler("cuda")  # expect: AMP010

    def train_step(self, batch):
        self.model.train()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            u, i, ctr = self.model(batch)
            u, i = F.normalize(u, dim=-1), F.normalize(i, dim=-1)
            logits = torch.mm(u, i.t()) / self.args.temperature
            # z-score the in-batch scores so the temperature stays scale-free
            logits = (logits - logits.mean(dim=1, keepdim=True)) / logits.std(dim=1, keepdim=True).clamp_min(1e-3)  # expect: AMP004
            labels = torch.arange(logits.size(0), device=logits.device)
            retrieval_loss = F.cross_entropy(logits, labels)
            click_loss = self.click_loss(ctr, batch["click"].float())  # expect: AMP003
            loss = retrieval_loss + self.args.click_weight * click_loss
        self.sparse_opt.zero_grad()
        self.dense_opt.zero_grad()
        self.scaler.scale(loss).backward()
        self.scaler.step(self.dense_opt)
        self.sparse_opt.step()  # expect: AMP006
        self.scaler.update()
        return {"retrieval": retrieval_loss.item(), "click": click_loss.item()}

    @torch.no_grad()
    def evaluate(self, loader):
        self.model.eval()
        preds, clicks, total_bce, n = [], [], 0.0, 0
        for batch in loader:
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, _, ctr = self.model(batch)
                total_bce += F.binary_cross_entropy(ctr, batch["click"].float(), reduction="sum").item()  # expect: AMP003
            n += ctr.numel()
            preds.append(ctr.float().cpu())
            clicks.append(batch["click"].cpu())
        all_ctr, all_click = torch.cat(preds), torch.cat(clicks).float()
        # calibration log-loss recomputed in fp32 outside autocast on purpose
        logloss = F.binary_cross_entropy(all_ctr, all_click).item()
        auc = roc_auc_score(all_click.numpy(), all_ctr.numpy())
        return {"bce_sum_mean": total_bce / max(n, 1), "logloss": logloss, "auc": auc}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", required=True)
    parser.add_argument("--valid", required=True)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--sparse-lr", type=float, default=1e-2)
    parser.add_argument("--wd", type=float, default=1e-5)
    parser.add_argument("--temperature", type=float, default=0.05)
    parser.add_argument("--click-weight", type=float, default=0.3)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    train_ds, valid_ds = ClickLogDataset(args.train), ClickLogDataset(args.valid)
    train_loader = DataLoader(train_ds, batch_size=4096, shuffle=True, collate_fn=collate_clicks, num_workers=8)
    valid_loader = DataLoader(valid_ds, batch_size=8192, collate_fn=collate_clicks, num_workers=8)
    model = TwoTower(train_ds.num_user_ids, train_ds.num_item_ids, train_ds.num_user_dense, train_ds.num_item_dense).cuda()
    trainer = RetrievalTrainer(model, args)
    for epoch in range(args.epochs):
        for step, batch in enumerate(train_loader):
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
            stats = trainer.train_step(batch)
            if step % 200 == 0:
                logger.info("epoch %d step %d %s", epoch, step, stats)
        logger.info("epoch %d eval %s", epoch, trainer.evaluate(valid_loader))
        torch.save(model.state_dict(), f"two_tower_{epoch}.pt")
    np.save("item_vectors.npy", model.item.emb.weight.detach().float().cpu().numpy())


if __name__ == "__main__":
    main()
