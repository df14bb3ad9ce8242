"""Token classification (FUNSD / CORD entity labelling) with a LayoutLM-style encoder.

The encoder adds 2-D layout embeddings (x0, y0, x1, y1, w, h of each word box, 0-1000
normalised) to the word embeddings and a spatial-aware bias to self-attention. The
trainer mimics the Hugging Face Trainer loop: precision strings, gradient accumulation,
clipping, linear warmup, best-checkpoint selection on entity F1.
"""

import json
import logging
import math
import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from seqeval.metrics import classification_report, f1_score
from torch.utils.data import DataLoader
from transformers import get_linear_schedule_with_warmup

logger = logging.getLogger(__name__)


@dataclass
class TrainingArguments:
    output_dir: str = "out/layoutlm-funsd"
    precision: str = "fp16"  # "fp32" | "fp16" | "bf16"
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 16
    gradient_accumulation_steps: int = 2
    learning_rate: float = 5e-5
    weight_decay: float = 0.01
    warmup_ratio: float = 0.1
    num_train_epochs: int = 30
    max_grad_norm: float = 1.0
    logging_steps: int = 20
    seed: int = 42


class LayoutEmbeddings(nn.Module):
    def __init__(self, vocab_size, hidden, max_pos=512, max_2d=1024):
        super().__init__()
        self.word = nn.Embedding(vocab_size, hidden, padding_idx=0)
        self.position = nn.Embedding(max_pos, hidden)
        self.x = nn.Embedding(max_2d, hidden)
        self.y = nn.Embedding(max_2d, hidden)
        self.h = nn.Embedding(max_2d, hidden)
        self.w = nn.Embedding(max_2d, hidden)
        self.norm = nn.LayerNorm(hidden, eps=1e-12)
        self.dropout = nn.Dropout(0.1)

    def forward(self, input_ids, bbox):
        pos = torch.arange(input_ids.size(1), device=input_ids.device).unsqueeze(0)
        e = self.word(input_ids) + self.position(pos)
        e = e + self.x(bbox[..., 0]) + self.y(bbox[..., 1]) + self.x(bbox[..., 2]) + self.y(bbox[..., 3])
        e = e + self.h((bbox[..., 3] - bbox[..., 1]).clamp(0, 1023)) + self.w((bbox[..., 2] - bbox[..., 0]).clamp(0, 1023))
        return self.dropout(self.norm(e))


def relative_2d_bucket(rel, num_buckets=32, max_distance=256):
    half = num_buckets // 2
    sign = (rel > 0).long() * half
    n = rel.abs()
    max_exact = half // 2
    is_small = n < max_exact
    large = max_exact + (torch.log(n.float() / max_exact + 1e-6) / math.log(max_distance / max_exact)
                         * (half - max_exact)).long()
    large = torch.min(large, torch.full_like(large, half - 1))
    return sign + torch.where(is_small, n, large)


class SpatialSelfAttention(nn.Module):
    def __init__(self, hidden, heads, num_buckets=32):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, hidden)
        self.num_buckets = num_buckets
        self.rel_x_bias = nn.Linear(num_buckets, heads, bias=False)
        self.rel_y_bias = nn.Linear(num_buckets, heads, bias=False)

    def split(self, t):
        b, n, _ = t.shape
        return t.view(b, n, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, hidden_states, bbox, key_mask):
        q, k, v = self.split(self.query(hidden_states)), self.split(self.key(hidden_states)), self.split(self.value(hidden_states))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        cx = (bbox[..., 0] + bbox[..., 2]) // 2
        cy = (bbox[..., 1] + bbox[..., 3]) // 2
        rel_x = F.one_hot(relative_2d_bucket(cx[:, None, :] - cx[:, :, None]), self.num_buckets).float()
        rel_y = F.one_hot(relative_2d_bucket(cy[:, None, :] - cy[:, :, None]), self.num_buckets).float()
        bias_x = self.rel_x_bias(rel_x).permute(0, 3, 1, 2)
        bias_y = self.rel_y_bias(rel_y).permute(0, 3, 1, 2)
        scores = scores + bias_x + bias_y
        scores = torch.where(key_mask[:, None, None, :], scores, -1e9)  # expect: AMP007
        probs = F.softmax(scores, dim=-1)
        ctx = torch.matmul(probs, v).transpose(1, 2).flatten(2)
        return self.out(ctx)


class EncoderLayer(nn.Module):
    def __init__(self, hidden, heads, ffn):
        super().__init__()
        self.attn = SpatialSelfAttention(hidden, heads)
        self.ln1 = nn.LayerNorm(hidden, eps=1e-12)
        self.ffn = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
        self.ln2 = nn.LayerNorm(hidden, eps=1e-12)
        self.drop = nn.Dropout(0.1)

    def forward(self, x, bbox, key_mask):
        x = self.ln1(x + self.drop(self.attn(x, bbox, key_mask)))
        return self.ln2(x + self.drop(self.ffn(x)))


class LayoutTokenClassifier(nn.Module):
    def __init__(self, vocab_size, num_labels, hidden=768, layers=12, heads=12, ffn=3072):
        super().__init__()
        self.embeddings = LayoutEmbeddings(vocab_size, hidden)
        self.layers = nn.ModuleList(EncoderLayer(hidden, heads, ffn) for _ in range(layers))
        self.dropout = nn.Dropout(0.1)
        self.classifier = nn.Linear(hidden, num_labels)

    def forward(self, input_ids, bbox, attention_mask):
        key_mask = attention_mask.bool()
        x = self.embeddings(input_ids, bbox)
        for layer in self.layers:
            x = layer(x, bbox, key_mask)
        return self.classifier(self.dropout(x))


class DocNERTrainer:
    def __init__(self, model, args, train_dataset, eval_dataset, label_list, collate_fn):
        self.model, self.args, self.label_list = model, args, label_list
        self.device = torch.device("cuda")
        self.model.to(self.device)
        self.train_loader = DataLoader(train_dataset, batch_size=args.per_device_train_batch_size,
                                       shuffle=True, collate_fn=collate_fn, num_workers=4)
        self.eval_loader = DataLoader(eval_dataset, batch_size=args.per_device_eval_batch_size,
                                      collate_fn=collate_fn)
        self.num_labels = len(label_list)
        self.loss_fct = nn.CrossEntropyLoss(ignore_index=-100)
        no_decay = ("bias", "norm")
        groups = [
            {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
             "weight_decay": args.weight_decay},
            {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
             "weight_decay": 0.0},
        ]
        self.optimizer = torch.optim.AdamW(groups, lr=args.learning_rate)
        total = len(self.train_loader) // args.gradient_accumulation_steps * args.num_train_epochs
        self.lr_scheduler = get_linear_schedule_with_warmup(self.optimizer, int(args.warmup_ratio * total), total)
        self.amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.precision)
        self.use_scaler = args.precision == "fp16"
        self.scaler = torch.cuda.amp.GradScaler(enabled=self.use_scaler)  # expect: AMP009
        self.global_step = 0

    def autocast_context(self):
        if self.amp_dtype is None:
            return nullcontext()
        return torch.autocast(device_type="cuda", dtype=self.amp_dtype)

    def _prepare_inputs(self, inputs):
        return {k: v.to(self.device, non_blocking=True) for k, v in inputs.items()}

    def training_step(self, inputs):
        self.model.train()
        inputs = self._prepare_inputs(inputs)
        with self.autocast_context():
            logits = self.model(inputs["input_ids"], inputs["bbox"], inputs["attention_mask"])
        loss = self.loss_fct(logits.view(-1, self.num_labels), inputs["labels"].view(-1))  # expect: AMP002
        if self.args.gradient_accumulation_steps > 1:
            loss = loss / self.args.gradient_accumulation_steps
        self.scaler.scale(loss).backward()
        return loss.detach()

    def optimizer_step(self):
        if self.use_scaler:
            self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.max_grad_norm)
        if self.use_scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.optimizer.step()  # expect: AMP006
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1

    @torch.no_grad()
    def evaluate(self):
        self.model.eval()
        preds, refs = [], []
        for inputs in self.eval_loader:
            inputs = self._prepare_inputs(inputs)
            with self.autocast_context():
                logits = self.model(inputs["input_ids"], inputs["bbox"], inputs["attention_mask"])
            pred_ids = logits.argmax(-1).cpu().tolist()
            for p_row, l_row in zip(pred_ids, inputs["labels"].cpu().tolist()):
                preds.append([self.label_list[p] for p, l in zip(p_row, l_row) if l != -100])
                refs.append([self.label_list[l] for l in l_row if l != -100])
        return {"f1": f1_score(refs, preds), "report": classification_report(refs, preds)}

    def train(self):
        best_f1 = -1.0
        for epoch in range(self.args.num_train_epochs):
            running = 0.0
            for step, inputs in enumerate(self.train_loader):
                running += self.training_step(inputs).item()
                if (step + 1) % self.args.gradient_accumulation_steps == 0:
                    self.optimizer_step()
                    if self.global_step % self.args.logging_steps == 0:
                        logger.info("epoch %d step %d loss %.4f lr %.2e", epoch, self.global_step,
                                    running / self.args.logging_steps, self.lr_scheduler.get_last_lr()[0])
                        running = 0.0
            metrics = self.evaluate()
            logger.info("epoch %d eval f1 %.4f\n%s", epoch, metrics["f1"], metrics["report"])
            if metrics["f1"] > best_f1:
                best_f1 = metrics["f1"]
                self.save_model(os.path.join(self.args.output_dir, "best"))
        return best_f1

    def save_model(self, path):
        os.makedirs(path, exist_ok=True)
        torch.save(self.model.state_dict(), os.path.join(path, "pytorch_model.bin"))
        with open(os.path.join(path, "trainer_state.json"), "w") as f:
            json.dump({"global_step": self.global_step, "labels": self.label_list,
                       "precision": self.args.precision}, f)
