#!/usr/bin/env python
# coding=utf-8
"""Supervised fine-tuning of a causal LM with LoRA adapters (PEFT).

The frozen base model is loaded directly in bf16 (``torch_dtype``), the adapter
weights are kept in fp32 and the forward pass runs under bf16 autocast.

Notes:
    Older revisions of this script wrapped the forward in
    ``torch.cuda.amp.autocast()``; that spelling is deprecated since torch 2.4,
    use ``torch.autocast("cuda", ...)`` instead.
"""
import argparse
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup
from peft import LoraConfig, TaskType, get_peft_model

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
PROMPT_TEMPLATE = "### Instruction:\n{instruction}\n\n### Response:\n"


def parse_args():
    p = argparse.ArgumentParser(description="LoRA SFT")
    p.add_argument("--model_name_or_path", required=True)
    p.add_argument("--train_file", required=True)
    p.add_argument("--eval_file", default=None)
    p.add_argument("--output_dir", default="outputs/lora")
    p.add_argument("--max_seq_len", type=int, default=1024)
    p.add_argument("--per_device_batch_size", type=int, default=4)
    p.add_argument("--grad_accum", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--adam_eps", type=float, default=1e-8)
    p.add_argument("--warmup_ratio", type=float, default=0.03)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--lora_alpha", type=int, default=32)
    p.add_argument("--lora_dropout", type=float, default=0.05)
    p.add_argument("--target_modules", default="q_proj,k_proj,v_proj,o_proj")
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--merge_dtype", choices=["fp16", "bf16"], default="bf16")
    p.add_argument("--log_every", type=int, default=10)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


class InstructionDataset(Dataset):
    def __init__(self, path: str, tokenizer, max_len: int):
        with open(path) as f:
            self.rows = [json.loads(line) for line in f if line.strip()]
        self.tok = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, idx):
        row = self.rows[idx]
        prompt = PROMPT_TEMPLATE.format(instruction=row["instruction"])
        prompt_ids = self.tok(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = self.tok(row["output"], add_special_tokens=False)["input_ids"]
        ids = [self.tok.bos_token_id] + prompt_ids + answer_ids + [self.tok.eos_token_id]
        labels = [IGNORE_INDEX] * (len(prompt_ids) + 1) + answer_ids + [self.tok.eos_token_id]
        return {"input_ids": ids[: self.max_len], "labels": labels[: self.max_len]}


@dataclass
class PadCollator:
    pad_token_id: int

    def __call__(self, features: Sequence[Dict[str, List[int]]]) -> Dict[str, torch.Tensor]:
        max_len = max(len(f["input_ids"]) for f in features)
        input_ids = torch.full((len(features), max_len), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(features), max_len), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(features), max_len), dtype=torch.long)
        for i, f in enumerate(features):
            n = len(f["input_ids"])
            input_ids[i, :n] = torch.tensor(f["input_ids"])
            labels[i, :n] = torch.tensor(f["labels"])
            attention_mask[i, :n] = 1
        return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def load_base_model(name: str, gradient_checkpointing: bool):
    model = AutoModelForCausalLM.from_pretrained(
        name,
        torch_dtype=torch.bfloat16,
        attn_implementation="sdpa",
    )
    model.requires_grad_(False)
    # norms in fp32, as in peft's prepare_model_for_kbit_training
    for name, module in model.named_modules():
        if "norm" in name.lower():
            module.to(torch.float32)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model.config.use_cache = False
    return model


def add_adapters(model, args):
    config = LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=args.target_modules.split(","),
    )
    model = get_peft_model(model, config)
    # adapters are created in the base dtype; train them in fp32
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    model.print_trainable_parameters()
    return model


def build_optimizer(model, args):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "bias" in n else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.999), eps=args.adam_eps)


def to_device(batch, device):
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def train_epoch(model, loader, optimizer, lr_scheduler, scaler, args, epoch, device, global_step=0):
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    running, n_tokens, t0 = 0.0, 0, time.time()
    optimizer.zero_grad(set_to_none=True)
    for step, batch in enumerate(loader):
        batch = to_device(batch, device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outputs = model(**batch)
            loss = outputs.loss
        loss = loss / args.grad_accum
        scaler.scale(loss).backward()
        running += loss.item()
        n_tokens += int((batch["labels"] != IGNORE_INDEX).sum())

        if (step + 1) % args.grad_accum != 0:
            continue
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable, args.max_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        global_step += 1

        if global_step % args.log_every == 0:
            dt = time.time() - t0
            logger.info(
                "epoch %d step %d | loss %.4f | grad_norm %.3f | lr %.2e | %.0f tok/s",
                epoch, global_step, running / args.log_every, float(grad_norm),
                lr_scheduler.get_last_lr()[0], n_tokens / max(dt, 1e-6),
            )
            running, n_tokens, t0 = 0.0, 0, time.time()
    return global_step


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    total_nll, total_tokens = 0.0, 0
    for batch in loader:
        batch = to_device(batch, device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outputs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        logits = outputs.logits.float()
        shift_logits = logits[:, :-1].contiguous()
        shift_labels = batch["labels"][:, 1:].contiguous()
        nll = F.cross_entropy(
            shift_logits.view(-1, shift_logits.size(-1)),
            shift_labels.view(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        total_nll += nll.item()
        total_tokens += int((shift_labels != IGNORE_INDEX).sum())
    model.train()
    avg = total_nll / max(total_tokens, 1)
    return {"eval_loss": avg, "eval_ppl": math.exp(min(avg, 20.0))}


def save_adapter(model, out_dir: str, step: int):
    os.makedirs(out_dir, exist_ok=True)
    torch.save(
        {k: v.to(torch.bfloat16) for k, v in model.state_dict().items() if "lora_" in k},
        os.path.join(out_dir, f"adapter_step{step}.pt"),
    )
    model.save_pretrained(out_dir)


def export_merged(model, out_dir: str, merge_dtype: str):
    merged = model.merge_and_unload()
    merged = merged.half() if merge_dtype == "fp16" else merged.to(torch.bfloat16)
    merged.save_pretrained(os.path.join(out_dir, "merged"), safe_serialization=True)


def main():
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    device = torch.device("cuda")

    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    collator = PadCollator(tokenizer.pad_token_id)
    train_ds = InstructionDataset(args.train_file, tokenizer, args.max_seq_len)
    train_loader = DataLoader(train_ds, batch_size=args.per_device_batch_size, shuffle=True,
                              collate_fn=collator, num_workers=2, pin_memory=True)
    eval_loader = None
    if args.eval_file:
        eval_ds = InstructionDataset(args.eval_file, tokenizer, args.max_seq_len)
        eval_loader = DataLoader(eval_ds, batch_size=args.per_device_batch_size, collate_fn=collator)

    model = load_base_model(args.model_name_or_path, args.gradient_checkpointing)
    model = add_adapters(model, args).to(device)

    optimizer = build_optimizer(model, args)
    steps_per_epoch = math.ceil(len(train_loader) / args.grad_accum)
    total_steps = steps_per_epoch * args.epochs
    lr_scheduler = get_cosine_schedule_with_warmup(
        optimizer, int(args.warmup_ratio * total_steps), total_steps
    )
    scaler = torch.cuda.amp.GradScaler()  # expect: AMP009 AMP010

    best_eval_loss = 1e9
    global_step = 0
    for epoch in range(args.epochs):
        global_step = train_epoch(model, train_loader, optimizer, lr_scheduler, scaler,
                                  args, epoch, device, global_step)
        if eval_loader is not None:
            metrics = evaluate(model, eval_loader, device)
            logger.info("epoch %d | %s", epoch, json.dumps(metrics))
            if metrics["eval_loss"] < best_eval_loss:
                best_eval_loss = metrics["eval_loss"]
                save_adapter(model, os.path.join(args.output_dir, "best"), global_step)
        save_adapter(model, os.path.join(args.output_dir, f"epoch{epoch}"), global_step)

    export_merged(model, args.output_dir, args.merge_dtype)
    logger.info("done; best eval loss %.4f", best_eval_loss)


if __name__ == "__main__":
    main()
