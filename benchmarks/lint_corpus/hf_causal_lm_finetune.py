"""Fine-tune a causal language model with a plain PyTorch loop (Hugging Face models)."""
import argparse
import math
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name_or_path", required=True)
    parser.add_argument("--train_file", required=True)
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=5e-5)
    parser.add_argument("--num_train_epochs", type=int, default=3)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--output_dir", default="out")
    return parser.parse_args()


def build_dataloader(tokenizer, path, batch_size):
    with open(path) as f:
        texts = [line.strip() for line in f if line.strip()]
    enc = tokenizer(texts, truncation=True, max_length=512, padding="max_length", return_tensors="pt")
    dataset = torch.utils.data.TensorDataset(enc["input_ids"], enc["attention_mask"])
    return DataLoader(dataset, batch_size=batch_size, shuffle=True)


def main():
    args = parse_args()
    device = torch.device("cuda")
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
    model = model.to(device, dtype=torch.bfloat16)  # expect: AMP001
    model.gradient_checkpointing_enable()
    train_dataloader = build_dataloader(tokenizer, args.train_file, args.per_device_train_batch_size)
    no_decay = ["bias", "layer_norm.weight"]
    grouped = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(grouped, lr=args.learning_rate)
    steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    max_train_steps = args.num_train_epochs * steps_per_epoch
    lr_scheduler = get_cosine_schedule_with_warmup(optimizer, 100, max_train_steps)
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010
    completed_steps = 0
    for epoch in range(args.num_train_epochs):
        model.train()
        for step, (input_ids, attention_mask) in enumerate(train_dataloader):
            input_ids = input_ids.to(device)
            attention_mask = attention_mask.to(device)
            labels = input_ids.masked_fill(attention_mask == 0, -100)
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                outputs = model(input_ids=input_ids, attention_mask=attention_mask)
            logits = outputs.logits
            shift_logits = logits[..., :-1, :].contiguous()
            shift_labels = labels[..., 1:].contiguous()
            loss = F.cross_entropy(  # expect: AMP002
                input=shift_logits.view(-1, shift_logits.size(-1)),
                target=shift_labels.view(-1),
                ignore_index=-100,
            )
            loss = loss / args.gradient_accumulation_steps
            scaler.scale(loss).backward()
            if (step + 1) % args.gradient_accumulation_steps == 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                scaler.step(optimizer)
                scaler.update()
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                completed_steps += 1
        model.eval()
        losses = []
        for input_ids, attention_mask in train_dataloader:
            with torch.no_grad():
                outputs = model(input_ids=input_ids.to(device), labels=input_ids.to(device))
            losses.append(outputs.loss.item())
        print(f"epoch {epoch}: perplexity {math.exp(sum(losses) / len(losses)):.2f}")
    os.makedirs(args.output_dir, exist_ok=True)
    model.save_pretrained(args.output_dir)


if __name__ == "__main__":
    main()
