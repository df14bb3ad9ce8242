# -*- coding: utf-8 -*-
"""Spider text-to-SQL: schema-item classifier + T5 seq2seq fine-tune (one script).

Stage 1 trains a cross-encoder that ranks tables/columns for each question (RESDSQL-style),
stage 2 fine-tunes T5 on "question | top-k schema" -> SQL.

    python text2sql_finetune.py --stage 1 --precision amp
    python text2sql_finetune.py --stage 2 --model_name_or_path t5-3b --precision bf16 --bs 4

precision: fp32 | amp (fp16 autocast + scaler) | bf16
"""
import argparse
import json
import logging
import math
import os
import random
import time
from contextlib import nullcontext
from functools import partial

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm
from transformers import (
    AutoModel,
    AutoTokenizer,
    T5ForConditionalGeneration,
    T5TokenizerFast,
    get_linear_schedule_with_warmup,
)

logger = logging.getLogger(__name__)
logging.basicConfig(format="%(asctime)s - %(levelname)s - %(message)s", level=logging.INFO)


def parse_option():
    parser = argparse.ArgumentParser("text2sql")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--bs", type=int, default=8)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=4)
    parser.add_argument("--learning_rate", type=float, default=5e-5)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--epochs", type=int, default=128)
    parser.add_argument("--warmup_ratio", type=float, default=0.1)
    parser.add_argument("--label_smoothing", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--precision", type=str, default="amp", choices=["fp32", "amp", "bf16"])
    parser.add_argument("--model_name_or_path", type=str, default="t5-base")
    parser.add_argument("--encoder_name", type=str, default="roberta-large")
    parser.add_argument("--train_filepath", type=str, default="data/preprocessed_data/resdsql_train_spider.json")
    parser.add_argument("--dev_filepath", type=str, default="data/preprocessed_data/resdsql_dev.json")
    parser.add_argument("--save_path", type=str, default="models/text2sql")
    parser.add_argument("--num_beams", type=int, default=8)
    parser.add_argument("--num_return_sequences", type=int, default=8)
    parser.add_argument("--topk_table_num", type=int, default=4)
    parser.add_argument("--topk_column_num", type=int, default=5)
    parser.add_argument("--eval_every", type=int, default=2000)
    return parser.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


# ----------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------
class Text2SQLDataset(Dataset):
    def __init__(self, dir_, mode):
        with open(dir_, "r", encoding="utf-8") as f:
            dataset = json.load(f)
        self.input_sequences = []
        self.output_sequences = []
        self.db_ids = []
        for data in dataset:
            self.input_sequences.append(data["input_sequence"])
            self.db_ids.append(data["db_id"])
            if mode == "train":
                self.output_sequences.append(data["output_sequence"])

    def __len__(self):
        return len(self.input_sequences)

    def __getitem__(self, index):
        if self.output_sequences:
            return self.input_sequences[index], self.output_sequences[index]
        return self.input_sequences[index], self.db_ids[index]


class SchemaItemDataset(Dataset):
    def __init__(self, dir_):
        with open(dir_, "r", encoding="utf-8") as f:
            self.data = json.load(f)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        d = self.data[index]
        return d["question"], d["table_names"], d["column_names"], d["table_labels"], d["column_labels"]


# ----------------------------------------------------------------------------------------
# stage 1: schema item classifier
# ----------------------------------------------------------------------------------------
class SpanAttentionPool(nn.Module):
    """pools the sub-tokens of one schema item into a vector (additive attention)"""

    def __init__(self, hidden):
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)
        self.score = nn.Linear(hidden, 1)

    def forward(self, hidden_states, span_mask):
        # hidden_states: (n_items, max_span, H), span_mask: (n_items, max_span) bool
        scores = self.score(torch.tanh(self.proj(hidden_states))).squeeze(-1)
        scores = scores.masked_fill(~span_mask, -1e9)  # expect: AMP007
        weights = torch.softmax(scores, dim=-1)
        return torch.bmm(weights.unsqueeze(1), hidden_states).squeeze(1)


class SchemaItemClassifier(nn.Module):
    def __init__(self, encoder_name):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(encoder_name)
        hidden = self.encoder.config.hidden_size
        self.table_pool = SpanAttentionPool(hidden)
        self.column_pool = SpanAttentionPool(hidden)
        self.table_column_cross_attention = nn.MultiheadAttention(hidden, 8, batch_first=True)
        self.table_cls = nn.Sequential(nn.Linear(hidden, 256), nn.LeakyReLU(), nn.Dropout(0.2), nn.Linear(256, 2))
        self.column_cls = nn.Sequential(nn.Linear(hidden, 256), nn.LeakyReLU(), nn.Dropout(0.2), nn.Linear(256, 2))

    def forward(self, input_ids, attention_mask, table_spans, table_span_mask, column_spans,
                column_span_mask, column_to_table):
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        table_logits, column_logits = [], []
        for b in range(h.size(0)):
            t_tok = h[b][table_spans[b]]                 # (n_tables, span, H)
            c_tok = h[b][column_spans[b]]
            t_emb = self.table_pool(t_tok, table_span_mask[b])
            c_emb = self.column_pool(c_tok, column_span_mask[b])
            # every table attends to its own columns
            key_padding = column_to_table[b].unsqueeze(0) != torch.arange(t_emb.size(0), device=h.device).unsqueeze(1)
            t_ctx, _ = self.table_column_cross_attention(
                t_emb.unsqueeze(0), c_emb.unsqueeze(0), c_emb.unsqueeze(0),
                attn_mask=key_padding.unsqueeze(0).repeat(8, 1, 1),
            )
            t_emb = t_emb + t_ctx.squeeze(0)
            table_logits.append(self.table_cls(t_emb))
            column_logits.append(self.column_cls(c_emb))
        return table_logits, column_logits


class ClassifierFocalLoss(nn.Module):
    def __init__(self, alpha=None, gamma=2.0):
        super().__init__()
        self.alpha = alpha
        self.gamma = gamma

    def forward(self, logits, labels):
        log_p = F.log_softmax(logits.float(), dim=-1)
        ce = F.nll_loss(log_p, labels, weight=self.alpha, reduction="none")
        p_t = torch.exp(-ce)
        return ((1 - p_t) ** self.gamma * ce).mean()


# ----------------------------------------------------------------------------------------
# utils
# ----------------------------------------------------------------------------------------
def label_smoothed_nll_loss(lprobs, target, epsilon, ignore_index=-100):
    """copied from fairseq"""
    if target.dim() == lprobs.dim() - 1:
        target = target.unsqueeze(-1)
    pad_mask = target.eq(ignore_index)
    target = target.clamp(min=0)
    nll_loss = -lprobs.gather(dim=-1, index=target)
    smooth_loss = -lprobs.sum(dim=-1, keepdim=True)
    nll_loss.masked_fill_(pad_mask, 0.0)
    smooth_loss.masked_fill_(pad_mask, 0.0)
    nll_loss = nll_loss.sum()
    smooth_loss = smooth_loss.sum()
    eps_i = epsilon / lprobs.size(-1)
    loss = (1.0 - epsilon) * nll_loss + eps_i * smooth_loss
    n_tokens = (~pad_mask).sum()
    return loss / n_tokens, nll_loss / n_tokens


def backward_step(loss, scaler, accum):
    loss = loss / accum
    scaler.scale(loss).backward()


def build_amp(precision):
    if precision == "amp":
        amp_ctx = partial(torch.autocast, "cuda", dtype=torch.float16)
    elif precision == "bf16":
        amp_ctx = partial(torch.autocast, "cuda", dtype=torch.bfloat16)
    else:
        amp_ctx = nullcontext
    try:
        scaler = torch.amp.GradScaler("cuda", enabled=precision == "amp")
    except (AttributeError, TypeError):  # torch < 2.3
        scaler = torch.cuda.amp.GradScaler(enabled=precision == "amp")
    return amp_ctx, scaler


def collate_schema_batch(batch, tokenizer):
    # (real implementation lives in utils/classifier_batch.py, trimmed here)
    questions, tables, columns, table_labels, column_labels = zip(*batch)
    enc = tokenizer(list(questions), padding=True, truncation=True, max_length=512, return_tensors="pt")
    return enc, tables, columns, table_labels, column_labels


# ----------------------------------------------------------------------------------------
# stage 1 training
# ----------------------------------------------------------------------------------------
def train_schema_classifier(opt):
    set_seed(opt.seed)
    tokenizer = AutoTokenizer.from_pretrained(opt.encoder_name, add_prefix_space=True)
    train_ds = SchemaItemDataset(opt.train_filepath)
    train_dl = DataLoader(train_ds, batch_size=opt.bs, shuffle=True,
                          collate_fn=lambda x: collate_schema_batch(x, tokenizer))
    model = SchemaItemClassifier(opt.encoder_name).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=opt.weight_decay)
    amp_ctx, scaler = build_amp(opt.precision)
    focal = ClassifierFocalLoss(gamma=2.0)

    model.train()
    for epoch in range(opt.epochs):
        for step, batch in enumerate(tqdm(train_dl)):
            enc, spans, col_spans, t_labels, c_labels = batch
            with amp_ctx():
                table_logits, column_logits = model(
                    enc["input_ids"].cuda(), enc["attention_mask"].cuda(), *spans_to_tensors(spans, col_spans)
                )
                loss = 0.0
                for tl, cl, ty, cy in zip(table_logits, column_logits, t_labels, c_labels):
                    loss = loss + focal(tl, torch.tensor(ty, device="cuda")) + focal(cl, torch.tensor(cy, device="cuda"))
                loss = loss / len(table_logits)
            backward_step(loss, scaler, opt.gradient_accumulation_steps)
            if (step + 1) % opt.gradient_accumulation_steps == 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), opt.max_grad_norm)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
        torch.save(model.state_dict(), os.path.join(opt.save_path, "schema_classifier.bin"))


def spans_to_tensors(spans, col_spans):
    raise NotImplementedError  # see utils/classifier_batch.py


# ----------------------------------------------------------------------------------------
# stage 2 training
# ----------------------------------------------------------------------------------------
def _train(opt):
    set_seed(opt.seed)
    print(opt)

    if not os.path.exists(opt.save_path):
        os.makedirs(opt.save_path)

    text2sql_tokenizer = T5TokenizerFast.from_pretrained(opt.model_name_or_path, add_prefix_space=True)
    if isinstance(text2sql_tokenizer, T5TokenizerFast):
        text2sql_tokenizer.add_tokens([AddedTokenShim(" <="), AddedTokenShim(" <")])

    train_dataset = Text2SQLDataset(dir_=opt.train_filepath, mode="train")
    train_dataloder = DataLoader(train_dataset, batch_size=opt.bs, shuffle=True,
                                 collate_fn=lambda x: x, drop_last=True)

    print("initializing text2sql model.")
    model = T5ForConditionalGeneration.from_pretrained(opt.model_name_or_path)
    model.resize_token_embeddings(len(text2sql_tokenizer))
    if "3b" in opt.model_name_or_path:
        # t5-3b + adamw states do not fit on the 48GB cards otherwise
        model = model.half()  # expect: AMP001
    if torch.cuda.is_available():
        model = model.cuda()

    print("finished.")

    num_warmup_steps = int(opt.warmup_ratio * len(train_dataset) * opt.epochs / (opt.bs * opt.gradient_accumulation_steps))
    num_training_steps = int(len(train_dataset) * opt.epochs / (opt.bs * opt.gradient_accumulation_steps))
    num_checkpoint_steps = int(1.42857 * len(train_dataset) / (opt.bs * opt.gradient_accumulation_steps))

    no_decay = ["bias", "LayerNorm.weight", "layer_norm.weight"]
    optimizer_grouped_parameters = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": opt.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=opt.learning_rate, eps=1e-8)  # expect: AMP011
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=num_warmup_steps,
                                                num_training_steps=num_training_steps)
    amp_ctx, scaler = build_amp(opt.precision)

    model.train()
    train_step = 0
    best_em = -1.0
    for epoch in range(opt.epochs):
        print(f"This is epoch {epoch+1}.")
        for batch in train_dataloder:
            train_step += 1

            batch_inputs = [data[0] for data in batch]
            batch_sqls = [data[1] for data in batch]
            if epoch == 0:
                for batch_id in range(len(batch_inputs)):
                    print(batch_inputs[batch_id])
                    print(batch_sqls[batch_id])
                    print("----------------------")

            tokenized_inputs = text2sql_tokenizer(batch_inputs, padding="max_length", return_tensors="pt",
                                                  max_length=512, truncation=True)
            with text2sql_tokenizer.as_target_tokenizer():
                tokenized_outputs = text2sql_tokenizer(batch_sqls, padding="max_length", return_tensors="pt",
                                                       max_length=256, truncation=True)

            encoder_input_ids = tokenized_inputs["input_ids"]
            encoder_input_attention_mask = tokenized_inputs["attention_mask"]
            decoder_labels = tokenized_outputs["input_ids"]
            decoder_labels[decoder_labels == text2sql_tokenizer.pad_token_id] = -100
            decoder_attention_mask = tokenized_outputs["attention_mask"]

            if torch.cuda.is_available():
                encoder_input_ids = encoder_input_ids.cuda()
                encoder_input_attention_mask = encoder_input_attention_mask.cuda()
                decoder_labels = decoder_labels.cuda()
                decoder_attention_mask = decoder_attention_mask.cuda()

            with amp_ctx():
                model_outputs = model(
                    input_ids=encoder_input_ids,
                    attention_mask=encoder_input_attention_mask,
                    labels=decoder_labels,
                    decoder_attention_mask=decoder_attention_mask,
                    return_dict=True,
                )
                logits = model_outputs["logits"]
                if opt.label_smoothing == 0:
                    loss = model_outputs["loss"]
                    backward_step(loss, scaler, opt.gradient_accumulation_steps)  # expect: AMP008

            if opt.label_smoothing > 0:
                lprobs = F.log_softmax(logits, dim=-1)
                loss, nll = label_smoothed_nll_loss(lprobs, decoder_labels, opt.label_smoothing)  # expect: AMP002
                backward_step(loss, scaler, opt.gradient_accumulation_steps)

            if scheduler is not None:
                scheduler.step()

            if train_step % opt.gradient_accumulation_steps == 0:
                if opt.max_grad_norm > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), opt.max_grad_norm)  # expect: AMP005
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()

            if train_step % 50 == 0:
                print(f"step {train_step} loss {loss.item():.4f} scale {scaler.get_scale():.0f}")

            if train_step % num_checkpoint_steps == 0 and epoch >= 6:
                print(f"At {train_step} training step, save a checkpoint.")
                os.makedirs(opt.save_path, exist_ok=True)
                model.save_pretrained(save_directory=opt.save_path + "/checkpoint-{}".format(train_step))
                text2sql_tokenizer.save_pretrained(save_directory=opt.save_path + "/checkpoint-{}".format(train_step))


class AddedTokenShim(str):
    pass


# ----------------------------------------------------------------------------------------
# eval / inference
# ----------------------------------------------------------------------------------------
def _predict_sql(opt, model_path):
    set_seed(opt.seed)
    tokenizer = T5TokenizerFast.from_pretrained(model_path, add_prefix_space=True)
    dev_dataset = Text2SQLDataset(dir_=opt.dev_filepath, mode="eval")
    dev_dataloder = DataLoader(dev_dataset, batch_size=opt.bs, shuffle=False, collate_fn=lambda x: x)

    model = T5ForConditionalGeneration.from_pretrained(model_path)
    if opt.precision == "amp" or "3b" in model_path:
        model = model.half()
    model = model.cuda().eval()

    predict_sqls = []
    for batch in tqdm(dev_dataloder):
        batch_inputs = [data[0] for data in batch]
        tokenized_inputs = tokenizer(batch_inputs, return_tensors="pt", padding="max_length",
                                     max_length=512, truncation=True)
        with torch.no_grad():
            model_outputs = model.generate(
                input_ids=tokenized_inputs["input_ids"].cuda(),
                attention_mask=tokenized_inputs["attention_mask"].cuda(),
                max_length=256,
                decoder_start_token_id=model.config.decoder_start_token_id,
                num_beams=opt.num_beams,
                num_return_sequences=opt.num_return_sequences,
            )
            model_outputs = model_outputs.view(len(batch_inputs), opt.num_return_sequences, model_outputs.shape[1])
            for seqs in model_outputs:
                predict_sqls.append(tokenizer.decode(seqs[0], skip_special_tokens=True))
    return predict_sqls


if __name__ == "__main__":
    opt = parse_option()
    if opt.stage == 1:
        train_schema_classifier(opt)
    else:
        _train(opt)
