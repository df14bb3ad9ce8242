"""Task-agnostic distillation of a BERT teacher into a small student.

Objectives: self-attention relation transfer (Q-Q, K-K, V-V, as in MiniLMv2),
standardized last-layer hidden-state matching through a learned projection, and
soft-label distillation on the masked positions. The student's own MLM loss is kept.

    python minilm_distill.py --teacher bert-base-uncased \
        --student nreimers/MiniLM-L6-H384-uncased --steps 100000
"""
import argparse
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_dataset
from torch.utils.data import DataLoader
from transformers import (
    AutoModelForMaskedLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    get_linear_schedule_with_warmup,
)


class ProjectionCapture:
    """Keeps the outputs of the Q/K/V projections of one transformer layer."""

    def __init__(self, layer):
        self.outputs = {}
        self.handles = [
            getattr(layer.attention.self, name).register_forward_hook(self._make_hook(name))
            for name in ("query", "key", "value")
        ]

    def _make_hook(self, name):
        def hook(module, inputs, output):
            self.outputs[name] = output

        return hook

    def remove(self):
        for handle in self.handles:
            handle.remove()


def split_heads(x, num_heads):
    b, n, d = x.shape
    return x.view(b, n, num_heads, d // num_heads).transpose(1, 2)


def relation_logits(states, num_heads, attention_mask):
    x = split_heads(states, num_heads)
    rel = torch.matmul(x, x.transpose(-1, -2)) / math.sqrt(x.size(-1))
    return rel.masked_fill(attention_mask[:, None, None, :] == 0, -1e9)  # expect: AMP007


def build_loader(tokenizer, args):
    raw = load_dataset(args.dataset, args.dataset_config, split="train")

    def tokenize(batch):
        return tokenizer(batch["text"], truncation=True, max_length=args.max_len)

    ds = raw.filter(lambda ex: len(ex["text"].strip()) > 0)
    ds = ds.map(tokenize, batched=True, remove_columns=raw.column_names, num_proc=8)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)
    return DataLoader(ds, batch_size=args.batch_size, shuffle=True, collate_fn=collator,
                      num_workers=4, drop_last=True)


@torch.no_grad()
def evaluate(student, loader, device, max_batches=200):
    student.eval()
    losses = []
    for i, batch in enumerate(loader):
        if i >= max_batches:
            break
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            out = student(**batch)
        losses.append(out.loss.float().item())
    student.train()
    mean_loss = sum(losses) / max(1, len(losses))
    return math.exp(min(mean_loss, 20.0))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--teacher", default="bert-base-uncased")
    p.add_argument("--student", default="nreimers/MiniLM-L6-H384-uncased")
    p.add_argument("--teacher-layer", type=int, default=-1)
    p.add_argument("--dataset", default="wikitext")
    p.add_argument("--dataset-config", default="wikitext-103-raw-v1")
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--accum-steps", type=int, default=4)
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=4000)
    p.add_argument("--relation-heads", type=int, default=12)
    p.add_argument("--temperature", type=float, default=2.0)
    p.add_argument("--alpha-rel", type=float, default=1.0)
    p.add_argument("--alpha-hid", type=float, default=0.5)
    p.add_argument("--alpha-kd", type=float, default=1.0)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--output-dir", default="out/minilm")
    args = p.parse_args()

    device = torch.device("cuda")
    tokenizer = AutoTokenizer.from_pretrained(args.teacher)
    loader = build_loader(tokenizer, args)

    teacher = AutoModelForMaskedLM.from_pretrained(args.teacher).to(device).eval()
    teacher.requires_grad_(False)
    student = AutoModelForMaskedLM.from_pretrained(args.student).to(device)
    t_cap = ProjectionCapture(teacher.base_model.encoder.layer[args.teacher_layer])
    s_cap = ProjectionCapture(student.base_model.encoder.layer[-1])

    # W_h maps student hidden states into the teacher's width
    hidden_proj = nn.Parameter(torch.empty(student.config.hidden_size, teacher.config.hidden_size, device=device))
    nn.init.xavier_uniform_(hidden_proj)

    params = list(student.parameters()) + [hidden_proj]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup, args.steps)
    scaler = torch.amp.GradScaler("cuda")

    student.train()
    step, micro = 0, 0
    data_iter = iter(loader)
    while step < args.steps:
        try:
            batch = next(data_iter)
        except StopIteration:
            data_iter = iter(loader)
            batch = next(data_iter)
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        input_ids, attn_mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
        active = labels != -100

        with torch.autocast(device_type="cuda", dtype=torch.float16):
            with torch.no_grad():
                t_out = teacher(input_ids=input_ids, attention_mask=attn_mask, output_hidden_states=True)
            s_out = student(input_ids=input_ids, attention_mask=attn_mask, labels=labels,
                            output_hidden_states=True)

            loss_rel = 0.0
            for name in ("query", "key", "value"):
                s_rel = relation_logits(s_cap.outputs[name], args.relation_heads, attn_mask)
                t_rel = relation_logits(t_cap.outputs[name], args.relation_heads, attn_mask)
                loss_rel = loss_rel + F.kl_div(
                    F.log_softmax(s_rel, dim=-1).flatten(0, 2),
                    F.softmax(t_rel, dim=-1).flatten(0, 2),
                    reduction="batchmean",
                )

            s_h = torch.matmul(s_out.hidden_states[-1], hidden_proj)
            s_h = (s_h - s_h.mean(dim=-1, keepdim=True)) / (s_h.std(dim=-1, keepdim=True) + 1e-8)  # expect: AMP004 AMP011
            t_last = t_out.hidden_states[-1]
            t_h = F.layer_norm(t_last, t_last.shape[-1:])
            loss_hid = F.mse_loss(s_h[attn_mask.bool()], t_h[attn_mask.bool()])

            s_logits = s_out.logits[active] / args.temperature
            t_probs = F.softmax(t_out.logits[active] / args.temperature, dim=-1)
        loss_kd = F.cross_entropy(s_logits, t_probs) * args.temperature ** 2  # expect: AMP002

        loss = s_out.loss + args.alpha_rel * loss_rel + args.alpha_hid * loss_hid + args.alpha_kd * loss_kd
        scaled = scaler.scale(loss / args.accum_steps)
        scaled.backward()
        micro += 1
        if micro % args.accum_steps != 0:
            continue

        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        optimizer.step()  # expect: AMP006
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        step += 1

        if step % 100 == 0:
            print(f"step {step} loss {loss.item():.4f} rel {float(loss_rel):.4f} "
                  f"hid {loss_hid.item():.4f} kd {loss_kd.item():.4f}")
        if step % 5000 == 0:
            ppl = evaluate(student, loader, device)
            print(f"step {step} student mlm ppl {ppl:.2f}")
            student.save_pretrained(os.path.join(args.output_dir, f"step_{step}"))

    t_cap.remove()
    s_cap.remove()
    student.save_pretrained(args.output_dir)
    tokenizer.save_pretrained(args.output_dir)


if __name__ == "__main__":
    main()
