"""Fine-tune a compact Transformer encoder for multi-label comment classification.

Input is pre-tokenized JSONL: {"input_ids": [...], "labels": [0, 1, 0, 0, 1, 0]}.
"""
import argparse
import json
import math
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

LABELS = ["toxic", "severe_toxic", "obscene", "threat", "insult", "identity_hate"]


@dataclass
class EncoderConfig:
    vocab_size: int = 30522
    hidden: int = 384
    layers: int = 6
    heads: int = 6
    intermediate: int = 1536
    max_len: int = 256
    dropout: float = 0.1
    layer_norm_eps: float = 1e-12
    num_labels: int = len(LABELS)
    pooling: str = "mean"


class SelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.num_heads = cfg.heads
        self.head_dim = cfg.hidden // cfg.heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, attention_mask):
        B, L, _ = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        # additive mask over the key dimension
        ext_mask = (1.0 - attention_mask[:, None, None, :].to(scores.dtype)) * -1e9  # expect: AMP007
        probs = self.drop(F.softmax(scores + ext_mask, dim=-1))
        attn_out = torch.matmul(probs, v).transpose(1, 2).reshape(B, L, -1)
        return self.out(attn_out)


class EncoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attn = SelfAttention(cfg)
        self.ln1 = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps)
        self.ffn = nn.Sequential(
            nn.Linear(cfg.hidden, cfg.intermediate), nn.GELU(), nn.Linear(cfg.intermediate, cfg.hidden)
        )
        self.ln2 = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, attention_mask):
        x = self.ln1(x + self.drop(self.attn(x, attention_mask)))
        return self.ln2(x + self.drop(self.ffn(x)))


class TextClassifier(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden, padding_idx=0)
        self.pos = nn.Embedding(cfg.max_len, cfg.hidden)
        self.emb_ln = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.layers))
        self.pooling = cfg.pooling
        self.dropout = nn.Dropout(cfg.dropout)
        self.classifier = nn.Linear(cfg.hidden, cfg.num_labels)

    def forward(self, input_ids, attention_mask):
        positions = torch.arange(input_ids.size(1), device=input_ids.device)
        hidden = self.emb_ln(self.tok(input_ids) + self.pos(positions)[None])
        for layer in self.layers:
            hidden = layer(hidden, attention_mask)
        if self.pooling == "max":
            keep = attention_mask.bool().unsqueeze(-1)
            pooled = hidden.masked_fill(~keep, -1e5).max(dim=1).values
        elif self.pooling == "cls":
            pooled = hidden[:, 0]
        else:
            m = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
        return self.classifier(self.dropout(pooled))


class JsonlDataset(Dataset):
    def __init__(self, path, max_len):
        with open(path) as f:
            self.rows = [json.loads(line) for line in f if line.strip()]
        self.max_len = max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = self.rows[i]
        return row["input_ids"][: self.max_len], row["labels"]


def collate(batch):
    max_len = max(len(ids) for ids, _ in batch)
    input_ids = torch.zeros(len(batch), max_len, dtype=torch.long)
    attention_mask = torch.zeros(len(batch), max_len, dtype=torch.long)
    for i, (ids, _) in enumerate(batch):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention_mask[i, : len(ids)] = 1
    labels = torch.tensor([lab for _, lab in batch], dtype=torch.float32)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def linear_warmup_decay(optimizer, warmup, total):
    def fn(step):
        if step < warmup:
            return step / max(1, warmup)
        return max(0.0, (total - step) / max(1, total - warmup))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


@torch.no_grad()
def evaluate(model, loader, device, use_amp, threshold=0.5):
    model.eval()
    all_probs, all_labels, total_loss = [], [], 0.0
    for batch in loader:
        labels = batch["labels"].to(device)
        with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=use_amp):
            logits = model(batch["input_ids"].to(device), batch["attention_mask"].to(device))
            total_loss += F.binary_cross_entropy_with_logits(logits, labels).item()
        all_probs.append(torch.sigmoid(logits.float()).cpu())
        all_labels.append(labels.cpu())
    probs, labels = torch.cat(all_probs), torch.cat(all_labels)
    preds = (probs > threshold).float()
    tp = (preds * labels).sum(0)
    fp = (preds * (1 - labels)).sum(0)
    fn = ((1 - preds) * labels).sum(0)
    f1 = 2 * tp / (2 * tp + fp + fn).clamp(min=1.0)
    model.train()
    return total_loss / max(1, len(loader)), f1.mean().item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--train-file", required=True)
    p.add_argument("--val-file", required=True)
    p.add_argument("--init-checkpoint", default=None)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup-ratio", type=float, default=0.06)
    p.add_argument("--pooling", choices=["mean", "max", "cls"], default="mean")
    p.add_argument("--no-amp", action="store_true")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--out", default="out/classifier")
    args = p.parse_args()

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    cfg = EncoderConfig(pooling=args.pooling)
    model = TextClassifier(cfg)
    if args.init_checkpoint:
        missing, unexpected = model.load_state_dict(torch.load(args.init_checkpoint, map_location="cpu"), strict=False)
        print(f"loaded encoder: {len(missing)} missing, {len(unexpected)} unexpected keys")
    model.to(device)

    train_loader = DataLoader(JsonlDataset(args.train_file, cfg.max_len), batch_size=args.batch_size,
                              shuffle=True, collate_fn=collate, num_workers=4)
    val_loader = DataLoader(JsonlDataset(args.val_file, cfg.max_len), batch_size=64, collate_fn=collate)

    no_decay = ("bias", "ln1.weight", "ln2.weight", "emb_ln.weight")
    groups = [
        {"params": [p_ for n, p_ in model.named_parameters() if not n.endswith(no_decay)], "weight_decay": args.weight_decay},
        {"params": [p_ for n, p_ in model.named_parameters() if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.999), eps=1e-8)
    total_steps = args.epochs * len(train_loader) // args.grad_accum
    scheduler = linear_warmup_decay(optimizer, int(args.warmup_ratio * total_steps), total_steps)

    use_amp = device.type == "cuda" and not args.no_amp
    scaler = torch.amp.GradScaler("cuda", enabled=use_amp)
    criterion = nn.BCELoss()

    best_f1 = 0.0
    for epoch in range(args.epochs):
        model.train()
        running = 0.0
        for step, batch in enumerate(train_loader):
            input_ids = batch["input_ids"].to(device, non_blocking=True)
            attention_mask = batch["attention_mask"].to(device, non_blocking=True)
            labels = batch["labels"].to(device, non_blocking=True)
            with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=use_amp):
                logits = model(input_ids, attention_mask)
                loss = criterion(torch.sigmoid(logits), labels)  # expect: AMP003
            running += loss.item()
            loss = scaler.scale(loss / args.grad_accum)
            loss.backward()
            if (step + 1) % args.grad_accum == 0:
                optimizer.step()  # expect: AMP006
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            if (step + 1) % 200 == 0:
                print(f"epoch {epoch} step {step + 1} loss {running / 200:.4f}")
                running = 0.0
        val_loss, macro_f1 = evaluate(model, val_loader, device, use_amp)
        print(f"epoch {epoch}: val_loss {val_loss:.4f} macro_f1 {macro_f1:.4f}")
        if macro_f1 > best_f1:
            best_f1 = macro_f1
            os.makedirs(args.out, exist_ok=True)
            torch.save(model.state_dict(), os.path.join(args.out, "best.pt"))


if __name__ == "__main__":
    main()
