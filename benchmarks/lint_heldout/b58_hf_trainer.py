"""Trainer subclasses for the sequence-classification experiments.

The stock ``Trainer`` runs ``compute_loss`` under ``compute_loss_context_manager``
(the accelerator's autocast) and calls ``self.accelerator.backward(loss)``; with
``TrainingArguments(fp16=True)`` the accelerator owns the GradScaler.  The
subclasses below override ``compute_loss`` / ``training_step`` for distillation,
VICReg-style regularisation and MoE auxiliary losses.
"""
import argparse
import copy
import functools
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from packaging import version
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

if version.parse(torch.__version__) >= version.parse("2.4"):
    eval_autocast = functools.partial(torch.amp.autocast, "cuda")
else:
    eval_autocast = torch.cuda.amp.autocast


class DistillationTrainer(Trainer):
    def __init__(self, *args, teacher_model=None, alpha=0.5, temperature=2.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.teacher = teacher_model
        self.teacher.requires_grad_(False)
        self.teacher.eval()
        self.alpha = alpha
        self.temperature = temperature

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outputs_student = model(**inputs)
        with torch.no_grad():
            outputs_teacher = self.teacher(**inputs)
        student_logits = outputs_student.logits
        ce = F.cross_entropy(student_logits.view(-1, student_logits.size(-1)), labels.view(-1))  # expect: AMP002
        t = self.temperature
        kd = F.kl_div(
            F.log_softmax(student_logits.float() / t, dim=-1),
            F.softmax(outputs_teacher.logits.float() / t, dim=-1),
            reduction="batchmean",
        ) * (t * t)
        loss = self.alpha * ce + (1.0 - self.alpha) * kd
        return (loss, outputs_student) if return_outputs else loss


class VICRegTrainer(Trainer):
    """Adds a variance/covariance penalty on a projection of the [CLS] state."""

    def __init__(self, *args, proj_dim=256, var_coef=1.0, cov_coef=0.04, **kwargs):
        super().__init__(*args, **kwargs)
        hidden = self.model.config.hidden_size
        self.proj = nn.Linear(hidden, proj_dim).to(self.args.device)
        self.var_coef = var_coef
        self.cov_coef = cov_coef

    def create_optimizer(self):
        if self.optimizer is None:
            params = [p for p in self.model.parameters() if p.requires_grad] + list(self.proj.parameters())
            self.optimizer = torch.optim.AdamW(params, lr=self.args.learning_rate, eps=1e-8, weight_decay=self.args.weight_decay)
        return self.optimizer

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs, output_hidden_states=True)
        task_loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
        pooled = outputs.hidden_states[-1][:, 0]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            z = self.proj(pooled)
            std = torch.sqrt(z.var(dim=0) + 1e-4)  # expect: AMP004
        var_loss = F.relu(1.0 - std.float()).mean()
        with torch.cuda.amp.autocast(enabled=False):  # expect: AMP009
            zf = z.float()
            zc = zf - zf.mean(dim=0)
            cov = (zc.T @ zc) / (zf.size(0) - 1)
            off_diag = cov - torch.diag(torch.diagonal(cov))
            cov_loss = off_diag.pow(2).sum() / zf.size(1)
        loss = task_loss + self.var_coef * var_loss + self.cov_coef * cov_loss
        return (loss, outputs) if return_outputs else loss


class L2SPTrainer(Trainer):
    """Keeps fine-tuned weights close to the pretrained starting point."""

    def __init__(self, *args, l2_coef=1e-4, **kwargs):
        super().__init__(*args, **kwargs)
        self.l2_coef = l2_coef
        self.anchor = {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        inputs = self._prepare_inputs(inputs)
        with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        reg = sum((p - self.anchor[n]).pow(2).sum() for n, p in model.named_parameters() if n in self.anchor)
        loss = loss + self.l2_coef * reg
        if self.args.n_gpu > 1:
            loss = loss.mean()
        loss.backward()
        return loss.detach() / self.args.gradient_accumulation_steps


class MoETrainer(Trainer):
    """Router z-loss and load-balancing loss come back from the model's forward."""

    def __init__(self, *args, aux_coef=0.01, **kwargs):
        super().__init__(*args, **kwargs)
        self.aux_coef = aux_coef

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        inputs = self._prepare_inputs(inputs)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outputs = model(**inputs, output_router_logits=True)
            loss = outputs.loss + self.aux_coef * outputs.aux_loss
            loss.backward()  # expect: AMP008
        return loss.detach() / self.args.gradient_accumulation_steps


class AcceleratedTrainer(Trainer):
    """Same as the stock step, spelled out, with a hook for logging the loss scale."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        inputs = self._prepare_inputs(inputs)
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(self.model.dtype)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        if self.args.n_gpu > 1:
            loss = loss.mean()
        if num_items_in_batch is None:
            loss = loss / self.args.gradient_accumulation_steps
        self.accelerator.backward(loss)
        return loss.detach()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.get("labels")
        outputs = model(**inputs)
        if labels is None:
            loss = outputs.loss
        else:
            logits = outputs.logits
            allowed = inputs.get("allowed_labels")
            if allowed is not None:
                logits = logits.masked_fill(~allowed, torch.finfo(logits.dtype).min)
            loss = F.cross_entropy(logits.float(), labels, label_smoothing=self.args.label_smoothing_factor)
        return (loss, outputs) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        labels = inputs.get("labels")
        with torch.no_grad(), eval_autocast(dtype=torch.bfloat16):
            outputs = model(**inputs)
            loss = outputs.loss.detach() if labels is not None else None
            logits = outputs.logits.float()
        if prediction_loss_only:
            return (loss, None, None)
        return (loss, logits, labels)


class ScaleLoggerCallback(TrainerCallback):
    def __init__(self):
        self.best_metric = 1e9

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        model = kwargs["model"]
        grads = [p.grad.detach() for p in model.parameters() if p.grad is not None]
        if grads:
            state.log_history.append({"grad_norm_preclip": torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()})

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if metrics and metrics.get("eval_loss", 1e9) < self.best_metric:
            self.best_metric = metrics["eval_loss"]


def export_for_serving(model, out_dir):
    serving = copy.deepcopy(model).half().eval()
    serving.save_pretrained(os.path.join(out_dir, "fp16"))


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="roberta-base")
    p.add_argument("--teacher", default="roberta-large")
    p.add_argument("--mode", choices=["distill", "vicreg", "l2sp", "moe", "plain"], default="plain")
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--output-dir", default="out")
    p.add_argument("--epochs", type=float, default=3.0)
    return p.parse_args()


def main():
    args = parse_args()
    from datasets import load_dataset

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    raw = load_dataset("glue", "sst2")
    data = raw.map(lambda b: tokenizer(b["sentence"], truncation=True, max_length=128), batched=True)
    data = data.rename_column("label", "labels")
    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=2)

    training_args = TrainingArguments(
        output_dir=args.output_dir,
        num_train_epochs=args.epochs,
        per_device_train_batch_size=32,
        gradient_accumulation_steps=4,
        learning_rate=3e-5,
        max_grad_norm=1.0,
        fp16=args.fp16 and args.mode in ("plain", "distill", "vicreg"),
        bf16=args.bf16,
        eval_strategy="epoch",
        logging_steps=50,
        report_to="none",
    )
    common = dict(
        model=model,
        args=training_args,
        train_dataset=data["train"],
        eval_dataset=data["validation"],
        data_collator=DataCollatorWithPadding(tokenizer),
        callbacks=[ScaleLoggerCallback()],
    )
    if args.mode == "distill":
        teacher = AutoModelForSequenceClassification.from_pretrained(args.teacher, num_labels=2)
        teacher.requires_grad_(False)
        teacher = teacher.half().to(training_args.device)
        trainer = DistillationTrainer(teacher_model=teacher, **common)
    elif args.mode == "vicreg":
        trainer = VICRegTrainer(**common)
    elif args.mode == "l2sp":
        trainer = L2SPTrainer(**common)
    elif args.mode == "moe":
        trainer = MoETrainer(**common)
    else:
        trainer = AcceleratedTrainer(**common)
    trainer.train()
    trainer.save_model()
    export_for_serving(trainer.model, args.output_dir)


if __name__ == "__main__":
    main()
