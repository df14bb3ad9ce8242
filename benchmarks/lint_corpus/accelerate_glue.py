"""Sequence classification fine-tuning with accelerate (no_trainer style)."""
import argparse
import logging
import math

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification, get_scheduler

logger = logging.getLogger(__name__)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="bert-base-cased")
    parser.add_argument("--mixed_precision", default="fp16", choices=["no", "fp16", "bf16"])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--grad_accum", type=int, default=1)
    args = parser.parse_args()

    accelerator = Accelerator(mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=args.grad_accum)
    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, eps=1e-8)
    train_dataloader = DataLoader([], batch_size=32)
    eval_dataloader = DataLoader([], batch_size=64)
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.grad_accum)
    lr_scheduler = get_scheduler("linear", optimizer=optimizer, num_warmup_steps=0,
                                 num_training_steps=args.epochs * num_update_steps_per_epoch)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    loss_fct = torch.nn.CrossEntropyLoss()
    for epoch in range(args.epochs):
        model.train()
        total_loss = 0.0
        for step, batch in enumerate(train_dataloader):
            with accelerator.accumulate(model):
                with accelerator.autocast():
                    outputs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
                loss = loss_fct(outputs.logits, batch["labels"])
                total_loss += loss.detach().float()
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
        model.eval()
        correct = 0
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            correct += (predictions == references).sum().item()
        accelerator.print(f"epoch {epoch}: loss {total_loss.item() / len(train_dataloader):.4f}")
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained("out", save_function=accelerator.save)


if __name__ == "__main__":
    main()
