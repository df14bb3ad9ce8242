"""Fine-tune T5 for abstractive summarisation: label smoothing + R-Drop, FSDP, bf16.

    torchrun --nproc_per_node 8 finetune_t5.py --model t5-large --data cnn_dm

T5 was pretrained in bf16 and overflows in fp16, so the loop runs under bf16 autocast.
The loss is fairseq's label-smoothed NLL computed on the logits (we do not use the
model's own ``outputs.loss``), plus an optional R-Drop consistency term between two
dropout samples of the same batch.
"""
import argparse
import contextlib
import functools
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoTokenizer, T5ForConditionalGeneration, get_linear_schedule_with_warmup
from transformers.models.t5.modeling_t5 import T5Block

bf16_policy = MixedPrecision(
    param_dtype=torch.bfloat16,
    reduce_dtype=torch.float32,
    buffer_dtype=torch.bfloat16,
)


def label_smoothed_nll_loss(lprobs, target, epsilon, ignore_index=-100):
    """fairseq's label-smoothed NLL; returns (loss, nll_loss), both summed over tokens."""
    if target.dim() == lprobs.dim() - 1:
        target = target.unsqueeze(-1)
    pad_mask = target.eq(ignore_index)
    safe_target = target.masked_fill(pad_mask, 0)
    nll_loss = -lprobs.gather(dim=-1, index=safe_target)
    smooth_loss = -lprobs.sum(dim=-1, keepdim=True)
    nll_loss = nll_loss.masked_fill(pad_mask, 0.0).sum()
    smooth_loss = smooth_loss.masked_fill(pad_mask, 0.0).sum()
    eps_i = epsilon / (lprobs.size(-1) - 1)
    loss = (1.0 - epsilon - eps_i) * nll_loss + eps_i * smooth_loss
    return loss, nll_loss


def setup():
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    return dist.get_rank(), dist.get_world_size(), local_rank


def build_loaders(args, tokenizer, rank, world_size):
    from datasets import load_dataset

    raw = load_dataset("cnn_dailymail", "3.0.0")

    def encode(batch):
        enc = tokenizer(
            ["summarize: " + a for a in batch["article"]],
            max_length=args.max_source_len,
            truncation=True,
            padding="max_length",
        )
        labels = tokenizer(batch["highlights"], max_length=args.max_target_len, truncation=True, padding="max_length")
        enc["labels"] = [
            [(t if t != tokenizer.pad_token_id else -100) for t in seq] for seq in labels["input_ids"]
        ]
        return enc

    cols = ["input_ids", "attention_mask", "labels"]
    train = raw["train"].map(encode, batched=True, remove_columns=raw["train"].column_names)
    val = raw["validation"].map(encode, batched=True, remove_columns=raw["validation"].column_names)
    train.set_format("torch", columns=cols)
    val.set_format("torch", columns=cols)
    train_sampler = DistributedSampler(train, rank=rank, num_replicas=world_size, shuffle=True)
    val_sampler = DistributedSampler(val, rank=rank, num_replicas=world_size, shuffle=False)
    return (
        DataLoader(train, batch_size=args.batch_size, sampler=train_sampler, num_workers=4, pin_memory=True),
        DataLoader(val, batch_size=args.batch_size, sampler=val_sampler, num_workers=4),
        train_sampler,
    )


def train_epoch(model, loader, optimizer, lr_scheduler, scaler, args, epoch, rank):
    model.train()
    optimizer.zero_grad(set_to_none=True)
    t0 = time.time()
    for step, batch in enumerate(loader):
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        labels = batch["labels"]
        ntokens = labels.ne(-100).sum()
        last_micro = (step + 1) % args.grad_accum == 0
        sync_ctx = contextlib.nullcontext() if last_micro else model.no_sync()
        with sync_ctx:
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                out1 = model(**batch)
                out2 = model(**batch) if args.rdrop_alpha > 0 else None
            loss, nll_loss = label_smoothed_nll_loss(out1.logits.log_softmax(dim=-1), labels, args.label_smoothing)  # expect: AMP002
            if out2 is not None:
                p, q = out1.logits.log_softmax(-1), out2.logits.log_softmax(-1)
                rdrop = 0.5 * (F.kl_div(p, q, log_target=True, reduction="sum") + F.kl_div(q, p, log_target=True, reduction="sum"))  # expect: AMP002
                loss = loss + args.rdrop_alpha * rdrop
            loss = loss / ntokens / args.grad_accum
            scaler.scale(loss).backward()

        if last_micro:
            model.clip_grad_norm_(args.max_grad_norm)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            lr_scheduler.step()

        if rank == 0 and step % args.log_every == 0:
            elapsed = time.time() - t0
            t0 = time.time()
            print(
                f"epoch {epoch} step {step} nll/tok {(nll_loss / ntokens).item():.4f} "
                f"lr {lr_scheduler.get_last_lr()[0]:.2e} {elapsed:.1f}s"
            )


@torch.no_grad()
def evaluate(model, loader, tokenizer, args, rank):
    model.eval()
    total_loss = torch.zeros(2, device="cuda")
    for batch in loader:
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            out = model(**batch)
        ntok = batch["labels"].ne(-100).sum()
        total_loss[0] += out.loss.float() * ntok
        total_loss[1] += ntok
    dist.all_reduce(total_loss)
    model.train()
    val_nll = (total_loss[0] / total_loss[1]).item()
    if rank == 0:
        print(f"val nll/tok {val_nll:.4f} ppl {math.exp(val_nll):.2f}")
    return val_nll


def save_checkpoint(model, tokenizer, path, rank):
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        state = model.state_dict()
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        torch.save(state, os.path.join(path, "pytorch_model.bin"))
        tokenizer.save_pretrained(path)


def main(args):
    rank, world_size, local_rank = setup()
    torch.manual_seed(args.seed + rank)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = T5ForConditionalGeneration.from_pretrained(args.model)
    model.gradient_checkpointing_enable()
    wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={T5Block})
    model = FSDP(
        model,
        auto_wrap_policy=wrap_policy,
        mixed_precision=bf16_policy,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=torch.cuda.current_device(),
    )
    train_loader, val_loader, train_sampler = build_loaders(args, tokenizer, rank, world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    total_steps = len(train_loader) * args.epochs // args.grad_accum
    lr_scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, total_steps)
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010

    best = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        train_epoch(model, train_loader, optimizer, lr_scheduler, scaler, args, epoch, rank)
        val_nll = evaluate(model, val_loader, tokenizer, args, rank)
        if val_nll < best:
            best = val_nll
            save_checkpoint(model, tokenizer, os.path.join(args.output_dir, "best"), rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="t5-large")
    parser.add_argument("--output_dir", default="out/t5-cnndm")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--grad_accum", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--warmup_steps", type=int, default=1000)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--label_smoothing", type=float, default=0.1)
    parser.add_argument("--rdrop_alpha", type=float, default=0.0)
    parser.add_argument("--max_source_len", type=int, default=512)
    parser.add_argument("--max_target_len", type=int, default=128)
    parser.add_argument("--log_every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=42)
    main(parser.parse_args())
