# coding=utf-8
# Copyright 2019 NVIDIA CORPORATION and The HuggingFace Inc. team. All rights reserved.
"""Continued BERT pre-training (MLM + NSP) on pregenerated in-domain shards.

History: this script used apex (``amp.initialize`` / ``FP16_Optimizer`` and
``amp.scale_loss``) until apex stopped building on our images; it now runs on
native PyTorch AMP. Run with ``--fp16`` on V100/T4 nodes.
"""
import argparse
import copy
import glob
import json
import logging
import math
import os
import random
import time

import numpy as np
import torch as th
from torch.cuda import amp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler
from tqdm import tqdm
from transformers import BertConfig, BertForPreTraining, get_linear_schedule_with_warmup

from pregenerated import PregeneratedDataset

logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s -   %(message)s",
                    datefmt="%m/%d/%Y %H:%M:%S", level=logging.INFO)
logger = logging.getLogger(__name__)


def is_main_process(args):
    return args.local_rank in (-1, 0)


def set_seed(args):
    random.seed(args.seed)
    np.random.seed(args.seed)
    th.manual_seed(args.seed)
    if args.n_gpu > 0:
        th.cuda.manual_seed_all(args.seed)


def reduce_tensor(tensor, world_size):
    rt = tensor.clone()
    th.distributed.all_reduce(rt, op=th.distributed.ReduceOp.SUM)
    rt /= world_size
    return rt


def convert_apex_checkpoint(state):
    """Checkpoints written by the apex version carry master params and amp state we no longer use."""
    state = dict(state)
    state.pop("master params", None)
    state.pop("amp", None)
    if "optimizer" in state and "fp32_groups_flat" in state["optimizer"]:
        state.pop("optimizer")
    return state


def prepare_model_and_optimizer(args, device, num_train_steps):
    config = BertConfig.from_json_file(args.config_file)
    # Padding for divisibility by 8
    if config.vocab_size % 8 != 0:
        config.vocab_size += 8 - (config.vocab_size % 8)
    model = BertForPreTraining(config)

    global_step = 0
    checkpoint = None
    if args.init_checkpoint:
        checkpoint = convert_apex_checkpoint(th.load(args.init_checkpoint, map_location="cpu"))
        model.load_state_dict(checkpoint["model"], strict=False)
        global_step = checkpoint.get("global_step", 0) if args.resume_step else 0
        logger.info("loaded %s (step %d)", args.init_checkpoint, global_step)

    model.to(device)
    if args.fp16:
        model.half()  # expect: AMP001

    param_optimizer = list(model.named_parameters())
    no_decay = ["bias", "LayerNorm.bias", "LayerNorm.weight"]
    optimizer_grouped_parameters = [
        {"params": [p for n, p in param_optimizer if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in param_optimizer if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = th.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)  # expect: AMP011
    scheduler = get_linear_schedule_with_warmup(
        optimizer, num_warmup_steps=int(args.warmup_proportion * num_train_steps), num_training_steps=num_train_steps)
    scaler = amp.GradScaler(init_scale=args.loss_scale or 2.0 ** 16, enabled=args.fp16)  # expect: AMP009

    if checkpoint is not None and args.resume_step and "optimizer" in checkpoint:
        optimizer.load_state_dict(checkpoint["optimizer"])
        if "scaler" in checkpoint:
            scaler.load_state_dict(checkpoint["scaler"])

    if args.local_rank != -1:
        model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    return model, optimizer, scheduler, scaler, global_step


def save_checkpoint(args, model, optimizer, scaler, global_step):
    model_to_save = model.module if hasattr(model, "module") else model
    output_file = os.path.join(args.output_dir, f"ckpt_{global_step}.pt")
    th.save({
        "model": model_to_save.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "global_step": global_step,
    }, output_file)
    # keep the last three
    ckpts = sorted(glob.glob(os.path.join(args.output_dir, "ckpt_*.pt")), key=os.path.getmtime)
    for old in ckpts[:-3]:
        os.remove(old)


def train(args, model, optimizer, scheduler, scaler, train_dataloader, device, global_step):
    model.train()
    tr_loss, nb_tr_steps = 0.0, 0
    start = time.time()
    for epoch in range(int(args.num_train_epochs)):
        if isinstance(train_dataloader.sampler, DistributedSampler):
            train_dataloader.sampler.set_epoch(epoch)
        epoch_iterator = tqdm(train_dataloader, desc=f"Epoch {epoch}", disable=not is_main_process(args))
        for step, batch in enumerate(epoch_iterator):
            batch = tuple(t.to(device) for t in batch)
            input_ids, input_mask, segment_ids, lm_label_ids, is_next = batch
            with amp.autocast(enabled=args.fp16):  # expect: AMP009
                outputs = model(input_ids=input_ids, token_type_ids=segment_ids, attention_mask=input_mask,
                                labels=lm_label_ids, next_sentence_label=is_next)
                loss = outputs.loss
            if args.gradient_accumulation_steps > 1:
                loss = loss / args.gradient_accumulation_steps
            tr_loss += loss.item()
            loss = scaler.scale(loss)
            loss.backward()
            nb_tr_steps += 1

            if (step + 1) % args.gradient_accumulation_steps == 0:
                optimizer.step()  # expect: AMP006
                scheduler.step()
                optimizer.zero_grad()
                global_step += 1
                if global_step % args.log_freq == 0 and is_main_process(args):
                    elapsed = time.time() - start
                    logger.info("step %d | loss %.4f | lr %.2e | %.1f seq/s", global_step, tr_loss / nb_tr_steps,
                                scheduler.get_last_lr()[0],
                                nb_tr_steps * args.train_batch_size / elapsed)
                if args.save_every and global_step % args.save_every == 0 and is_main_process(args):
                    save_checkpoint(args, model, optimizer, scaler, global_step)
            if args.max_steps and global_step >= args.max_steps:
                return global_step
    return global_step


def evaluate_mlm(args, model, eval_dataloader, device):
    model.eval()
    eval_loss, nb_eval_steps = 0.0, 0
    with th.no_grad(), th.autocast("cuda", dtype=th.float16, enabled=args.fp16):
        for batch in tqdm(eval_dataloader, desc="Evaluating", disable=not is_main_process(args)):
            input_ids, input_mask, segment_ids, lm_label_ids, is_next = (t.to(device) for t in batch)
            outputs = model(input_ids=input_ids, token_type_ids=segment_ids, attention_mask=input_mask,
                            labels=lm_label_ids, next_sentence_label=is_next)
            eval_loss += outputs.loss.item()
            nb_eval_steps += 1
    model.train()
    eval_loss = eval_loss / max(nb_eval_steps, 1)
    return {"eval_loss": eval_loss, "perplexity": math.exp(min(eval_loss, 20.0))}


def export_fp16_weights(args, model):
    """Writes a half-precision copy of the weights for the serving team."""
    model_to_save = copy.deepcopy(model.module if hasattr(model, "module") else model).half()
    export_dir = os.path.join(args.output_dir, "export_fp16")
    model_to_save.save_pretrained(export_dir)
    with open(os.path.join(export_dir, "export.json"), "w") as f:
        json.dump({"dtype": "float16", "source": args.output_dir}, f)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--input_dir", type=str, required=True)
    parser.add_argument("--eval_dir", type=str, default=None)
    parser.add_argument("--config_file", type=str, required=True)
    parser.add_argument("--output_dir", type=str, required=True)
    parser.add_argument("--init_checkpoint", type=str, default=None)
    parser.add_argument("--resume_step", action="store_true")
    parser.add_argument("--train_batch_size", type=int, default=32)
    parser.add_argument("--learning_rate", type=float, default=5e-5)
    parser.add_argument("--num_train_epochs", type=float, default=3.0)
    parser.add_argument("--max_steps", type=int, default=0)
    parser.add_argument("--warmup_proportion", type=float, default=0.01)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--fp16", action="store_true", help="Mixed precision training")
    parser.add_argument("--loss_scale", type=float, default=0,
                        help="Loss scaling, positive power of 2 values can improve fp16 convergence; 0 = dynamic")
    parser.add_argument("--log_freq", type=int, default=50)
    parser.add_argument("--save_every", type=int, default=1000)
    parser.add_argument("--export_fp16", action="store_true")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()

    if args.local_rank == -1:
        device = th.device("cuda" if th.cuda.is_available() else "cpu")
        args.n_gpu = th.cuda.device_count()
    else:
        th.cuda.set_device(args.local_rank)
        device = th.device("cuda", args.local_rank)
        th.distributed.init_process_group(backend="nccl")
        args.n_gpu = 1
    logger.info("device: %s n_gpu: %d, distributed training: %r, 16-bits training: %r",
                device, args.n_gpu, args.local_rank != -1, args.fp16)
    if args.gradient_accumulation_steps < 1:
        raise ValueError(f"Invalid gradient_accumulation_steps parameter: {args.gradient_accumulation_steps}")
    args.train_batch_size = args.train_batch_size // args.gradient_accumulation_steps
    set_seed(args)
    os.makedirs(args.output_dir, exist_ok=True)

    train_dataset = PregeneratedDataset(args.input_dir)
    sampler = RandomSampler(train_dataset) if args.local_rank == -1 else DistributedSampler(train_dataset)
    train_dataloader = DataLoader(train_dataset, sampler=sampler, batch_size=args.train_batch_size,
                                  num_workers=4, pin_memory=True, drop_last=True)
    num_train_steps = int(len(train_dataloader) / args.gradient_accumulation_steps * args.num_train_epochs)
    if args.max_steps:
        num_train_steps = min(num_train_steps, args.max_steps)

    model, optimizer, scheduler, scaler, global_step = prepare_model_and_optimizer(args, device, num_train_steps)
    logger.info("***** Running training *****  num steps = %d", num_train_steps)
    global_step = train(args, model, optimizer, scheduler, scaler, train_dataloader, device, global_step)

    if is_main_process(args):
        save_checkpoint(args, model, optimizer, scaler, global_step)
        if args.eval_dir:
            eval_loader = DataLoader(PregeneratedDataset(args.eval_dir), batch_size=args.train_batch_size * 2)
            logger.info("eval: %s", evaluate_mlm(args, model, eval_loader, device))
        if args.export_fp16:
            export_fp16_weights(args, model)


if __name__ == "__main__":
    main()
