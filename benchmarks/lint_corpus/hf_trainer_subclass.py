"""Custom Hugging Face Trainer subclasses and a manual evaluation loop."""
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import Trainer, TrainingArguments


class WeightedLossTrainer(Trainer):
    """Class-weighted cross entropy; the Trainer runs compute_loss under its own autocast."""

    def __init__(self, *args, class_weights=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.class_weights = class_weights

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits = outputs.get("logits")
        loss_fct = nn.CrossEntropyLoss(weight=self.class_weights.to(logits.device, logits.dtype))
        loss = loss_fct(logits.view(-1, self.model.config.num_labels), labels.view(-1))
        return (loss, outputs) if return_outputs else loss


class DistillationTrainer(Trainer):
    def __init__(self, *args, teacher_model=None, temperature=2.0, alpha=0.5, **kwargs):
        super().__init__(*args, **kwargs)
        self.teacher = teacher_model
        self.teacher.eval()
        self.temperature = temperature
        self.alpha = alpha

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs_student = model(**inputs)
        with torch.no_grad():
            outputs_teacher = self.teacher(**inputs)
        loss_ce = outputs_student.loss
        loss_kd = F.kl_div(
            F.log_softmax(outputs_student.logits / self.temperature, dim=-1),
            F.softmax(outputs_teacher.logits / self.temperature, dim=-1),
            reduction="batchmean",
        ) * self.temperature ** 2
        loss = self.alpha * loss_ce + (1.0 - self.alpha) * loss_kd
        return (loss, outputs_student) if return_outputs else loss


def compute_metrics(eval_pred):
    logits, labels = eval_pred
    preds = np.argmax(logits, axis=-1)
    return {"accuracy": float((preds == labels).mean())}


def mean_pooling(last_hidden, attention_mask):
    mask = attention_mask.unsqueeze(-1).type_as(last_hidden)
    return (last_hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)


@torch.no_grad()
def evaluate_perplexity(model, dataloader, device):
    model.eval()
    losses = []
    for batch in dataloader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outputs = model(**batch)
        losses.append(outputs.loss.float().item())
    return math.exp(sum(losses) / len(losses))


def make_args(out_dir, bf16):
    return TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=16,
        learning_rate=2e-5,
        num_train_epochs=3,
        bf16=bf16,
        fp16=not bf16,
        max_grad_norm=1.0,
        logging_steps=50,
    )
