# ====================================================
# Multi-label image classification: backbone + pseudo labels + embedding head
# ====================================================
import gc
import os
import random
import time

import cv2
import numpy as np
import pandas as pd
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import KFold
from torch.utils.data import DataLoader, Dataset


class CFG:
    debug = False
    data_dir = "../input/plant-pathology-2021"
    model_name = "tf_efficientnet_b3_ns"
    img_size = 512
    num_classes = 6
    embed_dim = 1536
    batch_size = 16
    num_workers = 4
    epochs = 5
    lr = 2e-4
    weight_decay = 1e-6
    max_grad_norm = 1000
    n_fold = 5
    trn_fold = [0]
    pseudo_lr = 5e-5
    head_lr = 1e-3
    head_epochs = 20
    head_batch_size = 256
    seed = 42


def seed_everything(seed=42):
    random.seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)
    torch.backends.cudnn.deterministic = True


class TrainDataset(Dataset):
    def __init__(self, df, labels=None):
        self.paths = df["path"].values
        self.labels = labels

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, idx):
        image = cv2.imread(self.paths[idx])
        image = cv2.cvtColor(image, cv2.COLOR_BGR2RGB)
        image = cv2.resize(image, (CFG.img_size, CFG.img_size)).astype(np.float32) / 255.0
        image = torch.from_numpy(image.transpose(2, 0, 1))
        if self.labels is None:
            return image, torch.zeros(CFG.num_classes)
        return image, torch.tensor(self.labels[idx], dtype=torch.float32)


class CustomModel(nn.Module):
    def __init__(self, model_name, pretrained=True):
        super().__init__()
        self.backbone = timm.create_model(model_name, pretrained=pretrained, num_classes=0)
        self.fc = nn.Linear(self.backbone.num_features, CFG.num_classes)

    def embed(self, x):
        return self.backbone(x)

    def forward(self, x):
        return self.fc(self.embed(x))


class EmbeddingHead(nn.Module):
    def __init__(self, in_dim, num_classes, hidden=512):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_dim, hidden), nn.GELU(), nn.Dropout(0.2), nn.Linear(hidden, num_classes))

    def forward(self, x):
        return self.net(x)


def train_one_epoch(model, loader, optimizer, scheduler, scaler, device):
    criterion = nn.BCELoss()
    model.train()
    running, n = 0.0, 0
    for step, (images, targets) in enumerate(loader):
        images, targets = images.to(device), targets.to(device)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            logits = model(images)
            loss = criterion(logits.sigmoid(), targets)  # expect: AMP003
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CFG.max_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        running += loss.item() * images.size(0)
        n += images.size(0)
        if step % 50 == 0:
            print(f"  step {step}/{len(loader)} loss {running / n:.4f} grad {grad_norm:.2f}")
    return running / n


@torch.no_grad()
def predict(model, loader, device):
    model.eval()
    preds = []
    for images, _ in loader:
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            logits = model(images.to(device))
        preds.append(torch.sigmoid(logits).float().cpu().numpy())
    return np.concatenate(preds)


def valid_one_epoch(model, loader, device):
    preds = predict(model, loader, device)
    labels = np.concatenate([targets.numpy() for _, targets in loader])
    return roc_auc_score(labels, preds, average="macro"), preds


def pseudo_label_finetune(model, loader, device, epochs=1):
    optimizer = torch.optim.AdamW(model.parameters(), lr=CFG.pseudo_lr, weight_decay=CFG.weight_decay)
    model.train()
    for epoch in range(epochs):
        for images, soft_targets in loader:
            images, soft_targets = images.to(device), soft_targets.to(device)
            with torch.autocast(device_type="cuda", dtype=torch.float16):  # expect: AMP010
                logits = model(images)
                loss = F.binary_cross_entropy(torch.sigmoid(logits), soft_targets)  # expect: AMP003
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return model


def extract_embeddings(model, loader, device):
    feats = torch.empty(len(loader.dataset), CFG.embed_dim, dtype=torch.float16, device=device)
    model.eval()
    pos = 0
    with torch.no_grad():
        for images, _ in loader:
            with torch.autocast(device_type="cuda", dtype=torch.float16):
                emb = model.embed(images.to(device))
            feats[pos:pos + emb.size(0)] = emb
            pos += emb.size(0)
    mu = feats.float().mean(dim=0, keepdim=True).to(feats.dtype)
    sigma = feats.std(dim=0, keepdim=True) + 1e-8  # expect: AMP011
    return (feats - mu) / sigma


def fit_head(feats, labels, device):
    head = EmbeddingHead(CFG.embed_dim, CFG.num_classes).to(device).half()  # expect: AMP001
    optimizer = torch.optim.Adam(head.parameters(), lr=CFG.head_lr, eps=1e-8)  # expect: AMP011
    y = torch.as_tensor(labels, device=device, dtype=feats.dtype)
    head.train()
    for epoch in range(CFG.head_epochs):
        perm = torch.randperm(feats.size(0), device=device)
        for idx in perm.split(CFG.head_batch_size):
            logits = head(feats[idx])
            loss = F.binary_cross_entropy_with_logits(logits, y[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return head


def main():
    seed_everything(CFG.seed)
    device = torch.device("cuda")
    train = pd.read_csv(os.path.join(CFG.data_dir, "train_folds.csv"))
    test = pd.read_csv(os.path.join(CFG.data_dir, "test.csv"))
    label_cols = [c for c in train.columns if c.startswith("label_")]
    if CFG.debug:
        train = train.sample(n=500, random_state=CFG.seed).reset_index(drop=True)

    kf = KFold(n_splits=CFG.n_fold, shuffle=True, random_state=CFG.seed)
    for fold, (trn_idx, val_idx) in enumerate(kf.split(train)):
        if fold not in CFG.trn_fold:
            continue
        trn_df, val_df = train.iloc[trn_idx].reset_index(drop=True), train.iloc[val_idx].reset_index(drop=True)
        trn_ds = TrainDataset(trn_df, trn_df[label_cols].values)
        val_ds = TrainDataset(val_df, val_df[label_cols].values)
        trn_loader = DataLoader(trn_ds, batch_size=CFG.batch_size, shuffle=True, num_workers=CFG.num_workers,
                                pin_memory=True, drop_last=True)
        val_loader = DataLoader(val_ds, batch_size=CFG.batch_size * 2, shuffle=False, num_workers=CFG.num_workers)

        model = CustomModel(CFG.model_name).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=CFG.lr, weight_decay=CFG.weight_decay)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=CFG.epochs * len(trn_loader))
        scaler = torch.amp.GradScaler("cuda")

        best_auc = 0.0
        for epoch in range(CFG.epochs):
            start = time.time()
            avg_loss = train_one_epoch(model, trn_loader, optimizer, scheduler, scaler, device)
            auc, _ = valid_one_epoch(model, val_loader, device)
            print(f"fold {fold} epoch {epoch + 1} loss {avg_loss:.4f} auc {auc:.4f} {time.time() - start:.0f}s")
            if auc > best_auc:
                best_auc = auc
                torch.save(model.state_dict(), f"{CFG.model_name}_fold{fold}_best.pth")

        test_ds = TrainDataset(test)
        test_loader = DataLoader(test_ds, batch_size=CFG.batch_size * 2, shuffle=False, num_workers=CFG.num_workers)
        test_probs = predict(model, test_loader, device)
        pseudo_ds = TrainDataset(test, test_probs)
        pseudo_loader = DataLoader(pseudo_ds, batch_size=CFG.batch_size, shuffle=True, num_workers=CFG.num_workers)
        model = pseudo_label_finetune(model, pseudo_loader, device)

        feats = extract_embeddings(model, DataLoader(trn_ds, batch_size=64, num_workers=CFG.num_workers), device)
        head = fit_head(feats, trn_df[label_cols].values, device)
        torch.save(head.state_dict(), f"head_fold{fold}.pth")

        del model, head, feats
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
