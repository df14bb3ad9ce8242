"""Logit distillation of a 7B teacher into a small causal LM, plus a plain SFT baseline."""
import argparse
import math
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

from sft_data import PackedChatDataset


def kd_loss(student_logits, teacher_logits, temperature):
    s = F.log_softmax(student_logits / temperature, dim=-1)
    t = F.softmax(teacher_logits / temperature, dim=-1)
    return F.kl_div(s.flatten(0, 1), t.flatten(0, 1), reduction="batchmean") * temperature ** 2


def build_loader(tokenizer, args, split="train"):
    ds = PackedChatDataset(args.data, tokenizer, seq_len=args.seq_len, split=split)
    return DataLoader(ds, batch_size=args.batch_size, shuffle=split == "train", num_workers=4, drop_last=True)


def distill(args):
    device = torch.device("cuda")
    tokenizer = AutoTokenizer.from_pretrained(args.student)
    teacher = AutoModelForCausalLM.from_pretrained(args.teacher, torch_dtype=torch.float16).to(device)
    teacher.requires_grad_(False)
    teacher.eval()
    student = AutoModelForCausalLM.from_pretrained(args.student).to(device)
    student.gradient_checkpointing_enable()
    student.train()

    loader = build_loader(tokenizer, args)
    optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    total_steps = args.epochs * len(loader) // args.accum
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(0.03 * total_steps), total_steps)
    scaler = torch.cuda.amp.GradScaler()  # expect: AMP009

    step = 0
    for epoch in range(args.epochs):
        for i, batch in enumerate(loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16):
                out = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
                with torch.no_grad():
                    t_logits = teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            kd = kd_loss(out.logits, t_logits, args.temperature)  # expect: AMP002
            loss = (args.alpha * kd + (1 - args.alpha) * out.loss) / args.accum
            scaler.scale(loss).backward()
            if (i + 1) % args.accum:
                continue
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(student.parameters(), args.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step += 1
            if step % args.log_every == 0:
                print(f"step {step} kd {kd.item():.4f} ce {out.loss.item():.4f} "
                      f"gnorm {grad_norm.item():.2f} lr {scheduler.get_last_lr()[0]:.2e}")
        student.save_pretrained(os.path.join(args.out, f"epoch{epoch}"))


def finetune_baseline(args):
    """SFT of the student alone on the same data, for the comparison table."""
    device = torch.device("cuda")
    tokenizer = AutoTokenizer.from_pretrained(args.student)
    model = AutoModelForCausalLM.from_pretrained(args.student, torch_dtype=torch.float16)  # expect: AMP001
    model.to(device)
    model.train()
    loader = build_loader(tokenizer, args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)  # expect: AMP011
    for epoch in range(args.epochs):
        for i, batch in enumerate(loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss / args.accum
            loss.backward()
            if (i + 1) % args.accum == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        model.save_pretrained(os.path.join(args.out, f"baseline_epoch{epoch}"))


@torch.no_grad()
def perplexity(model_dir, args):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float16).cuda().eval()
    nll, count = 0.0, 0
    for batch in build_loader(tokenizer, args, split="validation"):
        batch = {k: v.cuda() for k, v in batch.items()}
        n = (batch["labels"] != -100).sum().item()
        nll += model(**batch).loss.float().item() * n
        count += n
    return math.exp(nll / max(count, 1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["distill", "baseline", "eval"])
    ap.add_argument("--teacher", default="meta-llama/Llama-2-7b-hf")
    ap.add_argument("--student", default="TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T")
    ap.add_argument("--data", default="data/ultrachat_200k")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--accum", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--temperature", type=float, default=2.0)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--out", default="out/distill")
    args = ap.parse_args()
    if args.mode == "distill":
        distill(args)
    elif args.mode == "baseline":
        finetune_baseline(args)
    else:
        print(f"ppl: {perplexity(args.out, args):.3f}")


if __name__ == "__main__":
    main()
