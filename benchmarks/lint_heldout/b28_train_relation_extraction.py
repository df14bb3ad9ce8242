"""Sentence-level relation extraction with typed entity markers (TACRED / Re-TACRED).

    python train.py --data_dir data/tacred --model_name roberta-large --fp16

Entities are wrapped in marker tokens ([E1] ... [/E1], [E2] ... [/E2]); the relation
is classified from the marker representations plus a pooled sentence context.
"""
import argparse
import os
from typing import Dict, List

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

DEFAULT_CONFIG = {
    "max_seq_length": 256,
    "train_batch_size": 32,
    "eval_batch_size": 64,
    "lr": 3e-5,
    "weight_decay": 0.01,
    "warmup_ratio": 0.1,
    "epochs": 5,
    "grad_accum": 2,
    "max_grad_norm": 1.0,
    "dropout": 0.1,
    "pooling": "start",
    "na_label": "no_relation",
    "class_weight_power": 0.0,
}

ENTITY_MARKERS = ["[E1]", "[/E1]", "[E2]", "[/E2]"]


class EntityMarkerRE(nn.Module):
    def __init__(self, encoder_name: str, num_labels: int, dropout: float = 0.1, pooling: str = "start"):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(encoder_name)
        hidden = self.encoder.config.hidden_size
        self.pooling = pooling
        self.ctx_proj = nn.Linear(hidden, hidden)
        self.head = nn.Sequential(
            nn.Linear(3 * hidden, hidden),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, num_labels),
        )

    def span_max_pool(self, hidden, span_mask):
        h = hidden.masked_fill(~span_mask.unsqueeze(-1), -1e10)  # expect: AMP007
        return h.max(dim=1).values

    def forward(self, input_ids, attention_mask, head_start, tail_start, head_mask, tail_mask):
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        if self.pooling == "start":
            idx = torch.arange(hidden.size(0), device=hidden.device)
            h_head, h_tail = hidden[idx, head_start], hidden[idx, tail_start]
        else:
            h_head = self.span_max_pool(hidden, head_mask)
            h_tail = self.span_max_pool(hidden, tail_mask)
        ctx = self.ctx_proj(hidden)
        ctx = ctx.mean(dim=1)  # expect: AMP004
        return self.head(torch.cat([h_head, h_tail, ctx], dim=-1))


class REDataset(Dataset):
    def __init__(self, path: str, tokenizer, rel2id: Dict[str, int], max_len: int):
        df = pd.read_json(path)
        self.features: List[Dict[str, object]] = []
        for _, ex in df.iterrows():
            self.features.append(self.convert(ex, tokenizer, rel2id, max_len))

    @staticmethod
    def convert(ex, tokenizer, rel2id, max_len):
        tokens = list(ex["token"])
        ss, se, os_, oe = ex["subj_start"], ex["subj_end"], ex["obj_start"], ex["obj_end"]
        pieces = []
        for i, tok in enumerate(tokens):
            if i == ss:
                pieces.append("[E1]")
            if i == os_:
                pieces.append("[E2]")
            pieces.append(tok)
            if i == se:
                pieces.append("[/E1]")
            if i == oe:
                pieces.append("[/E2]")
        enc = tokenizer(" ".join(pieces), truncation=True, max_length=max_len)
        ids = enc["input_ids"]
        e1, e1_end = tokenizer.convert_tokens_to_ids(["[E1]", "[/E1]"])
        e2, e2_end = tokenizer.convert_tokens_to_ids(["[E2]", "[/E2]"])
        head_start = ids.index(e1) if e1 in ids else 0
        tail_start = ids.index(e2) if e2 in ids else 0
        head_end = ids.index(e1_end) if e1_end in ids else head_start
        tail_end = ids.index(e2_end) if e2_end in ids else tail_start
        return {"input_ids": ids, "head": (head_start, head_end), "tail": (tail_start, tail_end),
                "label": rel2id[ex["relation"]]}

    def __len__(self):
        return len(self.features)

    def __getitem__(self, i):
        return self.features[i]


def collate_fn(batch, pad_id):
    max_len = max(len(f["input_ids"]) for f in batch)
    input_ids = torch.full((len(batch), max_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(len(batch), max_len, dtype=torch.long)
    head_mask = torch.zeros(len(batch), max_len, dtype=torch.bool)
    tail_mask = torch.zeros(len(batch), max_len, dtype=torch.bool)
    for i, f in enumerate(batch):
        n = len(f["input_ids"])
        input_ids[i, :n] = torch.tensor(f["input_ids"])
        attention_mask[i, :n] = 1
        head_mask[i, f["head"][0]: f["head"][1] + 1] = True
        tail_mask[i, f["tail"][0]: f["tail"][1] + 1] = True
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "head_start": torch.tensor([f["head"][0] for f in batch]),
        "tail_start": torch.tensor([f["tail"][0] for f in batch]),
        "head_mask": head_mask,
        "tail_mask": tail_mask,
        "labels": torch.tensor([f["label"] for f in batch]),
    }


def micro_f1(preds, labels, na_id):
    correct = ((preds == labels) & (labels != na_id)).sum()
    pred_pos = (preds != na_id).sum()
    gold_pos = (labels != na_id).sum()
    p = correct / pred_pos if pred_pos > 0 else 0.0
    r = correct / gold_pos if gold_pos > 0 else 0.0
    return 2 * p * r / (p + r) if p + r > 0 else 0.0


@torch.no_grad()
def evaluate(model, loader, device, na_id, use_amp):
    model.eval()
    all_preds, all_labels = [], []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch.pop("labels")
        with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=use_amp):
            logits = model(**batch)
        all_preds.append(logits.float().argmax(-1).cpu().numpy())
        all_labels.append(labels.cpu().numpy())
    return micro_f1(np.concatenate(all_preds), np.concatenate(all_labels), na_id)


@torch.no_grad()
def predict_topk_relations(model, batch, na_id, k=3):
    """Top-k non-NA relations per example (used to build the distant-supervision candidates)."""
    model.eval()
    logits = model(**batch).float()
    logits[:, na_id] = -1e9
    return logits.softmax(-1).topk(k, dim=-1)


def train(args, config, model, train_loader, dev_loader, optimizer, scheduler, scaler, class_weights, na_id):
    best_f1, global_step = -1.0, 0
    for epoch in range(config["epochs"]):
        model.train()
        running = 0.0
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(args.device) for k, v in batch.items()}
            labels = batch.pop("labels")
            with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=args.fp16):
                logits = model(**batch)
            loss = F.cross_entropy(logits, labels, weight=class_weights)  # expect: AMP002
            loss = loss / config["grad_accum"]
            scaler.scale(loss).backward()
            running += loss.item()
            if (step + 1) % config["grad_accum"] == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), config["max_grad_norm"])  # expect: AMP005
                scaler.step(optimizer)
                scaler.update()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                global_step += 1
                if global_step % args.logging_steps == 0:
                    print(f"step {global_step} loss {running / args.logging_steps:.4f} lr {scheduler.get_last_lr()[0]:.2e}")
                    running = 0.0
        f1 = evaluate(model, dev_loader, args.device, na_id, args.fp16)
        print(f"epoch {epoch}: dev micro-F1 {f1 * 100:.2f}")
        if f1 > best_f1:
            best_f1 = f1
            model_to_save = model.module if hasattr(model, "module") else model
            torch.save(model_to_save.state_dict(), os.path.join(args.output_dir, "best_model.pt"))
    return best_f1


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_dir", type=str, default="data/tacred")
    parser.add_argument("--model_name", type=str, default="roberta-large")
    parser.add_argument("--output_dir", type=str, default="outputs/re")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--logging_steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--pooling", choices=["start", "span_max"], default=None)
    return parser.parse_args()


def main():
    args = parse_args()
    config = dict(DEFAULT_CONFIG)
    for key in ("lr", "epochs", "pooling"):
        if getattr(args, key) is not None:
            config[key] = getattr(args, key)
    args.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    os.makedirs(args.output_dir, exist_ok=True)
    print("config:", config)

    rel2id = pd.read_csv(os.path.join(args.data_dir, "rel2id.tsv"), sep="\t", header=None, index_col=0)[1].to_dict()
    na_id = rel2id[config["na_label"]]
    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    tokenizer.add_special_tokens({"additional_special_tokens": ENTITY_MARKERS})
    train_set = REDataset(os.path.join(args.data_dir, "train.json"), tokenizer, rel2id, config["max_seq_length"])
    dev_set = REDataset(os.path.join(args.data_dir, "dev.json"), tokenizer, rel2id, config["max_seq_length"])
    collate = lambda b: collate_fn(b, tokenizer.pad_token_id)
    train_loader = DataLoader(train_set, batch_size=config["train_batch_size"], shuffle=True, collate_fn=collate, drop_last=True)
    dev_loader = DataLoader(dev_set, batch_size=config["eval_batch_size"], collate_fn=collate)

    counts = np.bincount([f["label"] for f in train_set.features], minlength=len(rel2id)).astype(np.float64)
    weights = (counts.max() / np.maximum(counts, 1.0)) ** config["class_weight_power"]
    class_weights = torch.tensor(weights / weights.mean(), dtype=torch.float32, device=args.device)

    model = EntityMarkerRE(args.model_name, len(rel2id), config["dropout"], config["pooling"])
    model.encoder.resize_token_embeddings(len(tokenizer))
    model.to(args.device)
    if args.fp16:
        model.half()  # expect: AMP001
    scaler = torch.amp.GradScaler("cuda", enabled=args.fp16)

    no_decay = ["bias", "LayerNorm.weight"]
    grouped = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": config["weight_decay"]},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(grouped, lr=config["lr"])  # expect: AMP011
    total_steps = len(train_loader) // config["grad_accum"] * config["epochs"]
    scheduler = get_linear_schedule_with_warmup(optimizer, int(config["warmup_ratio"] * total_steps), total_steps)

    best = train(args, config, model, train_loader, dev_loader, optimizer, scheduler, scaler, class_weights, na_id)
    print(f"best dev micro-F1: {best * 100:.2f}")


if __name__ == "__main__":
    main()
