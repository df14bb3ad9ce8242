"""Supervised fine-tuning of a causal LM with LoRA adapters, custom training loop.

    python b30_lora_finetune.py --model meta-llama/Llama-3.2-1B --data data/sft.jsonl \
        --lora-r 16 --kl-coef 0.05 --grad-accum 8
"""
import argparse
import json
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, r=8, alpha=16, dropout=0.05):
        super().__init__()
        self.base = base
        self.r = r
        self.scaling = alpha / r
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, device=base.weight.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, device=base.weight.device))
        self.dropout = nn.Dropout(dropout)
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.merged = False

    def forward(self, x):
        out = self.base(x)
        if self.merged:
            return out
        return out + F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B) * self.scaling

    @torch.no_grad()
    def merge(self):
        if not self.merged:
            delta = (self.lora_B @ self.lora_A) * self.scaling
            self.base.weight += delta.to(self.base.weight.dtype)
            self.merged = True


def inject_lora(model, targets=("q_proj", "k_proj", "v_proj", "o_proj"), r=8, alpha=16, dropout=0.05):
    replaced = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child_name in targets:
                setattr(module, child_name, LoRALinear(child, r, alpha, dropout))
                replaced.append(f"{name}.{child_name}")
    return replaced


class SFTDataset(Dataset):
    def __init__(self, path, tokenizer, max_len=1024):
        with open(path) as f:
            self.rows = [json.loads(line) for line in f]
        self.tok = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = self.rows[i]
        prompt_ids = self.tok(row["prompt"], add_special_tokens=True)["input_ids"]
        answer_ids = self.tok(row["response"], add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        ids = (prompt_ids + answer_ids)[: self.max_len]
        labels = ([-100] * len(prompt_ids) + answer_ids)[: self.max_len]
        return {"input_ids": ids, "labels": labels}


def collate(batch, pad_id):
    max_len = max(len(b["input_ids"]) for b in batch)
    input_ids = torch.full((len(batch), max_len), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), max_len), -100, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), max_len), dtype=torch.long)
    for i, b in enumerate(batch):
        n = len(b["input_ids"])
        input_ids[i, :n] = torch.tensor(b["input_ids"])
        labels[i, :n] = torch.tensor(b["labels"])
        attention_mask[i, :n] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def packed_causal_mask(position_ids, dtype):
    doc = (position_ids == 0).cumsum(-1)
    seq_len = position_ids.size(-1)
    same_doc = doc[:, :, None] == doc[:, None, :]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=position_ids.device).tril()
    mask = torch.zeros(same_doc.shape, dtype=dtype, device=position_ids.device)
    mask.masked_fill_(~(same_doc & causal), torch.finfo(dtype).min)
    return mask[:, None]


def add_neftune(model, alpha):
    emb = model.get_input_embeddings()

    def hook(module, inputs, output):
        if module.training:
            mag = alpha / math.sqrt(output.size(1) * output.size(2))
            output = output + torch.zeros_like(output).uniform_(-mag, mag)
        return output

    return emb.register_forward_hook(hook)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    total, count = 0.0, 0
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**batch)
        n = (batch["labels"][:, 1:] != -100).sum().item()
        total += out.loss.float().item() * n
        count += n
    model.train()
    return math.exp(total / max(count, 1))


def save_adapter_checkpoint(model, out_dir, step):
    os.makedirs(out_dir, exist_ok=True)
    state = {n: p.detach().to(torch.float16).cpu() for n, p in model.named_parameters() if "lora_" in n}
    torch.save(state, os.path.join(out_dir, f"adapter_{step:06d}.pt"))


@torch.no_grad()
def export_merged(model, tokenizer, out_dir):
    for module in model.modules():
        if isinstance(module, LoRALinear):
            module.merge()
    model.half().save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--eval-data", default=None)
    p.add_argument("--out", default="out/lora")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=int, default=32)
    p.add_argument("--lora-dropout", type=float, default=0.05)
    p.add_argument("--kl-coef", type=float, default=0.0)
    p.add_argument("--neftune-alpha", type=float, default=0.0)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def main():
    args = parse_args()
    torch.manual_seed(args.seed)
    device = torch.device("cuda")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.requires_grad_(False)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()
    replaced = inject_lora(model, r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout)
    model.to(device)
    if args.neftune_alpha > 0:
        add_neftune(model, args.neftune_alpha)
    ref_model = None
    if args.kl_coef > 0:
        ref_model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(device).eval()
        ref_model.requires_grad_(False)

    params = [p for n, p in model.named_parameters() if "lora_" in n]
    n_train = sum(p.numel() for p in params)
    n_total = sum(p.numel() for p in model.parameters())
    print(f"LoRA on {len(replaced)} modules: {n_train / 1e6:.2f}M / {n_total / 1e6:.0f}M trainable")

    collate_fn = lambda b: collate(b, tokenizer.pad_token_id)  # noqa: E731
    train_loader = DataLoader(SFTDataset(args.data, tokenizer), batch_size=args.batch_size, shuffle=True,
                              collate_fn=collate_fn, num_workers=2)
    eval_loader = None
    if args.eval_data:
        eval_loader = DataLoader(SFTDataset(args.eval_data, tokenizer), batch_size=args.batch_size,
                                 collate_fn=collate_fn)
    total_steps = args.epochs * math.ceil(len(train_loader) / args.grad_accum)
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, total_steps)
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010

    global_step, t0 = 0, time.time()
    model.train()
    for epoch in range(args.epochs):
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                outputs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                labels=batch["labels"])
                lm_loss = outputs.loss
            loss = lm_loss
            if ref_model is not None:
                with torch.no_grad():
                    ref_logits = ref_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                kl = F.kl_div(F.log_softmax(outputs.logits, dim=-1), F.log_softmax(ref_logits.float(), dim=-1), log_target=True, reduction="batchmean")  # expect: AMP002
                loss = loss + args.kl_coef * kl
            loss = loss / args.grad_accum
            scaler.scale(loss).backward()
            if (step + 1) % args.grad_accum != 0:
                continue
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1
            if global_step % args.log_every == 0:
                with torch.no_grad():
                    preds = outputs.logits[:, :-1].argmax(-1)
                    tgt = batch["labels"][:, 1:]
                    valid = tgt != -100
                    acc = (preds[valid] == tgt[valid]).float().mean().item()
                print(f"epoch {epoch} step {global_step}/{total_steps} loss {lm_loss.item():.4f} acc {acc:.3f} "
                      f"gn {grad_norm.item():.3f} lr {scheduler.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s")
            if global_step % args.save_every == 0:
                save_adapter_checkpoint(model, args.out, global_step)
        if eval_loader is not None:
            print(f"epoch {epoch}: eval ppl {evaluate(model, eval_loader, device):.3f}")
    save_adapter_checkpoint(model, args.out, global_step)
    export_merged(model, tokenizer, os.path.join(args.out, "merged"))


if __name__ == "__main__":
    main()
