"""Fine-tuning entry points for the text models: classification, SFT, LoRA and reward models.

    python finetune.py task=cls model_name=roberta-large precision=bf16
    python finetune.py task=sft model_name=meta-llama/Llama-3.2-1B precision=fp16
"""
import json
import logging
import math
import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass, field, asdict

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    get_cosine_schedule_with_warmup,
)

from textlib.data import build_cls_dataset, build_pairwise_dataset, build_sft_dataset, collate_pad

logger = logging.getLogger("finetune")


@dataclass
class FinetuneConfig:
    task: str = "cls"
    model_name: str = "roberta-large"
    precision: str = "bf16"  # fp32 | fp16 | bf16
    lr: float = 2e-5
    weight_decay: float = 0.01
    epochs: int = 3
    batch_size: int = 16
    grad_accum: int = 1
    max_grad_norm: float = 1.0
    warmup_ratio: float = 0.06
    lora_r: int = 16
    lora_alpha: int = 32
    lora_targets: list = field(default_factory=lambda: ["q_proj", "v_proj"])
    output_dir: str = "runs/finetune"


def parse_overrides(argv):
    cfg = FinetuneConfig()
    for item in argv:
        key, value = item.split("=", 1)
        current = getattr(cfg, key)
        setattr(cfg, key, type(current)(value) if not isinstance(current, list) else value.split(","))
    return cfg


def grouped_params(model, weight_decay):
    no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight", "norm.weight")
    return [
        {"params": [p for n, p in model.named_parameters() if p.requires_grad and not n.endswith(no_decay)],
         "weight_decay": weight_decay},
        {"params": [p for n, p in model.named_parameters() if p.requires_grad and n.endswith(no_decay)],
         "weight_decay": 0.0},
    ]


def train_epoch(model, loader, optimizer, scheduler, scaler, cfg, epoch):
    model.train()
    total, n = 0.0, 0
    for step, batch in enumerate(loader):
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            loss = F.cross_entropy(logits, batch["labels"])
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        total += loss.item()
        n += 1
        if step % 100 == 0:
            logger.info("epoch %d step %d loss %.4f", epoch, step, total / n)
    return total / max(1, n)


@torch.no_grad()
def evaluate_cls(model, loader):
    model.eval()
    correct, count = 0, 0
    for batch in loader:
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        correct += (logits.argmax(-1) == batch["labels"]).sum().item()
        count += batch["labels"].numel()
    return correct / max(1, count)


def finetune_classifier(cfg):
    tokenizer = AutoTokenizer.from_pretrained(cfg.model_name)
    train_set, val_set = build_cls_dataset(tokenizer, split=("train", "validation"))
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, shuffle=True, collate_fn=collate_pad)
    val_loader = DataLoader(val_set, batch_size=cfg.batch_size * 2, collate_fn=collate_pad)

    model = AutoModelForSequenceClassification.from_pretrained(cfg.model_name, num_labels=train_set.num_labels).cuda()
    optimizer = torch.optim.AdamW(grouped_params(model, cfg.weight_decay), lr=cfg.lr)
    total_steps = cfg.epochs * len(train_loader)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(cfg.warmup_ratio * total_steps), total_steps)
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010

    best = 0.0
    for epoch in range(cfg.epochs):
        train_loss = train_epoch(model, train_loader, optimizer, scheduler, scaler, cfg, epoch)
        acc = evaluate_cls(model, val_loader)
        logger.info("epoch %d train_loss %.4f val_acc %.4f", epoch, train_loss, acc)
        if acc > best:
            best = acc
            model.save_pretrained(os.path.join(cfg.output_dir, "best"))
            torch.save({"optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()},
                       os.path.join(cfg.output_dir, "best", "trainer_state.pt"))
    return best


def train_sft(cfg):
    tokenizer = AutoTokenizer.from_pretrained(cfg.model_name)
    loader = DataLoader(build_sft_dataset(tokenizer), batch_size=cfg.batch_size, shuffle=True,
                        collate_fn=collate_pad)
    model = AutoModelForCausalLM.from_pretrained(cfg.model_name).cuda()
    model.gradient_checkpointing_enable()
    optimizer = torch.optim.AdamW(grouped_params(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95))
    steps = cfg.epochs * math.ceil(len(loader) / cfg.grad_accum)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(cfg.warmup_ratio * steps), steps)

    match cfg.precision:
        case "fp16":
            ctx = torch.autocast("cuda", dtype=torch.float16)  # expect: AMP010
        case "bf16":
            ctx = torch.autocast("cuda", dtype=torch.bfloat16)
        case _:
            ctx = nullcontext()

    model.train()
    for epoch in range(cfg.epochs):
        for step, batch in enumerate(loader):
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
            with ctx:
                outputs = model(**batch)
                loss = outputs.loss / cfg.grad_accum
            loss.backward()
            if (step + 1) % cfg.grad_accum == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            if step % 50 == 0:
                logger.info("sft epoch %d step %d loss %.4f", epoch, step, loss.item() * cfg.grad_accum)
    model.save_pretrained(os.path.join(cfg.output_dir, "sft"))


def train_lora(cfg):
    tokenizer = AutoTokenizer.from_pretrained(cfg.model_name)
    loader = DataLoader(build_sft_dataset(tokenizer), batch_size=cfg.batch_size, shuffle=True,
                        collate_fn=collate_pad)
    # the frozen base can live in bf16; only the adapters train
    base = AutoModelForCausalLM.from_pretrained(cfg.model_name, torch_dtype=torch.bfloat16).cuda()
    base.requires_grad_(False)
    lora_cfg = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, target_modules=cfg.lora_targets,
                          lora_dropout=0.05, task_type="CAUSAL_LM")
    model = get_peft_model(base, lora_cfg)
    model.print_trainable_parameters()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)

    model.train()
    for epoch in range(cfg.epochs):
        for step, batch in enumerate(loader):
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    model.save_pretrained(os.path.join(cfg.output_dir, "lora"))


def train_reward_model(cfg):
    tokenizer = AutoTokenizer.from_pretrained(cfg.model_name)
    loader = DataLoader(build_pairwise_dataset(tokenizer), batch_size=cfg.batch_size, shuffle=True,
                        collate_fn=collate_pad)
    model = AutoModelForSequenceClassification.from_pretrained(cfg.model_name, num_labels=1, torch_dtype=torch.bfloat16)  # expect: AMP001
    model.config.pad_token_id = tokenizer.pad_token_id
    model.cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)

    model.train()
    for epoch in range(cfg.epochs):
        for step, batch in enumerate(loader):
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
            chosen = model(input_ids=batch["chosen_ids"], attention_mask=batch["chosen_mask"]).logits.squeeze(-1)
            rejected = model(input_ids=batch["rejected_ids"], attention_mask=batch["rejected_mask"]).logits.squeeze(-1)
            loss = -F.logsigmoid(chosen.float() - rejected.float()).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step % 50 == 0:
                logger.info("rm epoch %d step %d loss %.4f", epoch, step, loss.item())
    model.save_pretrained(os.path.join(cfg.output_dir, "reward"))


def build_policy_for_eval(cfg):
    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
    return AutoModelForCausalLM.from_pretrained(cfg.model_name, torch_dtype=dtype).cuda().eval()


TASKS = {
    "cls": finetune_classifier,
    "sft": train_sft,
    "lora": train_lora,
    "rm": train_reward_model,
}


def main():
    logging.basicConfig(level=logging.INFO)
    cfg = parse_overrides(sys.argv[1:])
    os.makedirs(cfg.output_dir, exist_ok=True)
    with open(os.path.join(cfg.output_dir, "config.json"), "w") as f:
        json.dump(asdict(cfg), f, indent=2)
    TASKS[cfg.task](cfg)


if __name__ == "__main__":
    main()
