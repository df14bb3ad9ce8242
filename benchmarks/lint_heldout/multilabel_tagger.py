"""Multi-label image tagger (audio-set style labels), simple script with a global autocast context."""
import argparse
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from tagger_data import TagDataset
from tagger_model import TaggerNet

p = argparse.ArgumentParser()
p.add_argument("--amp", action="store_true")
p.add_argument("--epochs", type=int, default=30)
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--warm-start", default=None)
args = p.parse_args()

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
amp_ctx = torch.amp.autocast(device_type="cuda", dtype=torch.float16) if args.amp else nullcontext()
scaler = torch.amp.GradScaler("cuda", enabled=args.amp)

model = TaggerNet(num_tags=527).to(device)
criterion = nn.BCELoss()
opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
loader = DataLoader(TagDataset("train"), batch_size=64, shuffle=True, num_workers=8)
val_loader = DataLoader(TagDataset("val"), batch_size=128, num_workers=8)

if args.warm_start:
    state = torch.load(args.warm_start, map_location="cpu")
    model.load_state_dict({k: v.float() for k, v in state.items()})

for epoch in range(args.epochs):
    model.train()
    for wave, tags in loader:
        wave, tags = wave.to(device), tags.to(device).float()
        with amp_ctx:
            probs = torch.sigmoid(model(wave))
            loss = criterion(probs, tags)  # expect: AMP003
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    model.eval()
    ap_num, ap_den = 0.0, 0.0
    with torch.no_grad(), amp_ctx:
        for wave, tags in val_loader:
            logits = model(wave.to(device))
            val_loss = F.binary_cross_entropy_with_logits(logits, tags.to(device).float())
            ap_num += val_loss.item()
            ap_den += 1
    print(f"epoch {epoch}: val bce {ap_num / ap_den:.4f}")

# fine-tune the classifier head only, on the balanced subset, no mixed precision
head_opt = torch.optim.SGD(model.head.parameters(), lr=1e-2)
for wave, tags in loader:
    probs = torch.sigmoid(model(wave.to(device)))
    loss = F.binary_cross_entropy(probs, tags.to(device).float())
    head_opt.zero_grad()
    loss.backward()
    head_opt.step()

# one more epoch with mixed precision and the clipped loss
for wave, tags in loader:
    with amp_ctx:
        logits = model(wave.to(device))
        loss = F.binary_cross_entropy(logits.sigmoid().clamp(1e-4, 1 - 1e-4), tags.to(device).float())  # expect: AMP003
        scaler.scale(loss).backward()  # expect: AMP008
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
