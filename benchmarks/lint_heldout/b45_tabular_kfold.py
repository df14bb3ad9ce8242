# Tabular binary classification with 5-fold CV, run on the CPU-only kernels (bf16 on Sapphire Rapids).
# Kaggle-notebook layout: CFG dict, train_fn / valid_fn / train_loop, OOF predictions.
import gc
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import StratifiedKFold
from torch.utils.data import DataLoader, Dataset

CFG = {
    "seed": 42, "n_fold": 5, "trn_fold": [0, 1, 2, 3, 4], "epochs": 20, "batch_size": 1024,
    "lr": 2e-3, "weight_decay": 1e-5, "d_model": 64, "dropout": 0.1, "apex": True,
    "max_grad_norm": 5.0, "gradient_accumulation_steps": 1, "patience": 4, "output_dir": "./fold_ckpts",
}
NUM_COLS = [f"num_{i}" for i in range(24)]
CAT_COLS = [f"cat_{i}" for i in range(8)]
CAT_CARDS = [32] * len(CAT_COLS)


class TabDataset(Dataset):
    def __init__(self, df, stats):
        self.x_num = torch.tensor(((df[NUM_COLS] - stats["mean"]) / stats["std"]).values, dtype=torch.float32)
        self.x_cat = torch.tensor(df[CAT_COLS].values, dtype=torch.long)
        self.y = torch.tensor(df["target"].values, dtype=torch.float32) if "target" in df else None

    def __len__(self):
        return len(self.x_num)

    def __getitem__(self, i):
        return self.x_num[i], self.x_cat[i], (self.y[i] if self.y is not None else torch.tensor(0.0))


class GatedFeatureSelector(nn.Module):
    """Soft feature selection: one sigmoid gate per numeric column, renormalised to sum to n_features."""

    def __init__(self, n_features):
        super().__init__()
        self.gate = nn.Linear(n_features, n_features)

    def forward(self, x):
        g = torch.sigmoid(self.gate(x))
        g = g / g.sum(dim=-1, keepdim=True)  # expect: AMP004
        return x * g * g.size(-1)


class TabAttnNet(nn.Module):
    def __init__(self, n_num, cat_cards, d_model, dropout):
        super().__init__()
        self.selector = GatedFeatureSelector(n_num)
        self.num_tokenizer = nn.Linear(1, d_model)
        self.cat_emb = nn.ModuleList([nn.Embedding(card, d_model) for card in cat_cards])
        layer = nn.TransformerEncoderLayer(d_model, 4, 2 * d_model, dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 3)
        self.pool_score = nn.Linear(d_model, 1)
        self.pool_value = nn.Linear(d_model, d_model)
        self.head = nn.Sequential(nn.Linear(d_model, d_model), nn.GELU(), nn.Dropout(dropout),
                                  nn.Linear(d_model, 1), nn.Sigmoid())

    def forward(self, x_num, x_cat):
        x_num = self.selector(x_num)
        num_tokens = self.num_tokenizer(x_num.unsqueeze(-1))
        cat_tokens = torch.stack([emb(x_cat[:, i]) for i, emb in enumerate(self.cat_emb)], dim=1)
        tokens = self.encoder(torch.cat([num_tokens, cat_tokens], dim=1))
        w = torch.softmax(self.pool_score(tokens), dim=1)
        pooled = (w * self.pool_value(tokens)).sum(dim=1)  # expect: AMP004
        return self.head(pooled).squeeze(-1)


class AverageMeter:
    def __init__(self):
        self.sum, self.count = 0.0, 0

    def update(self, val, n=1):
        self.sum, self.count = self.sum + val * n, self.count + n

    @property
    def avg(self):
        return self.sum / max(self.count, 1)


def train_fn(fold, train_loader, model, optimizer, scheduler, scaler, epoch, device):
    model.train()
    criterion = nn.BCELoss()
    losses = AverageMeter()
    for step, (x_num, x_cat, y) in enumerate(train_loader):
        x_num, x_cat, y = x_num.to(device), x_cat.to(device), y.to(device)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=CFG["apex"]):
            y_preds = model(x_num, x_cat)
            loss = criterion(y_preds, y)  # expect: AMP003
        losses.update(loss.item(), y.size(0))
        if CFG["gradient_accumulation_steps"] > 1:
            loss = loss / CFG["gradient_accumulation_steps"]
        scaler.scale(loss).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CFG["max_grad_norm"])  # expect: AMP005
        if (step + 1) % CFG["gradient_accumulation_steps"] == 0:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            scheduler.step()
    return losses.avg


def valid_fn(valid_loader, model, device):
    model.eval()
    criterion = nn.BCELoss()
    losses, preds = AverageMeter(), []
    for x_num, x_cat, y in valid_loader:
        x_num, x_cat, y = x_num.to(device), x_cat.to(device), y.to(device)
        with torch.no_grad():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=CFG["apex"]):
                y_preds = model(x_num, x_cat)
            loss = criterion(y_preds.float(), y)
        losses.update(loss.item(), y.size(0))
        preds.append(y_preds.float().numpy())
    return losses.avg, np.concatenate(preds)


def get_optimizer_params(model, weight_decay):
    no_decay = ["bias", "norm", "emb"]
    return [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]


def train_loop(folds, fold, device):
    print(f"========== fold: {fold} training ==========")
    trn_df, val_df = folds[folds["fold"] != fold].reset_index(drop=True), folds[folds["fold"] == fold].reset_index(drop=True)
    stats = {"mean": trn_df[NUM_COLS].mean(), "std": trn_df[NUM_COLS].std() + 1e-8}
    train_loader = DataLoader(TabDataset(trn_df, stats), batch_size=CFG["batch_size"], shuffle=True, drop_last=True)
    valid_loader = DataLoader(TabDataset(val_df, stats), batch_size=CFG["batch_size"] * 2, shuffle=False)

    model = TabAttnNet(len(NUM_COLS), CAT_CARDS, CFG["d_model"], CFG["dropout"]).to(device)
    optimizer = torch.optim.AdamW(get_optimizer_params(model, CFG["weight_decay"]), lr=CFG["lr"], eps=1e-8)
    num_train_steps = len(train_loader) * CFG["epochs"] // CFG["gradient_accumulation_steps"]
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=CFG["lr"], total_steps=num_train_steps)
    scaler = torch.amp.GradScaler("cpu", enabled=CFG["apex"])  # expect: AMP010

    best_score, bad_epochs, best_preds = -np.inf, 0, None
    for epoch in range(CFG["epochs"]):
        start = time.time()
        avg_loss = train_fn(fold, train_loader, model, optimizer, scheduler, scaler, epoch, device)
        val_loss, preds = valid_fn(valid_loader, model, device)
        score = roc_auc_score(val_df["target"].values, preds)
        print(f"Epoch {epoch + 1} - loss {avg_loss:.4f} val {val_loss:.4f} auc {score:.5f} {time.time() - start:.0f}s")
        if score > best_score:
            best_score, bad_epochs, best_preds = score, 0, preds
            torch.save({"model": model.state_dict(), "stats": stats, "preds": preds},
                       os.path.join(CFG["output_dir"], f"tabattn_fold{fold}_best.pth"))
        else:
            bad_epochs += 1
            if bad_epochs >= CFG["patience"]:
                break
    val_df["pred"] = best_preds
    del model, optimizer, scaler
    gc.collect()
    return val_df


@torch.inference_mode()
def predict_test(test_df, device):
    preds = []
    for fold in CFG["trn_fold"]:
        state = torch.load(os.path.join(CFG["output_dir"], f"tabattn_fold{fold}_best.pth"), weights_only=False)
        model = TabAttnNet(len(NUM_COLS), CAT_CARDS, CFG["d_model"], CFG["dropout"])
        model.load_state_dict(state["model"])
        model = model.to(device, dtype=torch.bfloat16).eval()
        x_num = torch.tensor(((test_df[NUM_COLS] - state["stats"]["mean"]) / state["stats"]["std"]).values)
        x_cat = torch.tensor(test_df[CAT_COLS].values, dtype=torch.long)
        preds.append(model(x_num.to(device, torch.bfloat16), x_cat.to(device)).float().numpy())
    return np.mean(preds, axis=0)


if __name__ == "__main__":
    os.makedirs(CFG["output_dir"], exist_ok=True)
    torch.manual_seed(CFG["seed"])
    device = torch.device("cpu")
    train = pd.read_csv("train.csv")
    skf = StratifiedKFold(n_splits=CFG["n_fold"], shuffle=True, random_state=CFG["seed"])
    for n, (_, val_idx) in enumerate(skf.split(train, train["target"])):
        train.loc[val_idx, "fold"] = n
    oof = pd.concat([train_loop(train, fold, device) for fold in CFG["trn_fold"]])
    print(f"CV AUC: {roc_auc_score(oof['target'].values, oof['pred'].values):.5f}")
    test = pd.read_csv("test.csv")
    pd.DataFrame({"id": test["id"], "target": predict_test(test, device)}).to_csv("submission.csv", index=False)
