"""DeepFM towers in an ESMM layout (pCTR, pCVR -> pCTCVR) on Ali-CCP style click logs.

    python train_deepfm_esmm.py --data /data/aliccp --epochs 2 --batch-size 4096

Each sample has sparse categorical fields, a few dense counters and the user's last
SEQ_LEN clicked item ids, which go through a small target-attention block (DIN style)
before the FM and the two deep towers.
"""

import argparse
import glob
import logging
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.utils.data import DataLoader, Dataset

logger = logging.getLogger("deepfm_esmm")

SPARSE_FIELDS = ["user_id", "item_id", "category_id", "shop_id", "brand_id",
                 "age", "gender", "city", "device", "hour"]
DENSE_FIELDS = ["user_ctr_7d", "item_ctr_7d", "item_price", "user_active_days"]
SEQ_LEN = 50


class AliCCPDataset(Dataset):
    def __init__(self, files, field_dims):
        df = pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)
        self.sparse = df[SPARSE_FIELDS].to_numpy(np.int64)
        self.dense = np.log1p(df[DENSE_FIELDS].to_numpy(np.float32).clip(min=0))
        hist = np.stack(df["hist_item_ids"].to_numpy())
        self.hist = hist[:, -SEQ_LEN:].astype(np.int64)
        self.click = df["click"].to_numpy(np.float32)
        self.conversion = df["conversion"].to_numpy(np.float32)
        self.offsets = np.concatenate([[0], np.cumsum(field_dims)[:-1]]).astype(np.int64)

    def __len__(self):
        return len(self.click)

    def __getitem__(self, i):
        hist = self.hist[i]
        return {
            "sparse": torch.from_numpy(self.sparse[i] + self.offsets),
            "dense": torch.from_numpy(self.dense[i]),
            "hist": torch.from_numpy(hist + self.offsets[1]),
            "hist_mask": torch.from_numpy(hist > 0),
            "click": torch.tensor(self.click[i]),
            "conversion": torch.tensor(self.conversion[i]),
        }


class TargetAttention(nn.Module):
    """Attention of the candidate item over the click history (DIN activation unit)."""

    def __init__(self, dim, hidden=64):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(4 * dim, hidden), nn.PReLU(), nn.Linear(hidden, 1))

    def forward(self, query, keys, mask):
        q = query.unsqueeze(1).expand_as(keys)
        scores = self.mlp(torch.cat([q, keys, q - keys, q * keys], dim=-1)).squeeze(-1)
        scores = scores.masked_fill(~mask, -1e9)  # expect: AMP007
        weights = torch.softmax(scores, dim=-1)
        return torch.bmm(weights.unsqueeze(1), keys).squeeze(1)


class FactorizationMachine(nn.Module):
    def forward(self, emb):
        square_of_sum = emb.sum(dim=1).pow(2)
        sum_of_square = emb.pow(2).sum(dim=1)
        return 0.5 * (square_of_sum - sum_of_square).sum(dim=1, keepdim=True)


class Tower(nn.Module):
    def __init__(self, in_dim, hidden=(256, 128, 64), dropout=0.2):
        super().__init__()
        layers = []
        for h in hidden:
            layers += [nn.Linear(in_dim, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Dropout(dropout)]
            in_dim = h
        layers.append(nn.Linear(in_dim, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


class DeepFMESMM(nn.Module):
    def __init__(self, field_dims, embed_dim=16):
        super().__init__()
        self.num_fields = len(field_dims)
        self.embedding = nn.Embedding(sum(field_dims), embed_dim)
        self.linear = nn.Embedding(sum(field_dims), 1)
        self.bias = nn.Parameter(torch.zeros(2))
        self.attention = TargetAttention(embed_dim)
        self.fm = FactorizationMachine()
        deep_in = (self.num_fields + 1) * embed_dim + len(DENSE_FIELDS)
        self.ctr_tower = Tower(deep_in)
        self.cvr_tower = Tower(deep_in)
        nn.init.normal_(self.embedding.weight, std=1e-3)
        nn.init.zeros_(self.linear.weight)

    def forward(self, sparse, dense, hist, hist_mask):
        emb = self.embedding(sparse)
        interest = self.attention(emb[:, 1], self.embedding(hist), hist_mask)
        fields = torch.cat([emb, interest.unsqueeze(1)], dim=1)
        first_order = self.linear(sparse).sum(dim=1)
        second_order = self.fm(fields)
        deep_in = torch.cat([fields.flatten(1), dense], dim=1)
        ctr_logit = self.bias[0] + first_order + second_order + self.ctr_tower(deep_in)
        cvr_logit = self.bias[1] + first_order + second_order + self.cvr_tower(deep_in)
        return torch.sigmoid(ctr_logit).squeeze(1), torch.sigmoid(cvr_logit).squeeze(1)


def load_field_dims(data_dir):
    meta = pd.read_json(os.path.join(data_dir, "meta.json"), typ="series")
    return [int(meta[f"{name}_vocab"]) for name in SPARSE_FIELDS]


@torch.no_grad()
def evaluate(model, loader, device, amp_enabled):
    model.eval()
    ctr_p, ctcvr_p, clicks, convs = [], [], [], []
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=amp_enabled):
            p_ctr, p_cvr = model(batch["sparse"], batch["dense"], batch["hist"], batch["hist_mask"])
        ctr_p.append(p_ctr.float().cpu())
        ctcvr_p.append((p_ctr.float() * p_cvr.float()).cpu())
        clicks.append(batch["click"].cpu())
        convs.append(batch["conversion"].cpu())
    ctr_p, ctcvr_p = torch.cat(ctr_p), torch.cat(ctcvr_p)
    clicks, convs = torch.cat(clicks), torch.cat(convs)
    model.train()
    return {
        "ctr_auc": roc_auc_score(clicks.numpy(), ctr_p.numpy()),
        "ctcvr_auc": roc_auc_score(convs.numpy(), ctcvr_p.numpy()),
        "ctr_logloss": F.binary_cross_entropy(ctr_p.clamp(1e-7, 1 - 1e-7), clicks).item(),
    }


def train(args):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    amp_enabled = device.type == "cuda"
    field_dims = load_field_dims(args.data)
    train_files = sorted(glob.glob(os.path.join(args.data, "train", "*.parquet")))
    valid_files = sorted(glob.glob(os.path.join(args.data, "valid", "*.parquet")))
    train_loader = DataLoader(AliCCPDataset(train_files, field_dims), batch_size=args.batch_size,
                              shuffle=True, num_workers=args.workers, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(AliCCPDataset(valid_files, field_dims), batch_size=4 * args.batch_size,
                              num_workers=args.workers, pin_memory=True)

    model = DeepFMESMM(field_dims, embed_dim=args.embed_dim).to(device)
    # the embedding table is >90% of the parameters: keep it in half to fit 2x the batch
    model.embedding.half()  # expect: AMP001
    emb_ids = {id(p) for p in model.embedding.parameters()}
    dense_params = [p for p in model.parameters() if id(p) not in emb_ids]
    emb_optimizer = torch.optim.Adam(model.embedding.parameters(), lr=args.emb_lr)  # expect: AMP011
    dense_optimizer = torch.optim.AdamW(dense_params, lr=args.lr, weight_decay=args.weight_decay)
    criterion = nn.BCELoss()

    best_auc, best_logloss = 0.0, 1e9
    global_step = 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            emb_optimizer.zero_grad(set_to_none=True)
            dense_optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=amp_enabled):  # expect: AMP010
                p_ctr, p_cvr = model(batch["sparse"], batch["dense"], batch["hist"], batch["hist_mask"])
                p_ctcvr = p_ctr * p_cvr
                ctr_loss = criterion(p_ctr, batch["click"])  # expect: AMP003
                ctcvr_loss = F.binary_cross_entropy(p_ctcvr, batch["conversion"])  # expect: AMP003
                loss = ctr_loss + args.ctcvr_weight * ctcvr_loss
                loss.backward()  # expect: AMP008
            emb_optimizer.step()
            dense_optimizer.step()
            global_step += 1

            if global_step % args.log_every == 0:
                logger.info("epoch %d step %d loss %.5f ctr %.5f ctcvr %.5f (%.1f samples/s)",
                            epoch, global_step, loss.item(), ctr_loss.item(), ctcvr_loss.item(),
                            args.log_every * args.batch_size / (time.time() - t0))
                t0 = time.time()

            if global_step % args.eval_every == 0:
                metrics = evaluate(model, valid_loader, device, amp_enabled)
                logger.info("eval step %d %s", global_step, metrics)
                if metrics["ctcvr_auc"] > best_auc:
                    best_auc = metrics["ctcvr_auc"]
                    best_logloss = min(best_logloss, metrics["ctr_logloss"])
                    torch.save({"model": model.state_dict(), "step": global_step,
                                "field_dims": field_dims, "metrics": metrics},
                               os.path.join(args.out, "best.pt"))
    logger.info("done: best ctcvr auc %.5f, best ctr logloss %.5f", best_auc, best_logloss)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/deepfm_esmm")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--embed-dim", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--emb-lr", type=float, default=1e-2)
    p.add_argument("--weight-decay", type=float, default=1e-6)
    p.add_argument("--ctcvr-weight", type=float, default=1.0)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--log-every", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=5000)
    return p.parse_args()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(2024)
    train(args)
