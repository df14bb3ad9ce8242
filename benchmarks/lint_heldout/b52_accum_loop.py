"""Fine-tune a Hugging Face image classifier with a hand-written, accelerate-style loop.

No `accelerate` dependency: the loop does what `Accelerator(mixed_precision=...,
gradient_accumulation_steps=...)` would do -- an autocast chosen by a string, a
GradScaler that is only on for fp16, `no_sync` on accumulation micro-steps and
unscale/clip/step/update on the sync step.
"""
import argparse
import contextlib
import copy
import functools
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoModelForImageClassification, get_cosine_schedule_with_warmup

from finetune.data import build_loaders


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name_or_path", default="google/vit-base-patch16-224-in21k")
    p.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default="fp16")
    p.add_argument("--gradient_accumulation_steps", type=int, default=4)
    p.add_argument("--per_device_batch_size", type=int, default=64)
    p.add_argument("--learning_rate", type=float, default=3e-5)
    p.add_argument("--head_lr", type=float, default=1e-2)
    p.add_argument("--bitfit_lr", type=float, default=1e-3)
    p.add_argument("--head_warmup_steps", type=int, default=300)
    p.add_argument("--class_weights", type=float, nargs="*", default=None)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--num_train_epochs", type=int, default=3)
    p.add_argument("--warmup_ratio", type=float, default=0.1)
    p.add_argument("--mode", choices=["full", "bitfit"], default="full")
    p.add_argument("--output_dir", default="out/vit-ft")
    p.add_argument("--save_half", action="store_true")
    return p.parse_args()


def get_autocast(mixed_precision, device_type):
    if mixed_precision == "fp16":
        return functools.partial(torch.autocast, device_type=device_type, dtype=torch.float16)
    if mixed_precision == "bf16":
        return functools.partial(torch.autocast, device_type=device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def unwrap(model):
    return model.module if isinstance(model, DDP) else model


def warmup_head(model, loader, args, device):
    """Train only the freshly initialised classifier for a few hundred steps."""
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith("classifier"))
    head_params = [p for n, p in model.named_parameters() if n.startswith("classifier")]
    optimizer = torch.optim.SGD(head_params, lr=args.head_lr, momentum=0.9)
    scaler = torch.cuda.amp.GradScaler()  # expect: AMP009, AMP010
    class_weights = torch.tensor(args.class_weights, device=device).type("torch.cuda.HalfTensor")  # expect: AMP001
    criterion = nn.CrossEntropyLoss(weight=class_weights)
    model.train()
    for step, batch in enumerate(loader):
        if step >= args.head_warmup_steps:
            break
        pixel_values = batch["pixel_values"].to(device, non_blocking=True)
        labels = batch["labels"].to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(pixel_values=pixel_values).logits
            loss = criterion(logits, labels)
        scaler.scale(loss).backward()
        optimizer.step()  # expect: AMP006
        optimizer.zero_grad(set_to_none=True)
    for param in model.parameters():
        param.requires_grad_(True)


def bitfit(model, loader, args, device):
    """BitFit baseline: only biases and LayerNorm parameters are trained."""
    params = []
    for name, param in model.named_parameters():
        trainable = name.endswith(".bias") or "layernorm" in name
        param.requires_grad_(trainable)
        if trainable:
            params.append(param)
    optimizer = torch.optim.AdamW(params, lr=args.bitfit_lr, weight_decay=0.0)
    model.train()
    for epoch in range(args.num_train_epochs):
        for step, batch in enumerate(loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
                loss.backward()  # expect: AMP008
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step % 50 == 0:
                print(f"bitfit epoch {epoch} step {step} loss {loss.item():.4f}")


@torch.inference_mode()
def evaluate(model, loader, device):
    eval_model = copy.deepcopy(unwrap(model)).half().eval()
    correct = total = 0
    for batch in loader:
        batch = {k: (v.to(device).half() if v.is_floating_point() else v.to(device)) for k, v in batch.items()}
        logits = eval_model(pixel_values=batch["pixel_values"]).logits
        correct += (logits.argmax(-1) == batch["labels"]).sum().item()
        total += batch["labels"].numel()
    return correct / max(total, 1)


def save_model(model, output_dir, save_half):
    to_save = copy.deepcopy(unwrap(model))
    if save_half:
        to_save = to_save.half()
    to_save.save_pretrained(output_dir, safe_serialization=True)


def train(args):
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("nccl")
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda")
    is_main = not distributed or dist.get_rank() == 0

    train_loader, val_loader, num_labels = build_loaders(args.per_device_batch_size, distributed)
    model = AutoModelForImageClassification.from_pretrained(args.model_name_or_path, num_labels=num_labels)
    model.to(device)
    if args.class_weights and args.head_warmup_steps > 0:
        warmup_head(model, train_loader, args, device)
    if args.mode == "bitfit":
        bitfit(model, train_loader, args, device)
        return
    if distributed:
        model = DDP(model, device_ids=[local_rank])

    no_decay = ("bias", "layernorm.weight")
    grouped = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.05},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(grouped, lr=args.learning_rate)
    updates_per_epoch = math.ceil(len(train_loader) / args.gradient_accumulation_steps)
    total_updates = updates_per_epoch * args.num_train_epochs
    lr_scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_updates), total_updates)

    amp_autocast = get_autocast(args.mixed_precision, device.type)
    scaler = torch.amp.GradScaler("cuda", enabled=args.mixed_precision == "fp16")

    for epoch in range(args.num_train_epochs):
        model.train()
        if distributed:
            train_loader.sampler.set_epoch(epoch)
        for step, batch in enumerate(train_loader):
            batch = {k: (v.to(device, non_blocking=True).half() if v.is_floating_point() else v.to(device, non_blocking=True)) for k, v in batch.items()}  # expect: AMP001
            sync_step = (step + 1) % args.gradient_accumulation_steps == 0 or step + 1 == len(train_loader)
            accumulate_ctx = model.no_sync if (distributed and not sync_step) else contextlib.nullcontext
            with accumulate_ctx():
                with amp_autocast():
                    outputs = model(**batch)
                    loss = outputs.loss
                loss = loss / args.gradient_accumulation_steps
                scaler.scale(loss).backward()
            if sync_step:
                scaler.unscale_(optimizer)
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                scaler.step(optimizer)
                scaler.update()
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                if is_main and (step + 1) % (50 * args.gradient_accumulation_steps) == 0:
                    print(f"epoch {epoch} step {step + 1} loss {loss.item() * args.gradient_accumulation_steps:.4f} "
                          f"|g| {grad_norm.item():.3f} lr {lr_scheduler.get_last_lr()[0]:.2e}")
        if is_main:
            acc = evaluate(model, val_loader, device)
            print(f"epoch {epoch}: val acc {acc:.4f}")
            save_model(model, args.output_dir, args.save_half)


if __name__ == "__main__":
    train(parse_args())
