"""Knowledge distillation for sequence classification with the Hugging Face Trainer.

A fine-tuned teacher provides soft targets; the student is trained on a mix of the
temperature-scaled KL term and the usual cross-entropy on the labels.
"""
import argparse
import logging

import numpy as np
import torch
import torch.nn.functional as F
from datasets import load_dataset
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    Trainer,
    TrainingArguments,
    get_linear_schedule_with_warmup,
)

logger = logging.getLogger(__name__)


class DistillationTrainer(Trainer):
    def __init__(self, *args, teacher_model=None, temperature=2.0, alpha=0.5, **kwargs):
        super().__init__(*args, **kwargs)
        self.teacher = teacher_model
        self.temperature = temperature
        self.alpha = alpha
        if self.teacher is not None:
            self._move_model_to_device(self.teacher, self.args.device)
            self.teacher.eval()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            outputs = model(**inputs)
            student_logits = outputs.logits
            with torch.no_grad():
                teacher_logits = self.teacher(**inputs).logits
        t = self.temperature
        kd_loss = F.kl_div(F.log_softmax(student_logits / t, dim=-1), F.softmax(teacher_logits.float() / t, dim=-1), reduction="batchmean")  # expect: AMP002
        loss = self.alpha * (t * t) * kd_loss + (1.0 - self.alpha) * outputs.loss
        return (loss, outputs) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        if self.args.n_gpu > 1:
            loss = loss.mean()
        if self.args.gradient_accumulation_steps > 1 and num_items_in_batch is None:
            loss = loss / self.args.gradient_accumulation_steps
        self.accelerator.backward(loss)
        return loss.detach()


def compute_metrics(eval_pred):
    logits, labels = eval_pred
    preds = np.argmax(logits, axis=-1)
    return {"accuracy": float((preds == labels).mean())}


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--teacher", required=True, help="path or hub id of the fine-tuned teacher")
    p.add_argument("--student", default="distilbert-base-uncased")
    p.add_argument("--dataset", default="glue")
    p.add_argument("--subset", default="sst2")
    p.add_argument("--output-dir", default="runs/distill")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--learning-rate", type=float, default=5e-5)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup-ratio", type=float, default=0.06)
    p.add_argument("--temperature", type=float, default=2.0)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--resume", default=None)
    return p.parse_args()


def main():
    args = parse_args()
    logging.basicConfig(level=logging.INFO)

    raw = load_dataset(args.dataset, args.subset)
    num_labels = raw["train"].features["label"].num_classes
    tokenizer = AutoTokenizer.from_pretrained(args.student)

    def tokenize(batch):
        return tokenizer(batch["sentence"], truncation=True, max_length=128)

    encoded = raw.map(tokenize, batched=True, remove_columns=["sentence", "idx"])
    encoded = encoded.rename_column("label", "labels")

    teacher = AutoModelForSequenceClassification.from_pretrained(args.teacher, num_labels=num_labels, torch_dtype=torch.float16)
    teacher.requires_grad_(False)
    teacher.eval()

    student = AutoModelForSequenceClassification.from_pretrained(args.student, num_labels=num_labels, torch_dtype=torch.float16)  # expect: AMP001

    no_decay = ("bias", "LayerNorm.weight")
    param_groups = [
        {"params": [p for n, p in student.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in student.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(param_groups, lr=args.learning_rate, betas=(0.9, 0.98))  # expect: AMP011

    steps_per_epoch = int(np.ceil(len(encoded["train"]) / args.batch_size))
    total_steps = steps_per_epoch * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)

    training_args = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=2 * args.batch_size,
        num_train_epochs=args.epochs,
        bf16=True,
        eval_strategy="epoch",
        save_strategy="epoch",
        logging_steps=50,
        load_best_model_at_end=True,
        metric_for_best_model="accuracy",
        report_to="none",
    )
    trainer = DistillationTrainer(
        model=student,
        args=training_args,
        train_dataset=encoded["train"],
        eval_dataset=encoded["validation"],
        data_collator=DataCollatorWithPadding(tokenizer),
        processing_class=tokenizer,
        compute_metrics=compute_metrics,
        optimizers=(optimizer, scheduler),
        teacher_model=teacher,
        temperature=args.temperature,
        alpha=args.alpha,
    )
    trainer.train(resume_from_checkpoint=args.resume)
    trainer.save_model(f"{args.output_dir}/final")
    logger.info("final eval: %s", trainer.evaluate())


if __name__ == "__main__":
    main()
