"""Supervised instruction tuning with example packing.

Examples are rendered with the chat template, concatenated with EOS and cut into fixed-length
blocks. Each block carries per-token document ids so attention never crosses example
boundaries (position_ids for flash-attn-2 varlen, a block-diagonal 4-D mask for sdpa/eager).
"""
import argparse
import itertools
import json
import logging
import math
import os
import random

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

logger = logging.getLogger("sft")

IGNORE_INDEX = -100


def render(example, tokenizer, train_on_prompt=False):
    messages = example["messages"]
    prompt_ids = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True)
    full_ids = tokenizer.apply_chat_template(messages)
    labels = list(full_ids)
    if not train_on_prompt:
        labels[: len(prompt_ids)] = [IGNORE_INDEX] * len(prompt_ids)
    return full_ids, labels


class PackedInstructionDataset(IterableDataset):
    def __init__(self, path, tokenizer, seq_len=4096, shuffle_buffer=10_000, seed=0, infinite=True):
        self.path = path
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed
        self.infinite = infinite

    def _examples(self):
        rng = random.Random(self.seed)
        while True:
            with open(self.path) as f:
                buf = []
                for line in f:
                    buf.append(json.loads(line))
                    if len(buf) >= self.shuffle_buffer:
                        rng.shuffle(buf)
                        yield from buf
                        buf = []
                rng.shuffle(buf)
                yield from buf
            if not self.infinite:
                return

    def __iter__(self):
        ids, labels, doc_ids, pos = [], [], [], []
        for doc_idx, ex in enumerate(self._examples()):
            full, lab = render(ex, self.tokenizer)
            full = full + [self.tokenizer.eos_token_id]
            lab = lab + [self.tokenizer.eos_token_id]
            ids.extend(full)
            labels.extend(lab)
            doc_ids.extend([doc_idx] * len(full))
            pos.extend(range(len(full)))
            while len(ids) >= self.seq_len:
                yield {
                    "input_ids": torch.tensor(ids[: self.seq_len]),
                    "labels": torch.tensor(labels[: self.seq_len]),
                    "doc_ids": torch.tensor(doc_ids[: self.seq_len]),
                    "position_ids": torch.tensor(pos[: self.seq_len]),
                }
                ids, labels = ids[self.seq_len:], labels[self.seq_len:]
                doc_ids, pos = doc_ids[self.seq_len:], pos[self.seq_len:]


class BlockDiagonalCausalMask(nn.Module):
    """Additive 4-D mask [bsz, 1, q, k] for packed sequences (used when flash-attn is off)."""

    def forward(self, doc_ids, dtype):
        bsz, seqlen = doc_ids.shape
        same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
        causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=doc_ids.device).tril()
        allowed = (same_doc & causal)[:, None]
        mask = torch.zeros(bsz, 1, seqlen, seqlen, dtype=dtype, device=doc_ids.device)
        return mask.masked_fill(~allowed, torch.finfo(dtype).min)


def packed_lm_loss(logits, labels, reduction="token"):
    """Next-token loss over a packed block. `sequence` averages per example first."""
    logits = logits[:, :-1].float()
    labels = labels[:, 1:]
    per_tok = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                              ignore_index=IGNORE_INDEX, reduction="none").view(labels.shape)
    valid = (labels != IGNORE_INDEX).float()
    if reduction == "token":
        return (per_tok * valid).sum() / valid.sum().clamp(min=1.0)
    return ((per_tok * valid).sum(-1) / valid.sum(-1).clamp(min=1.0)).mean()


def model_inputs(batch, use_flash, mask_builder, dtype):
    if use_flash:
        # flash-attn-2 detects boundaries from position_ids resetting to 0
        return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    return {
        "input_ids": batch["input_ids"],
        "position_ids": batch["position_ids"],
        "attention_mask": mask_builder(batch["doc_ids"], dtype),
    }


@torch.no_grad()
def evaluate(model, loader, args, mask_builder, max_batches=50):
    model.eval()
    total, n = 0.0, 0
    for batch in itertools.islice(loader, max_batches):
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        with torch.cuda.amp.autocast(dtype=torch.bfloat16):  # expect: AMP009
            logits = model(**model_inputs(batch, args.flash_attn, mask_builder, model.dtype)).logits
            loss = packed_lm_loss(logits, batch["labels"], args.loss_reduction)
        total += loss.item()
        n += 1
    model.train()
    return total / max(n, 1)


def train(args, model, optimizer, scheduler, train_loader, eval_loader):
    mask_builder = BlockDiagonalCausalMask()
    best = float("inf")
    model.train()
    data_iter = iter(train_loader)
    for step in range(1, args.max_steps + 1):
        step_loss = 0.0
        for _ in range(args.grad_accum):
            batch = {k: v.cuda(non_blocking=True) for k, v in next(data_iter).items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(**model_inputs(batch, args.flash_attn, mask_builder, model.dtype)).logits
                loss = packed_lm_loss(logits, batch["labels"], args.loss_reduction) / args.grad_accum
                loss.backward()  # expect: AMP008
            step_loss += loss.item()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        if step % args.log_every == 0:
            logger.info("step %d loss %.4f gnorm %.3f lr %.2e", step, step_loss, grad_norm.item(),
                        scheduler.get_last_lr()[0])
        if step % args.eval_every == 0:
            val = evaluate(model, eval_loader, args, mask_builder)
            logger.info("step %d val_loss %.4f ppl %.2f", step, val, math.exp(min(val, 20.0)))
            if val < best:
                best = val
                model.save_pretrained(os.path.join(args.output_dir, "best"), safe_serialization=True)
    return best


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name_or_path", required=True)
    p.add_argument("--train_file", required=True)
    p.add_argument("--eval_file", required=True)
    p.add_argument("--output_dir", default="sft_out")
    p.add_argument("--seq_len", type=int, default=4096)
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--grad_accum", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--max_steps", type=int, default=3000)
    p.add_argument("--warmup_steps", type=int, default=100)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--loss_reduction", choices=["token", "sequence"], default="token")
    p.add_argument("--flash_attn", action="store_true")
    p.add_argument("--log_every", type=int, default=10)
    p.add_argument("--eval_every", type=int, default=250)
    return p.parse_args()


def main():
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    attn_impl = "flash_attention_2" if args.flash_attn else "sdpa"
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, torch_dtype=torch.bfloat16, attn_implementation=attn_impl)  # expect: AMP001
    model.config.use_cache = False
    model.gradient_checkpointing_enable()
    model.cuda()

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "norm" in n]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, args.max_steps)

    train_ds = PackedInstructionDataset(args.train_file, tokenizer, seq_len=args.seq_len)
    eval_ds = PackedInstructionDataset(args.eval_file, tokenizer, seq_len=args.seq_len, infinite=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, num_workers=1, pin_memory=True)
    eval_loader = DataLoader(eval_ds, batch_size=args.batch_size)

    best = train(args, model, optimizer, scheduler, train_loader, eval_loader)
    logger.info("best val loss %.4f", best)
    model.save_pretrained(os.path.join(args.output_dir, "final"), safe_serialization=True)
    tokenizer.save_pretrained(os.path.join(args.output_dir, "final"))


if __name__ == "__main__":
    main()
