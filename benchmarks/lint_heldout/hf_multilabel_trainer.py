"""Multi-label text classification with a custom Hugging Face Trainer."""
from typing import Any, Dict

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import f1_score
from transformers import AutoModelForSequenceClassification, Trainer, TrainingArguments


class WeightedBCETrainer(Trainer):
    def __init__(self, *args, pos_weight=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.pos_weight = pos_weight
        self.bce = nn.BCELoss(reduction="none")

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels").float()
        outputs = model(**inputs)
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.args.fp16):
            probs = torch.sigmoid(outputs.logits)
            loss = self.bce(probs, labels)  # expect: AMP003
            if self.pos_weight is not None:
                loss = loss * (1 + (self.pos_weight - 1) * labels)
            loss = loss.mean()
        return (loss, outputs) if return_outputs else loss


class LogitsBCETrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels").float()
        outputs = model(**inputs)
        loss = F.binary_cross_entropy_with_logits(outputs.logits.float(), labels)
        return (loss, outputs) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        self.accelerator.backward(loss)
        return loss.detach() / self.args.gradient_accumulation_steps


def compute_metrics(eval_pred) -> Dict[str, Any]:
    logits, labels = eval_pred
    probs = 1 / (1 + np.exp(-logits))
    return {"micro_f1": f1_score(labels, probs > 0.5, average="micro")}


def main(train_ds, eval_ds, num_labels=28):
    model = AutoModelForSequenceClassification.from_pretrained(
        "roberta-base", num_labels=num_labels, problem_type="multi_label_classification"
    )
    args = TrainingArguments("out", per_device_train_batch_size=32, fp16=True, num_train_epochs=3,
                             eval_strategy="epoch", learning_rate=3e-5, max_grad_norm=1.0)
    trainer = LogitsBCETrainer(model=model, args=args, train_dataset=train_ds, eval_dataset=eval_ds,
                               compute_metrics=compute_metrics)
    trainer.train()
    trainer.save_model("best")
