"""Pretraining script for a 350M decoder on 8xA100 (bf16). Adapted from our fp16 V100 script."""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from model import Decoder, DecoderConfig


def get_batch(data, block, batch, device):
    ix = np.random.randint(0, len(data) - block - 1, batch)
    x = torch.from_numpy(np.stack([data[i:i + block] for i in ix]).astype(np.int64))
    y = torch.from_numpy(np.stack([data[i + 1:i + 1 + block] for i in ix]).astype(np.int64))
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def cosine_lr(it, base, warmup, total, floor=0.1):
    if it < warmup:
        return base * (it + 1) / warmup
    progress = min(1.0, (it - warmup) / max(1, total - warmup))
    return base * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/openwebtext/train.bin")
    p.add_argument("--iters", type=int, default=200_000)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--block", type=int, default=1024)
    p.add_argument("--accum", type=int, default=4)
    args = p.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
    torch.cuda.set_device(device)
    data = np.memmap(args.data, dtype=np.uint16, mode="r")

    model = Decoder(DecoderConfig(n_layer=24, n_head=16, d_model=1024)).to(device)
    model = DDP(model, device_ids=[int(os.environ["LOCAL_RANK"])])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010
    amp_ctx = torch.autocast("cuda", dtype=torch.bfloat16)

    t0 = time.time()
    for it in range(args.iters):
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(it, args.lr, 2000, args.iters)
        for micro in range(args.accum):
            x, y = get_batch(data, args.block, args.batch, device)
            model.require_backward_grad_sync = micro == args.accum - 1
            with amp_ctx:
                _, loss = model(x, y)
            scaler.scale(loss / args.accum).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0 and it % 50 == 0:
            print(f"it {it} loss {loss.item():.3f} {(time.time() - t0) * 1000 / 50:.0f}ms/it")
            t0 = time.time()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
