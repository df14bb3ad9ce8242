"""Supervised fine-tuning of a causal LM with hand-rolled LoRA adapters.

Expects JSONL records of the form {"prompt": ..., "response": ...}; the loss is
taken on response tokens only.

    python sft_lora_causal_lm.py --model meta-llama/Llama-2-7b-hf --train-file data/sft.jsonl
"""
import argparse
import json
import math
import os
import random

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

IGNORE_INDEX = -100


class LoRAAdapter(nn.Module):
    def __init__(self, base: nn.Linear, r: int, alpha: int, dropout: float = 0.05):
        super().__init__()
        self.base = base
        self.scale = alpha / r
        self.drop = nn.Dropout(dropout)
        self.down = nn.Linear(base.in_features, r, bias=False)
        self.up = nn.Linear(r, base.out_features, bias=False)
        nn.init.kaiming_uniform_(self.down.weight, a=math.sqrt(5))
        nn.init.zeros_(self.up.weight)

    def forward(self, x):
        return self.base(x) + self.up(self.down(self.drop(x))) * self.scale


def add_lora(model, r, alpha, targets=("q_proj", "v_proj")):
    for p in model.parameters():
        p.requires_grad_(False)
    replaced = 0
    for _, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in targets and isinstance(child, nn.Linear):
                setattr(module, child_name, LoRAAdapter(child, r, alpha))
                replaced += 1
    return replaced


class SFTDataset(Dataset):
    def __init__(self, path, tokenizer, max_len):
        with open(path) as f:
            self.rows = [json.loads(line) for line in f if line.strip()]
        self.tok = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = self.rows[i]
        prompt_ids = self.tok(row["prompt"], add_special_tokens=True)["input_ids"]
        resp_ids = self.tok(row["response"], add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        ids = (prompt_ids + resp_ids)[: self.max_len]
        labels = ([IGNORE_INDEX] * len(prompt_ids) + resp_ids)[: self.max_len]
        return torch.tensor(ids), torch.tensor(labels)


def collate(batch, pad_id):
    ids, labels = zip(*batch)
    lengths = torch.tensor([len(x) for x in ids])
    ids = nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=pad_id)
    labels = nn.utils.rnn.pad_sequence(labels, batch_first=True, padding_value=IGNORE_INDEX)
    mask = (torch.arange(ids.size(1))[None, :] < lengths[:, None]).long()
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


@torch.no_grad()
def evaluate(model, loader, device, max_batches=50):
    model.eval()
    losses = []
    for i, batch in enumerate(loader):
        if i >= max_batches:
            break
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            losses.append(model(**batch).loss.item())
    model.train()
    mean_loss = sum(losses) / max(len(losses), 1)
    return mean_loss, math.exp(min(mean_loss, 20.0))


def save_adapter(model, out_dir, step):
    os.makedirs(out_dir, exist_ok=True)
    state = {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}
    torch.save(state, os.path.join(out_dir, f"adapter_step{step}.pt"))


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="meta-llama/Llama-2-7b-hf")
    p.add_argument("--train-file", required=True)
    p.add_argument("--eval-file")
    p.add_argument("--out-dir", default="checkpoints/sft-lora")
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--warmup-ratio", type=float, default=0.03)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=int, default=32)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main():
    args = parse_args()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device("cuda")

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model)
    n_wrapped = add_lora(model, args.lora_r, args.lora_alpha)
    model.gradient_checkpointing_enable()
    model.enable_input_require_grads()
    model = model.to(device=device, dtype=torch.float16)  # expect: AMP001
    trainable = [p for p in model.parameters() if p.requires_grad]
    print(f"wrapped {n_wrapped} projections, {sum(p.numel() for p in trainable) / 1e6:.2f}M trainable params")

    pad = lambda b: collate(b, tokenizer.pad_token_id)  # noqa: E731
    train_loader = DataLoader(SFTDataset(args.train_file, tokenizer, args.max_len), batch_size=args.batch_size,
                              shuffle=True, collate_fn=pad, num_workers=2)
    eval_loader = None
    if args.eval_file:
        eval_loader = DataLoader(SFTDataset(args.eval_file, tokenizer, args.max_len),
                                 batch_size=args.batch_size, collate_fn=pad)

    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)  # expect: AMP011
    updates = math.ceil(len(train_loader) / args.grad_accum) * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * updates), updates)

    model.train()
    update = 0
    for epoch in range(args.epochs):
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast(device_type="cuda", dtype=torch.float16):  # expect: AMP010
                loss = model(**batch).loss / args.grad_accum
            loss.backward()
            if (step + 1) % args.grad_accum != 0:
                continue

            grad_norm = torch.nn.utils.clip_grad_norm_(trainable, args.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            update += 1

            if update % 10 == 0:
                print(f"epoch {epoch} update {update}/{updates} loss {loss.item() * args.grad_accum:.4f} "
                      f"gnorm {grad_norm.item():.3f} lr {scheduler.get_last_lr()[0]:.2e}")
            if eval_loader is not None and update % args.eval_every == 0:
                val_loss, ppl = evaluate(model, eval_loader, device)
                print(f"  eval loss {val_loss:.4f} ppl {ppl:.2f}")
                save_adapter(model, args.out_dir, update)

    save_adapter(model, args.out_dir, update)


if __name__ == "__main__":
    main()
