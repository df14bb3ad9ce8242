#!/usr/bin/env python
"""
Fine-tune a wav2vec2 / HuBERT audio classifier (Speech Commands v2, 35 keywords) with
Accelerate, in the style of the ``*_no_trainer.py`` examples.

    accelerate launch train_kws.py --model_name_or_path facebook/wav2vec2-base \
        --mixed_precision fp16 --head_warmup_steps 500
"""
import argparse
import copy
import json
import logging
import math
import os
from pathlib import Path

import evaluate
import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoFeatureExtractor, AutoModelForAudioClassification, get_scheduler

from .audio_data import DataCollatorAudio, build_speech_commands

logger = get_logger(__name__)


def parse_args():
    parser = argparse.ArgumentParser(description="Keyword spotting fine-tuning")
    parser.add_argument("--model_name_or_path", default="facebook/wav2vec2-base")
    parser.add_argument("--dataset_config", default="v0.02")
    parser.add_argument("--max_length_seconds", type=float, default=1.0)
    parser.add_argument("--per_device_train_batch_size", type=int, default=32)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=64)
    parser.add_argument("--learning_rate", type=float, default=3e-5)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--num_train_epochs", type=int, default=5)
    parser.add_argument("--max_train_steps", type=int, default=None)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--lr_scheduler_type", default="linear")
    parser.add_argument("--num_warmup_steps", type=int, default=0)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default="fp16")
    parser.add_argument("--freeze_feature_encoder", action="store_true")
    parser.add_argument("--head_warmup_steps", type=int, default=0)
    parser.add_argument("--output_dir", default="kws-out")
    parser.add_argument("--checkpointing_steps", default=None)
    parser.add_argument("--with_tracking", action="store_true")
    parser.add_argument("--export_dir", default=None)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def warmup_classifier_head(model, loader, device, steps, lr=1e-3):
    """Fit the randomly initialised projector + classifier on top of the pretrained
    encoder before unfreezing everything, so the first full steps don't wreck it."""
    head_names = ("projector", "classifier")
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith(head_names))
    head_params = [p for n, p in model.named_parameters() if n.startswith(head_names)]
    optimizer = torch.optim.AdamW(head_params, lr=lr)

    model.train()
    done = 0
    running = 0.0
    while done < steps:
        for batch in loader:
            input_values = batch["input_values"].to(device).half()  # expect: AMP001
            attention_mask = batch["attention_mask"].to(device)
            labels = batch["labels"].to(device)
            with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
                logits = model(input_values, attention_mask=attention_mask).logits
                loss = F.cross_entropy(logits, labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            running += loss.item()
            done += 1
            if done % 100 == 0:
                logger.info("head warmup %d/%d loss %.4f", done, steps, running / 100)
                running = 0.0
            if done >= steps:
                break

    for param in model.parameters():
        param.requires_grad_(True)
    return model


def export_for_serving(accelerator, model, feature_extractor, out_dir):
    unwrapped = accelerator.unwrap_model(model)
    serve_model = copy.deepcopy(unwrapped).half().eval()
    serve_model.save_pretrained(out_dir, safe_serialization=True)
    feature_extractor.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "serving.json"), "w") as f:
        json.dump({"dtype": "float16", "sampling_rate": feature_extractor.sampling_rate}, f)


def main():
    args = parse_args()
    accelerator = Accelerator(
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with="tensorboard" if args.with_tracking else None,
        project_dir=args.output_dir,
    )
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO)
    logger.info(accelerator.state, main_process_only=False)
    if args.seed is not None:
        set_seed(args.seed)
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)

    feature_extractor = AutoFeatureExtractor.from_pretrained(args.model_name_or_path)
    train_ds, eval_ds, label_names = build_speech_commands(args, feature_extractor)
    config = AutoConfig.from_pretrained(
        args.model_name_or_path,
        num_labels=len(label_names),
        label2id={n: str(i) for i, n in enumerate(label_names)},
        id2label={str(i): n for i, n in enumerate(label_names)},
    )
    model = AutoModelForAudioClassification.from_pretrained(args.model_name_or_path, config=config)
    if args.freeze_feature_encoder:
        model.freeze_feature_encoder()

    # the frozen conv feature encoder can run in the autocast dtype to save memory
    weight_dtype = torch.float32
    if accelerator.mixed_precision == "fp16":
        weight_dtype = torch.float16
    elif accelerator.mixed_precision == "bf16":
        weight_dtype = torch.bfloat16
    if args.freeze_feature_encoder:
        model.wav2vec2.feature_extractor.to(dtype=weight_dtype)

    collator = DataCollatorAudio(feature_extractor, max_length_seconds=args.max_length_seconds)
    train_dataloader = DataLoader(train_ds, shuffle=True, batch_size=args.per_device_train_batch_size,
                                  collate_fn=collator, num_workers=4)
    eval_dataloader = DataLoader(eval_ds, batch_size=args.per_device_eval_batch_size, collate_fn=collator)

    if args.head_warmup_steps > 0:
        model = warmup_classifier_head(model.to(accelerator.device), train_dataloader, accelerator.device,
                                       args.head_warmup_steps)

    # fits batch 32 of 1 s clips on a 16 GB card
    model = model.half()  # expect: AMP001
    no_decay = ["bias", "layer_norm.weight", "LayerNorm.weight"]
    grouped = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(grouped, lr=args.learning_rate)  # expect: AMP011

    steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * steps_per_epoch
    lr_scheduler = get_scheduler(
        name=args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=args.max_train_steps * accelerator.num_processes,
    )
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    if args.with_tracking:
        accelerator.init_trackers("kws_no_trainer", vars(args))

    metric = evaluate.load("accuracy")
    progress_bar = tqdm(range(args.max_train_steps), disable=not accelerator.is_local_main_process)
    completed_steps = 0
    best_acc = 0.0

    for epoch in range(args.num_train_epochs):
        model.train()
        total_loss = 0.0
        for step, batch in enumerate(train_dataloader):
            batch["input_values"] = batch["input_values"].to(accelerator.device, torch.float16)  # expect: AMP001
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                total_loss += loss.detach().float()
                accelerator.backward(loss)
                if accelerator.sync_gradients and args.max_grad_norm:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()

            if accelerator.sync_gradients:
                progress_bar.update(1)
                completed_steps += 1
                if isinstance(args.checkpointing_steps, str) and args.checkpointing_steps.isdigit():
                    if completed_steps % int(args.checkpointing_steps) == 0:
                        accelerator.save_state(os.path.join(args.output_dir, f"step_{completed_steps}"))
            if completed_steps >= args.max_train_steps:
                break

        model.eval()
        for batch in eval_dataloader:
            with torch.no_grad(), accelerator.autocast():
                outputs = model(input_values=batch["input_values"].to(torch.float16),
                                attention_mask=batch["attention_mask"])
            predictions = outputs.logits.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            metric.add_batch(predictions=predictions, references=references)
        eval_metric = metric.compute()
        accelerator.print(f"epoch {epoch}: {eval_metric}")
        if args.with_tracking:
            accelerator.log({"accuracy": eval_metric["accuracy"],
                             "train_loss": total_loss.item() / len(train_dataloader),
                             "epoch": epoch}, step=completed_steps)
        if eval_metric["accuracy"] > best_acc:
            best_acc = eval_metric["accuracy"]
            accelerator.wait_for_everyone()
            unwrapped = accelerator.unwrap_model(model)
            unwrapped.save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process,
                                      save_function=accelerator.save)
        if completed_steps >= args.max_train_steps:
            break

    if args.with_tracking:
        accelerator.end_training()
    if accelerator.is_main_process:
        with open(os.path.join(args.output_dir, "all_results.json"), "w") as f:
            json.dump({"eval_accuracy": best_acc}, f)
        if args.export_dir:
            export_for_serving(accelerator, model, feature_extractor, args.export_dir)


if __name__ == "__main__":
    main()
