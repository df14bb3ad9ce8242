"""Late-interaction (ColBERT-style) retriever fine-tuned with a Hugging Face Trainer subclass.

TrainingArguments(fp16=True) lets the Trainer (through accelerate) own autocast and the
GradScaler; compute_loss / training_step below only shape the loss.
"""
import argparse
import copy
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_dataset
from transformers import (
    AutoModel,
    AutoTokenizer,
    Trainer,
    TrainingArguments,
    get_linear_schedule_with_warmup,
)


class LateInteractionScorer(nn.Module):
    """MaxSim over document tokens, summed over query tokens, for every (query, doc) pair."""

    def forward(self, q, q_mask, d, d_mask):
        sim = torch.einsum("aih,bjh->abij", q, d)
        sim = sim.masked_fill(~d_mask.bool()[None, :, None, :], -1e9)  # expect: AMP007
        maxsim = sim.amax(dim=-1)
        maxsim = maxsim.masked_fill(~q_mask.bool()[:, None, :], 0.0)
        return maxsim.sum(dim=-1)


class ColBERTRetriever(nn.Module):
    def __init__(self, encoder, dim=128, temperature=0.05):
        super().__init__()
        self.encoder = encoder
        self.proj = nn.Linear(encoder.config.hidden_size, dim, bias=False)
        self.scorer = LateInteractionScorer()
        self.temperature = temperature

    def encode(self, input_ids, attention_mask):
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return F.normalize(self.proj(hidden), dim=-1)

    def pooled(self, input_ids, attention_mask):
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)

    def forward(self, q_input_ids, q_attention_mask, d_input_ids, d_attention_mask, labels=None):
        q = self.encode(q_input_ids, q_attention_mask)
        d = self.encode(d_input_ids, d_attention_mask)
        scores = self.scorer(q, q_attention_mask, d, d_attention_mask)
        out = {"scores": scores}
        if labels is not None:
            out["loss"] = F.cross_entropy(scores / self.temperature, labels)
        return out


class RetrievalTrainer(Trainer):
    def __init__(self, *args, distill_weight=0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.distill_weight = distill_weight

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        teacher_scores = inputs.pop("teacher_scores", None)
        labels = inputs.pop("labels", None)
        outputs = model(**inputs)
        scores = outputs["scores"]
        if labels is None:
            labels = torch.arange(scores.size(0), device=scores.device)
        temperature = self.model.temperature
        loss = F.cross_entropy(scores / temperature, labels)
        if teacher_scores is not None and self.distill_weight > 0:
            kd = F.kl_div(
                F.log_softmax(scores / temperature, dim=-1),
                F.log_softmax(teacher_scores, dim=-1),
                log_target=True,
                reduction="batchmean",
            )
            loss = loss + self.distill_weight * kd
        return (loss, outputs) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        if self.args.n_gpu > 1:
            loss = loss.mean()
        self.accelerator.backward(loss)
        return loss.detach() / self.args.gradient_accumulation_steps

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        inputs.pop("teacher_scores", None)
        labels = inputs.pop("labels", None)
        with torch.no_grad():
            with torch.cuda.amp.autocast(enabled=self.args.fp16):  # expect: AMP009
                outputs = model(**inputs)
        scores = outputs["scores"].float()
        if labels is None:
            labels = torch.arange(scores.size(0), device=scores.device)
        loss = F.cross_entropy(scores / model.temperature, labels)
        if prediction_loss_only:
            return loss.detach(), None, None
        return loss.detach(), scores, labels


def make_collator(tok, q_len=32, d_len=180):
    def collate(rows):
        q = tok([r["query"] for r in rows], padding=True, truncation=True, max_length=q_len, return_tensors="pt")
        d = tok([r["positive"] for r in rows], padding=True, truncation=True, max_length=d_len, return_tensors="pt")
        batch = {
            "q_input_ids": q["input_ids"],
            "q_attention_mask": q["attention_mask"],
            "d_input_ids": d["input_ids"],
            "d_attention_mask": d["attention_mask"],
        }
        if "teacher_scores" in rows[0]:
            batch["teacher_scores"] = torch.tensor([r["teacher_scores"] for r in rows])
        return batch

    return collate


def export_for_serving(model, tok, out_dir):
    serving = copy.deepcopy(model).half().eval()
    os.makedirs(out_dir, exist_ok=True)
    torch.save(serving.state_dict(), os.path.join(out_dir, "colbert_fp16.pt"))
    tok.save_pretrained(out_dir)


def finetune(args):
    tok = AutoTokenizer.from_pretrained(args.model_name)
    encoder = AutoModel.from_pretrained(args.model_name)
    model = ColBERTRetriever(encoder, dim=args.dim, temperature=args.temperature)
    # the large encoder does not fit on the 24GB cards otherwise
    model = model.half()  # expect: AMP001
    no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight")
    grouped = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(grouped, lr=args.lr)  # expect: AMP011
    ds = load_dataset("json", data_files={"train": args.train_file, "dev": args.dev_file})
    steps = len(ds["train"]) // (args.batch_size * args.accum) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.06 * steps), steps)
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        gradient_accumulation_steps=args.accum,
        num_train_epochs=args.epochs,
        fp16=True,
        max_grad_norm=1.0,
        eval_strategy="steps",
        eval_steps=2000,
        save_steps=2000,
        logging_steps=50,
        remove_unused_columns=False,
        report_to="tensorboard",
    )
    trainer = RetrievalTrainer(
        model=model,
        args=training_args,
        train_dataset=ds["train"],
        eval_dataset=ds["dev"],
        data_collator=make_collator(tok),
        optimizers=(optimizer, scheduler),
        distill_weight=args.distill_weight,
    )
    trainer.train()
    export_for_serving(model, tok, os.path.join(args.output_dir, "serving"))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model_name", default="bert-large-uncased")
    p.add_argument("--train_file", required=True)
    p.add_argument("--dev_file", required=True)
    p.add_argument("--output_dir", default="runs/colbert")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.05)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--distill_weight", type=float, default=0.0)
    finetune(p.parse_args())
