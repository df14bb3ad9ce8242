"""AMP002 in a file whose only module is a loss: the training function's ``model`` (bound by
no call here) is not taken for that loss."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class ClassBalancedFocal(nn.Module):
    def __init__(self, weights, gamma=2.0):
        super().__init__()
        self.gamma = gamma
        self.register_buffer("weights", weights)

    def forward(self, logits, target):
        logp = F.log_softmax(logits, dim=1)
        focal = (1 - logp.exp()) ** self.gamma * logp
        return F.nll_loss(focal, target, weight=self.weights)


def train_epoch(model, loader, optimizer, criterion, scaler):
    for points, labels in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(points)
        loss = criterion(logits, labels)  # AMP002
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
