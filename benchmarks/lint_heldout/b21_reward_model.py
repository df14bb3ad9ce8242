"""Pairwise reward model training (Bradley-Terry) on preference data.

Data: JSONL with {"prompt", "chosen", "rejected", optional "margin"}.
Backbone: a causal LM trunk from the hub; scalar value head on the last
non-padding token. Stage 1 warms up the value head with the trunk frozen,
stage 2 fine-tunes everything.
"""
import argparse
import json
import math
import os
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModel, AutoTokenizer, get_cosine_schedule_with_warmup


@dataclass
class RMConfig:
    model_name: str = "org/llm-1b-base"
    train_file: str = "data/prefs_train.jsonl"
    eval_file: str = "data/prefs_eval.jsonl"
    out_dir: str = "ckpt/rm"
    max_len: int = 1024
    batch_size: int = 8
    grad_accum: int = 8
    lr: float = 9e-6
    head_lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.03
    head_warmup_steps: int = 200
    rank_margin: float = 0.0
    max_grad_norm: float = 1.0
    epochs: int = 1
    eval_every: int = 500


class PreferenceDataset(Dataset):
    def __init__(self, path, tokenizer, max_len):
        with open(path) as f:
            self.rows = [json.loads(line) for line in f]
        self.tok = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.rows)

    def _encode(self, prompt, response):
        text = prompt + response + self.tok.eos_token
        return self.tok(text, truncation=True, max_length=self.max_len)["input_ids"]

    def __getitem__(self, i):
        r = self.rows[i]
        return {
            "chosen": self._encode(r["prompt"], r["chosen"]),
            "rejected": self._encode(r["prompt"], r["rejected"]),
            "margin": float(r.get("margin", 0.0)),
        }


def make_collate(pad_id):
    def pad(seqs):
        n = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), n), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        return ids, mask

    def collate(batch):
        c_ids, c_mask = pad([b["chosen"] for b in batch])
        r_ids, r_mask = pad([b["rejected"] for b in batch])
        return {"chosen_ids": c_ids, "chosen_mask": c_mask, "rejected_ids": r_ids,
                "rejected_mask": r_mask, "margin": torch.tensor([b["margin"] for b in batch])}
    return collate


class RewardModel(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.backbone = AutoModel.from_pretrained(name)
        hidden = self.backbone.config.hidden_size
        self.dropout = nn.Dropout(0.0)
        self.v_head = nn.Linear(hidden, 1, bias=False)
        nn.init.normal_(self.v_head.weight, std=1.0 / math.sqrt(hidden + 1))

    def forward(self, input_ids, attention_mask):
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        last = attention_mask.sum(dim=1) - 1
        h = out[torch.arange(out.size(0), device=out.device), last]
        return self.v_head(self.dropout(h)).squeeze(-1)


def pairwise_loss(r_chosen, r_rejected, margin: Optional[torch.Tensor] = None):
    diff = r_chosen.float() - r_rejected.float()
    if margin is not None:
        diff = diff - margin
    return -F.logsigmoid(diff).mean()


def grouped_params(model, weight_decay):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "norm" in n else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def to_device(batch, device):
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def warmup_value_head(model, loader, cfg, device):
    """Stage 1: fit the value head on frozen trunk features."""
    model.backbone.requires_grad_(False)
    head_opt = torch.optim.AdamW(model.v_head.parameters(), lr=cfg.head_lr)
    model.train()
    for step, batch in enumerate(loader):
        if step >= cfg.head_warmup_steps:
            break
        b = to_device(batch, device)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            r_c = model(b["chosen_ids"], b["chosen_mask"])
            r_r = model(b["rejected_ids"], b["rejected_mask"])
        target = torch.ones_like(b["margin"])
        loss = F.margin_ranking_loss(r_c, r_r, target, margin=cfg.rank_margin)  # expect: AMP002
        loss.backward()
        head_opt.step()
        head_opt.zero_grad(set_to_none=True)
    model.backbone.requires_grad_(True)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    n, correct, loss_sum = 0, 0, 0.0
    for batch in loader:
        b = to_device(batch, device)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            r_c = model(b["chosen_ids"], b["chosen_mask"])
            r_r = model(b["rejected_ids"], b["rejected_mask"])
            loss = pairwise_loss(r_c, r_r)
        loss_sum += loss.item() * r_c.size(0)
        correct += (r_c > r_r).sum().item()
        n += r_c.size(0)
    model.train()
    return {"eval_loss": loss_sum / n, "eval_acc": correct / n}


def save_checkpoint(model, tokenizer, path):
    os.makedirs(path, exist_ok=True)
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    torch.save(state, os.path.join(path, "reward_model.bin"))
    tokenizer.save_pretrained(path)


def train(cfg: RMConfig):
    device = torch.device("cuda")
    tok = AutoTokenizer.from_pretrained(cfg.model_name)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    collate = make_collate(tok.pad_token_id)
    train_loader = DataLoader(PreferenceDataset(cfg.train_file, tok, cfg.max_len), batch_size=cfg.batch_size,
                              shuffle=True, collate_fn=collate, num_workers=4)
    eval_loader = DataLoader(PreferenceDataset(cfg.eval_file, tok, cfg.max_len), batch_size=cfg.batch_size,
                             collate_fn=collate)

    model = RewardModel(cfg.model_name).to(device)
    model.backbone.gradient_checkpointing_enable()
    warmup_value_head(model, train_loader, cfg, device)

    optimizer = torch.optim.AdamW(grouped_params(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95))
    total_steps = cfg.epochs * len(train_loader) // cfg.grad_accum
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(cfg.warmup_ratio * total_steps), total_steps)
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010

    opt_step, t0 = 0, time.time()
    best_acc = 0.0
    for epoch in range(cfg.epochs):
        for step, batch in enumerate(train_loader):
            b = to_device(batch, device)
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                r_c = model(b["chosen_ids"], b["chosen_mask"])
                r_r = model(b["rejected_ids"], b["rejected_mask"])
                loss = pairwise_loss(r_c, r_r, b["margin"]) / cfg.grad_accum
            scaler.scale(loss).backward()
            if (step + 1) % cfg.grad_accum != 0:
                continue
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)  # expect: AMP005
            scaler.step(optimizer)  # expect: AMP006
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            opt_step += 1
            if opt_step % 10 == 0:
                acc = (r_c > r_r).float().mean().item()
                margin = (r_c.float() - r_r.float()).mean().item()
                print(f"ep {epoch} step {opt_step} loss {loss.item() * cfg.grad_accum:.4f} acc {acc:.3f} "
                      f"margin {margin:.3f} gnorm {grad_norm:.2f} lr {scheduler.get_last_lr()[0]:.2e} "
                      f"{time.time() - t0:.0f}s")
            if opt_step % cfg.eval_every == 0:
                metrics = evaluate(model, eval_loader, device)
                print(metrics)
                if metrics["eval_acc"] > best_acc:
                    best_acc = metrics["eval_acc"]
                    save_checkpoint(model, tok, os.path.join(cfg.out_dir, "best"))
    save_checkpoint(model, tok, os.path.join(cfg.out_dir, "final"))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=RMConfig.model_name)
    p.add_argument("--train-file", default=RMConfig.train_file)
    p.add_argument("--epochs", type=int, default=1)
    a = p.parse_args()
    train(RMConfig(model_name=a.model, train_file=a.train_file, epochs=a.epochs))
