#!/usr/bin/env python
# coding: utf-8

# # BirdCLEF 2024 — log-mel CNN baseline (5 folds, AMP)
#
# Exported from the competition notebook. Waveforms are 5 s crops at 32 kHz,
# the front end builds log-mel spectrograms on the GPU.

# In[1]:


import gc
import math
import os
import random
import time

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


# In[2]:


class CFG:
    seed = 42
    n_fold = 5
    trn_fold = [0, 1, 2, 3, 4]
    epochs = 8
    batch_size = 64
    lr = 1e-3
    weight_decay = 1e-6
    apex = True
    sr = 32000
    n_fft = 1024
    hop = 320
    n_mels = 128
    num_classes = 182
    max_grad_norm = 1000
    print_freq = 100
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def seed_everything(seed=42):
    random.seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)


seed_everything(CFG.seed)


# In[3]:


train_df = pd.read_csv("/kaggle/input/birdclef-2024/train_metadata.csv")
labels = sorted(train_df["primary_label"].unique())
label2id = {l: i for i, l in enumerate(labels)}
train_df["fold"] = train_df.index % CFG.n_fold


class BirdDataset(Dataset):
    def __init__(self, df, root="/kaggle/input/birdclef-2024/waves"):
        self.df = df.reset_index(drop=True)
        self.root = root

    def __len__(self):
        return len(self.df)

    def __getitem__(self, idx):
        row = self.df.iloc[idx]
        wav = np.load(os.path.join(self.root, row["filename"] + ".npy"))[: CFG.sr * 5]
        wav = np.pad(wav, (0, CFG.sr * 5 - len(wav)))
        target = np.zeros(CFG.num_classes, dtype=np.float32)
        target[label2id[row["primary_label"]]] = 1.0
        return torch.from_numpy(wav).float(), torch.from_numpy(target)


# In[4]:


def mel_filterbank(sr, n_fft, n_mels, fmin=50.0, fmax=14000.0):
    def hz_to_mel(f):
        return 2595.0 * math.log10(1.0 + f / 700.0)

    mels = torch.linspace(hz_to_mel(fmin), hz_to_mel(fmax), n_mels + 2)
    hz = 700.0 * (10 ** (mels / 2595.0) - 1.0)
    bins = torch.floor((n_fft + 1) * hz / sr).long()
    fb = torch.zeros(n_fft // 2 + 1, n_mels)
    for m in range(1, n_mels + 1):
        lo, c, hi = bins[m - 1].item(), bins[m].item(), bins[m + 1].item()
        for k in range(lo, c):
            fb[k, m - 1] = (k - lo) / max(c - lo, 1)
        for k in range(c, hi):
            fb[k, m - 1] = (hi - k) / max(hi - c, 1)
    return fb


class LogMel(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("window", torch.hann_window(CFG.n_fft))
        self.register_buffer("mel_basis", mel_filterbank(CFG.sr, CFG.n_fft, CFG.n_mels))

    def forward(self, wav):
        spec = torch.stft(wav, CFG.n_fft, CFG.hop, window=self.window, return_complex=True)
        power = spec.abs().pow(2).transpose(1, 2)
        mel = torch.matmul(power, self.mel_basis)
        return torch.log(mel + 1e-10).transpose(1, 2)  # expect: AMP011


def conv_block(c_in, c_out):
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
        nn.AvgPool2d(2),
    )


class BirdModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.frontend = LogMel()
        self.bn0 = nn.BatchNorm2d(1)
        self.encoder = nn.Sequential(
            conv_block(1, 32), conv_block(32, 64), conv_block(64, 128),
            nn.Conv2d(128, 256, 3, padding=1),
        )
        self.dropout = nn.Dropout(0.3)
        self.fc = nn.Linear(256, CFG.num_classes)

    def forward(self, wav):
        x = self.bn0(self.frontend(wav).unsqueeze(1))
        x = F.relu(self.encoder(x))
        x = torch.mean(x, dim=2)  # expect: AMP004
        x, _ = torch.max(x, dim=2)
        return self.fc(self.dropout(x))


# In[5]:


class AverageMeter:
    def __init__(self):
        self.sum, self.count, self.avg = 0.0, 0, 0.0

    def update(self, val, n=1):
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


def train_fn(fold, train_loader, model, criterion, optimizer, epoch, scheduler):
    model.train()
    scaler = torch.cuda.amp.GradScaler(enabled=CFG.apex)  # expect: AMP009
    losses = AverageMeter()
    start = time.time()
    for step, (inputs, labels) in enumerate(train_loader):
        inputs = inputs.to(CFG.device)
        labels = labels.to(CFG.device)
        batch_size = labels.size(0)
        with torch.cuda.amp.autocast(enabled=CFG.apex):  # expect: AMP009
            y_preds = model(inputs)
        loss = criterion(y_preds, labels)  # expect: AMP002
        losses.update(loss.item(), batch_size)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CFG.max_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        scheduler.step()
        if step % CFG.print_freq == 0 or step == len(train_loader) - 1:
            print(f"Epoch {epoch + 1} [{step}/{len(train_loader)}] "
                  f"loss {losses.avg:.4f} grad {grad_norm:.3f} {time.time() - start:.0f}s")
    return losses.avg


def valid_fn(valid_loader, model, criterion):
    model.eval()
    losses = AverageMeter()
    preds = []
    for inputs, labels in valid_loader:
        inputs, labels = inputs.to(CFG.device), labels.to(CFG.device)
        with torch.no_grad():
            y_preds = model(inputs)
        loss = criterion(y_preds, labels)
        losses.update(loss.item(), labels.size(0))
        preds.append(y_preds.sigmoid().cpu().numpy())
    return losses.avg, np.concatenate(preds)


# In[6]:


def train_loop(folds, fold):
    trn = folds[folds["fold"] != fold]
    val = folds[folds["fold"] == fold]
    train_loader = DataLoader(BirdDataset(trn), batch_size=CFG.batch_size, shuffle=True, num_workers=4, drop_last=True)
    valid_loader = DataLoader(BirdDataset(val), batch_size=CFG.batch_size * 2, shuffle=False, num_workers=4)

    model = BirdModel().to(CFG.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=CFG.lr, weight_decay=CFG.weight_decay, eps=1e-8)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=CFG.lr, epochs=CFG.epochs, steps_per_epoch=len(train_loader))
    criterion = nn.BCEWithLogitsLoss()

    best_score = -1e9
    for epoch in range(CFG.epochs):
        avg_loss = train_fn(fold, train_loader, model, criterion, optimizer, epoch, scheduler)
        avg_val_loss, preds = valid_fn(valid_loader, model, criterion)
        score = -avg_val_loss
        print(f"Epoch {epoch + 1} - avg_train_loss: {avg_loss:.4f} avg_val_loss: {avg_val_loss:.4f}")
        if score > best_score:
            best_score = score
            torch.save({"model": model.state_dict(), "preds": preds}, f"birdclef_fold{fold}_best.pth")
    torch.cuda.empty_cache()
    gc.collect()
    return best_score


def inference(model_paths, test_loader):
    model = BirdModel().to(CFG.device)
    outs = []
    for path in model_paths:
        model.load_state_dict(torch.load(path)["model"])
        model.eval().half()
        with torch.no_grad():
            outs.append(torch.cat([model(x.to(CFG.device).half()).float().sigmoid() for x in test_loader]))
    return torch.stack(outs).mean(0)


# In[7]:


for fold in range(CFG.n_fold):
    if fold in CFG.trn_fold:
        print(f"========== fold: {fold} training ==========")
        train_loop(train_df, fold)
