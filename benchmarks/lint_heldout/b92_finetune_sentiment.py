#!/usr/bin/env python
# Fine-tune a BERT-style encoder on our product-review sentiment CSVs.
# Usage: python finetune_sentiment.py --train data/train.csv --valid data/valid.csv
import argparse
import copy
import csv
import math
import os

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup


class ReviewDataset(Dataset):
    def __init__(self, path, tokenizer, max_len=256):
        self.rows = []
        with open(path, newline="", encoding="utf-8") as f:
            for row in csv.DictReader(f):
                self.rows.append((row["text"], int(row["label"])))
        self.tokenizer = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, idx):
        text, label = self.rows[idx]
        enc = self.tokenizer(text, truncation=True, max_length=self.max_len, padding="max_length",
                             return_tensors="pt")
        item = {k: v.squeeze(0) for k, v in enc.items()}
        item["labels"] = torch.tensor(label, dtype=torch.long)
        return item


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-name", default="bert-base-uncased")
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--output-dir", default="checkpoints/sentiment")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--grad-accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--warmup-ratio", type=float, default=0.06)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--log-every", type=int, default=50)
    return ap.parse_args()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            out = model(**batch)
        loss_sum += out.loss.item() * batch["labels"].size(0)
        preds = out.logits.argmax(dim=-1)
        correct += (preds == batch["labels"]).sum().item()
        total += batch["labels"].size(0)
    model.train()
    return loss_sum / total, correct / total


def export_half(model, output_dir):
    os.makedirs(output_dir, exist_ok=True)
    small = copy.deepcopy(model).half()
    torch.save(small.state_dict(), os.path.join(output_dir, "model_fp16.bin"))


def main():
    args = parse_args()
    device = torch.device("cuda")
    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    model = AutoModelForSequenceClassification.from_pretrained(args.model_name, num_labels=2).to(device)

    train_ds = ReviewDataset(args.train, tokenizer)
    valid_ds = ReviewDataset(args.valid, tokenizer)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=4, pin_memory=True)
    valid_loader = DataLoader(valid_ds, batch_size=args.batch_size * 2, num_workers=4)

    no_decay = ["bias", "LayerNorm.weight"]
    grouped = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(grouped, lr=args.lr, eps=1e-6)
    steps_per_epoch = math.ceil(len(train_loader) / args.grad_accum)
    total_steps = steps_per_epoch * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)
    scaler = torch.amp.GradScaler("cuda")

    best_acc = 0.0
    global_step = 0
    model.train()
    optimizer.zero_grad(set_to_none=True)
    for epoch in range(args.epochs):
        running = 0.0
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.cuda.amp.autocast():  # expect: AMP009
                outputs = model(**batch)
                loss = outputs.loss / args.grad_accum
            scaler.scale(loss).backward()
            running += loss.item()

            if (step + 1) % args.grad_accum == 0 or step + 1 == len(train_loader):
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)  # expect: AMP005
                optimizer.step()  # expect: AMP006
                scaler.update()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                global_step += 1

                if global_step % args.log_every == 0:
                    print(f"epoch {epoch} step {global_step}/{total_steps} "
                          f"loss {running / args.log_every:.4f} lr {scheduler.get_last_lr()[0]:.2e}")
                    running = 0.0

        val_loss, val_acc = evaluate(model, valid_loader, device)
        print(f"epoch {epoch}: val_loss={val_loss:.4f} val_acc={val_acc:.4f}")
        if val_acc > best_acc:
            best_acc = val_acc
            model.save_pretrained(args.output_dir)
            tokenizer.save_pretrained(args.output_dir)

    export_half(model, args.output_dir)
    print(f"best val acc {best_acc:.4f}")


if __name__ == "__main__":
    main()
