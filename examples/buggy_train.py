"""Fine-tune a small transformer for multi-label tagging with fp16 mixed precision.

A realistic GPU training script that carries the AMP bugs real projects ship. Each
buggy line ends with the code ``flake8 --select=AMP`` reports for it (``# AMPxxx``);
everything else is idiomatic and must stay quiet. The fixed version of each line is
on the rule's page under docs/rules/.
"""
import argparse
import copy
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float = 0.1):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, padding_mask):
        batch, length, dim = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
        scores = scores.masked_fill(padding_mask[:, None, None, :], -1e9)  # AMP007
        weights = self.dropout(scores.softmax(dim=-1))
        out = (weights @ v).transpose(1, 2).reshape(batch, length, dim)
        return self.proj(out)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, padding_mask):
        x = x + self.attn(self.norm1(x), padding_mask)
        return x + self.mlp(self.norm2(x))


class Tagger(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, depth: int, tags: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, tags)

    def forward(self, tokens):
        padding_mask = tokens == 0
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, padding_mask)
        pooled = x.masked_fill(padding_mask[..., None], 0.0).sum(1)
        pooled = pooled / (~padding_mask).sum(1, keepdim=True).clamp(min=1)
        return self.head(self.norm(pooled))


def synthetic_data(samples: int, length: int, vocab: int, tags: int):
    tokens = torch.randint(1, vocab, (samples, length))
    tokens[:, length // 2:] *= torch.rand(samples, 1) > 0.3
    labels = torch.stack([(tokens == t + 1).any(1) for t in range(tags)], dim=1).float()
    return TensorDataset(tokens, labels)


def warmup_head(model, loader, device, steps):
    """Train only the classifier head for a few steps before unfreezing the encoder."""
    optimizer = torch.optim.SGD(model.head.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda")
    for step, (tokens, labels) in enumerate(loader):
        if step == steps:
            break
        tokens, labels = tokens.to(device), labels.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.binary_cross_entropy_with_logits(model(tokens), labels)
        optimizer.zero_grad(set_to_none=True)
        loss = scaler.scale(loss)
        loss.backward()
        optimizer.step()  # AMP006


def train_epoch(model, loader, optimizer, scaler, device, clip):
    model.train()
    total = 0.0
    for tokens, labels in loader:
        tokens, labels = tokens.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            probs = torch.sigmoid(model(tokens))
            loss = F.binary_cross_entropy(probs, labels)  # AMP003
        scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)  # AMP005
        scaler.step(optimizer)
        scaler.update()
        total += loss.item()
    return total / len(loader)


def benchmark_step(model, tokens, labels, optimizer, scaler):
    """One timed iteration for the throughput table in the README."""
    with torch.autocast("cuda", dtype=torch.float16):
        loss = F.binary_cross_entropy_with_logits(model(tokens), labels)
        scaler.scale(loss).backward()  # AMP008
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = count = 0
    for tokens, labels in loader:
        tokens, labels = tokens.to(device), labels.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(tokens)
        correct += ((logits > 0).float() == labels).sum().item()
        count += labels.numel()
    return correct / count


def export_fp16(model, path):
    """Half-precision copy for serving; the training model keeps its fp32 weights."""
    torch.save(copy.deepcopy(model).half().state_dict(), path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--out", default="tagger-fp16.pt")
    args = parser.parse_args()

    device = torch.device("cuda")
    torch.manual_seed(0)
    train_set, val_set = synthetic_data(2048, 64, 1000, 8), synthetic_data(256, 64, 1000, 8)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, pin_memory=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size)

    model = Tagger(vocab=1000, dim=128, heads=4, depth=2, tags=8).to(device)
    warmup_head(model, train_loader, device, steps=50)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    scaler = torch.cuda.amp.GradScaler()  # AMP009

    best_train_loss = 1e9
    for epoch in range(args.epochs):
        train_loss = train_epoch(model, train_loader, optimizer, scaler, device, args.clip)
        accuracy = evaluate(model, val_loader, device)
        print(f"epoch {epoch}: train loss {train_loss:.4f}, val accuracy {accuracy:.3f}")
        if train_loss < best_train_loss:
            best_train_loss = train_loss
            export_fp16(model, args.out)


if __name__ == "__main__":
    main()
