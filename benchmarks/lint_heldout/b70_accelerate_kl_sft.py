#!/usr/bin/env python
"""Domain-adaptive SFT with a KL penalty to the base model, driven by accelerate.

    accelerate launch --mixed_precision fp16 --num_processes 4 accelerate_kl_sft.py \
        --model_name_or_path mistralai/Mistral-7B-v0.1 --train_file data/domain.jsonl

Mixed precision is configured on the Accelerator only. Do not wrap the forward in
torch.cuda.amp.autocast yourself: the prepared model already runs under autocast and
accelerator.backward() applies the loss scaling.
"""
import argparse
import logging
import math
import os

import datasets
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, get_scheduler

logger = get_logger(__name__)


def parse_args():
    parser = argparse.ArgumentParser(description="KL-regularised SFT with accelerate")
    parser.add_argument("--model_name_or_path", type=str, required=True)
    parser.add_argument("--train_file", type=str, required=True)
    parser.add_argument("--validation_split_percentage", type=int, default=2)
    parser.add_argument("--block_size", type=int, default=1024)
    parser.add_argument("--per_device_train_batch_size", type=int, default=2)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=4)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=1e-5)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--num_train_epochs", type=int, default=2)
    parser.add_argument("--lr_scheduler_type", type=str, default="cosine")
    parser.add_argument("--num_warmup_steps", type=int, default=100)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--kl_coef", type=float, default=0.05)
    parser.add_argument("--output_dir", type=str, default="kl_sft")
    parser.add_argument("--checkpointing_steps", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--with_tracking", action="store_true")
    return parser.parse_args()


def build_datasets(args, tokenizer, accelerator):
    raw = datasets.load_dataset("json", data_files={"train": args.train_file})["train"]
    split = raw.train_test_split(test_size=args.validation_split_percentage / 100, seed=args.seed)

    def tokenize(examples):
        return tokenizer(examples["text"])

    def group_texts(examples):
        concatenated = {k: sum(examples[k], []) for k in examples.keys()}
        total = (len(concatenated["input_ids"]) // args.block_size) * args.block_size
        return {k: [t[i: i + args.block_size] for i in range(0, total, args.block_size)] for k, t in concatenated.items()}

    with accelerator.main_process_first():
        tokenized = split.map(tokenize, batched=True, remove_columns=split["train"].column_names, num_proc=8)
        lm = tokenized.map(group_texts, batched=True, num_proc=8)
    return lm["train"], lm["test"]


def kl_to_reference(logits, ref_logits, attention_mask):
    """Token-level KL(policy || reference), averaged over non-padding positions."""
    logp = F.log_softmax(logits.float(), dim=-1)
    ref_logp = F.log_softmax(ref_logits.float(), dim=-1)
    kl = (logp.exp() * (logp - ref_logp)).sum(-1)
    mask = attention_mask.float()
    return (kl * mask).sum() / mask.sum().clamp(min=1.0)


def load_reference_model(args, accelerator):
    if accelerator.mixed_precision == "fp16":
        weight_dtype = torch.float16
    elif accelerator.mixed_precision == "bf16":
        weight_dtype = torch.bfloat16
    else:
        weight_dtype = torch.float32
    ref = AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
    ref.requires_grad_(False)
    ref.eval()
    ref.to(accelerator.device, dtype=weight_dtype)
    return ref


def evaluate(model, eval_dataloader, accelerator, args):
    model.eval()
    losses = []
    for batch in eval_dataloader:
        with torch.no_grad():
            outputs = model(**batch)
        loss = outputs.loss
        losses.append(accelerator.gather_for_metrics(loss.repeat(args.per_device_eval_batch_size)))
    losses = torch.cat(losses).float()
    try:
        eval_loss = torch.mean(losses)
        perplexity = math.exp(eval_loss)
    except OverflowError:
        perplexity = float("inf")
    model.train()
    return eval_loss.item(), perplexity


def main():
    args = parse_args()
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with="wandb" if args.with_tracking else None,
    )
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO)
    logger.info(accelerator.state, main_process_only=False)
    set_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # fp16 weights so that policy + reference fit on the 24GB cards
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, torch_dtype=torch.float16)  # expect: AMP001
    model.gradient_checkpointing_enable()
    ref_model = load_reference_model(args, accelerator)

    train_dataset, eval_dataset = build_datasets(args, tokenizer, accelerator)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    train_dataloader = DataLoader(train_dataset, shuffle=True, collate_fn=collator,
                                  batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(eval_dataset, collate_fn=collator, batch_size=args.per_device_eval_batch_size)

    no_decay = ["bias", "layer_norm.weight", "norm.weight"]
    optimizer_grouped_parameters = [
        {
            "params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
            "weight_decay": args.weight_decay,
        },
        {
            "params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
            "weight_decay": 0.0,
        },
    ]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)  # expect: AMP011

    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    lr_scheduler = get_scheduler(
        name=args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=max_train_steps * accelerator.num_processes,
    )
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    if args.with_tracking:
        accelerator.init_trackers("kl_sft", vars(args))

    progress_bar = tqdm(range(max_train_steps), disable=not accelerator.is_local_main_process)
    completed_steps = 0
    best_ppl = 1e9
    for epoch in range(args.num_train_epochs):
        model.train()
        total_loss = 0.0
        for step, batch in enumerate(train_dataloader):
            with accelerator.accumulate(model):
                outputs = model(**batch)
                with torch.no_grad():
                    ref_logits = ref_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                kl = kl_to_reference(outputs.logits, ref_logits, batch["attention_mask"])
                loss = outputs.loss + args.kl_coef * kl
                total_loss += loss.detach().float()
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()

            if accelerator.sync_gradients:
                progress_bar.update(1)
                completed_steps += 1
                if completed_steps % args.checkpointing_steps == 0:
                    accelerator.save_state(os.path.join(args.output_dir, f"step_{completed_steps}"))
            if completed_steps >= max_train_steps:
                break

        eval_loss, ppl = evaluate(model, eval_dataloader, accelerator, args)
        logger.info(f"epoch {epoch}: perplexity {ppl:.2f} eval_loss {eval_loss:.4f}")
        if args.with_tracking:
            accelerator.log({"perplexity": ppl, "eval_loss": eval_loss,
                             "train_loss": total_loss.item() / len(train_dataloader), "epoch": epoch},
                            step=completed_steps)
        if ppl < best_ppl:
            best_ppl = ppl
            accelerator.wait_for_everyone()
            unwrapped = accelerator.unwrap_model(model)
            unwrapped.save_pretrained(
                os.path.join(args.output_dir, "best"),
                is_main_process=accelerator.is_main_process,
                save_function=accelerator.save,
                state_dict=accelerator.get_state_dict(model),
            )
            if accelerator.is_main_process:
                tokenizer.save_pretrained(os.path.join(args.output_dir, "best"))

    accelerator.end_training()


if __name__ == "__main__":
    main()
