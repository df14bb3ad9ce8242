"""Cross-encoder passage reranker fine-tuned with the Hugging Face Trainer.

Each training example is a query with one positive and `group_size - 1` mined negatives.
The loss mixes a pointwise relevance term with a listwise softmax term over the group.

    python train_reranker.py --model microsoft/MiniLM-L12-H384-uncased --train data/train.jsonl \
        --eval data/dev.jsonl --output_dir out/minilm-rerank --fp16
"""
import argparse
import copy
import json
import logging
import os
import random
from dataclasses import dataclass
from typing import Dict, List

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from transformers import (
    AutoModel,
    AutoTokenizer,
    PreTrainedTokenizerBase,
    Trainer,
    TrainingArguments,
)

logger = logging.getLogger(__name__)


class GroupedRerankDataset(Dataset):
    def __init__(self, path, group_size=8, seed=13):
        self.group_size = group_size
        self.rng = random.Random(seed)
        with open(path) as f:
            self.rows = [json.loads(line) for line in f]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, idx):
        row = self.rows[idx]
        negs = list(row["negatives"])
        self.rng.shuffle(negs)
        passages = [row["positive"]] + negs[: self.group_size - 1]
        return {"query": row["query"], "passages": passages}


@dataclass
class GroupedPairCollator:
    tokenizer: PreTrainedTokenizerBase
    group_size: int = 8
    max_length: int = 256

    def __call__(self, features: List[Dict]) -> Dict[str, torch.Tensor]:
        queries, passages, valid = [], [], []
        for feat in features:
            cands = feat["passages"]
            n = len(cands)
            # pad short groups with an empty passage; cand_mask hides them from the listwise loss
            cands = cands + [""] * (self.group_size - n)
            queries.extend([feat["query"]] * self.group_size)
            passages.extend(cands)
            valid.append([True] * n + [False] * (self.group_size - n))
        enc = self.tokenizer(
            queries,
            passages,
            padding=True,
            truncation="only_second",
            max_length=self.max_length,
            return_tensors="pt",
        )
        bs = len(features)
        cand_mask = torch.tensor(valid, dtype=torch.bool)
        point_labels = torch.zeros(bs, self.group_size)
        point_labels[:, 0] = 1.0
        enc["cand_mask"] = cand_mask
        enc["point_labels"] = point_labels.view(-1)
        enc["labels"] = torch.zeros(bs, dtype=torch.long)  # the positive is always first
        return enc


class CrossEncoderReranker(nn.Module):
    def __init__(self, model_name, pooling="cls", dropout=0.1):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(model_name)
        hidden = self.encoder.config.hidden_size
        self.pooling = pooling
        self.dropout = nn.Dropout(dropout)
        self.score = nn.Linear(hidden, 1)

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        out = self.encoder(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        hidden = out.last_hidden_state
        if self.pooling == "max":
            pad = attention_mask[..., None] == 0
            pooled = hidden.masked_fill(pad, torch.finfo(hidden.dtype).min).max(dim=1).values
        elif self.pooling == "mean":
            m = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
        else:
            pooled = hidden[:, 0]
        return self.score(self.dropout(pooled)).squeeze(-1)


class RerankTrainer(Trainer):
    def __init__(self, *args, group_size=8, temperature=1.0, point_weight=0.5, **kwargs):
        super().__init__(*args, **kwargs)
        self.group_size = group_size
        self.temperature = temperature
        self.point_weight = point_weight
        self.pointwise_criterion = nn.BCELoss()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        target = inputs.pop("labels")
        cand_mask = inputs.pop("cand_mask")
        point_labels = inputs.pop("point_labels")
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.args.fp16):
            scores = model(**inputs)
            grouped = scores.view(-1, self.group_size)
            grouped = grouped.masked_fill(~cand_mask, -1e9)  # expect: AMP007
            point_loss = self.pointwise_criterion(torch.sigmoid(scores), point_labels)  # expect: AMP003
        list_loss = F.cross_entropy(grouped / self.temperature, target)  # expect: AMP002
        loss = list_loss + self.point_weight * point_loss
        if return_outputs:
            return loss, {"scores": grouped.detach()}
        return loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        self.accelerator.backward(loss)
        return loss.detach() / self.args.gradient_accumulation_steps


def warmup_score_head(model, loader, steps, lr, device):
    """Fit the freshly initialised scoring head for a few hundred steps with the encoder frozen."""
    model.encoder.requires_grad_(False)
    head_opt = torch.optim.AdamW(model.score.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cuda")
    model.train()
    for step, batch in enumerate(loader):
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch.pop("point_labels")
        batch.pop("labels")
        batch.pop("cand_mask")
        with torch.autocast("cuda", dtype=torch.float16):
            scores = model(**batch)
            loss = F.binary_cross_entropy_with_logits(scores, labels)
        scaler.scale(loss).backward()
        scaler.step(head_opt)  # expect: AMP006
        head_opt.zero_grad(set_to_none=True)
        if step % 50 == 0:
            logger.info("head warmup step %d loss %.4f", step, loss.item())
        if step + 1 >= steps:
            break
    model.encoder.requires_grad_(True)


def evaluate_rerank(model, dataset, collator, group_size, batch_size=32, device="cuda"):
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=collator)
    model.eval()
    mrr, top1, n = 0.0, 0.0, 0
    with torch.no_grad(), torch.cuda.amp.autocast():  # expect: AMP009
        for batch in loader:
            batch = {k: v.to(device) for k, v in batch.items()}
            cand_mask = batch.pop("cand_mask")
            batch.pop("labels")
            batch.pop("point_labels")
            scores = model(**batch).float().view(-1, group_size)
            scores = scores.masked_fill(~cand_mask, float("-inf"))
            rank_of_pos = (scores > scores[:, :1]).sum(dim=1) + 1
            mrr += (1.0 / rank_of_pos.float()).sum().item()
            top1 += (rank_of_pos == 1).float().sum().item()
            n += scores.size(0)
    model.train()
    return {"mrr@group": mrr / max(n, 1), "acc@1": top1 / max(n, 1)}


def export_for_serving(model, tokenizer, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    serving = copy.deepcopy(model).half().eval()
    torch.save(serving.state_dict(), os.path.join(out_dir, "reranker_fp16.bin"))
    tokenizer.save_pretrained(out_dir)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="microsoft/MiniLM-L12-H384-uncased")
    p.add_argument("--train", required=True)
    p.add_argument("--eval", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--pooling", default="cls", choices=["cls", "mean", "max"])
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--head_warmup_steps", type=int, default=200)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--fp16", action="store_true")
    return p.parse_args()


def main():
    args = parse_args()
    logging.basicConfig(level=logging.INFO)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = CrossEncoderReranker(args.model, pooling=args.pooling)
    collator = GroupedPairCollator(tokenizer, group_size=args.group_size)
    train_ds = GroupedRerankDataset(args.train, group_size=args.group_size)
    eval_ds = GroupedRerankDataset(args.eval, group_size=args.group_size)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.head_warmup_steps > 0:
        model.to(device)
        warm_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, collate_fn=collator)
        warmup_score_head(model, warm_loader, args.head_warmup_steps, lr=1e-3, device=device)

    training_args = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        num_train_epochs=args.epochs,
        warmup_ratio=0.1,
        weight_decay=0.01,
        adam_epsilon=1e-8,
        fp16=args.fp16,
        logging_steps=50,
        save_strategy="epoch",
        remove_unused_columns=False,
        dataloader_num_workers=4,
        report_to="none",
    )
    trainer = RerankTrainer(
        model=model,
        args=training_args,
        train_dataset=train_ds,
        data_collator=collator,
        group_size=args.group_size,
    )
    trainer.train()

    metrics = evaluate_rerank(model, eval_ds, collator, args.group_size, device=trainer.args.device)
    logger.info("eval: %s", metrics)
    with open(os.path.join(args.output_dir, "eval_metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    export_for_serving(model, tokenizer, os.path.join(args.output_dir, "serving"))


if __name__ == "__main__":
    main()
