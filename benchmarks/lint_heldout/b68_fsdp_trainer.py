"""Distributed pre-training loops: FSDP with mixed-precision policies, and a DDP fallback.

bf16 is the default everywhere (A100/H100). The fp16 policy exists for V100 nodes and
is the only configuration that uses a (sharded) gradient scaler.
"""
import functools
import logging
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import (
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.nn.parallel import DistributedDataParallel as DDP

from model import GPT, GPTConfig, TransformerBlock
from data import get_batch_iterator

logger = logging.getLogger(__name__)

bf16_policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                             buffer_dtype=torch.bfloat16)
fp16_policy = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32,
                             buffer_dtype=torch.float32)
fp32_policy = MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float32,
                             buffer_dtype=torch.float32)
POLICIES = {"bf16": bf16_policy, "fp16": fp16_policy, "fp32": fp32_policy}


@dataclass
class TrainConfig:
    out_dir: str = "out"
    precision: str = "bf16"
    batch_size: int = 8
    grad_accum: int = 4
    max_iters: int = 100_000
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_iters: int = 2000
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_interval: int = 1000
    eval_iters: int = 50
    log_interval: int = 20
    compile: bool = False


def setup_distributed():
    dist.init_process_group(backend="nccl")
    rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    return rank, local_rank, dist.get_world_size()


def get_lr(it: int, cfg: TrainConfig) -> float:
    if it < cfg.warmup_iters:
        return cfg.lr * (it + 1) / (cfg.warmup_iters + 1)
    progress = min(1.0, (it - cfg.warmup_iters) / max(1, cfg.max_iters - cfg.warmup_iters))
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


@torch.no_grad()
def estimate_loss(model, batch_iters, eval_iters, autocast_ctx):
    model.eval()
    out = {}
    for split, it in batch_iters.items():
        losses = torch.zeros(eval_iters, device="cuda")
        for k in range(eval_iters):
            x, y = next(it)
            with autocast_ctx:
                _, loss = model(x, y)
            losses[k] = loss.float()
        dist.all_reduce(losses, op=dist.ReduceOp.AVG)
        out[split] = losses.mean().item()
    model.train()
    return out


def save_full_checkpoint(model, optimizer, step, cfg, rank):
    save_policy = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, save_policy):
        cpu_state = model.state_dict()
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        torch.save({"model": {k: v.to(torch.bfloat16) for k, v in cpu_state.items()}, "step": step},
                   os.path.join(cfg.out_dir, f"ckpt_{step:07d}.pt"))
    dist.barrier()


def fsdp_train(cfg: TrainConfig, model_cfg: GPTConfig):
    rank, local_rank, world = setup_distributed()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    use_fp16 = cfg.precision == "fp16"
    if cfg.precision == "bf16" and not torch.cuda.is_bf16_supported():
        raise RuntimeError("bf16 requested but not supported on this GPU; use --precision fp16")

    wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerBlock})
    model = FSDP(
        GPT(model_cfg),
        auto_wrap_policy=wrap_policy,
        mixed_precision=POLICIES[cfg.precision],
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=torch.cuda.current_device(),
        limit_all_gathers=True,
        use_orig_params=True,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                  weight_decay=cfg.weight_decay, fused=True)
    scaler = ShardedGradScaler() if use_fp16 else None
    autocast_ctx = torch.autocast("cuda", dtype=torch.float16) if use_fp16 else nullcontext()

    train_iter = get_batch_iterator("train", cfg.batch_size, rank, world)
    eval_iters = {"train": get_batch_iterator("train", cfg.batch_size, rank, world),
                  "val": get_batch_iterator("val", cfg.batch_size, rank, world)}
    best_val_loss = 1e9
    t0 = time.time()
    for it in range(cfg.max_iters):
        lr = get_lr(it, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr

        if it % cfg.eval_interval == 0 and it > 0:
            losses = estimate_loss(model, eval_iters, cfg.eval_iters, autocast_ctx)
            if rank == 0:
                logger.info("iter %d: train %.4f val %.4f", it, losses["train"], losses["val"])
            if losses["val"] < best_val_loss:
                best_val_loss = losses["val"]
                save_full_checkpoint(model, optimizer, it, cfg, rank)

        loss_accum = torch.zeros((), device="cuda", dtype=torch.float32)
        for micro in range(cfg.grad_accum):
            x, y = next(train_iter)
            sync_ctx = model.no_sync() if micro < cfg.grad_accum - 1 else nullcontext()
            with sync_ctx:
                with autocast_ctx:
                    _, loss = model(x, y)
                loss = loss / cfg.grad_accum
                loss_accum += loss.detach().float()
                if scaler is not None:
                    scaler.scale(loss).backward()
                else:
                    loss.backward()

        if scaler is not None:
            if cfg.grad_clip > 0:
                grad_norm = model.clip_grad_norm_(cfg.grad_clip)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
        else:
            if cfg.grad_clip > 0:
                grad_norm = model.clip_grad_norm_(cfg.grad_clip)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if it % cfg.log_interval == 0:
            dist.all_reduce(loss_accum, op=dist.ReduceOp.AVG)
            if rank == 0:
                dt = (time.time() - t0) / cfg.log_interval
                t0 = time.time()
                logger.info("iter %d loss %.4f lr %.2e %.1f ms/iter", it, loss_accum.item(), lr, dt * 1000)

    save_full_checkpoint(model, optimizer, cfg.max_iters, cfg, rank)
    dist.destroy_process_group()


def ddp_train(cfg: TrainConfig, model_cfg: GPTConfig):
    """Plain DDP, bf16 autocast with fp32 weights (small models)."""
    rank, local_rank, world = setup_distributed()
    device = torch.device("cuda", local_rank)
    raw_model = GPT(model_cfg).to(device)
    model = DDP(torch.compile(raw_model) if cfg.compile else raw_model, device_ids=[local_rank])
    optimizer = raw_model.configure_optimizers(cfg.weight_decay, cfg.lr, (0.9, 0.95), device_type="cuda")
    dtype = "bfloat16" if cfg.precision == "bf16" else "float32"
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    ctx = nullcontext() if dtype == "float32" else torch.autocast(device_type="cuda", dtype=ptdtype)

    train_iter = get_batch_iterator("train", cfg.batch_size, rank, world)
    x, y = next(train_iter)
    for it in range(cfg.max_iters):
        lr = get_lr(it, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        for micro_step in range(cfg.grad_accum):
            no_sync = model.no_sync if micro_step < cfg.grad_accum - 1 else nullcontext
            with no_sync():
                with ctx:
                    logits, loss = model(x, y)
                    loss = loss / cfg.grad_accum
                    loss.backward()  # expect: AMP008
            x, y = next(train_iter)
        if cfg.grad_clip > 0.0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if it % cfg.log_interval == 0 and rank == 0:
            logger.info("iter %d loss %.4f", it, loss.item() * cfg.grad_accum)
    if rank == 0:
        torch.save(raw_model.state_dict(), os.path.join(cfg.out_dir, "ddp_final.pt"))
    dist.destroy_process_group()
