#!/usr/bin/env python
"""Fine-tune RoBERTa with a biaffine span classifier for (nested) named entity recognition.

Adapted from the `run_ner_no_trainer.py` example and "Named Entity Recognition as
Dependency Parsing" (Yu et al., 2020): every span (i, j) with i <= j is scored by a
biaffine layer over start/end projections of the first sub-token of each word; spans
that are not entities have label 0 ("O").

    python train_biaffine_ner.py --model_name_or_path roberta-large \
        --train_file data/genia/train.jsonl --validation_file data/genia/dev.jsonl \
        --fp16 --gradient_accumulation_steps 2 --output_dir out/genia-biaffine
"""
import argparse
import json
import logging
import math
import os
import random
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger(__name__)


def parse_args():
    p = argparse.ArgumentParser(description="Biaffine span NER fine-tuning")
    p.add_argument("--model_name_or_path", default="roberta-base")
    p.add_argument("--train_file", required=True)
    p.add_argument("--validation_file", required=True)
    p.add_argument("--output_dir", default="out/biaffine-ner")
    p.add_argument("--max_length", type=int, default=256)
    p.add_argument("--per_device_train_batch_size", type=int, default=8)
    p.add_argument("--per_device_eval_batch_size", type=int, default=16)
    p.add_argument("--learning_rate", type=float, default=2e-5)
    p.add_argument("--head_lr", type=float, default=1e-3)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--num_train_epochs", type=int, default=10)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--warmup_ratio", type=float, default=0.1)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--ffn_size", type=int, default=256)
    p.add_argument("--fp16", action="store_true", help="mixed precision on CUDA")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class SpanNERDataset(Dataset):
    """jsonl lines: {"tokens": [...], "entities": [{"start": i, "end": j, "type": "protein"}, ...]}"""

    def __init__(self, path, tokenizer, label2id, max_length):
        self.items = []
        with open(path) as f:
            for line in f:
                ex = json.loads(line)
                enc = tokenizer(ex["tokens"], is_split_into_words=True, truncation=True, max_length=max_length)
                word_ids = enc.word_ids()
                first = {}
                for pos, w in enumerate(word_ids):
                    if w is not None and w not in first:
                        first[w] = pos
                n_words = len(first)
                spans = [(e["start"], e["end"], label2id[e["type"]]) for e in ex["entities"] if e["end"] < n_words]
                self.items.append((enc["input_ids"], [first[w] for w in range(n_words)], spans))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def collate(batch, pad_id):
    max_tok = max(len(ids) for ids, _, _ in batch)
    max_w = max(len(w) for _, w, _ in batch)
    B = len(batch)
    input_ids = torch.full((B, max_tok), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, max_tok), dtype=torch.long)
    word_index = torch.zeros((B, max_w), dtype=torch.long)
    word_mask = torch.zeros((B, max_w), dtype=torch.bool)
    span_labels = torch.zeros((B, max_w, max_w), dtype=torch.long)
    for b, (ids, words, spans) in enumerate(batch):
        input_ids[b, : len(ids)] = torch.tensor(ids)
        attention_mask[b, : len(ids)] = 1
        word_index[b, : len(words)] = torch.tensor(words)
        word_mask[b, : len(words)] = True
        for s, e, lab in spans:
            span_labels[b, s, e] = lab
    upper = torch.ones(max_w, max_w, dtype=torch.bool).triu()
    span_mask = word_mask[:, :, None] & word_mask[:, None, :] & upper
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "word_index": word_index,
        "word_mask": word_mask,
        "span_labels": span_labels,
        "span_mask": span_mask,
    }


class BiaffineScorer(nn.Module):
    def __init__(self, hidden, ffn, num_labels, dropout=0.2):
        super().__init__()
        self.norm = nn.LayerNorm(hidden, eps=1e-12)
        self.start_mlp = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Dropout(dropout))
        self.end_mlp = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Dropout(dropout))
        self.U = nn.Parameter(torch.empty(num_labels, ffn + 1, ffn + 1))
        nn.init.xavier_uniform_(self.U)

    def forward(self, h, word_mask):
        h = self.norm(h)
        s = self.start_mlp(h)
        e = self.end_mlp(h)
        s = torch.cat([s, torch.ones_like(s[..., :1])], dim=-1)
        e = torch.cat([e, torch.ones_like(e[..., :1])], dim=-1)
        logits = torch.einsum("bxi,oij,byj->bxyo", s, self.U, e)  # (B, L, L, C)
        L = logits.size(1)
        # a span cannot end before it starts
        lower = torch.ones(L, L, dtype=torch.bool, device=logits.device).tril(-1)
        logits[:, lower] = -1e9  # expect: AMP007
        pad = ~(word_mask[:, :, None] & word_mask[:, None, :])
        logits = logits.masked_fill(pad.unsqueeze(-1), -1e9)  # expect: AMP007
        return logits


class RobertaBiaffineNER(nn.Module):
    def __init__(self, name, num_labels, ffn=256, dropout=0.2):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(name)
        self.dropout = nn.Dropout(dropout)
        self.scorer = BiaffineScorer(self.encoder.config.hidden_size, ffn, num_labels, dropout)

    def forward(self, input_ids, attention_mask, word_index, word_mask):
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        idx = word_index.unsqueeze(-1).expand(-1, -1, hidden.size(-1))
        words = torch.gather(hidden, 1, idx)
        return self.scorer(self.dropout(words), word_mask)


@torch.no_grad()
def evaluate(model, loader, device, args):
    model.eval()
    tp = n_pred = n_gold = 0
    total_loss, steps = 0.0, 0
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=args.fp16):
            span_logits = model(batch["input_ids"], batch["attention_mask"], batch["word_index"], batch["word_mask"])
            valid = batch["span_mask"]
            loss = F.cross_entropy(span_logits[valid], batch["span_labels"][valid])
        total_loss += loss.item()
        steps += 1
        pred = span_logits.argmax(-1).masked_fill(~valid, 0)
        gold = batch["span_labels"]
        tp += ((pred == gold) & (gold > 0)).sum().item()
        n_pred += (pred > 0).sum().item()
        n_gold += (gold > 0).sum().item()
    model.train()
    p = tp / max(n_pred, 1)
    r = tp / max(n_gold, 1)
    f1 = 2 * p * r / max(p + r, 1e-12)
    return {"loss": total_loss / max(steps, 1), "precision": p, "recall": r, "f1": f1}


def export_fp16_checkpoint(model, tokenizer, output_dir):
    """Half-precision copy of the fine-tuned weights for the serving container."""
    os.makedirs(output_dir, exist_ok=True)
    state = {k: v.half() if v.is_floating_point() else v for k, v in model.state_dict().items()}
    torch.save(state, os.path.join(output_dir, "pytorch_model.fp16.bin"))
    tokenizer.save_pretrained(output_dir)


def train(args, model, tokenizer, train_loader, dev_loader, device):
    no_decay = ("bias", "LayerNorm.weight")
    grouped = [
        {"params": [p for n, p in model.encoder.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.encoder.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
        {"params": list(model.scorer.parameters()), "weight_decay": 0.0, "lr": args.head_lr},
    ]
    optimizer = torch.optim.AdamW(grouped, lr=args.learning_rate, eps=1e-8)
    updates_per_epoch = math.ceil(len(train_loader) / args.gradient_accumulation_steps)
    total_updates = updates_per_epoch * args.num_train_epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_updates), total_updates)

    autocast_ctx = torch.autocast(device_type="cuda", dtype=torch.float16) if args.fp16 else nullcontext()  # expect: AMP010
    loss_fct = nn.CrossEntropyLoss()

    best_f1, best_dev_loss = -1.0, 1e9
    global_step = 0
    model.train()
    for epoch in range(args.num_train_epochs):
        running = 0.0
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with autocast_ctx:
                span_logits = model(batch["input_ids"], batch["attention_mask"], batch["word_index"], batch["word_mask"])
            valid = batch["span_mask"]
            loss = loss_fct(span_logits[valid], batch["span_labels"][valid])  # expect: AMP002
            loss = loss / args.gradient_accumulation_steps
            loss.backward()
            running += loss.item()

            if (step + 1) % args.gradient_accumulation_steps == 0 or step == len(train_loader) - 1:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                global_step += 1
                if global_step % 50 == 0:
                    logger.info("epoch %d step %d loss %.4f lr %.2e", epoch, global_step, running / 50, scheduler.get_last_lr()[0])
                    running = 0.0

        metrics = evaluate(model, dev_loader, device, args)
        logger.info("epoch %d dev %s", epoch, json.dumps(metrics))
        if metrics["f1"] > best_f1:
            best_f1, best_dev_loss = metrics["f1"], metrics["loss"]
            torch.save(model.state_dict(), os.path.join(args.output_dir, "best.pt"))
    return best_f1, best_dev_loss


def main():
    args = parse_args()
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", level=logging.INFO)
    set_seed(args.seed)
    os.makedirs(args.output_dir, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    types = set()
    for path in (args.train_file, args.validation_file):
        with open(path) as f:
            for line in f:
                types.update(e["type"] for e in json.loads(line)["entities"])
    label2id = {"O": 0, **{t: i + 1 for i, t in enumerate(sorted(types))}}

    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path, add_prefix_space=True)
    train_ds = SpanNERDataset(args.train_file, tokenizer, label2id, args.max_length)
    dev_ds = SpanNERDataset(args.validation_file, tokenizer, label2id, args.max_length)
    pad_id = tokenizer.pad_token_id
    train_loader = DataLoader(train_ds, batch_size=args.per_device_train_batch_size, shuffle=True, collate_fn=lambda b: collate(b, pad_id), num_workers=2, pin_memory=True)
    dev_loader = DataLoader(dev_ds, batch_size=args.per_device_eval_batch_size, collate_fn=lambda b: collate(b, pad_id))

    model = RobertaBiaffineNER(args.model_name_or_path, len(label2id), ffn=args.ffn_size).to(device)
    best_f1, _ = train(args, model, tokenizer, train_loader, dev_loader, device)
    logger.info("best dev F1 %.4f", best_f1)

    model.load_state_dict(torch.load(os.path.join(args.output_dir, "best.pt"), map_location=device))
    export_fp16_checkpoint(model, tokenizer, os.path.join(args.output_dir, "export"))
    with open(os.path.join(args.output_dir, "labels.json"), "w") as f:
        json.dump(label2id, f, indent=2)


if __name__ == "__main__":
    main()
