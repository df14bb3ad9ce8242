"""Instruction fine-tuning of a causal LM with hand-written LoRA adapters.

No HF Trainer: a plain PyTorch loop with gradient accumulation, gradient
checkpointing, a cosine schedule and bf16 autocast. `--full` trains every weight
instead (for the small <=1.5B models that fit on one card).

    python sft_lora.py --model Qwen/Qwen2-1.5B --train-file data/alpaca.jsonl --lora-r 16
    python sft_lora.py --model Qwen/Qwen2-0.5B --train-file data/alpaca.jsonl --full
"""
import argparse
import json
import logging
import math
import os
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, get_cosine_schedule_with_warmup

logger = logging.getLogger("sft")

IGNORE_INDEX = -100
PROMPT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Qwen/Qwen2-1.5B")
    p.add_argument("--train-file", required=True)
    p.add_argument("--eval-file", default=None)
    p.add_argument("--output-dir", default="out/sft")
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=8)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup-ratio", type=float, default=0.03)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=int, default=32)
    p.add_argument("--lora-dropout", type=float, default=0.05)
    p.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    p.add_argument("--load-in-4bit", action="store_true")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--full", action="store_true", help="full fine-tune instead of LoRA")
    p.add_argument("--merge", action="store_true", help="merge adapters and export an fp16 model")
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    return p.parse_args()


# ----------------------------------------------------------------------------- data
class SFTDataset(Dataset):
    def __init__(self, path, tokenizer, max_len):
        with open(path) as f:
            self.rows = [json.loads(line) for line in f if line.strip()]
        self.tok, self.max_len = tokenizer, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = self.rows[i]
        prompt = PROMPT.format(instruction=row["instruction"], input=row.get("input", ""))
        p_ids = self.tok(prompt, add_special_tokens=True)["input_ids"]
        a_ids = self.tok(row["output"] + self.tok.eos_token, add_special_tokens=False)["input_ids"]
        ids = (p_ids + a_ids)[: self.max_len]
        labels = ([IGNORE_INDEX] * len(p_ids) + a_ids)[: self.max_len]
        return torch.tensor(ids), torch.tensor(labels)


def collate(batch, pad_id):
    ids, labels = zip(*batch)
    lengths = torch.tensor([len(x) for x in ids])
    input_ids = nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=pad_id)
    labels = nn.utils.rnn.pad_sequence(labels, batch_first=True, padding_value=IGNORE_INDEX)
    attention_mask = (torch.arange(input_ids.size(1))[None, :] < lengths[:, None]).long()
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


# ----------------------------------------------------------------------------- LoRA
class LoRALinear(nn.Module):
    """y = W x + (B A x) * alpha / r, with A, B trainable in fp32 and W frozen."""

    def __init__(self, base, r=16, alpha=32, dropout=0.05):
        super().__init__()
        self.base = base
        self.scaling = alpha / r
        device = base.weight.device
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, device=device, dtype=torch.float32))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, device=device, dtype=torch.float32))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        result = self.base(x)
        lora_x = self.dropout(x).to(self.lora_A.dtype)
        update = (lora_x @ self.lora_A.t()) @ self.lora_B.t()
        return result + update.to(result.dtype) * self.scaling


def inject_lora(model, targets, r, alpha, dropout):
    replaced = 0
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if child_name in targets and hasattr(child, "in_features"):
                setattr(module, child_name, LoRALinear(child, r, alpha, dropout))
                replaced += 1
    return replaced


def causal_lm_loss(logits, labels):
    shift_logits = logits[:, :-1, :].contiguous()
    shift_labels = labels[:, 1:].contiguous()
    return F.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1),
                           ignore_index=IGNORE_INDEX)


def save_adapters(model, path):
    state = {k: v.detach().to(torch.bfloat16).cpu() for k, v in model.state_dict().items() if "lora_" in k}
    torch.save(state, path)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    losses = []
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**batch)
        losses.append(out.loss.float())
    model.train()
    mean_loss = torch.stack(losses).mean().item()
    return mean_loss, math.exp(min(mean_loss, 20.0))


@torch.inference_mode()
def generate_sample(model, tokenizer, instruction, device, max_new_tokens=128):
    enc = tokenizer(PROMPT.format(instruction=instruction, input=""), return_tensors="pt").to(device)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


@torch.no_grad()
def merge_and_export(model, tokenizer, out_dir):
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, LoRALinear):
                delta = (child.lora_B @ child.lora_A) * child.scaling
                child.base.weight += delta.to(child.base.weight.dtype)
                setattr(module, name, child.base)
    model.half().save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


# ----------------------------------------------------------------------------- training
def train_lora(args, tokenizer, train_loader, eval_loader):
    quant = None
    if args.load_in_4bit:
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16, quantization_config=quant,
                                                 device_map={"": 0}, attn_implementation="sdpa")
    model.requires_grad_(False)
    model.config.use_cache = False
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    n_layers = inject_lora(model, set(args.lora_targets.split(",")), args.lora_r, args.lora_alpha, args.lora_dropout)
    lora_params = [p for n, p in model.named_parameters() if "lora_" in n]
    logger.info("LoRA on %d layers, %.2fM trainable params", n_layers, sum(p.numel() for p in lora_params) / 1e6)

    optimizer = torch.optim.AdamW(lora_params, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))
    total_steps = args.epochs * math.ceil(len(train_loader) / args.grad_accum)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010

    model.train()
    step, t0 = 0, time.time()
    for epoch in range(args.epochs):
        for i, batch in enumerate(train_loader):
            batch = {k: v.to(args.device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                loss = causal_lm_loss(logits, batch["labels"])
            scaler.scale(loss / args.grad_accum).backward()
            if (i + 1) % args.grad_accum != 0:
                continue

            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(lora_params, args.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % 10 == 0:
                logger.info("epoch %d step %d/%d loss %.4f gnorm %.3f lr %.2e %.1fs", epoch, step, total_steps,
                            loss.item(), grad_norm.item(), scheduler.get_last_lr()[0], time.time() - t0)
            if eval_loader is not None and step % args.eval_every == 0:
                eval_loss, ppl = evaluate(model, eval_loader, args.device)
                logger.info("step %d eval loss %.4f ppl %.2f", step, eval_loss, ppl)
                save_adapters(model, Path(args.output_dir) / f"adapter_step{step}.pt")
    save_adapters(model, Path(args.output_dir) / "adapter_final.pt")
    return model


def train_full(args, tokenizer, train_loader, eval_loader):
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float16)  # expect: AMP001
    model.to(args.device)
    model.config.use_cache = False
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))  # expect: AMP011
    total_steps = args.epochs * math.ceil(len(train_loader) / args.grad_accum)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)

    model.train()
    step = 0
    for epoch in range(args.epochs):
        for i, batch in enumerate(train_loader):
            batch = {k: v.to(args.device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            (loss / args.grad_accum).backward()
            if (i + 1) % args.grad_accum == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                if step % 10 == 0:
                    logger.info("epoch %d step %d loss %.4f", epoch, step, loss.item())
        if eval_loader is not None:
            eval_loss, ppl = evaluate(model, eval_loader, args.device)
            logger.info("epoch %d eval loss %.4f ppl %.2f", epoch, eval_loss, ppl)
    model.save_pretrained(Path(args.output_dir) / "full")
    tokenizer.save_pretrained(Path(args.output_dir) / "full")
    return model


def main():
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    os.makedirs(args.output_dir, exist_ok=True)
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True

    tokenizer = AutoTokenizer.from_pretrained(args.model, use_fast=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    collate_fn = partial(collate, pad_id=tokenizer.pad_token_id)
    train_loader = DataLoader(SFTDataset(args.train_file, tokenizer, args.max_len), batch_size=args.micro_batch_size,
                              shuffle=True, collate_fn=collate_fn, num_workers=2, pin_memory=True)
    eval_loader = None
    if args.eval_file:
        eval_loader = DataLoader(SFTDataset(args.eval_file, tokenizer, args.max_len),
                                 batch_size=args.micro_batch_size, collate_fn=collate_fn)

    if args.full:
        model = train_full(args, tokenizer, train_loader, eval_loader)
    else:
        model = train_lora(args, tokenizer, train_loader, eval_loader)
    logger.info("sample: %s", generate_sample(model, tokenizer, "Give three tips for staying healthy.", args.device))
    if args.merge and not args.full and not args.load_in_4bit:
        merge_and_export(model, tokenizer, Path(args.output_dir) / "merged")


if __name__ == "__main__":
    main()
