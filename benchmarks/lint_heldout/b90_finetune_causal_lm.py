"""Supervised fine-tuning of a causal language model on prompt/response pairs.

Targets V100-class cards, so half precision autocast is used instead of bfloat16.

    python finetune_causal_lm.py --config configs/sft_pythia410m.json
"""
import argparse
import json
import math
import os
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

AMP_DTYPE = torch.float16

DEFAULT_CONFIG = {
    "model_name": "EleutherAI/pythia-410m",
    "train_file": "data/sft_train.jsonl",
    "eval_file": "data/sft_eval.jsonl",
    "max_len": 1024,
    "batch_size": 4,
    "grad_accum_steps": 8,
    "lr": 2e-5,
    "weight_decay": 0.0,
    "warmup_steps": 100,
    "max_steps": 3000,
    "max_grad_norm": 1.0,
    "init_loss_scale": 2.0 ** 14,
    "eval_every": 250,
    "log_every": 10,
    "out_dir": "checkpoints/sft",
}


def load_config(path):
    cfg = dict(DEFAULT_CONFIG)
    if path:
        with open(path) as f:
            cfg.update(json.load(f))
    return cfg


def get_autocast(enabled=True):
    if not enabled:
        return nullcontext()
    return torch.amp.autocast(device_type="cuda", dtype=AMP_DTYPE)


class PromptResponseDataset(Dataset):
    """Each row holds a prompt and a response; only response tokens are supervised."""

    def __init__(self, path, tokenizer, max_len):
        with open(path) as f:
            self.rows = [json.loads(line) for line in f if line.strip()]
        self.tok = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, idx):
        row = self.rows[idx]
        prompt_ids = self.tok(row["prompt"])["input_ids"]
        answer_ids = self.tok(row["response"] + self.tok.eos_token)["input_ids"]
        ids = (prompt_ids + answer_ids)[: self.max_len + 1]
        targets = ([-100] * len(prompt_ids) + answer_ids)[: self.max_len + 1]
        # inputs and next-token targets, already shifted
        return torch.tensor(ids[:-1]), torch.tensor(targets[1:])


def make_collate(pad_id):
    def collate(batch):
        ids, labels = zip(*batch)
        ids = pad_sequence(ids, batch_first=True, padding_value=pad_id)
        labels = pad_sequence(labels, batch_first=True, padding_value=-100)
        return {"input_ids": ids, "labels": labels, "attention_mask": (ids != pad_id).long()}
    return collate


@torch.no_grad()
def evaluate(model, loader, device, max_batches=50):
    model.eval()
    total, count = 0.0, 0
    for i, batch in enumerate(loader):
        if i >= max_batches:
            break
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with get_autocast():
            out = model(**batch)
        total += out.loss.item()
        count += 1
    model.train()
    return total / max(count, 1)


def save(cfg, model, optimizer, scheduler, scaler, step):
    os.makedirs(cfg["out_dir"], exist_ok=True)
    torch.save({
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "step": step,
        "config": cfg,
    }, os.path.join(cfg["out_dir"], f"step_{step:06d}.pt"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="")
    args = parser.parse_args()
    cfg = load_config(args.config)
    device = torch.device("cuda")
    torch.manual_seed(1337)

    tokenizer = AutoTokenizer.from_pretrained(cfg["model_name"])
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    collate = make_collate(tokenizer.pad_token_id)
    train_ds = PromptResponseDataset(cfg["train_file"], tokenizer, cfg["max_len"])
    eval_ds = PromptResponseDataset(cfg["eval_file"], tokenizer, cfg["max_len"])
    train_loader = DataLoader(train_ds, batch_size=cfg["batch_size"], shuffle=True,
                              collate_fn=collate, num_workers=2, pin_memory=True)
    eval_loader = DataLoader(eval_ds, batch_size=cfg["batch_size"], collate_fn=collate)

    model = AutoModelForCausalLM.from_pretrained(cfg["model_name"])
    model.gradient_checkpointing_enable()
    model = model.to(device, dtype=torch.float16)  # expect: AMP001
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"], eps=1e-8)  # expect: AMP011
    scheduler = get_cosine_schedule_with_warmup(optimizer, cfg["warmup_steps"], cfg["max_steps"])
    scaler = torch.amp.GradScaler("cuda", init_scale=cfg["init_loss_scale"])

    accum = cfg["grad_accum_steps"]
    step, micro_step, running = 0, 0, 0.0
    t0 = time.time()
    model.train()
    while step < cfg["max_steps"]:
        for batch in train_loader:
            input_ids = batch["input_ids"].to(device, non_blocking=True)
            labels = batch["labels"].to(device, non_blocking=True)
            attention_mask = batch["attention_mask"].to(device).half()  # expect: AMP001

            with get_autocast():
                logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)  # expect: AMP002
            running += loss.item() / accum
            loss = loss / accum
            loss = scaler.scale(loss)
            loss.backward()
            micro_step += 1
            if micro_step % accum != 0:
                continue

            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["max_grad_norm"])
            optimizer.step()  # expect: AMP006
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % cfg["log_every"] == 0:
                dt = (time.time() - t0) / cfg["log_every"]
                print(f"step {step} loss {running / cfg['log_every']:.4f} "
                      f"gnorm {grad_norm.item():.3f} lr {scheduler.get_last_lr()[0]:.2e} "
                      f"ppl {math.exp(min(running / cfg['log_every'], 20)):.1f} {dt * 1000:.0f}ms")
                running, t0 = 0.0, time.time()
            if step % cfg["eval_every"] == 0:
                print(f"step {step} eval loss {evaluate(model, eval_loader, device):.4f}")
                save(cfg, model, optimizer, scheduler, scaler, step)
            if step >= cfg["max_steps"]:
                break


if __name__ == "__main__":
    main()
