"""Pairwise reward-model training for RLHF (Bradley-Terry loss on chosen/rejected pairs).

The backbone is any Hugging Face decoder; a scalar value head reads the hidden state
of the last non-padding token. Training runs under bf16 autocast on Ampere or newer.
Soft preference labels (annotator agreement) add a calibration term.
"""
import argparse
import copy
import json
import math
import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModel, AutoTokenizer, get_cosine_schedule_with_warmup


class PreferenceDataset(Dataset):
    def __init__(self, path, tokenizer, max_length=1024):
        with open(path) as f:
            self.rows = [json.loads(line) for line in f]
        self.tokenizer, self.max_length = tokenizer, max_length

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, idx):
        row = self.rows[idx]
        enc = lambda text: self.tokenizer(row["prompt"] + text, truncation=True, max_length=self.max_length)["input_ids"]
        return {"chosen": enc(row["chosen"]), "rejected": enc(row["rejected"]),
                "margin": float(row.get("margin", 0.0)), "strength": float(row.get("agreement", 1.0))}


def collate(batch, pad_id):
    seqs = [b["chosen"] for b in batch] + [b["rejected"] for b in batch]
    max_len = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), max_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), max_len), dtype=torch.long)
    for i, s in enumerate(seqs):
        input_ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        attention_mask[i, : len(s)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "margin": torch.tensor([b["margin"] for b in batch], dtype=torch.float32),
            "strength": torch.tensor([b["strength"] for b in batch], dtype=torch.float32)}


class RewardModel(nn.Module):
    def __init__(self, name_or_path):
        super().__init__()
        self.backbone = AutoModel.from_pretrained(name_or_path, torch_dtype=torch.float32)
        hidden = self.backbone.config.hidden_size
        self.v_head = nn.Linear(hidden, 1, bias=False)
        nn.init.normal_(self.v_head.weight, std=1.0 / math.sqrt(hidden + 1))

    def forward(self, input_ids, attention_mask):
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        last_index = attention_mask.sum(dim=1) - 1
        last_hidden = hidden[torch.arange(hidden.shape[0], device=hidden.device), last_index]
        return self.v_head(last_hidden).squeeze(-1).float()


def preference_loss(rewards, margin, center_coef=0.01):
    r_chosen, r_rejected = rewards.chunk(2)
    loss = -F.logsigmoid(r_chosen - r_rejected - margin).mean()
    if center_coef > 0:
        loss = loss + center_coef * torch.mean((r_chosen + r_rejected) ** 2)
    return loss, r_chosen, r_rejected


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    accs, all_rewards = [], []
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            rewards = model(batch["input_ids"], batch["attention_mask"])
            loss, r_c, r_r = preference_loss(rewards, batch["margin"])
        accs.append((r_c > r_r).float().mean().item())
        all_rewards.append(rewards.cpu())
    all_rewards = torch.cat(all_rewards)
    model.train()
    return {"accuracy": float(np.mean(accs)), "reward_mean": all_rewards.mean().item(),
            "reward_std": all_rewards.std().item(), "last_loss": loss.item()}


@torch.no_grad()
def best_of_n(model, input_ids, attention_mask, valid):
    """Index of the highest-reward completion per prompt; invalid completions never win."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        scores = model(input_ids, attention_mask)
    scores = scores.float().view(valid.shape)
    scores[~valid] = -1e9
    return scores.argmax(dim=-1)


def normalize_rewards(model, loader, device):
    """Compute the reward offset so that the SFT distribution has mean 0 (for PPO)."""
    stats = evaluate(model, loader, device)
    return stats["reward_mean"], stats["reward_std"] + 1e-8


@torch.no_grad()
def reward_length_correlation(model, loader, device, max_batches=50):
    """Pearson correlation between reward and sequence length: a length-bias diagnostic."""
    model.eval()
    rewards, lengths = [], []
    for i, batch in enumerate(loader):
        if i >= max_batches:
            break
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            r = model(batch["input_ids"], batch["attention_mask"])
        rewards.append(r.float().cpu())
        lengths.append(batch["attention_mask"].sum(dim=1).float().cpu())
    model.train()
    r, n = torch.cat(rewards), torch.cat(lengths)
    r, n = r - r.mean(), n - n.mean()
    return (r * n).sum().item() / ((r.norm() * n.norm()).item() + 1e-8)


def save_reward_model(model, tokenizer, out_dir, mean, std):
    os.makedirs(out_dir, exist_ok=True)
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    torch.save({"state_dict": state, "reward_mean": mean, "reward_std": std}, os.path.join(out_dir, "reward_model.pt"))
    tokenizer.save_pretrained(out_dir)


def export_for_serving(model, path):
    served = copy.deepcopy(model).to(dtype=torch.bfloat16).eval()
    torch.save(served.state_dict(), path)


def train(args):
    device = torch.device("cuda")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    pad_id = tokenizer.pad_token_id
    train_ds = PreferenceDataset(args.train_file, tokenizer, args.max_length)
    eval_ds = PreferenceDataset(args.eval_file, tokenizer, args.max_length)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, collate_fn=lambda b: collate(b, pad_id))
    eval_loader = DataLoader(eval_ds, batch_size=args.batch_size, collate_fn=lambda b: collate(b, pad_id))

    model = RewardModel(args.model).to(device)
    if args.gradient_checkpointing:
        model.backbone.gradient_checkpointing_enable()
    no_decay = ("bias", "norm", "ln_")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n.lower() for k in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(k in n.lower() for k in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    total_steps = args.epochs * len(train_loader) // args.grad_accum
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(0.03 * total_steps), total_steps)
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010

    step, best_acc = 0, -1.0
    model.train()
    for epoch in range(args.epochs):
        for i, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                rewards = model(batch["input_ids"], batch["attention_mask"])
                loss, r_c, r_r = preference_loss(rewards, batch["margin"], args.center_coef)
                if args.calibration_weight > 0:
                    p_chosen = torch.sigmoid(r_c - r_r)
                    loss = loss + args.calibration_weight * F.binary_cross_entropy(p_chosen, batch["strength"])  # expect: AMP003
                loss = loss / args.grad_accum
                scaler.scale(loss).backward()  # expect: AMP008
            if (i + 1) % args.grad_accum != 0:
                continue
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step += 1
            if step % args.log_every == 0:
                acc = (r_c > r_r).float().mean().item()
                margin = (r_c - r_r).mean().item()
                print(f"epoch {epoch} step {step}: loss {loss.item() * args.grad_accum:.4f} acc {acc:.3f} "
                      f"margin {margin:.3f} grad_norm {grad_norm.item():.2f}")
            if step % args.eval_every == 0:
                metrics = evaluate(model, eval_loader, device)
                print(f"eval @ {step}: {metrics}")
                if metrics["accuracy"] > best_acc:
                    best_acc = metrics["accuracy"]
                    mean, std = normalize_rewards(model, eval_loader, device)
                    save_reward_model(model, tokenizer, os.path.join(args.output_dir, "best"), mean, std)
    print(f"reward/length correlation: {reward_length_correlation(model, eval_loader, device):.3f}")
    export_for_serving(model, os.path.join(args.output_dir, "reward_model_bf16.pt"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="EleutherAI/pythia-410m")
    parser.add_argument("--train_file", default="data/prefs_train.jsonl")
    parser.add_argument("--eval_file", default="data/prefs_eval.jsonl")
    parser.add_argument("--output_dir", default="rm-out")
    parser.add_argument("--max_length", type=int, default=1024)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--grad_accum", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=9e-6)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--center_coef", type=float, default=0.01)
    parser.add_argument("--calibration_weight", type=float, default=0.0)
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--log_every", type=int, default=10)
    parser.add_argument("--eval_every", type=int, default=500)
    train(parser.parse_args())
