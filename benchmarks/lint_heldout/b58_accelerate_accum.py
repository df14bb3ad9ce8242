#!/usr/bin/env python
"""Causal-LM fine-tuning with Accelerate, with a KL penalty to a frozen reference.

Default path: ``accelerator.accumulate`` + ``accelerator.autocast()`` +
``accelerator.backward`` + ``accelerator.clip_grad_norm_``; the accelerator owns
the loss scaler when ``--mixed_precision fp16``.

``--custom_accumulation``: the accelerator is created with
``mixed_precision="no"`` and only places tensors / skips all-reduce on
micro-steps; loss scaling is done by hand with native AMP.
"""
import argparse
import contextlib
import copy
import functools
import math
import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, default_data_collator, get_cosine_schedule_with_warmup


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name_or_path", default="gpt2")
    p.add_argument("--dataset", default="wikitext")
    p.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default="bf16")
    p.add_argument("--gradient_accumulation_steps", type=int, default=8)
    p.add_argument("--custom_accumulation", action="store_true")
    p.add_argument("--learning_rate", type=float, default=5e-5)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--kl_coef", type=float, default=0.05)
    p.add_argument("--num_train_epochs", type=int, default=3)
    p.add_argument("--block_size", type=int, default=512)
    p.add_argument("--output_dir", default="out")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def get_autocast(precision):
    if precision == "bf16":
        return functools.partial(torch.autocast, "cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext


def build_dataloaders(args, tokenizer):
    from datasets import load_dataset

    raw = load_dataset(args.dataset, "wikitext-2-raw-v1")
    tok = raw.map(lambda b: tokenizer(b["text"]), batched=True, remove_columns=["text"])

    def group(examples):
        concat = {k: sum(examples[k], []) for k in examples}
        total = (len(concat["input_ids"]) // args.block_size) * args.block_size
        out = {k: [t[i:i + args.block_size] for i in range(0, total, args.block_size)] for k, t in concat.items()}
        out["labels"] = out["input_ids"].copy()
        return out

    lm = tok.map(group, batched=True)
    train = DataLoader(lm["train"], shuffle=True, collate_fn=default_data_collator, batch_size=4)
    val = DataLoader(lm["validation"], collate_fn=default_data_collator, batch_size=8)
    return train, val


def kl_to_reference(logits, ref_logits):
    return F.kl_div(F.log_softmax(logits.float(), dim=-1), F.log_softmax(ref_logits.float(), dim=-1),
                    log_target=True, reduction="batchmean")


def evaluate(args, accelerator, model, eval_loader):
    model.eval()
    amp_ctx = get_autocast(args.mixed_precision)
    losses = []
    for batch in eval_loader:
        with torch.no_grad(), amp_ctx():
            outputs = model(**batch)
        bs = batch["input_ids"].size(0)
        losses.append(accelerator.gather_for_metrics(outputs.loss.detach().float().repeat(bs)))
    eval_loss = torch.cat(losses).mean().item()
    try:
        perplexity = math.exp(eval_loss)
    except OverflowError:
        perplexity = float("inf")
    model.train()
    return eval_loss, perplexity


def train_accelerate(args, accelerator, model, ref_model, optimizer, train_loader, eval_loader, lr_scheduler):
    ema_model = copy.deepcopy(accelerator.unwrap_model(model)).half().requires_grad_(False)
    best_ppl = 1e9
    completed_steps = 0
    for epoch in range(args.num_train_epochs):
        model.train()
        for step, batch in enumerate(train_loader):
            with accelerator.accumulate(model):
                with accelerator.autocast():
                    outputs = model(**batch)
                    logits = outputs.logits
                with torch.no_grad():
                    ref_logits = ref_model(**batch).logits
                loss = outputs.loss + args.kl_coef * kl_to_reference(logits, ref_logits)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            if accelerator.sync_gradients:
                completed_steps += 1
                with torch.no_grad():
                    for p_ema, p in zip(ema_model.parameters(), accelerator.unwrap_model(model).parameters()):
                        p_ema.lerp_(p.detach().to(p_ema.dtype), 0.001)
                if completed_steps % 100 == 0:
                    accelerator.log({"train/loss": loss.item(), "train/grad_norm": float(grad_norm)}, step=completed_steps)
        eval_loss, ppl = evaluate(args, accelerator, model, eval_loader)
        if ppl < best_ppl:
            best_ppl = ppl
            accelerator.save_state(os.path.join(args.output_dir, "best"))
    return ema_model


def train_custom_accumulation(args, accelerator, model, optimizer, train_loader, eval_loader, lr_scheduler):
    """Manual accumulation: all-reduce only on the boundary micro-step."""
    scaler = torch.cuda.amp.GradScaler()  # expect: AMP009
    accum = args.gradient_accumulation_steps
    model.train()
    completed_steps = 0
    for epoch in range(args.num_train_epochs):
        for i, batch in enumerate(train_loader):
            boundary = (i + 1) % accum == 0
            sync_ctx = contextlib.nullcontext() if boundary else accelerator.no_sync(model)
            with sync_ctx:
                with torch.autocast("cuda", dtype=torch.float16):
                    outputs = model(**batch)
                    loss = outputs.loss / accum
                    scaler.scale(loss).backward()  # expect: AMP008
            if not boundary:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            completed_steps += 1
            if completed_steps % 100 == 0:
                accelerator.log({"train/loss": loss.item() * accum, "train/scale": scaler.get_scale()}, step=completed_steps)
        evaluate(args, accelerator, model, eval_loader)


def main():
    args = parse_args()
    set_seed(args.seed)
    accelerator = Accelerator(
        mixed_precision="no" if args.custom_accumulation else args.mixed_precision,
        gradient_accumulation_steps=1 if args.custom_accumulation else args.gradient_accumulation_steps,
        log_with="tensorboard",
        project_dir=args.output_dir,
    )
    weight_dtype = torch.float32
    if accelerator.mixed_precision == "fp16":
        weight_dtype = torch.float16
    elif accelerator.mixed_precision == "bf16":
        weight_dtype = torch.bfloat16

    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    train_loader, eval_loader = build_dataloaders(args, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
    ref_model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
    ref_model.requires_grad_(False)
    ref_model.eval()
    ref_model.to(accelerator.device, dtype=weight_dtype)

    # keep the trainable copy small enough for a 24 GB card
    model = model.to(torch.bfloat16)  # expect: AMP001
    no_decay = ("bias", "ln_", "layernorm")
    grouped = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(grouped, lr=args.learning_rate, eps=1e-8)
    steps = args.num_train_epochs * math.ceil(len(train_loader) / args.gradient_accumulation_steps)
    lr_scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=100, num_training_steps=steps)

    model, ref_model, optimizer, train_loader, eval_loader, lr_scheduler = accelerator.prepare(
        model, ref_model, optimizer, train_loader, eval_loader, lr_scheduler
    )
    accelerator.init_trackers("clm-kl", config=vars(args))

    if args.custom_accumulation:
        train_custom_accumulation(args, accelerator, model, optimizer, train_loader, eval_loader, lr_scheduler)
        ema_model = None
    else:
        ema_model = train_accelerate(args, accelerator, model, ref_model, optimizer, train_loader, eval_loader, lr_scheduler)

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    if accelerator.is_main_process:
        unwrapped.save_pretrained(args.output_dir, state_dict=accelerator.get_state_dict(model), safe_serialization=True)
        tokenizer.save_pretrained(args.output_dir)
        if ema_model is not None:
            torch.save({k: v.half() for k, v in ema_model.state_dict().items()}, os.path.join(args.output_dir, "ema_fp16.pt"))
    accelerator.end_training()


if __name__ == "__main__":
    main()
