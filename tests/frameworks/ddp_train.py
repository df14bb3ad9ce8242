"""A plain PyTorch DDP training script for torchrun: gloo on the CPU, bf16 autocast.

    torchrun --standalone --nproc-per-node 2 ddp_train.py --steps 6
             [--overflow-at N --overflow-rank R] [--losses FILE]
"""
from __future__ import annotations

import argparse
import gc
import json

import torch
import torch.distributed as dist
from torch import nn


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--overflow-at", type=int)
    parser.add_argument("--overflow-rank", type=int)
    parser.add_argument("--losses", help="rank 0 writes its losses to this JSON file")
    options = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(rank)
    losses = []
    for step in range(options.steps):
        x = torch.randn(8, 8, generator=generator)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
            if step == options.overflow_at and rank == options.overflow_rank:
                out = out * 1e39  # injected overflow
        loss = nn.functional.mse_loss(out.float(), x.sum(dim=1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    if options.losses and rank == 0:
        with open(options.losses, "w", encoding="utf-8") as fh:
            json.dump(losses, fh)
    # DDP's reducer holds gloo work; free it before the group goes
    del model, optimizer
    gc.collect()
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
