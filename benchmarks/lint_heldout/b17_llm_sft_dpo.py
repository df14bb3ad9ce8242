"""SFT and DPO for causal LMs with LoRA adapters and gradient checkpointing.

    python b17_llm_sft_dpo.py --mode sft --model meta-llama/Llama-3.2-1B --data sft.jsonl
    python b17_llm_sft_dpo.py --mode dpo --model out/sft --data prefs.jsonl --beta 0.1
"""
import argparse
import json
import math
import os
import random
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

IGNORE = -100


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, r=16, alpha=32, dropout=0.05):
        super().__init__()
        self.base = base
        self.scaling = alpha / r
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r))
        self.dropout = nn.Dropout(dropout)
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def forward(self, x):
        return self.base(x) + (self.dropout(x) @ self.lora_A.t() @ self.lora_B.t()) * self.scaling

    @torch.no_grad()
    def merged(self) -> nn.Linear:
        delta = (self.lora_B @ self.lora_A) * self.scaling
        self.base.weight += delta.to(self.base.weight.dtype)
        return self.base


def inject_lora(model, r, alpha, targets=("q_proj", "k_proj", "v_proj", "o_proj")):
    model.requires_grad_(False)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in targets and isinstance(child, nn.Linear):
                setattr(module, name, LoRALinear(child, r, alpha))
    return model


class JsonlDataset(Dataset):
    def __init__(self, path, tokenizer, mode, max_len=1024):
        with open(path) as f:
            self.rows = [json.loads(line) for line in f]
        self.tok, self.mode, self.max_len = tokenizer, mode, max_len

    def __len__(self):
        return len(self.rows)

    def _encode(self, prompt, answer):
        p = self.tok(prompt, add_special_tokens=True)["input_ids"]
        a = self.tok(answer + self.tok.eos_token, add_special_tokens=False)["input_ids"]
        ids = (p + a)[: self.max_len]
        labels = ([IGNORE] * len(p) + a)[: self.max_len]
        return ids, labels

    def __getitem__(self, i):
        row = self.rows[i]
        if self.mode == "sft":
            ids, labels = self._encode(row["prompt"], row["response"])
            return {"input_ids": ids, "input_labels": labels}
        c_ids, c_lab = self._encode(row["prompt"], row["chosen"])
        r_ids, r_lab = self._encode(row["prompt"], row["rejected"])
        return {"chosen_ids": c_ids, "chosen_labels": c_lab, "rejected_ids": r_ids, "rejected_labels": r_lab}


def collate(rows, pad_id):
    out = {}
    keys = [k for k in rows[0] if k.endswith("ids")]
    width = max(len(r[k]) for r in rows for k in keys)
    for key in rows[0]:
        fill = IGNORE if key.endswith("labels") else pad_id
        out[key] = torch.tensor([r[key] + [fill] * (width - len(r[key])) for r in rows])
    for key in keys:
        out[key.replace("ids", "mask")] = (out[key.replace("ids", "labels")] != IGNORE) | (out[key] != pad_id)
    return out


def sequence_logps(model, input_ids, attention_mask, labels):
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    labels = labels[:, 1:]
    mask = labels != IGNORE
    safe = labels.masked_fill(~mask, 0)
    per_token = torch.gather(logits.float().log_softmax(-1), 2, safe.unsqueeze(-1)).squeeze(-1)
    return (per_token * mask).sum(-1)


def concatenated_logps(model, batch):
    ids = torch.cat([batch["chosen_ids"], batch["rejected_ids"]])
    am = torch.cat([batch["chosen_mask"], batch["rejected_mask"]])
    lb = torch.cat([batch["chosen_labels"], batch["rejected_labels"]])
    logps = sequence_logps(model, ids, am, lb)
    n = batch["chosen_ids"].size(0)
    return logps[:n], logps[n:]


def dpo_loss(pol_c, pol_r, ref_c, ref_r, beta, label_smoothing=0.0):
    logits = (pol_c - pol_r) - (ref_c - ref_r)
    losses = (-F.logsigmoid(beta * logits) * (1.0 - label_smoothing)
              - F.logsigmoid(-beta * logits) * label_smoothing)
    return losses.mean(), beta * (pol_c - ref_c).detach(), beta * (pol_r - ref_r).detach()


def sft_step(policy, batch, optimizer, scaler, args, step):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = policy(input_ids=batch["input_ids"], attention_mask=batch["input_mask"]).logits
    shift_logits = logits[:, :-1, :].contiguous()
    shift_labels = batch["input_labels"][:, 1:].contiguous()
    loss = F.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1), ignore_index=IGNORE)  # expect: AMP002
    scaler.scale(loss / args.grad_accum).backward()
    if (step + 1) % args.grad_accum == 0:
        torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return {"loss": loss.item()}


def dpo_step(policy, ref_model, batch, optimizer, scaler, args, step):
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        ref_c, ref_r = concatenated_logps(ref_model, batch)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        pol_c, pol_r = concatenated_logps(policy, batch)
        loss, r_c, r_r = dpo_loss(pol_c, pol_r, ref_c, ref_r, args.beta, args.label_smoothing)
        scaler.scale(loss / args.grad_accum).backward()  # expect: AMP008
    if (step + 1) % args.grad_accum == 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    acc = (r_c > r_r).float().mean().item()
    return {"loss": loss.item(), "reward_acc": acc, "margin": (r_c - r_r).mean().item()}


@torch.no_grad()
def generate_samples(policy, tokenizer, prompts, max_new_tokens=128):
    policy.eval()
    outs = []
    with torch.cuda.amp.autocast(dtype=torch.bfloat16):  # expect: AMP009
        for prompt in prompts:
            enc = tokenizer(prompt, return_tensors="pt").to(policy.device)
            gen = policy.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
            outs.append(tokenizer.decode(gen[0, enc["input_ids"].shape[1]:], skip_special_tokens=True))
    policy.train()
    return outs


def export_merged(policy, tokenizer, out_dir):
    for module in list(policy.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, LoRALinear):
                setattr(module, name, child.merged())
    policy = policy.half()
    policy.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["sft", "dpo"], default="sft")
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="out/run")
    ap.add_argument("--lora_r", type=int, default=16)
    ap.add_argument("--lora_alpha", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--weight_decay", type=float, default=0.0)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--grad_accum", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--max_grad_norm", type=float, default=1.0)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--label_smoothing", type=float, default=0.0)
    ap.add_argument("--grad_ckpt", action="store_true")
    args = ap.parse_args()

    device = torch.device("cuda")
    random.seed(0)
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    policy = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    if args.grad_ckpt:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        policy.enable_input_require_grads()
    if args.lora_r > 0:
        inject_lora(policy, args.lora_r, args.lora_alpha)
    policy = policy.to(device=device, dtype=torch.bfloat16)  # expect: AMP001
    ref_model = None
    if args.mode == "dpo":
        ref_model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
        ref_model.requires_grad_(False)
        ref_model = ref_model.to(device, dtype=torch.bfloat16).eval()

    ds = JsonlDataset(args.data, tok, args.mode)
    loader = DataLoader(ds, batch_size=args.bs, shuffle=True, collate_fn=lambda rows: collate(rows, tok.pad_token_id))
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))
    total = args.epochs * len(loader) // args.grad_accum
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(0.03 * total), total)
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010

    policy.train()
    step, t0 = 0, time.time()
    for epoch in range(args.epochs):
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            if args.mode == "sft":
                stats = sft_step(policy, batch, optimizer, scaler, args, step)
            else:
                stats = dpo_step(policy, ref_model, batch, optimizer, scaler, args, step)
            if (step + 1) % args.grad_accum == 0:
                scheduler.step()
            step += 1
            if step % 100 == 0:
                print(json.dumps({"step": step, "epoch": epoch, **stats, "s": round(time.time() - t0, 1)}))
            if step % 2000 == 0:
                for s in generate_samples(policy, tok, ["Explain gradient checkpointing in one sentence."]):
                    print("sample:", s)
    os.makedirs(args.out, exist_ok=True)
    export_merged(policy, tok, args.out)


if __name__ == "__main__":
    main()
