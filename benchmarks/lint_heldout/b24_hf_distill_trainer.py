"""Distil an MNLI teacher into a small student with a custom Hugging Face Trainer.

The trainer owns its mixed-precision step (bf16 autocast, frozen fp16 teacher);
run with `python b24_hf_distill_trainer.py --teacher ... --student ...`.
"""
import argparse
import copy
import math
import os

import numpy as np
import torch
import torch.nn.functional as F
from datasets import load_dataset
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    get_linear_schedule_with_warmup,
)


class DistillationTrainer(Trainer):
    """Trainer with a frozen teacher and its own mixed-precision step.

    Earlier revisions wrapped the step in torch.cuda.amp.autocast; the step below
    opens the autocast region itself so the teacher can share it.
    """

    def __init__(self, *args, teacher_model=None, alpha=0.5, temperature=2.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.teacher = teacher_model.half().eval()
        self.teacher.requires_grad_(False)
        self.alpha = alpha
        self.temperature = temperature
        self.amp_scaler = torch.cuda.amp.GradScaler()  # expect: AMP009 AMP010
        self._micro_step = 0

    def distill_loss(self, student_logits, teacher_logits, labels):
        t = self.temperature
        soft = F.kl_div(
            F.log_softmax(student_logits / t, dim=-1),
            F.softmax(teacher_logits / t, dim=-1),
            reduction="batchmean",
        ) * (t * t)
        hard = F.cross_entropy(student_logits, labels)
        return self.alpha * soft + (1.0 - self.alpha) * hard

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # used by evaluate(): the student's own classification loss
        outputs = model(**inputs)
        loss = outputs.loss
        return (loss, outputs) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        inputs = self._prepare_inputs(inputs)
        labels = inputs.pop("labels")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            student_logits = model(**inputs).logits
            with torch.no_grad():
                teacher_logits = self.teacher(**inputs).logits
        loss = self.distill_loss(student_logits, teacher_logits, labels)  # expect: AMP002
        loss = loss / self.args.gradient_accumulation_steps
        self.amp_scaler.scale(loss).backward()
        self._micro_step += 1
        if self._micro_step % self.args.gradient_accumulation_steps == 0:
            if self.args.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), self.args.max_grad_norm)  # expect: AMP005
            self.amp_scaler.step(self.optimizer)
            self.amp_scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            outputs = model(**inputs)
        logits = outputs.logits.float()
        loss = F.cross_entropy(logits, inputs["labels"]).detach() if "labels" in inputs else None
        if prediction_loss_only:
            return loss, None, None
        return loss, logits, inputs.get("labels")


class LossScaleLogger(TrainerCallback):
    def __init__(self, trainer_ref):
        self.trainer_ref = trainer_ref

    def on_log(self, args, state, control, logs=None, **kwargs):
        trainer = self.trainer_ref()
        if trainer is not None and logs is not None:
            logs["loss_scale"] = trainer.amp_scaler.get_scale()


def compute_metrics(eval_pred):
    logits, labels = eval_pred
    preds = np.argmax(logits, axis=-1)
    return {"accuracy": float((preds == labels).mean())}


def export_student(model, path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(copy.deepcopy(model).half().state_dict(), path)


def build_data(tokenizer, max_length=128):
    raw = load_dataset("glue", "mnli")

    def encode(batch):
        return tokenizer(batch["premise"], batch["hypothesis"], truncation=True, max_length=max_length)

    data = raw.map(encode, batched=True, remove_columns=["premise", "hypothesis", "idx"])
    return data.rename_column("label", "labels")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--teacher", default="textattack/bert-base-uncased-MNLI")
    p.add_argument("--student", default="prajjwal1/bert-small")
    p.add_argument("--output-dir", default="out/distil-mnli")
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--temperature", type=float, default=2.0)
    return p.parse_args()


def main():
    cli = parse_args()
    args = TrainingArguments(
        output_dir=cli.output_dir,
        per_device_train_batch_size=cli.batch_size,
        per_device_eval_batch_size=2 * cli.batch_size,
        gradient_accumulation_steps=cli.accum,
        learning_rate=cli.lr,
        num_train_epochs=cli.epochs,
        max_grad_norm=1.0,
        logging_steps=50,
        eval_strategy="epoch",
        save_strategy="epoch",
        report_to="none",
    )
    tokenizer = AutoTokenizer.from_pretrained(cli.student)
    data = build_data(tokenizer)
    teacher = AutoModelForSequenceClassification.from_pretrained(cli.teacher).cuda()
    student = AutoModelForSequenceClassification.from_pretrained(cli.student, num_labels=3).cuda()
    student = student.half()  # expect: AMP001
    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in student.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in student.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=cli.lr)  # expect: AMP011
    steps_per_epoch = math.ceil(len(data["train"]) / (cli.batch_size * cli.accum))
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.06 * steps_per_epoch * cli.epochs), steps_per_epoch * cli.epochs)
    trainer = DistillationTrainer(
        model=student,
        args=args,
        train_dataset=data["train"],
        eval_dataset=data["validation_matched"],
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=compute_metrics,
        optimizers=(optimizer, scheduler),
        teacher_model=teacher,
        alpha=cli.alpha,
        temperature=cli.temperature,
    )
    import weakref

    trainer.add_callback(LossScaleLogger(weakref.ref(trainer)))
    trainer.train()
    print(trainer.evaluate())
    export_student(trainer.model, os.path.join(cli.output_dir, "student-fp16.pt"))


if __name__ == "__main__":
    main()
