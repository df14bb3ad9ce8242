#!/usr/bin/env python
# coding: utf-8

# # UBC-OCEAN | tile MIL baseline [train]
# exported from ubc-ocean-effnet-mil-train.ipynb (v14, CV 0.571 / LB 0.55)
#
# * 16 random 256px tiles per slide, attention-MIL pooling over tiles
# * auxiliary tile-level tumour/stroma head (tile labels from the supplemental masks)
# * 5-fold StratifiedGroupKFold on patient id

# In[1]:

import os
import gc
import time
import random
import warnings

import cv2
import numpy as np
import pandas as pd
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset, DataLoader
from torch.optim.lr_scheduler import CosineAnnealingWarmRestarts
from torch.cuda.amp import autocast, GradScaler
from sklearn.model_selection import StratifiedGroupKFold
from sklearn.metrics import balanced_accuracy_score

warnings.filterwarnings("ignore")


# In[2]:

CFG = {
    "apex": True, "print_freq": 50, "num_workers": 8, "seed": 42,
    "model_name": "tf_efficientnet_b0_ns", "n_tiles": 16, "tile_size": 256,
    "epochs": 10, "lr": 2e-4, "min_lr": 1e-6, "T_0": 10, "weight_decay": 1e-6,
    "batch_size": 4, "gradient_accumulation_steps": 4, "max_grad_norm": 1000, "aux_weight": 0.3,
    "n_fold": 5, "trn_fold": [0, 1, 2, 3, 4],
    "target_cols": ["CC", "EC", "HGSC", "LGSC", "MC"],
}
TILE_DIR = "../input/ubc-ocean-tiles-256/"
OUTPUT_DIR = "./"
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")


# In[3]:

def seed_torch(seed=42):
    random.seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)
    torch.backends.cudnn.deterministic = True


def get_score(y_true, y_pred):
    return balanced_accuracy_score(y_true, y_pred.argmax(1))


class AverageMeter(object):
    def __init__(self):
        self.val, self.avg, self.sum, self.count = 0, 0, 0, 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


def timeSince(since, percent):
    s = time.time() - since
    es = s / (percent + 1e-9)
    return "%dm %ds (remain %dm %ds)" % (s // 60, s % 60, (es - s) // 60, (es - s) % 60)


seed_torch(seed=CFG["seed"])


# In[4]:

class TileDataset(Dataset):
    def __init__(self, df, train=True):
        self.df = df.reset_index(drop=True)
        self.train = train
        self.labels = df["label_id"].values

    def __len__(self):
        return len(self.df)

    def __getitem__(self, idx):
        row = self.df.iloc[idx]
        folder = os.path.join(TILE_DIR, str(row["image_id"]))
        files = sorted(os.listdir(folder))
        if self.train:
            random.shuffle(files)
        files = files[: CFG["n_tiles"]]
        tiles = np.zeros((CFG["n_tiles"], 3, CFG["tile_size"], CFG["tile_size"]), dtype=np.float32)
        tile_mask = np.zeros(CFG["n_tiles"], dtype=bool)
        tile_labels = np.zeros(CFG["n_tiles"], dtype=np.float32)
        for i, f in enumerate(files):
            img = cv2.cvtColor(cv2.imread(os.path.join(folder, f)), cv2.COLOR_BGR2RGB)
            if self.train and random.random() < 0.5:
                img = img[:, ::-1]
            tiles[i] = (img.astype(np.float32) / 255.0 - 0.5).transpose(2, 0, 1) / 0.25
            tile_mask[i] = True
            tile_labels[i] = float("_tumor" in f)
        return torch.from_numpy(tiles), torch.from_numpy(tile_mask), torch.tensor(self.labels[idx]), torch.from_numpy(tile_labels)


# In[5]:

class GeM(nn.Module):
    def __init__(self, p=3, eps=1e-6):
        super().__init__()
        self.p = nn.Parameter(torch.ones(1) * p)
        self.eps = eps

    def forward(self, x):
        return F.avg_pool2d(x.clamp(min=self.eps).pow(self.p), (x.size(-2), x.size(-1))).pow(1.0 / self.p)


class TileMILModel(nn.Module):
    def __init__(self, model_name, n_classes, pretrained=False):
        super().__init__()
        self.backbone = timm.create_model(model_name, pretrained=pretrained, num_classes=0, global_pool="")
        n_features = self.backbone.num_features
        self.pool = GeM()
        self.attention = nn.Sequential(nn.Linear(n_features, 256), nn.Tanh(), nn.Linear(256, 1))
        self.head = nn.Linear(n_features, n_classes)
        self.aux_head = nn.Linear(n_features, 1)

    def forward(self, tiles, tile_mask):
        bs, n = tiles.shape[:2]
        feats = self.backbone(tiles.flatten(0, 1))
        feats = self.pool(feats).flatten(1).view(bs, n, -1)
        a = self.attention(feats).squeeze(-1)
        a = a.masked_fill(~tile_mask, torch.finfo(a.dtype).min)
        w = torch.softmax(a, dim=1)
        slide = torch.bmm(w.unsqueeze(1).to(feats.dtype), feats).squeeze(1)
        return self.head(slide), self.aux_head(feats).squeeze(-1)


# tile-level auxiliary target (tumour vs. stroma), probabilities from the aux head
bce = nn.BCELoss()


# In[6]:

def train_fn(fold, train_loader, model, criterion, optimizer, epoch, scheduler, scaler, device):
    model.train()
    losses = AverageMeter()
    start = time.time()
    global_step = 0
    grad_norm = torch.tensor(0.0)
    for step, (tiles, tile_mask, labels, tile_labels) in enumerate(train_loader):
        tiles = tiles.to(device, non_blocking=True)
        tile_mask = tile_mask.to(device)
        labels = labels.to(device)
        tile_labels = tile_labels.to(device)
        batch_size = labels.size(0)
        with autocast(enabled=CFG["apex"], dtype=torch.bfloat16):  # expect: AMP009
            y_preds, tile_logits = model(tiles, tile_mask)
            loss = criterion(y_preds, labels)
            tile_probs = torch.sigmoid(tile_logits)[tile_mask]
            aux_loss = bce(tile_probs, tile_labels[tile_mask])  # expect: AMP003
            loss = loss + CFG["aux_weight"] * aux_loss
            if CFG["gradient_accumulation_steps"] > 1:
                loss = loss / CFG["gradient_accumulation_steps"]
            losses.update(loss.item(), batch_size)
            scaler.scale(loss).backward()  # expect: AMP008
        if (step + 1) % CFG["gradient_accumulation_steps"] == 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CFG["max_grad_norm"])  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            global_step += 1
            scheduler.step()
        if step % CFG["print_freq"] == 0 or step == (len(train_loader) - 1):
            print(
                f"Epoch: [{epoch + 1}][{step}/{len(train_loader)}] "
                f"Elapsed {timeSince(start, float(step + 1) / len(train_loader))} "
                f"Loss: {losses.val:.4f}({losses.avg:.4f}) Grad: {grad_norm:.4f} "
                f"LR: {scheduler.get_last_lr()[0]:.8f}"
            )
    return losses.avg


def valid_fn(valid_loader, model, criterion, device):
    losses = AverageMeter()
    model.eval()
    preds = []
    for step, (tiles, tile_mask, labels, _) in enumerate(valid_loader):
        tiles = tiles.to(device)
        tile_mask = tile_mask.to(device)
        labels = labels.to(device)
        with torch.no_grad():
            y_preds, _ = model(tiles, tile_mask)
        loss = criterion(y_preds, labels)
        losses.update(loss.item(), labels.size(0))
        preds.append(y_preds.softmax(1).to("cpu").numpy())
    return losses.avg, np.concatenate(preds)


# In[7]:

def get_scheduler(optimizer):
    return CosineAnnealingWarmRestarts(optimizer, T_0=CFG["T_0"], T_mult=1, eta_min=CFG["min_lr"], last_epoch=-1)


def train_loop(folds, fold):
    print(f"========== fold: {fold} training ==========")
    trn_idx = folds[folds["fold"] != fold].index
    val_idx = folds[folds["fold"] == fold].index
    train_folds = folds.loc[trn_idx].reset_index(drop=True)
    valid_folds = folds.loc[val_idx].reset_index(drop=True)
    valid_labels = valid_folds["label_id"].values

    train_loader = DataLoader(TileDataset(train_folds, train=True), batch_size=CFG["batch_size"], shuffle=True,
                              num_workers=CFG["num_workers"], pin_memory=True, drop_last=True)
    valid_loader = DataLoader(TileDataset(valid_folds, train=False), batch_size=CFG["batch_size"] * 2, shuffle=False,
                              num_workers=CFG["num_workers"], pin_memory=True, drop_last=False)

    model = TileMILModel(CFG["model_name"], len(CFG["target_cols"]), pretrained=True)
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=CFG["lr"], weight_decay=CFG["weight_decay"])
    scheduler = get_scheduler(optimizer)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    scaler = GradScaler(enabled=CFG["apex"])  # expect: AMP009 AMP010

    best_score = 0.0
    best_loss = np.inf
    for epoch in range(CFG["epochs"]):
        start_time = time.time()
        avg_loss = train_fn(fold, train_loader, model, criterion, optimizer, epoch, scheduler, scaler, device)
        avg_val_loss, preds = valid_fn(valid_loader, model, criterion, device)
        score = get_score(valid_labels, preds)
        elapsed = time.time() - start_time
        print(f"Epoch {epoch + 1} - avg_train_loss: {avg_loss:.4f}  avg_val_loss: {avg_val_loss:.4f}  time: {elapsed:.0f}s")
        print(f"Epoch {epoch + 1} - Score: {score:.4f}")
        if avg_val_loss < best_loss:
            best_loss = avg_val_loss
        if score > best_score:
            best_score = score
            print(f"Epoch {epoch + 1} - Save Best Score: {best_score:.4f} Model")
            torch.save({"model": model.state_dict(), "preds": preds},
                       OUTPUT_DIR + f"{CFG['model_name']}_fold{fold}_best.pth")

    valid_folds[[f"pred_{c}" for c in CFG["target_cols"]]] = torch.load(
        OUTPUT_DIR + f"{CFG['model_name']}_fold{fold}_best.pth", map_location="cpu")["preds"]
    del model, optimizer, scaler
    torch.cuda.empty_cache()
    gc.collect()
    return valid_folds


# In[8]:

def inference(model_paths, test_loader, device):
    model = TileMILModel(CFG["model_name"], len(CFG["target_cols"]), pretrained=False)
    probs = []
    for path in model_paths:
        model.load_state_dict(torch.load(path, map_location="cpu")["model"])
        model.to(device).eval().half()
        fold_probs = []
        with torch.no_grad():
            for tiles, tile_mask, _, _ in test_loader:
                y_preds, _ = model(tiles.to(device).half(), tile_mask.to(device))
                fold_probs.append(y_preds.float().softmax(1).cpu().numpy())
        probs.append(np.concatenate(fold_probs))
    return np.mean(probs, axis=0)


# In[9]:

if __name__ == "__main__":
    train = pd.read_csv("../input/UBC-OCEAN/train.csv")
    train["label_id"] = train["label"].map({c: i for i, c in enumerate(CFG["target_cols"])})
    folds = train.copy()
    sgkf = StratifiedGroupKFold(n_splits=CFG["n_fold"], shuffle=True, random_state=CFG["seed"])
    for n, (_, val_index) in enumerate(sgkf.split(folds, folds["label_id"], folds["patient_id"])):
        folds.loc[val_index, "fold"] = int(n)
    folds["fold"] = folds["fold"].astype(int)

    oof_df = pd.DataFrame()
    for fold in range(CFG["n_fold"]):
        if fold in CFG["trn_fold"]:
            _oof_df = train_loop(folds, fold)
            oof_df = pd.concat([oof_df, _oof_df])
            score = get_score(_oof_df["label_id"].values, _oof_df[[f"pred_{c}" for c in CFG["target_cols"]]].values)
            print(f"========== fold: {fold} result: {score:<.4f} ==========")
    oof_df = oof_df.reset_index(drop=True)
    print(f"CV: {get_score(oof_df['label_id'].values, oof_df[[f'pred_{c}' for c in CFG['target_cols']]].values):.4f}")
    oof_df.to_csv(OUTPUT_DIR + "oof_df.csv", index=False)
