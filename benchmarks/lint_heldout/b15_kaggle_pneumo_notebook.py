#!/usr/bin/env python
# coding: utf-8

# # Pneumothorax classification + auxiliary segmentation head
# EfficientNet-B3 encoder, 5 folds, AWP from epoch 2, pseudo-label finetune at the end.


# In[1]:

import gc
import math
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
from sklearn.model_selection import StratifiedKFold
from torch.utils.data import DataLoader, Dataset, TensorDataset
from transformers import get_cosine_schedule_with_warmup


# In[2]:

class CFG:
    seed = 42
    model_name = "tf_efficientnet_b3_ns"
    img_size = 512
    epochs, batch_size, num_workers = 8, 16, 4
    lr = 3e-4
    weight_decay = 1e-2
    apex = True
    gradient_accumulation_steps = 2
    max_grad_norm = 1000
    seg_weight = 0.5
    print_freq = 50
    n_fold, trn_fold = 5, [0, 1, 2, 3, 4]
    awp_lr, awp_eps, awp_start_epoch = 1e-3, 1e-3, 2
    pseudo_lr, pseudo_epochs = 1e-5, 1
    OUTPUT_DIR = "./"


device = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def seed_everything(seed=42):
    random.seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)
    torch.backends.cudnn.deterministic = True


seed_everything(CFG.seed)


# In[3]:

class AverageMeter(object):
    def __init__(self):
        self.val = self.avg = self.sum = self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


def as_minutes(s):
    m = math.floor(s / 60)
    return f"{m}m {int(s - m * 60)}s"


# In[4]:

train = pd.read_csv("../input/siim-pneumo/train_folds.csv")
pseudo_df = pd.read_csv("../input/siim-pneumo-pseudo/pseudo.csv")
skf = StratifiedKFold(n_splits=CFG.n_fold, shuffle=True, random_state=CFG.seed)
for n, (_, val_idx) in enumerate(skf.split(train, train["has_pneumo"])):
    train.loc[val_idx, "fold"] = n


class TrainDataset(Dataset):
    def __init__(self, df, img_size):
        self.df = df.reset_index(drop=True)
        self.img_size = img_size

    def __len__(self):
        return len(self.df)

    def __getitem__(self, idx):
        row = self.df.iloc[idx]
        img = cv2.resize(cv2.imread(row["image_path"]), (self.img_size, self.img_size)).astype(np.float32) / 255.0
        mask = cv2.resize(cv2.imread(row["mask_path"], cv2.IMREAD_GRAYSCALE), (self.img_size, self.img_size))
        img = torch.from_numpy(img.transpose(2, 0, 1))
        mask = torch.from_numpy((mask > 127).astype(np.float32))[None]
        return img, torch.tensor(row["has_pneumo"], dtype=torch.float32), mask


# In[5]:

class PneumoModel(nn.Module):
    def __init__(self, model_name, pretrained=True):
        super().__init__()
        self.encoder = timm.create_model(model_name, pretrained=pretrained, features_only=True, out_indices=(3, 4))
        chs = self.encoder.feature_info.channels()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(chs[-1], 1)
        self.seg_head = nn.Sequential(nn.Conv2d(chs[0], 64, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(64, 1, 1))

    def forward(self, x):
        f3, f4 = self.encoder(x)
        logits = self.fc(self.pool(f4).flatten(1)).squeeze(-1)
        mask_logits = F.interpolate(self.seg_head(f3), size=x.shape[-2:], mode="bilinear", align_corners=False)
        return logits, mask_logits


# In[6]:

class AWP:
    def __init__(self, model, criterion, optimizer, apex, adv_param="weight", adv_lr=1.0, adv_eps=0.01):
        self.model = model
        self.criterion = criterion
        self.optimizer = optimizer
        self.apex = apex
        self.adv_param = adv_param
        self.adv_lr = adv_lr
        self.adv_eps = adv_eps
        self.backup, self.backup_eps = {}, {}

    def attack_backward(self, images, labels):
        self._save()
        self._attack_step()
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.apex):  # expect: AMP010
            y_preds, _ = self.model(images)
            adv_loss = self.criterion(y_preds, labels)
            adv_loss.backward()  # expect: AMP008
        self._restore()

    def _attack_step(self):
        e = 1e-6
        for name, param in self.model.named_parameters():
            if param.requires_grad and param.grad is not None and self.adv_param in name:
                norm1 = torch.norm(param.grad)
                norm2 = torch.norm(param.data.detach())
                if norm1 != 0 and not torch.isnan(norm1):
                    r_at = self.adv_lr * param.grad / (norm1 + e) * (norm2 + e)
                    param.data.add_(r_at)
                    param.data = torch.min(torch.max(param.data, self.backup_eps[name][0]), self.backup_eps[name][1])

    def _save(self):
        for name, param in self.model.named_parameters():
            if param.requires_grad and param.grad is not None and self.adv_param in name:
                if name not in self.backup:
                    self.backup[name] = param.data.clone()
                    grad_eps = self.adv_eps * param.abs().detach()
                    self.backup_eps[name] = (self.backup[name] - grad_eps, self.backup[name] + grad_eps)

    def _restore(self):
        for name, param in self.model.named_parameters():
            if name in self.backup:
                param.data = self.backup[name]
        self.backup, self.backup_eps = {}, {}


# In[7]:

def train_fn(fold, train_loader, model, criterion, optimizer, epoch, scheduler, device, awp=None):
    model.train()
    scaler = torch.cuda.amp.GradScaler(enabled=CFG.apex)  # expect: AMP009
    losses = AverageMeter()
    start = time.time()
    for step, (images, labels, masks) in enumerate(train_loader):
        images, labels, masks = images.to(device), labels.to(device), masks.to(device)
        batch_size = labels.size(0)
        with torch.cuda.amp.autocast(enabled=CFG.apex):  # expect: AMP009
            y_preds, mask_preds = model(images)
            cls_loss = criterion(y_preds, labels)
            seg_loss = F.binary_cross_entropy(mask_preds.sigmoid(), masks)  # expect: AMP003
            loss = cls_loss + CFG.seg_weight * seg_loss
        if CFG.gradient_accumulation_steps > 1:
            loss = loss / CFG.gradient_accumulation_steps
        losses.update(loss.item(), batch_size)
        scaler.scale(loss).backward()
        if awp is not None and epoch >= CFG.awp_start_epoch:
            awp.attack_backward(images, labels)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CFG.max_grad_norm)  # expect: AMP005
        if (step + 1) % CFG.gradient_accumulation_steps == 0:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            scheduler.step()
        if step % CFG.print_freq == 0 or step == (len(train_loader) - 1):
            print(f"Epoch: [{epoch + 1}][{step}/{len(train_loader)}] Elapsed {as_minutes(time.time() - start)} "
                  f"Loss: {losses.val:.4f}({losses.avg:.4f}) Grad: {grad_norm:.4f} LR: {scheduler.get_lr()[0]:.8f}")
    return losses.avg


def valid_fn(valid_loader, model, criterion, device):
    model.eval()
    losses = AverageMeter()
    preds = []
    for images, labels, masks in valid_loader:
        images, labels = images.to(device), labels.to(device)
        with torch.no_grad():
            y_preds, _ = model(images)
            loss = criterion(y_preds, labels)
        losses.update(loss.item(), labels.size(0))
        preds.append(y_preds.sigmoid().cpu().numpy())
    return losses.avg, np.concatenate(preds)


# In[8]:

def finetune_pseudo(model, pl_loader, device):
    model = model.half()  # expect: AMP001
    optimizer = torch.optim.AdamW(model.parameters(), lr=CFG.pseudo_lr, weight_decay=CFG.weight_decay)  # expect: AMP011
    criterion = nn.BCEWithLogitsLoss()
    model.train()
    for _ in range(CFG.pseudo_epochs):
        for images, pseudo_labels in pl_loader:
            images, pseudo_labels = images.to(device), pseudo_labels.to(device)
            y_preds, _ = model(images)
            loss = criterion(y_preds.float(), pseudo_labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return model


def inference_fn(test_loader, model, device):
    model = model.half().eval()
    preds = []
    with torch.no_grad():
        for images in test_loader:
            y_preds, _ = model(images.to(device).half())
            preds.append(y_preds.float().sigmoid().cpu().numpy())
    return np.concatenate(preds)


# In[9]:

def train_loop(folds, fold):
    print(f"========== fold: {fold} training ==========")
    train_folds = folds[folds["fold"] != fold].reset_index(drop=True)
    valid_folds = folds[folds["fold"] == fold].reset_index(drop=True)
    train_loader = DataLoader(TrainDataset(train_folds, CFG.img_size), batch_size=CFG.batch_size, shuffle=True,
                              num_workers=CFG.num_workers, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(TrainDataset(valid_folds, CFG.img_size), batch_size=CFG.batch_size * 2,
                              shuffle=False, num_workers=CFG.num_workers, pin_memory=True)

    model = PneumoModel(CFG.model_name).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=CFG.lr, weight_decay=CFG.weight_decay)
    num_train_steps = int(len(train_loader) / CFG.gradient_accumulation_steps * CFG.epochs)
    scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=0, num_training_steps=num_train_steps)
    criterion = nn.BCEWithLogitsLoss(reduction="mean")
    awp = AWP(model, criterion, optimizer, CFG.apex, adv_lr=CFG.awp_lr, adv_eps=CFG.awp_eps)

    best_score = -np.inf
    for epoch in range(CFG.epochs):
        start_time = time.time()
        avg_loss = train_fn(fold, train_loader, model, criterion, optimizer, epoch, scheduler, device, awp=awp)
        avg_val_loss, predictions = valid_fn(valid_loader, model, criterion, device)
        score = roc_auc_score(valid_folds["has_pneumo"].values, predictions)
        print(f"Epoch {epoch + 1} - avg_train_loss: {avg_loss:.4f} avg_val_loss: {avg_val_loss:.4f} "
              f"AUC: {score:.4f} time: {time.time() - start_time:.0f}s")
        if score > best_score:
            best_score = score
            torch.save({"model": model.state_dict(), "predictions": predictions},
                       CFG.OUTPUT_DIR + f"{CFG.model_name}_fold{fold}_best.pth")
    torch.cuda.empty_cache(); gc.collect()
    return model, best_score


# In[10]:

if __name__ == "__main__":
    scores = []
    for fold in CFG.trn_fold:
        model, score = train_loop(train, fold)
        scores.append(score)
    print(f"CV AUC: {np.mean(scores):.4f}")
    # pseudo-label images were cached as float16 arrays to fit the 13 GB notebook RAM
    pl_images = torch.from_numpy(np.load("../input/siim-pneumo-pseudo/images_fp16.npy"))
    pl_labels = torch.tensor(pseudo_df["label"].values, dtype=torch.float32)
    pl_loader = DataLoader(TensorDataset(pl_images, pl_labels), batch_size=CFG.batch_size, shuffle=True)
    model = finetune_pseudo(model, pl_loader, device)
    torch.save(model.state_dict(), CFG.OUTPUT_DIR + "pseudo_finetuned.pth")
