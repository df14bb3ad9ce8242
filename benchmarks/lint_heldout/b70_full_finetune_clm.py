#!/usr/bin/env python
# coding=utf-8
"""Full-parameter fine-tuning of a decoder-only LM without the HF Trainer.

    torchrun --nproc_per_node 8 finetune_clm.py \
        --model_name_or_path meta-llama/Llama-2-7b-hf \
        --dataset_name wikitext --dataset_config wikitext-103-raw-v1 \
        --mixed_precision bf16 --gradient_checkpointing
"""
import argparse
import logging
import math
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

from data.clm_dataset import DataCollatorForCLM, build_clm_datasets
from utils.dist import barrier, get_rank, get_world_size, init_distributed, is_main_process
from utils.metrics import MetricLogger

logger = logging.getLogger(__name__)

PTDTYPE = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def parse_args():
    p = argparse.ArgumentParser(description="Fine-tune a causal LM")
    p.add_argument("--model_name_or_path", required=True)
    p.add_argument("--dataset_name", required=True)
    p.add_argument("--dataset_config", default=None)
    p.add_argument("--block_size", type=int, default=2048)
    p.add_argument("--per_device_batch_size", type=int, default=4)
    p.add_argument("--gradient_accumulation_steps", type=int, default=8)
    p.add_argument("--learning_rate", type=float, default=2e-5)
    p.add_argument("--embedding_warmup_lr", type=float, default=1e-3)
    p.add_argument("--embedding_warmup_steps", type=int, default=0)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--num_train_epochs", type=int, default=1)
    p.add_argument("--warmup_ratio", type=float, default=0.03)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default="bf16")
    p.add_argument("--torch_dtype", choices=["auto", "float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--extra_tokens", nargs="*", default=[])
    p.add_argument("--eval_every", type=int, default=500)
    p.add_argument("--save_every", type=int, default=2000)
    p.add_argument("--save_bf16", action="store_true", help="store weights in bf16 to halve disk usage")
    p.add_argument("--output_dir", default="out")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def load_model_and_tokenizer(args):
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path, use_fast=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if args.torch_dtype == "auto":
        torch_dtype = "auto"
    else:
        torch_dtype = getattr(torch, args.torch_dtype)
    # weights stay in whatever dtype the user asked for; autocast handles the compute dtype
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, torch_dtype=torch_dtype, use_cache=False)
    if args.extra_tokens:
        tokenizer.add_tokens(args.extra_tokens)
        model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, tokenizer


def get_param_groups(model, weight_decay):
    no_decay = ("bias", "norm", "ln_", "layernorm")
    decay, skip = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim < 2 or any(nd in name.lower() for nd in no_decay):
            skip.append(param)
        else:
            decay.append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": skip, "weight_decay": 0.0},
    ]


def get_autocast_ctx(args, device_type="cuda"):
    if args.mixed_precision == "no":
        return nullcontext()
    return torch.autocast(device_type=device_type, dtype=PTDTYPE[args.mixed_precision])


def warmup_new_embeddings(args, model, loader, scaler, device):
    """Train only the (resized) embedding matrices for a few steps so the new rows are not random
    when the full model is unfrozen."""
    base = model.module if isinstance(model, DDP) else model
    emb = base.get_input_embeddings()
    head = base.get_output_embeddings()
    for p in base.parameters():
        p.requires_grad_(False)
    params = [emb.weight]
    if head is not None and head.weight is not emb.weight:
        params.append(head.weight)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=args.embedding_warmup_lr, weight_decay=0.0)
    amp_dtype = PTDTYPE[args.mixed_precision]
    model.train()
    data_iter = iter(loader)
    for step in range(args.embedding_warmup_steps):
        try:
            batch = next(data_iter)
        except StopIteration:
            data_iter = iter(loader)
            batch = next(data_iter)
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=amp_dtype, enabled=args.mixed_precision != "no"):
            out = model(**batch)
        scaler.scale(out.loss).backward()
        opt.step()  # expect: AMP006
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 and is_main_process():
            logger.info("embedding warmup step %d loss %.4f", step, out.loss.item())
    for p in base.parameters():
        p.requires_grad_(True)


@torch.no_grad()
def evaluate(args, model, eval_loader, device):
    model.eval()
    losses = []
    ctx = get_autocast_ctx(args)
    for batch in eval_loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with ctx:
            outputs = model(**batch)
        losses.append(outputs.loss.float().reshape(1))
    loss = torch.cat(losses).mean()
    if dist.is_initialized():
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    model.train()
    try:
        ppl = math.exp(loss.item())
    except OverflowError:
        ppl = float("inf")
    return loss.item(), ppl


def save_model(args, model, tokenizer, tag):
    if not is_main_process():
        return
    out_dir = os.path.join(args.output_dir, tag)
    os.makedirs(out_dir, exist_ok=True)
    unwrapped = model.module if isinstance(model, DDP) else model
    state_dict = unwrapped.state_dict()
    if args.save_bf16:
        state_dict = {k: v.to(torch.bfloat16) for k, v in state_dict.items()}
    unwrapped.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    logger.info("saved %s", out_dir)


def train(args, model, tokenizer, train_loader, eval_loader, optimizer, lr_scheduler, scaler, device):
    amp_dtype = PTDTYPE[args.mixed_precision]
    use_amp = args.mixed_precision != "no"
    loss_fct = nn.CrossEntropyLoss(ignore_index=-100)
    metrics = MetricLogger(window=20)
    best_eval_loss = 1e9
    global_step = 0
    model.train()
    for epoch in range(args.num_train_epochs):
        if isinstance(train_loader.sampler, DistributedSampler):
            train_loader.sampler.set_epoch(epoch)
        t0 = time.time()
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            labels = batch.pop("labels")
            last_micro = (step + 1) % args.gradient_accumulation_steps == 0
            sync_ctx = model.no_sync() if isinstance(model, DDP) and not last_micro else nullcontext()
            with sync_ctx:
                with torch.autocast("cuda", dtype=amp_dtype, enabled=use_amp):
                    logits = model(**batch).logits
                # shift so that tokens < n predict n
                shift_logits = logits[..., :-1, :].contiguous()
                shift_labels = labels[..., 1:].contiguous()
                loss = loss_fct(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))  # expect: AMP002
                loss = loss / args.gradient_accumulation_steps
                scaler.scale(loss).backward()
            metrics.update(loss=loss.item() * args.gradient_accumulation_steps)
            if not last_micro:
                continue

            grad_norm = None
            if args.max_grad_norm > 0:
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1

            if global_step % 10 == 0 and is_main_process():
                dt = time.time() - t0
                t0 = time.time()
                logger.info(
                    "epoch %d step %d loss %.4f lr %.2e grad_norm %s scale %.0f %.2fs/it",
                    epoch, global_step, metrics.avg("loss"), lr_scheduler.get_last_lr()[0],
                    f"{grad_norm.item():.3f}" if grad_norm is not None else "-", scaler.get_scale(), dt / 10,
                )
            if global_step % args.eval_every == 0:
                eval_loss, ppl = evaluate(args, model, eval_loader, device)
                if is_main_process():
                    logger.info("eval step %d loss %.4f ppl %.2f", global_step, eval_loss, ppl)
                if eval_loss < best_eval_loss:
                    best_eval_loss = eval_loss
                    save_model(args, model, tokenizer, "best")
            if global_step % args.save_every == 0:
                save_model(args, model, tokenizer, f"step-{global_step}")
                barrier()
    return global_step


def main():
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    local_rank = init_distributed()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + get_rank())
    torch.backends.cuda.matmul.allow_tf32 = True

    if args.torch_dtype == "float16" and args.mixed_precision == "fp16":
        raise ValueError("GradScaler cannot unscale fp16 parameters; load the weights in float32")

    model, tokenizer = load_model_and_tokenizer(args)
    model.to(device)

    train_ds, eval_ds = build_clm_datasets(args, tokenizer)
    collator = DataCollatorForCLM(tokenizer, block_size=args.block_size)
    train_loader = DataLoader(
        train_ds,
        batch_size=args.per_device_batch_size,
        sampler=DistributedSampler(train_ds, shuffle=True) if get_world_size() > 1 else None,
        shuffle=get_world_size() == 1,
        collate_fn=collator,
        num_workers=4,
        pin_memory=True,
        drop_last=True,
    )
    eval_loader = DataLoader(eval_ds, batch_size=args.per_device_batch_size, collate_fn=collator)

    use_fp16 = args.mixed_precision == "fp16"
    scaler = torch.cuda.amp.GradScaler(enabled=use_fp16)  # expect: AMP009

    if args.extra_tokens and args.embedding_warmup_steps > 0:
        warmup_new_embeddings(args, model, train_loader, scaler, device)

    if get_world_size() > 1:
        model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(
        get_param_groups(model, args.weight_decay),
        lr=args.learning_rate,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=torch.cuda.is_available(),
    )
    steps_per_epoch = len(train_loader) // args.gradient_accumulation_steps
    total_steps = steps_per_epoch * args.num_train_epochs
    lr_scheduler = get_cosine_schedule_with_warmup(
        optimizer, num_warmup_steps=int(args.warmup_ratio * total_steps), num_training_steps=total_steps
    )

    steps = train(args, model, tokenizer, train_loader, eval_loader, optimizer, lr_scheduler, scaler, device)
    save_model(args, model, tokenizer, "final")
    if is_main_process():
        logger.info("done after %d optimizer steps", steps)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
