# Exported from a Jupyter notebook: fine-tune a ViT on a folder of images.
import copy
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torchvision import transforms

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# %% data
tfm = transforms.Compose([transforms.Resize(224), transforms.ToTensor()])
train_ds = torchvision.datasets.ImageFolder("data/train", transform=tfm)
val_ds = torchvision.datasets.ImageFolder("data/val", transform=tfm)
train_dl = torch.utils.data.DataLoader(train_ds, batch_size=64, shuffle=True, num_workers=4)
val_dl = torch.utils.data.DataLoader(val_ds, batch_size=128, num_workers=4)

# %% model
model = torchvision.models.vit_b_16(weights="IMAGENET1K_V1")
model.heads = nn.Linear(768, len(train_ds.classes))
model = model.to(device)
model.half()  # expect: AMP001

# %% optimizer
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-5, weight_decay=0.05, eps=1e-8)  # expect: AMP011
criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

# %% train
best_acc, best_state = 0.0, None
for epoch in range(5):
    model.train()
    t0 = time.time()
    for xb, yb in train_dl:
        xb, yb = xb.to(device).half(), yb.to(device)  # expect: AMP001
        out = model(xb)
        loss = criterion(out.float(), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    correct = 0
    with torch.no_grad():
        for xb, yb in val_dl:
            correct += (model(xb.to(device).half()).argmax(1) == yb.to(device)).sum().item()
    acc = correct / len(val_ds)
    if acc > best_acc:
        best_acc, best_state = acc, copy.deepcopy(model.state_dict())
    print(f"epoch {epoch}: acc {acc:.3f} ({time.time() - t0:.0f}s)")

# %% save
torch.save(best_state, "vit_best_fp16.pt")

# %% attention rollout for a few validation images
attn_masks = []
with torch.no_grad():
    x = next(iter(val_dl))[0][:4].to(device).half()
    feats = model._process_input(x)
    scores = feats @ feats.transpose(1, 2)
    scores = scores.masked_fill(torch.eye(scores.size(1), device=device, dtype=torch.bool), -1e9)  # expect: AMP007
    attn_masks.append(F.softmax(scores.float(), dim=-1))
