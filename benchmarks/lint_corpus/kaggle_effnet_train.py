"""Kaggle-style image competition training script (folds, OOF predictions, TTA)."""
import gc
import os
import random

import numpy as np
import pandas as pd
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.cuda.amp import GradScaler, autocast
from torch.utils.data import DataLoader, Dataset

CFG = {
    "model": "tf_efficientnet_b3_ns",
    "img_size": 512,
    "epochs": 10,
    "lr": 1e-4,
    "batch_size": 16,
    "accum": 2,
    "folds": 5,
    "apex": True,
    "max_grad_norm": 1000,
}
DEVICE = torch.device("cuda")


def seed_everything(seed=42):
    random.seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)
    torch.backends.cudnn.deterministic = True


class ImgDataset(Dataset):
    def __init__(self, df, transforms=None):
        self.df = df
        self.transforms = transforms

    def __len__(self):
        return len(self.df)

    def __getitem__(self, idx):
        img = np.load(self.df.iloc[idx]["path"])
        if self.transforms:
            img = self.transforms(image=img)["image"]
        return torch.from_numpy(img).permute(2, 0, 1).float() / 255.0, torch.tensor(self.df.iloc[idx]["target"]).float()


class FocalLoss(nn.Module):
    def __init__(self, alpha=0.25, gamma=2.0):
        super().__init__()
        self.alpha = alpha
        self.gamma = gamma

    def forward(self, logits, targets):
        bce = F.binary_cross_entropy_with_logits(logits, targets, reduction="none")
        pt = torch.exp(-bce)
        return (self.alpha * (1 - pt) ** self.gamma * bce).mean()


class Net(nn.Module):
    def __init__(self, name, pretrained=True):
        super().__init__()
        self.backbone = timm.create_model(name, pretrained=pretrained, num_classes=0)
        self.head = nn.Linear(self.backbone.num_features, 1)

    def forward(self, x):
        return self.head(self.backbone(x)).squeeze(-1)


def train_fn(loader, model, criterion, optimizer, scheduler, scaler):
    model.train()
    losses = []
    for step, (images, labels) in enumerate(loader):
        images = images.to(DEVICE)
        labels = labels.to(DEVICE)
        with autocast(enabled=CFG["apex"]):  # expect: AMP009
            y_preds = model(images)
        loss = criterion(y_preds, labels)  # expect: AMP002
        loss = loss / CFG["accum"]
        scaler.scale(loss).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CFG["max_grad_norm"])  # expect: AMP005
        if (step + 1) % CFG["accum"] == 0:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            scheduler.step()
        losses.append(loss.item() * CFG["accum"])
    return np.mean(losses), grad_norm


def valid_fn(loader, model, criterion):
    model.eval()
    preds, losses = [], []
    for images, labels in loader:
        images = images.to(DEVICE)
        labels = labels.to(DEVICE)
        with torch.no_grad():
            y_preds = model(images)
        losses.append(criterion(y_preds, labels).item())
        preds.append(y_preds.sigmoid().cpu().numpy())
    return np.mean(losses), np.concatenate(preds)


def inference_tta(model, loader):
    model.eval()
    model.half()
    out = []
    with torch.no_grad():
        for images, _ in loader:
            images = images.to(DEVICE).half()
            p = (model(images).sigmoid() + model(images.flip(-1)).sigmoid()) / 2
            out.append(p.float().cpu().numpy())
    return np.concatenate(out)


def train_loop(folds, fold):
    trn = folds[folds.fold != fold].reset_index(drop=True)
    val = folds[folds.fold == fold].reset_index(drop=True)
    train_loader = DataLoader(ImgDataset(trn), batch_size=CFG["batch_size"], shuffle=True, num_workers=4, drop_last=True)
    valid_loader = DataLoader(ImgDataset(val), batch_size=CFG["batch_size"] * 2, shuffle=False, num_workers=4)
    model = Net(CFG["model"]).to(DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=CFG["lr"], weight_decay=1e-6)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=CFG["lr"], total_steps=CFG["epochs"] * len(train_loader))
    criterion = FocalLoss()
    scaler = GradScaler(enabled=CFG["apex"])  # expect: AMP009
    best_score = -np.inf
    best_preds = None
    for epoch in range(CFG["epochs"]):
        avg_loss, _ = train_fn(train_loader, model, criterion, optimizer, scheduler, scaler)
        avg_val_loss, preds = valid_fn(valid_loader, model, nn.BCEWithLogitsLoss())
        score = roc_auc_score(val["target"].values, preds)
        if score > best_score:
            best_score = score
            best_preds = preds
            torch.save({"model": model.state_dict(), "preds": preds}, f"{CFG['model']}_fold{fold}_best.pth")
    val["pred"] = best_preds
    del model, optimizer
    gc.collect()
    torch.cuda.empty_cache()
    return val


if __name__ == "__main__":
    seed_everything()
    folds = pd.read_csv("train_folds.csv")
    oof = pd.concat([train_loop(folds, f) for f in range(CFG["folds"])])
    oof.to_csv("oof.csv", index=False)
