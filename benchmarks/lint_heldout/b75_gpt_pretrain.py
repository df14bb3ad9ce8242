"""Pretrain a small GPT on tokenized shards (nanoGPT-style loop).

    python pretrain.py --config configs/gpt2_small.yaml --dtype bfloat16
    python pretrain.py --config configs/gpt2_small.yaml --overfit-one-batch

The config's ``dtype`` is one of ``float32``, ``bfloat16`` or ``float16``; when it
is left out we use bf16 where the GPU supports it and fall back to fp16.
"""
import argparse
import math
import os
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F
import yaml

from gptlib.model import GPT, GPTConfig
from gptlib.logging import MetricLogger

PTDTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_config(path, overrides):
    with open(path) as f:
        cfg = yaml.safe_load(f)
    for key, value in overrides.items():
        if value is not None:
            cfg[key] = value
    if cfg.get("dtype") is None:
        cfg["dtype"] = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float16"
    return cfg


def make_batch_fn(data_dir, block_size, batch_size, device):
    train_data = np.memmap(os.path.join(data_dir, "train.bin"), dtype=np.uint16, mode="r")
    val_data = np.memmap(os.path.join(data_dir, "val.bin"), dtype=np.uint16, mode="r")
    device_type = "cuda" if "cuda" in device else "cpu"

    def get_batch(split):
        data = train_data if split == "train" else val_data
        ix = torch.randint(len(data) - block_size, (batch_size,))
        x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
        if device_type == "cuda":
            x = x.pin_memory().to(device, non_blocking=True)
            y = y.pin_memory().to(device, non_blocking=True)
        else:
            x, y = x.to(device), y.to(device)
        return x, y

    return get_batch


def get_lr(it, cfg):
    if it < cfg["warmup_iters"]:
        return cfg["learning_rate"] * (it + 1) / (cfg["warmup_iters"] + 1)
    if it > cfg["lr_decay_iters"]:
        return cfg["min_lr"]
    ratio = (it - cfg["warmup_iters"]) / (cfg["lr_decay_iters"] - cfg["warmup_iters"])
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return cfg["min_lr"] + coeff * (cfg["learning_rate"] - cfg["min_lr"])


@torch.no_grad()
def estimate_loss(model, get_batch, ctx, eval_iters):
    out = {}
    model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            with ctx:
                _, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean().item()
    model.train()
    return out


def lr_range_test(model, optimizer, get_batch, ctx, scaler, start_lr=1e-7, end_lr=1e-1, num_iters=200):
    """Sweep the learning rate exponentially and record the loss curve."""
    model.train()
    mult = (end_lr / start_lr) ** (1.0 / num_iters)
    lr, best, history = start_lr, float("inf"), []
    for it in range(num_iters):
        for group in optimizer.param_groups:
            group["lr"] = lr
        X, Y = get_batch("train")
        with ctx:
            _, loss = model(X, Y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        optimizer.step()  # expect: AMP006
        history.append((lr, loss.item()))
        best = min(best, loss.item())
        if loss.item() > 4 * best:
            break
        lr *= mult
    return history


def overfit_one_batch(model, get_batch, device, steps=300, lr=3e-4):
    """Debug helper: the loss on a single fixed batch should go to ~0."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    X, Y = get_batch("train")
    for step in range(steps):
        with torch.autocast(device_type="cuda", dtype=torch.float16):  # expect: AMP010
            _, loss = model(X, Y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 25 == 0:
            print(f"overfit step {step}: loss {loss.item():.4f}")
    return loss.item()


def finetune_on_task(model, task_batches, optimizer, ctx, scaler, grad_clip, epochs=1):
    """Short supervised finetune on (x, y) pairs after pretraining."""
    model.train()
    for epoch in range(epochs):
        for X, Y in task_batches:
            with ctx:
                _, loss = model(X, Y)
            scaler.scale(loss).backward()
            if grad_clip > 0.0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)


def save_compact_checkpoint(model, cfg, iter_num, path):
    """Half-size checkpoint for sharing: weights only, stored in fp16."""
    raw = model._orig_mod if hasattr(model, "_orig_mod") else model
    state = {k: v.half() if v.is_floating_point() else v for k, v in raw.state_dict().items()}
    torch.save({"model": state, "config": cfg, "iter_num": iter_num}, path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--dtype", choices=list(PTDTYPES), default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--overfit-one-batch", action="store_true")
    parser.add_argument("--lr-range-test", action="store_true")
    parser.add_argument("--finetune-data", default=None)
    args = parser.parse_args()

    cfg = load_config(args.config, {"dtype": args.dtype})
    device = args.device
    device_type = "cuda" if "cuda" in device else "cpu"
    dtype = cfg["dtype"]
    torch.manual_seed(cfg.get("seed", 1337))
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    ptdtype = PTDTYPES[dtype]
    ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=ptdtype)

    get_batch = make_batch_fn(cfg["data_dir"], cfg["block_size"], cfg["batch_size"], device)
    model = GPT(GPTConfig(**cfg["model"])).to(device)

    if args.overfit_one_batch:
        overfit_one_batch(model, get_batch, device)
        return

    # only fp16 needs the scaler; with enabled=False every call is a pass-through
    scaler = torch.amp.GradScaler("cuda", enabled=(dtype == "float16"))
    optimizer = model.configure_optimizers(cfg["weight_decay"], cfg["learning_rate"],
                                           (cfg["beta1"], cfg["beta2"]), device_type)

    if args.lr_range_test:
        history = lr_range_test(model, optimizer, get_batch, ctx, scaler)
        for lr, loss in history:
            print(f"{lr:.2e}\t{loss:.4f}")
        return

    raw_model = model
    if args.compile:
        model = torch.compile(model)

    metrics = MetricLogger(cfg.get("out_dir", "out"))
    grad_accum = cfg["gradient_accumulation_steps"]
    best_val_loss = 1e9
    iter_num = 0
    X, Y = get_batch("train")
    t0 = time.time()
    while iter_num <= cfg["max_iters"]:
        lr = get_lr(iter_num, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr

        if iter_num % cfg["eval_interval"] == 0:
            losses = estimate_loss(model, get_batch, ctx, cfg["eval_iters"])
            metrics.log(iter_num, val_loss=losses["val"], train_loss=losses["train"], lr=lr)
            if losses["val"] < best_val_loss:
                best_val_loss = losses["val"]
                torch.save({
                    "model": raw_model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scaler": scaler.state_dict(),
                    "iter_num": iter_num,
                    "best_val_loss": best_val_loss,
                    "config": cfg,
                }, os.path.join(cfg["out_dir"], "ckpt.pt"))

        for micro_step in range(grad_accum):
            with ctx:
                logits, loss = model(X, Y)
                loss = loss / grad_accum
            X, Y = get_batch("train")
            scaler.scale(loss).backward()
        if cfg["grad_clip"] != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

        if iter_num % cfg["log_interval"] == 0:
            dt = time.time() - t0
            t0 = time.time()
            print(f"iter {iter_num}: loss {loss.item() * grad_accum:.4f}, time {dt * 1000:.2f}ms")
        iter_num += 1

    if args.finetune_data:
        task_batches = torch.load(args.finetune_data)
        finetune_on_task(model, task_batches, optimizer, ctx, scaler, cfg["grad_clip"])

    save_compact_checkpoint(model, cfg, iter_num, os.path.join(cfg["out_dir"], "final_fp16.pt"))


if __name__ == "__main__":
    main()
