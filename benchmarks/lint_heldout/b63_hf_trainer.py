#!/usr/bin/env python
"""
Fine-tune an image classifier with the Hugging Face ``Trainer``, with an optional KL
penalty towards the initial (reference) model to limit drift on small datasets.

Also holds the plain PyTorch loop we used for the competition baselines
(``--custom-loop``), kept here so both paths share the data code.
"""
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch as th
import torch.nn.functional as F
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForImageClassification,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    get_cosine_schedule_with_warmup,
    set_seed,
)
from transformers.trainer_utils import get_last_checkpoint

from .data import build_datasets, build_fold_loaders, collate_fn
from .metrics import compute_metrics

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(default="google/vit-base-patch16-224-in21k")
    kl_coef: float = field(default=0.0, metadata={"help": "weight of KL(model || reference)"})
    export_dir: Optional[str] = field(default=None)
    custom_loop: bool = field(default=False)


@dataclass
class DataArguments:
    dataset_name: str = field(default="food101")
    train_val_split: float = field(default=0.1)
    image_size: int = field(default=224)
    n_folds: int = field(default=5)


class AverageMeter:
    def __init__(self):
        self.reset()

    def reset(self):
        self.val = self.avg = self.sum = 0.0
        self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


class RegularizedTrainer(Trainer):
    """Trainer with a KL(student || reference) term on the logits."""

    def __init__(self, *args, ref_model=None, kl_coef=0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.kl_coef = kl_coef
        self.ref_model = None
        if ref_model is not None:
            self.ref_model = ref_model.half().eval()
            self.ref_model.requires_grad_(False)
            self.ref_model.to(self.args.device)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits = outputs.logits
        loss = F.cross_entropy(logits.float(), labels, label_smoothing=self.args.label_smoothing_factor)
        if self.ref_model is not None and self.kl_coef > 0:
            with th.no_grad():
                ref_logits = self.ref_model(pixel_values=inputs["pixel_values"].half()).logits.float()
            kl = F.kl_div(
                F.log_softmax(logits.float(), dim=-1),
                F.log_softmax(ref_logits, dim=-1),
                log_target=True,
                reduction="batchmean",
            )
            loss = loss + self.kl_coef * kl
        return (loss, outputs) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        inputs = self._prepare_inputs(inputs)
        inputs["pixel_values"] = inputs["pixel_values"].type(th.cuda.HalfTensor)  # expect: AMP001
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        if self.args.n_gpu > 1:
            loss = loss.mean()
        del inputs
        if self.args.gradient_accumulation_steps > 1 and num_items_in_batch is None:
            loss = loss / self.args.gradient_accumulation_steps
        self.accelerator.backward(loss)
        return loss.detach()

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with th.no_grad():
            if self.args.fp16_full_eval:
                inputs["pixel_values"] = inputs["pixel_values"].half()
            labels = inputs.get("labels")
            outputs = model(pixel_values=inputs["pixel_values"])
            logits = outputs.logits.float()
            loss = F.cross_entropy(logits, labels) if labels is not None else None
        if prediction_loss_only:
            return (loss, None, None)
        return (loss, logits.detach(), labels)


def train(model_args, data_args, training_args):
    set_seed(training_args.seed)
    train_ds, eval_ds, label_names = build_datasets(data_args)
    config = AutoConfig.from_pretrained(
        model_args.model_name_or_path,
        num_labels=len(label_names),
        label2id={name: i for i, name in enumerate(label_names)},
        id2label={i: name for i, name in enumerate(label_names)},
        finetuning_task="image-classification",
    )
    model = AutoModelForImageClassification.from_pretrained(
        model_args.model_name_or_path, config=config, ignore_mismatched_sizes=True
    )
    ref_model = None
    if model_args.kl_coef > 0:
        ref_model = AutoModelForImageClassification.from_pretrained(
            model_args.model_name_or_path, config=config, ignore_mismatched_sizes=True
        )
        ref_model.load_state_dict(model.state_dict())

    model = model.to(dtype=th.bfloat16)  # expect: AMP001

    trainer = RegularizedTrainer(
        model=model,
        args=training_args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        data_collator=collate_fn,
        compute_metrics=compute_metrics,
        ref_model=ref_model,
        kl_coef=model_args.kl_coef,
    )
    last_checkpoint = None
    if os.path.isdir(training_args.output_dir) and not training_args.overwrite_output_dir:
        last_checkpoint = get_last_checkpoint(training_args.output_dir)

    train_result = trainer.train(resume_from_checkpoint=last_checkpoint)
    trainer.save_model()
    trainer.log_metrics("train", train_result.metrics)
    trainer.save_metrics("train", train_result.metrics)
    trainer.save_state()

    metrics = trainer.evaluate()
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)
    return trainer


def export_fp16(trainer, output_dir):
    model = trainer.accelerator.unwrap_model(trainer.model)
    model.half().save_pretrained(output_dir, safe_serialization=True)
    logger.info("wrote fp16 weights to %s", output_dir)


# ---------------------------------------------------------------------------
# competition baseline loop
# ---------------------------------------------------------------------------
class CFG:
    apex = True
    max_grad_norm = 1000
    gradient_accumulation_steps = 1
    batch_scheduler = True
    epochs = 4
    lr = 2e-5
    weight_decay = 0.01
    warmup_ratio = 0.1
    print_freq = 50
    seed = 42


def train_fn(fold, train_loader, model, criterion, optimizer, epoch, scheduler, device):
    model.train()
    scaler = th.amp.GradScaler("cuda", enabled=CFG.apex)  # expect: AMP010
    losses = AverageMeter()
    start = time.time()
    grad_norm = th.tensor(0.0)
    for step, (images, labels) in enumerate(train_loader):
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        batch_size = labels.size(0)
        with th.autocast("cuda", dtype=th.bfloat16, enabled=CFG.apex):
            y_preds = model(images)
            loss = criterion(y_preds, labels)
        if CFG.gradient_accumulation_steps > 1:
            loss = loss / CFG.gradient_accumulation_steps
        losses.update(loss.item(), batch_size)
        scaler.scale(loss).backward()
        if (step + 1) % CFG.gradient_accumulation_steps == 0:
            scaler.unscale_(optimizer)
            grad_norm = th.nn.utils.clip_grad_norm_(model.parameters(), CFG.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            if CFG.batch_scheduler:
                scheduler.step()
        if step % CFG.print_freq == 0 or step == len(train_loader) - 1:
            logger.info(
                "Fold %d Epoch %d [%d/%d] loss %.4f (%.4f) grad %.3f lr %.2e %.0fs",
                fold, epoch + 1, step, len(train_loader), losses.val, losses.avg,
                float(grad_norm), scheduler.get_last_lr()[0], time.time() - start,
            )
    return losses.avg


def valid_fn(valid_loader, model, criterion, device):
    model.eval()
    losses = AverageMeter()
    preds = []
    for images, labels in valid_loader:
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with th.no_grad():
            with th.autocast("cuda", dtype=th.bfloat16, enabled=CFG.apex):
                y_preds = model(images)
                loss = criterion(y_preds, labels)
        losses.update(loss.item(), labels.size(0))
        preds.append(y_preds.float().softmax(-1).cpu().numpy())
    return losses.avg, np.concatenate(preds)


def train_loop(data_args, model_args, fold, device):
    logger.info("========== fold: %d training ==========", fold)
    train_loader, valid_loader, valid_labels, num_labels = build_fold_loaders(data_args, fold)
    model = AutoModelForImageClassification.from_pretrained(
        model_args.model_name_or_path, num_labels=num_labels, ignore_mismatched_sizes=True
    )
    backbone = model.base_model

    class Wrapped(nn.Module):
        def __init__(self, hf_model):
            super().__init__()
            self.hf_model = hf_model

        def forward(self, x):
            return self.hf_model(pixel_values=x).logits

    net = Wrapped(model).to(device)
    head_params = [p for n, p in net.named_parameters() if "classifier" in n]
    body_params = [p for p in backbone.parameters()]
    optimizer = th.optim.AdamW(
        [{"params": body_params, "lr": CFG.lr}, {"params": head_params, "lr": CFG.lr * 10}],
        weight_decay=CFG.weight_decay,
    )
    num_train_steps = len(train_loader) * CFG.epochs // CFG.gradient_accumulation_steps
    scheduler = get_cosine_schedule_with_warmup(
        optimizer, int(CFG.warmup_ratio * num_train_steps), num_train_steps
    )
    criterion = nn.CrossEntropyLoss()

    best_score = -np.inf
    best_loss = 1e9
    for epoch in range(CFG.epochs):
        avg_loss = train_fn(fold, train_loader, net, criterion, optimizer, epoch, scheduler, device)
        val_loss, predictions = valid_fn(valid_loader, net, criterion, device)
        score = float((predictions.argmax(1) == valid_labels).mean())
        logger.info("Epoch %d avg_train_loss %.4f avg_val_loss %.4f acc %.4f", epoch + 1, avg_loss, val_loss, score)
        if score > best_score:
            best_score, best_loss = score, val_loss
            th.save({"model": net.state_dict(), "predictions": predictions}, f"fold{fold}_best.pth")
    return best_score, best_loss


def main():
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        handlers=[logging.StreamHandler(sys.stdout)],
        level=logging.INFO,
    )
    if model_args.custom_loop:
        device = th.device("cuda" if th.cuda.is_available() else "cpu")
        scores = [train_loop(data_args, model_args, fold, device)[0] for fold in range(data_args.n_folds)]
        logger.info("CV: %.4f", float(np.mean(scores)))
        return
    trainer = train(model_args, data_args, training_args)
    if model_args.export_dir and trainer.is_world_process_zero():
        export_fp16(trainer, model_args.export_dir)


if __name__ == "__main__":
    main()
