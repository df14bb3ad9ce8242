"""Fine-tune a sentence encoder with in-batch negatives on (query, document) pairs."""
import argparse
import copy
import logging
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_dataset
from transformers import AutoModel, AutoTokenizer, Trainer, TrainingArguments, get_linear_schedule_with_warmup

logger = logging.getLogger(__name__)


class MeanPooler(nn.Module):
    def forward(self, hidden, attention_mask):
        mask = attention_mask.unsqueeze(-1).float()
        summed = (hidden * mask).sum(dim=1)
        return summed / mask.sum(dim=1).clamp(min=1.0)


class MaxPooler(nn.Module):
    def forward(self, hidden, attention_mask):
        mask = attention_mask.unsqueeze(-1).bool()
        hidden = hidden.masked_fill(~mask, -1e9)  # expect: AMP007
        return hidden.max(dim=1).values


class MinPooler(nn.Module):
    def forward(self, hidden, attention_mask):
        fill = torch.finfo(hidden.dtype).max
        return hidden.masked_fill(attention_mask.unsqueeze(-1) == 0, fill).min(dim=1).values


POOLERS = {"mean": MeanPooler, "max": MaxPooler, "min": MinPooler}


class SentenceEncoder(nn.Module):
    def __init__(self, name, pooling="mean", proj_dim=256):
        super().__init__()
        self.backbone = AutoModel.from_pretrained(name)
        self.pooler = POOLERS[pooling]()
        self.proj = nn.Linear(self.backbone.config.hidden_size, proj_dim)

    def forward(self, input_ids, attention_mask):
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask)
        return self.proj(self.pooler(out.last_hidden_state, attention_mask))


class InBatchNegativesTrainer(Trainer):
    def __init__(self, *args, temperature=0.05, **kwargs):
        super().__init__(*args, **kwargs)
        self.temperature = temperature
        self.loss_fct = nn.CrossEntropyLoss()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        q = model(inputs["q_input_ids"], inputs["q_attention_mask"])
        d = model(inputs["d_input_ids"], inputs["d_attention_mask"])
        q = F.normalize(q.float(), dim=-1)
        d = F.normalize(d.float(), dim=-1)
        scores = q @ d.T / self.temperature
        labels = torch.arange(scores.size(0), device=scores.device)
        loss = self.loss_fct(scores, labels)
        return (loss, {"scores": scores}) if return_outputs else loss


def build_model_and_optimizer(args, num_training_steps):
    model = SentenceEncoder(args.model_name, pooling=args.pooling, proj_dim=args.proj_dim)
    # the 7B backbones do not fit on a 40GB card otherwise
    model.half()  # expect: AMP001
    no_decay = ("bias", "LayerNorm.weight")
    grouped = [
        {"params": [p for n, p in model.named_parameters() if not n.endswith(no_decay)], "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(grouped, lr=args.lr, eps=1e-8)  # expect: AMP011
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, num_training_steps)
    return model, optimizer, scheduler


def make_collator(tokenizer, max_len):
    def collate(batch):
        q = tokenizer([b["query"] for b in batch], padding=True, truncation=True, max_length=max_len, return_tensors="pt")
        d = tokenizer([b["positive"] for b in batch], padding=True, truncation=True, max_length=max_len, return_tensors="pt")
        return {"q_input_ids": q.input_ids, "q_attention_mask": q.attention_mask, "d_input_ids": d.input_ids, "d_attention_mask": d.attention_mask}
    return collate


def export_for_serving(model, tokenizer, path):
    serving = copy.deepcopy(model).half().eval()
    example = tokenizer(["hello world"], return_tensors="pt").to(next(serving.parameters()).device)
    torch.onnx.export(serving, (example.input_ids, example.attention_mask), os.path.join(path, "encoder.onnx"),
                      input_names=["input_ids", "attention_mask"], output_names=["embedding"], opset_version=17)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name", default="intfloat/e5-mistral-7b-instruct")
    parser.add_argument("--pooling", default="max", choices=sorted(POOLERS))
    parser.add_argument("--proj_dim", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--warmup_steps", type=int, default=500)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--output_dir", default="out")
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    train_ds = load_dataset("sentence-transformers/msmarco-query-passage", split="train")
    steps = len(train_ds) // 64 * args.epochs
    model, optimizer, scheduler = build_model_and_optimizer(args, steps)
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=64,
        num_train_epochs=args.epochs,
        fp16=True,
        max_grad_norm=1.0,
        logging_steps=50,
        remove_unused_columns=False,
    )
    trainer = InBatchNegativesTrainer(model=model, args=training_args, train_dataset=train_ds,
                                      data_collator=make_collator(tokenizer, 128), optimizers=(optimizer, scheduler))
    trainer.train()
    export_for_serving(trainer.model, tokenizer, args.output_dir)


if __name__ == "__main__":
    main()
