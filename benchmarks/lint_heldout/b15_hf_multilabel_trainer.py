"""Multi-label topic tagging with a transformer encoder.

Runs on top of the Hugging Face Trainer but drives mixed precision itself
(TrainingArguments.fp16 stays off) so that the loss scale can be logged and
checkpointed together with the model.
"""
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_dataset
from sklearn.metrics import f1_score, roc_auc_score
from transformers import (
    AutoConfig,
    AutoModel,
    AutoTokenizer,
    DataCollatorWithPadding,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
)
from transformers.modeling_outputs import SequenceClassifierOutput

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(default="microsoft/deberta-v3-base")
    pooling: str = field(default="attention", metadata={"help": "attention | mean | max"})
    label_smoothing: float = field(default=0.05)
    max_length: int = field(default=512)
    export_dir: Optional[str] = field(default=None)


@dataclass
class DataArguments:
    dataset_name: str = field(default="my-org/topic-tags")
    text_column: str = field(default="text")
    label_column: str = field(default="labels")
    num_labels: int = field(default=42)


class AttentionPool(nn.Module):
    def __init__(self, hidden_size):
        super().__init__()
        self.score = nn.Sequential(nn.Linear(hidden_size, hidden_size), nn.Tanh(), nn.Linear(hidden_size, 1))

    def forward(self, hidden_states, attention_mask):
        scores = self.score(hidden_states).squeeze(-1)
        scores = scores.masked_fill(attention_mask == 0, -1e9)  # expect: AMP007
        weights = torch.softmax(scores, dim=-1)
        return torch.bmm(weights.unsqueeze(1), hidden_states).squeeze(1)


class MeanPool(nn.Module):
    def forward(self, hidden_states, attention_mask):
        mask = attention_mask.unsqueeze(-1).float()
        summed = (hidden_states.float() * mask).sum(dim=1)
        counts = mask.sum(dim=1).clamp(min=1e-9)
        return (summed / counts).to(hidden_states.dtype)


class MaxPool(nn.Module):
    def forward(self, hidden_states, attention_mask):
        fill = torch.finfo(hidden_states.dtype).min
        masked = hidden_states.masked_fill(attention_mask.unsqueeze(-1) == 0, fill)
        return masked.max(dim=1).values


POOLERS = {"attention": AttentionPool, "mean": MeanPool, "max": MaxPool}


class MultiLabelClassifier(nn.Module):
    def __init__(self, model_name, num_labels, pooling="attention"):
        super().__init__()
        self.config = AutoConfig.from_pretrained(model_name)
        self.backbone = AutoModel.from_pretrained(model_name, config=self.config)
        hidden = self.config.hidden_size
        self.pool = AttentionPool(hidden) if pooling == "attention" else POOLERS[pooling]()
        self.dropout = nn.Dropout(0.1)
        self.head = nn.Linear(hidden, num_labels)

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask)
        pooled = self.pool(out.last_hidden_state, attention_mask)
        logits = self.head(self.dropout(pooled))
        return SequenceClassifierOutput(logits=logits)


class MultiLabelTrainer(Trainer):
    def __init__(self, *args, label_smoothing=0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.label_smoothing = label_smoothing
        self.bce = nn.BCELoss()
        self.amp_scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 14)
        self._micro_steps = 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        probs = torch.sigmoid(outputs.logits)
        if self.label_smoothing > 0:
            labels = labels * (1.0 - self.label_smoothing) + 0.5 * self.label_smoothing
        loss = self.bce(probs, labels.float())  # expect: AMP003
        return (loss, outputs) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        inputs = self._prepare_inputs(inputs)
        accum = self.args.gradient_accumulation_steps
        with torch.autocast("cuda", dtype=torch.float16):
            loss = self.compute_loss(model, inputs)
            loss = loss / accum
            self.amp_scaler.scale(loss).backward()  # expect: AMP008

        self._micro_steps += 1
        if self._micro_steps % accum == 0:
            if self.args.max_grad_norm is not None and self.args.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), self.args.max_grad_norm)  # expect: AMP005
            self.amp_scaler.step(self.optimizer)
            self.amp_scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            if self.state.global_step % self.args.logging_steps == 0:
                self.log({"loss_scale": float(self.amp_scaler.get_scale())})
        return loss.detach()

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        labels = inputs.pop("labels")
        model.eval()
        with torch.no_grad():
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(**inputs).logits
            loss = F.binary_cross_entropy_with_logits(logits.float(), labels.float())
        if prediction_loss_only:
            return loss.detach(), None, None
        return loss.detach(), logits.float().detach(), labels.detach()

    def _save(self, output_dir=None, state_dict=None):
        super()._save(output_dir, state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        torch.save(self.amp_scaler.state_dict(), os.path.join(output_dir, "amp_scaler.pt"))


def compute_metrics(eval_pred):
    logits, labels = eval_pred
    probs = 1.0 / (1.0 + np.exp(-logits))
    preds = (probs > 0.5).astype(np.int64)
    metrics = {
        "micro_f1": f1_score(labels, preds, average="micro", zero_division=0),
        "macro_f1": f1_score(labels, preds, average="macro", zero_division=0),
    }
    try:
        metrics["macro_auc"] = roc_auc_score(labels, probs, average="macro")
    except ValueError:
        pass
    return metrics


def export_for_serving(model, tokenizer, output_dir):
    os.makedirs(output_dir, exist_ok=True)
    serving_model = model.half().eval()
    torch.save(serving_model.state_dict(), os.path.join(output_dir, "model_fp16.bin"))
    tokenizer.save_pretrained(output_dir)


def main():
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    logging.basicConfig(stream=sys.stdout, level=logging.INFO)
    if training_args.fp16 or training_args.bf16:
        logger.warning("fp16/bf16 in TrainingArguments is ignored, this script handles autocast itself")
        training_args.fp16 = False
        training_args.bf16 = False

    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    raw = load_dataset(data_args.dataset_name)
    num_labels = data_args.num_labels

    def preprocess(batch):
        enc = tokenizer(batch[data_args.text_column], truncation=True, max_length=model_args.max_length)
        multi_hot = np.zeros((len(batch[data_args.label_column]), num_labels), dtype=np.float32)
        for row, label_ids in enumerate(batch[data_args.label_column]):
            multi_hot[row, label_ids] = 1.0
        enc["labels"] = multi_hot.tolist()
        return enc

    tokenized = raw.map(preprocess, batched=True, remove_columns=raw["train"].column_names)
    model = MultiLabelClassifier(model_args.model_name_or_path, num_labels, pooling=model_args.pooling)

    trainer = MultiLabelTrainer(
        model=model,
        args=training_args,
        train_dataset=tokenized["train"],
        eval_dataset=tokenized["validation"],
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=compute_metrics,
        label_smoothing=model_args.label_smoothing,
    )
    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        trainer.log_metrics("train", result.metrics)
    if training_args.do_eval:
        metrics = trainer.evaluate()
        trainer.log_metrics("eval", metrics)
    if model_args.export_dir and trainer.is_world_process_zero():
        export_for_serving(trainer.model, tokenizer, model_args.export_dir)


if __name__ == "__main__":
    main()
