"""Image-captioning fine-tune of a BLIP-style model with Hugging Face accelerate (no_trainer example style)."""
import argparse
import copy
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoProcessor, BlipForConditionalGeneration, get_cosine_schedule_with_warmup

logger = get_logger(__name__)


def parse_args():
    parser = argparse.ArgumentParser(description="Fine-tune a captioning model with accelerate")
    parser.add_argument("--model_name_or_path", default="Salesforce/blip-image-captioning-base")
    parser.add_argument("--dataset_name", default="lambdalabs/pokemon-blip-captions")
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=5e-5)
    parser.add_argument("--weight_decay", type=float, default=0.05)
    parser.add_argument("--num_train_epochs", type=int, default=5)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=4)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--quality_weight", type=float, default=0.1)
    parser.add_argument("--mixed_precision", default="bf16", choices=["no", "fp16", "bf16"])
    parser.add_argument("--output_dir", default="blip-captions")
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


class QualityHead(nn.Module):
    """Predicts whether an image/caption pair passed the human quality filter."""

    def __init__(self, hidden):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, 1)

    def forward(self, h):
        return self.out(torch.tanh(self.dense(h))).squeeze(-1)


@torch.no_grad()
def generate_captions(model, processor, pixel_values, device, max_new_tokens=30):
    gen_model = copy.deepcopy(model).half().eval().to(device)
    ids = gen_model.generate(pixel_values=pixel_values.to(device, torch.float16), max_new_tokens=max_new_tokens)
    return processor.batch_decode(ids, skip_special_tokens=True)


def main():
    args = parse_args()
    accelerator = Accelerator(mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=args.gradient_accumulation_steps,
                              log_with="tensorboard", project_dir=args.output_dir)
    set_seed(args.seed)

    processor = AutoProcessor.from_pretrained(args.model_name_or_path)
    model = BlipForConditionalGeneration.from_pretrained(args.model_name_or_path)
    model = model.to(torch.bfloat16)  # expect: AMP001
    quality_head = QualityHead(model.config.vision_config.hidden_size)

    raw = load_dataset(args.dataset_name)
    split = raw["train"].train_test_split(test_size=0.05, seed=args.seed)

    def collate(examples):
        enc = processor(images=[e["image"] for e in examples], text=[e["text"] for e in examples],
                        padding="max_length", max_length=64, truncation=True, return_tensors="pt")
        enc["quality"] = torch.tensor([float(e.get("passed_filter", 1)) for e in examples])
        return enc

    train_dataloader = DataLoader(split["train"], shuffle=True, collate_fn=collate,
                                  batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(split["test"], collate_fn=collate, batch_size=args.per_device_eval_batch_size)

    no_decay = ["bias", "layer_norm.weight", "LayerNorm.weight"]
    optimizer_grouped_parameters = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
        {"params": list(quality_head.parameters()), "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    lr_scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=int(0.05 * max_train_steps),
                                                   num_training_steps=max_train_steps)

    model, quality_head, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, quality_head, optimizer, train_dataloader, eval_dataloader, lr_scheduler)

    progress_bar = tqdm(range(max_train_steps), disable=not accelerator.is_local_main_process)
    completed_steps = 0
    for epoch in range(args.num_train_epochs):
        model.train()
        total_loss = 0.0
        for step, batch in enumerate(train_dataloader):
            with accelerator.accumulate(model):
                batch = {k: v.to(torch.bfloat16) if torch.is_floating_point(v) else v for k, v in batch.items()}  # expect: AMP001
                with accelerator.autocast():
                    outputs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                    pixel_values=batch["pixel_values"], labels=batch["input_ids"])
                    lm_loss = outputs.loss
                    quality_prob = torch.sigmoid(quality_head(outputs.image_embeds[:, 0]))
                    quality_loss = F.binary_cross_entropy(quality_prob, batch["quality"])  # expect: AMP003
                    loss = lm_loss + args.quality_weight * quality_loss
                total_loss += loss.detach().float()
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                progress_bar.update(1)
                completed_steps += 1

        model.eval()
        losses = []
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                pixel_values=batch["pixel_values"], labels=batch["input_ids"])
            loss = outputs.loss
            losses.append(accelerator.gather_for_metrics(loss.repeat(args.per_device_eval_batch_size)))
        losses = torch.cat(losses)
        eval_loss = torch.mean(losses.float())
        try:
            perplexity = math.exp(eval_loss)
        except OverflowError:
            perplexity = float("inf")
        logger.info(f"epoch {epoch}: perplexity {perplexity:.2f} eval_loss {eval_loss:.4f} "
                    f"train_loss {total_loss.item() / len(train_dataloader):.4f}")

    accelerator.wait_for_everyone()
    unwrapped_model = accelerator.unwrap_model(model)
    unwrapped_model.save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process,
                                    save_function=accelerator.save)
    if accelerator.is_main_process:
        processor.save_pretrained(args.output_dir)
        sample = next(iter(eval_dataloader))
        for caption in generate_captions(unwrapped_model, processor, sample["pixel_values"][:4], accelerator.device):
            logger.info(caption)
        os.makedirs(os.path.join(args.output_dir, "samples"), exist_ok=True)


if __name__ == "__main__":
    main()
