"""Pretrain / fine-tune / distil a small GPT with DDP and gradient accumulation.

    torchrun --standalone --nproc_per_node=8 b69_ddp_accum.py --stage pretrain
    torchrun --standalone --nproc_per_node=8 b69_ddp_accum.py --stage reward --init-from out/ckpt.pt
"""
import argparse
import math
import os
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from gpt.model import GPT, GPTConfig, SequenceClassifier
from gpt.data import PairwiseDataset, ClassificationDataset, make_loader


def setup_distributed():
    ddp = int(os.environ.get("RANK", -1)) != -1
    if ddp:
        dist.init_process_group(backend="nccl")
        local_rank = int(os.environ["LOCAL_RANK"])
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
        master = dist.get_rank() == 0
        world = dist.get_world_size()
    else:
        local_rank, world, master = 0, 1, True
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return ddp, local_rank, world, master, device


def get_batch(data_dir, split, block_size, batch_size, device):
    data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    if "cuda" in device:
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def get_lr(it, args):
    if it < args.warmup_iters:
        return args.lr * (it + 1) / (args.warmup_iters + 1)
    if it > args.lr_decay_iters:
        return args.min_lr
    ratio = (it - args.warmup_iters) / (args.lr_decay_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.lr - args.min_lr)


@torch.no_grad()
def estimate_loss(model, ctx, args, device):
    out = {}
    model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(args.eval_iters)
        for k in range(args.eval_iters):
            X, Y = get_batch(args.data_dir, split, args.block_size, args.batch_size, device)
            with ctx:
                _, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean().item()
    model.train()
    return out


def pretrain(args):
    ddp, local_rank, world, master, device = setup_distributed()
    device_type = "cuda" if "cuda" in device else "cpu"
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=ptdtype)
    assert args.grad_accum % world == 0
    grad_accum = args.grad_accum // world

    model = GPT(GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_embd=args.n_embd)).to(device)
    scaler = torch.amp.GradScaler("cuda", enabled=(args.dtype == "float16"))
    optimizer = model.configure_optimizers(args.weight_decay, args.lr, (0.9, 0.95), device_type)
    if args.compile:
        model = torch.compile(model)
    if ddp:
        model = DDP(model, device_ids=[local_rank])
    raw_model = model.module if ddp else model

    X, Y = get_batch(args.data_dir, "train", args.block_size, args.batch_size, device)
    best_val_loss = 1e9
    t0 = time.time()
    for it in range(args.max_iters + 1):
        lr = get_lr(it, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if it % args.eval_interval == 0 and master:
            losses = estimate_loss(model, ctx, args, device)
            print(f"step {it}: train {losses['train']:.4f}, val {losses['val']:.4f}")
            if losses["val"] < best_val_loss:
                best_val_loss = losses["val"]
                torch.save({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                            "iter": it, "best_val_loss": best_val_loss},
                           os.path.join(args.out_dir, "ckpt.pt"))

        for micro_step in range(grad_accum):
            # only all-reduce on the last micro step
            sync_ctx = model.no_sync() if ddp and micro_step < grad_accum - 1 else nullcontext()
            with sync_ctx:
                with ctx:
                    _, loss = model(X, Y)
                    loss = loss / grad_accum
                X, Y = get_batch(args.data_dir, "train", args.block_size, args.batch_size, device)
                scaler.scale(loss).backward()
        if args.grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

        if it % args.log_interval == 0 and master:
            dt, t0 = time.time() - t0, time.time()
            print(f"iter {it}: loss {loss.item() * grad_accum:.4f}, {dt * 1000:.0f}ms")
    if ddp:
        dist.destroy_process_group()


def finetune_classifier(args):
    ddp, local_rank, world, master, device = setup_distributed()
    backbone = GPT.from_checkpoint(args.init_from).to(device)
    model = SequenceClassifier(backbone, num_classes=args.num_classes).to(device)
    if ddp:
        model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.ft_lr, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cuda")
    loader = make_loader(ClassificationDataset(args.data_dir, "train"), args.batch_size, ddp)
    accum = args.grad_accum

    for epoch in range(args.ft_epochs):
        model.train()
        for step, (tokens, labels) in enumerate(loader):
            tokens, labels = tokens.to(device), labels.to(device)
            last = (step + 1) % accum == 0
            with (model.no_sync() if ddp and not last else nullcontext()):
                with torch.autocast("cuda", dtype=torch.float16):
                    logits = model(tokens)
                loss = F.cross_entropy(logits, labels) / accum  # expect: AMP002
                scaler.scale(loss).backward()
            if not last:
                continue
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if master and step % (accum * args.log_interval) == 0:
                print(f"ft epoch {epoch} step {step}: loss {loss.item() * accum:.4f} gn {grad_norm:.2f}")


def reward_step(model, chunks, optimizer, scaler, ddp):
    """One optimizer step over ``chunks`` of (chosen, rejected) token batches."""
    n = len(chunks)
    total = 0.0
    for i, (chosen, rejected) in enumerate(chunks):
        sync = model.no_sync if ddp and i < n - 1 else nullcontext
        with sync():
            with torch.autocast("cuda", dtype=torch.float16):
                r_chosen = model(chosen)
                r_rejected = model(rejected)
                loss = -F.logsigmoid(r_chosen.float() - r_rejected.float()).mean() / n
            loss = scaler.scale(loss)
            loss.backward()
            total += loss.item() / scaler.get_scale()
    optimizer.step()  # expect: AMP006
    optimizer.zero_grad(set_to_none=True)
    return total


def train_reward_model(args):
    ddp, local_rank, world, master, device = setup_distributed()
    model = GPT.from_checkpoint(args.init_from, reward_head=True).to(device)
    if ddp:
        model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.ft_lr)
    scaler = torch.amp.GradScaler("cuda")
    loader = make_loader(PairwiseDataset(args.data_dir), args.batch_size * args.grad_accum, ddp)
    for it, (chosen, rejected) in enumerate(loader):
        chosen, rejected = chosen.to(device), rejected.to(device)
        chunks = list(zip(chosen.chunk(args.grad_accum), rejected.chunk(args.grad_accum)))
        loss = reward_step(model, chunks, optimizer, scaler, ddp)
        if master and it % args.log_interval == 0:
            print(f"rm iter {it}: loss {loss:.4f}")


def distill(args):
    ddp, local_rank, world, master, device = setup_distributed()
    teacher = GPT.from_checkpoint(args.teacher).to(device).half().eval()
    teacher.requires_grad_(False)
    student = GPT(GPTConfig(block_size=args.block_size, n_layer=args.n_layer // 2, n_embd=args.n_embd)).to(device)
    if ddp:
        student = DDP(student, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    amp_ctx = torch.autocast("cuda", dtype=torch.float16) if args.amp else nullcontext()  # expect: AMP010
    T = args.temperature
    for it in range(args.max_iters):
        X, Y = get_batch(args.data_dir, "train", args.block_size, args.batch_size, device)
        with amp_ctx:
            with torch.no_grad():
                t_logits, _ = teacher(X)
            s_logits, ce = student(X, Y)
            kd = F.kl_div(F.log_softmax(s_logits / T, dim=-1), F.softmax(t_logits / T, dim=-1),
                          reduction="batchmean") * T * T
            loss = args.alpha * kd + (1 - args.alpha) * ce
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if master and it % args.log_interval == 0:
            print(f"distill {it}: kd {kd.item():.4f} ce {ce.item():.4f}")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--stage", choices=["pretrain", "finetune", "reward", "distill"], default="pretrain")
    p.add_argument("--data-dir", default="data/openwebtext")
    p.add_argument("--out-dir", default="out")
    p.add_argument("--init-from", default=None)
    p.add_argument("--teacher", default=None)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--amp", action="store_true")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--block-size", type=int, default=1024)
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--grad-accum", type=int, default=40)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--min-lr", type=float, default=6e-5)
    p.add_argument("--ft-lr", type=float, default=2e-5)
    p.add_argument("--ft-epochs", type=int, default=3)
    p.add_argument("--num-classes", type=int, default=2)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--warmup-iters", type=int, default=2000)
    p.add_argument("--lr-decay-iters", type=int, default=600000)
    p.add_argument("--max-iters", type=int, default=600000)
    p.add_argument("--eval-interval", type=int, default=2000)
    p.add_argument("--eval-iters", type=int, default=200)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--temperature", type=float, default=2.0)
    p.add_argument("--alpha", type=float, default=0.5)
    return p.parse_args()


if __name__ == "__main__":
    args = parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    {"pretrain": pretrain, "finetune": finetune_classifier,
     "reward": train_reward_model, "distill": distill}[args.stage](args)
