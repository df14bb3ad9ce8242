"""Supervised fine-tuning with accelerate (mixed precision from `accelerate config`)."""
import math

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

from sft_data import SFTDataset, collate


def masked_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    shift_logits = logits[..., :-1, :].contiguous()
    shift_labels = labels[..., 1:].contiguous()
    return F.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1), ignore_index=-100)


def main(model_name="meta-llama/Llama-3.2-1B", epochs=3, lr=2e-5, accum=8):
    accelerator = Accelerator(gradient_accumulation_steps=accum, mixed_precision="bf16", log_with="wandb")
    set_seed(1234)
    tokenizer = AutoTokenizer.from_pretrained(model_name)
    model = AutoModelForCausalLM.from_pretrained(model_name, torch_dtype=torch.float32)
    model.gradient_checkpointing_enable()
    train_dl = DataLoader(SFTDataset("train.jsonl", tokenizer), batch_size=4, shuffle=True, collate_fn=collate)
    eval_dl = DataLoader(SFTDataset("eval.jsonl", tokenizer), batch_size=8, collate_fn=collate)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    total = math.ceil(len(train_dl) / accum) * epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(0.03 * total), total)
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, eval_dl, scheduler)

    for epoch in range(epochs):
        model.train()
        for batch in train_dl:
            with accelerator.accumulate(model):
                with accelerator.autocast():
                    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                loss = masked_lm_loss(logits, batch["labels"])
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            accelerator.log({"loss": loss.item()})

        model.eval()
        losses = []
        for batch in eval_dl:
            with torch.no_grad(), accelerator.autocast():
                out = model(**batch)
            losses.append(accelerator.gather_for_metrics(out.loss.repeat(batch["input_ids"].size(0))))
        ppl = math.exp(torch.cat(losses).mean().item())
        accelerator.print(f"epoch {epoch}: ppl {ppl:.2f}")

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained("sft-out", save_function=accelerator.save, is_main_process=accelerator.is_main_process)


def probe_gradients(model, batch, device="cuda"):
    """Debug helper: gradient norms per layer on one batch (run outside accelerate)."""
    model.to(device).train()
    with torch.autocast(device, dtype=torch.bfloat16):
        out = model(**{k: v.to(device) for k, v in batch.items()})
        out.loss.backward()  # expect: AMP008
    return {n: p.grad.norm().item() for n, p in model.named_parameters() if p.grad is not None}


if __name__ == "__main__":
    main()
