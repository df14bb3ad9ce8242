"""Pretraining / SFT driver for the GPT models in model.py.

Single GPU:   python train_lm.py --data data/owt --out runs/gpt2-124m
DDP:          torchrun --standalone --nproc_per_node=8 train_lm.py --data data/owt
"""
import argparse
import copy
import math
import os
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

from model import GPT, GPTConfig

PTDTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_scaler(enabled):
    try:
        return torch.amp.GradScaler("cuda", enabled=enabled)
    except (AttributeError, TypeError):  # torch < 2.3
        return torch.cuda.amp.GradScaler(enabled=enabled)


def get_lr(it, args):
    if it < args.warmup_iters:
        return args.lr * (it + 1) / (args.warmup_iters + 1)
    if it > args.lr_decay_iters:
        return args.min_lr
    ratio = (it - args.warmup_iters) / (args.lr_decay_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.lr - args.min_lr)


def make_get_batch(data_dir, block_size, batch_size, device):
    device_type = "cuda" if "cuda" in device else "cpu"

    def get_batch(split):
        data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - block_size, (batch_size,))
        x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
        if device_type == "cuda":
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x.to(device), y.to(device)

    return get_batch


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


def sft_step(model, batch, optimizer, scaler, grad_clip):
    """One supervised fine-tuning step on a packed (input_ids, labels) batch."""
    idx, targets = batch
    with torch.autocast(device_type="cuda", dtype=torch.float16):
        logits, _ = model(idx)
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-100)  # expect: AMP002
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def lr_range_test(model, optimizer, scaler, get_batch, ctx, start_lr=1e-7, end_lr=1.0, num_iters=200):
    history = []
    for i in range(num_iters):
        lr = start_lr * (end_lr / start_lr) ** (i / (num_iters - 1))
        for g in optimizer.param_groups:
            g["lr"] = lr
        X, Y = get_batch("train")
        with ctx:
            _, loss = model(X, Y)
        history.append((lr, loss.item()))
        loss = scaler.scale(loss)
        loss.backward()
        optimizer.step()  # expect: AMP006
        optimizer.zero_grad(set_to_none=True)
        if not math.isfinite(history[-1][1]) or history[-1][1] > 4 * history[0][1]:
            break
    return history


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="out")
    p.add_argument("--init-from", default="scratch", choices=["scratch", "resume"])
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--block-size", type=int, default=1024)
    p.add_argument("--grad-accum", type=int, default=40)
    p.add_argument("--max-iters", type=int, default=600000)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--min-lr", type=float, default=6e-5)
    p.add_argument("--warmup-iters", type=int, default=2000)
    p.add_argument("--lr-decay-iters", type=int, default=600000)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-interval", type=int, default=2000)
    p.add_argument("--eval-iters", type=int, default=200)
    p.add_argument("--dtype", default=None, choices=list(PTDTYPE))
    p.add_argument("--compile", action="store_true")
    p.add_argument("--lr-test", action="store_true")
    args = p.parse_args()

    ddp = int(os.environ.get("RANK", -1)) != -1
    if ddp:
        init_process_group(backend="nccl")
        rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
        args.grad_accum //= int(os.environ["WORLD_SIZE"])
    else:
        rank, device = 0, "cuda" if torch.cuda.is_available() else "cpu"
    master = rank == 0
    torch.manual_seed(1337 + rank)
    torch.backends.cuda.matmul.allow_tf32 = True

    if args.dtype is None:
        args.dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float16"
    device_type = "cuda" if "cuda" in device else "cpu"
    ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=PTDTYPE[args.dtype])
    scaler = make_scaler(enabled=(args.dtype == "float16"))

    get_batch = make_get_batch(args.data, args.block_size, args.batch_size, device)
    model = GPT(GPTConfig(block_size=args.block_size)).to(device)
    optimizer = model.configure_optimizers(weight_decay=0.1, learning_rate=args.lr, betas=(0.9, 0.95),
                                           device_type=device_type)
    iter_num, best_val_loss = 0, 1e9
    if args.init_from == "resume":
        ckpt = torch.load(os.path.join(args.out, "ckpt.pt"), map_location=device)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        iter_num, best_val_loss = ckpt["iter_num"], ckpt["best_val_loss"]

    if args.lr_test:
        for lr, loss in lr_range_test(model, optimizer, scaler, get_batch, ctx):
            print(f"{lr:.3e} {loss:.4f}")
        return
    if args.compile:
        model = torch.compile(model)
    if ddp:
        model = DDP(model, device_ids=[local_rank])
    raw_model = model.module if ddp else model
    raw_model = getattr(raw_model, "_orig_mod", raw_model)

    tokens_per_iter = args.grad_accum * args.batch_size * args.block_size * (int(os.environ.get("WORLD_SIZE", 1)))
    X, Y = get_batch("train")
    t0 = time.time()
    while iter_num <= args.max_iters:
        lr = get_lr(iter_num, args)
        for g in optimizer.param_groups:
            g["lr"] = lr
        if iter_num % args.eval_interval == 0 and master:
            losses = estimate_loss(model, get_batch, ctx, args.eval_iters)
            print(f"step {iter_num}: train {losses['train']:.4f}, val {losses['val']:.4f}")
            if losses["val"] < best_val_loss:
                best_val_loss = losses["val"]
                torch.save({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                            "scaler": scaler.state_dict(), "iter_num": iter_num,
                            "best_val_loss": best_val_loss}, os.path.join(args.out, "ckpt.pt"))

        for micro_step in range(args.grad_accum):
            if ddp:
                model.require_backward_grad_sync = micro_step == args.grad_accum - 1
            with ctx:
                _, loss = model(X, Y)
                loss = loss / args.grad_accum
            X, Y = get_batch("train")
            scaler.scale(loss).backward()
        if args.grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

        if iter_num % 10 == 0 and master:
            dt, t0 = time.time() - t0, time.time()
            lossf = loss.item() * args.grad_accum
            mfu = raw_model.estimate_mfu(args.batch_size * args.grad_accum, dt / 10) if iter_num else 0.0
            print(f"iter {iter_num}: loss {lossf:.4f}, {dt * 100:.0f} ms/it, "
                  f"{tokens_per_iter * 10 / dt / 1e6:.2f} Mtok/s, mfu {mfu * 100:.1f}%")
        iter_num += 1

    if master:
        release = copy.deepcopy(raw_model).half()
        torch.save({"model": release.state_dict(), "config": raw_model.config}, os.path.join(args.out, "release_fp16.pt"))
    if ddp:
        destroy_process_group()


if __name__ == "__main__":
    main()
