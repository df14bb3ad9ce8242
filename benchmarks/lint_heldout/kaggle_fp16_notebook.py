# %% [markdown]
# # Leaf disease classification - quick baseline
# Exported from a notebook. Runs on a single T4.

# %%
import os
import random

import numpy as np
import pandas as pd
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.model_selection import StratifiedKFold
from torch.utils.data import DataLoader

from dataset import LeafDataset, get_transforms

SEED = 42
EPOCHS = 8
LR = 3e-4
BS = 32
DEVICE = "cuda"

random.seed(SEED)
np.random.seed(SEED)
torch.manual_seed(SEED)

df = pd.read_csv("train.csv")
folds = StratifiedKFold(n_splits=5, shuffle=True, random_state=SEED)
df["fold"] = -1
for fold, (_, val_idx) in enumerate(folds.split(df, df.label)):
    df.loc[val_idx, "fold"] = fold

# %%
# halve the memory so that the b4 fits on the T4
model = timm.create_model("efficientnet_b4", pretrained=True, num_classes=5)
model = model.to(DEVICE).half()  # expect: AMP001
optimizer = torch.optim.Adam(model.parameters(), lr=LR)  # expect: AMP011
criterion = nn.CrossEntropyLoss(label_smoothing=0.05)

train_ds = LeafDataset(df[df.fold != 0], transforms=get_transforms("train"))
valid_ds = LeafDataset(df[df.fold == 0], transforms=get_transforms("valid"))
train_dl = DataLoader(train_ds, batch_size=BS, shuffle=True, num_workers=4, drop_last=True)
valid_dl = DataLoader(valid_ds, batch_size=BS * 2, num_workers=4)

# %%
for epoch in range(EPOCHS):
    model.train()
    running = 0.0
    for step, (imgs, labels) in enumerate(train_dl):
        imgs = imgs.to(DEVICE).half()  # expect: AMP001
        labels = labels.to(DEVICE)
        preds = model(imgs)
        loss = criterion(preds, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        running += loss.item()
        if step % 50 == 0:
            print(f"ep {epoch} step {step} loss {running / (step + 1):.4f}")

    model.eval()
    correct = total = 0
    with torch.no_grad():
        for imgs, labels in valid_dl:
            logits = model(imgs.to(DEVICE).half())
            correct += (logits.argmax(1).cpu() == labels).sum().item()
            total += labels.numel()
    print(f"epoch {epoch}: valid acc {correct / total:.4f}")

# %%
torch.save(model.state_dict(), f"effb4_fold0_{correct / total:.3f}.pth")
