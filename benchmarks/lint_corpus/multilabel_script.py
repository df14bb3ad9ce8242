"""Multi-label image tagging: a flat training script with bf16 autocast on Ampere GPUs."""
import os

import torch
import torch.nn as nn
import torchvision

EPOCHS = int(os.environ.get("EPOCHS", 20))
DEVICE = "cuda"
AMP_DTYPE = torch.bfloat16

model = torchvision.models.efficientnet_b0(num_classes=80).to(DEVICE)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
criterion = nn.BCEWithLogitsLoss()
scaler = torch.amp.GradScaler(DEVICE)  # expect: AMP010
loader = torch.utils.data.DataLoader([], batch_size=64)


class TaggingHead(nn.Module):
    def __init__(self, dim, n):
        super().__init__()
        self.fc = nn.Linear(dim, n)
        self.loss = nn.BCELoss()

    def forward(self, feats, targets=None):
        probs = torch.sigmoid(self.fc(feats))
        if targets is None:
            return probs
        return probs, self.loss(probs, targets)  # expect: AMP003


head = TaggingHead(1280, 80).to(DEVICE)

for epoch in range(EPOCHS):
    model.train()
    for images, targets in loader:
        images, targets = images.to(DEVICE), targets.to(DEVICE).float()
        with torch.autocast(device_type="cuda", dtype=AMP_DTYPE):
            logits = model(images)
            loss = criterion(logits, targets)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    with torch.autocast(device_type="cuda", dtype=AMP_DTYPE):
        feats = model.features(images).mean((2, 3))
        _, head_loss = head(feats, targets)
    print(f"epoch {epoch} loss {loss.item():.4f} head {head_loss.item():.4f}")

torch.save(model.state_dict(), "tagger.pt")
