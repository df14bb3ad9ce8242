# %% [markdown]
# # Leaf disease classification - AMP version (the one that made the leaderboard)

# %%
import copy
import random

import numpy as np
import pandas as pd
import timm
import torch
import torch.nn as nn
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

# %%
model = timm.create_model("efficientnet_b4", pretrained=True, num_classes=5).to(DEVICE)
optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=1e-2)
criterion = nn.CrossEntropyLoss(label_smoothing=0.05)
scaler = torch.amp.GradScaler("cuda")

train_dl = DataLoader(LeafDataset(df[df.fold != 0], transforms=get_transforms("train")), batch_size=BS, shuffle=True)
valid_dl = DataLoader(LeafDataset(df[df.fold == 0], transforms=get_transforms("valid")), batch_size=BS * 2)

# %%
best_acc = 0.0
for epoch in range(EPOCHS):
    model.train()
    for step, (imgs, labels) in enumerate(train_dl):
        imgs, labels = imgs.to(DEVICE), labels.to(DEVICE)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            preds = model(imgs)
            loss = criterion(preds, labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        scaler.step(optimizer)
        scaler.update()

    model.eval()
    correct = total = 0
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.float16):
        for imgs, labels in valid_dl:
            logits = model(imgs.to(DEVICE))
            correct += (logits.argmax(1).cpu() == labels).sum().item()
            total += labels.numel()
    acc = correct / total
    print(f"epoch {epoch}: valid acc {acc:.4f}")
    if acc > best_acc:
        best_acc = acc
        # fp16 copy for the submission kernel, the training model stays fp32
        half_model = copy.deepcopy(model).half()
        torch.save(half_model.state_dict(), "effb4_best_fp16.pth")

# %%
# TTA inference for the submission
model.load_state_dict(torch.load("effb4_best.pth"))
model.half().eval()
with torch.no_grad():
    test_logits = [model(imgs.to(DEVICE).half()) for imgs, _ in valid_dl]
