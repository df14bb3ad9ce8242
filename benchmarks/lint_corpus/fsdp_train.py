"""Fully sharded data parallel training of a transformer with fp16 mixed precision."""
import functools
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.nn import TransformerEncoderLayer

fp16_policy = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32, buffer_dtype=torch.float32)
bf16_policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)


def setup():
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))


def build(model, use_fp16):
    wrap_policy = functools.partial(transformer_auto_wrap_policy,
                                    transformer_layer_cls={TransformerEncoderLayer})
    return FSDP(
        model,
        auto_wrap_policy=wrap_policy,
        mixed_precision=fp16_policy if use_fp16 else bf16_policy,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=torch.cuda.current_device(),
    )


def train(model, loader, epochs, max_norm=1.0):
    setup()
    model = FSDP(model, mixed_precision=fp16_policy, device_id=torch.cuda.current_device())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    scaler = ShardedGradScaler()
    for epoch in range(epochs):
        model.train()
        for batch in loader:
            batch = {k: v.cuda() for k, v in batch.items()}
            optimizer.zero_grad(set_to_none=True)
            loss = model(**batch).loss
            scaler.scale(loss).backward()
            model.clip_grad_norm_(max_norm)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
    dist.destroy_process_group()


def train_unscaled_first(model, loader, epochs, max_norm=1.0):
    setup()
    model = build(model, use_fp16=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    scaler = ShardedGradScaler()
    for epoch in range(epochs):
        for batch in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = model(**batch).loss
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            model.clip_grad_norm_(max_norm)
            scaler.step(optimizer)
            scaler.update()


def train_bf16(model, loader, epochs, max_norm=1.0):
    setup()
    model = build(model, use_fp16=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for epoch in range(epochs):
        for batch in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = model(**batch).loss
            loss.backward()
            model.clip_grad_norm_(max_norm)
            optimizer.step()


def train_engine(engine, loader, scaler):
    """``engine`` is a DeepSpeed/accelerate-like wrapper: its clip unscales by itself."""
    for batch in loader:
        loss = engine(**batch).loss
        scaler.scale(loss).backward()
        engine.clip_grad_norm_(1.0)
        scaler.step(engine.optimizer)
        scaler.update()
