"""LoRA / QLoRA fine-tuning for causal LMs.

Three modes:
  * ``--mode peft``    : peft LoRA on a half-precision base
  * ``--mode qlora``   : 4-bit NF4 base + peft LoRA (bitsandbytes)
  * ``--mode manual``  : our own LoRALinear injection, no peft dependency at train time

The manual path exists because peft pulled in a broken accelerate pin on the cluster image;
keep it in sync with peft's defaults (alpha / r scaling, B initialised to zero).
"""
import argparse
import json
import logging
import math
import os
import re

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    get_linear_schedule_with_warmup,
)

from sft.data import SupervisedDataset, collate_supervised

logger = logging.getLogger("lora")

DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoRALinear(nn.Module):
    """y = W x + (alpha / r) * B A x with W frozen."""

    def __init__(self, base: nn.Linear, r: int = 8, alpha: int = 16, dropout: float = 0.05):
        super().__init__()
        self.base = base
        self.base.requires_grad_(False)
        self.r = r
        self.scaling = alpha / r
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.merged = False

    def forward(self, x):
        result = self.base(x)
        if self.merged:
            return result
        lora_x = self.dropout(x.to(self.lora_A.weight.dtype))
        update = self.lora_B(self.lora_A(lora_x)) * self.scaling
        return result + update.to(result.dtype)

    @torch.no_grad()
    def merge(self):
        delta = (self.lora_B.weight @ self.lora_A.weight) * self.scaling
        self.base.weight.add_(delta.to(self.base.weight.dtype))
        self.merged = True


def inject_lora(model, target_modules, r, alpha, dropout):
    pattern = re.compile(r"(^|\.)(" + "|".join(map(re.escape, target_modules)) + r")$")
    replaced = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or not pattern.search(name):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        lora = LoRALinear(module, r=r, alpha=alpha, dropout=dropout).to(module.weight.device)
        setattr(parent, child, lora)
        replaced += 1
    return replaced


def lora_state_dict(model, dtype=torch.float16):
    # adapters are tiny; store them in half to match what peft writes
    return {k: v.to(dtype) for k, v in model.state_dict().items() if "lora_" in k}


def load_peft_base(args):
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, torch_dtype=torch.float16, device_map={"": 0})
    model.gradient_checkpointing_enable()
    model.enable_input_require_grads()
    config = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=args.target_modules,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, config)
    model.print_trainable_parameters()
    return model


def load_qlora_model(args):
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    compute_dtype = torch.bfloat16 if args.bf16 else torch.float16
    bnb_config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
    )
    model = AutoModelForCausalLM.from_pretrained(
        args.model_name_or_path,
        quantization_config=bnb_config,
        torch_dtype=torch.bfloat16,
        device_map={"": 0},
    )
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                        target_modules=args.target_modules, task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def make_loader(args, tokenizer):
    ds = SupervisedDataset(args.data_path, tokenizer, max_len=args.max_len)
    return DataLoader(ds, batch_size=args.batch_size, shuffle=True,
                      collate_fn=lambda b: collate_supervised(b, tokenizer.pad_token_id), num_workers=2)


def train_peft(args, tokenizer):
    model = load_peft_base(args)
    loader = make_loader(args, tokenizer)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    total = len(loader) * args.epochs // args.grad_accum
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.03 * total), total)
    model.train()
    step = 0
    for epoch in range(args.epochs):
        for i, batch in enumerate(loader):
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss / args.grad_accum
            loss.backward()
            if (i + 1) % args.grad_accum == 0:
                torch.nn.utils.clip_grad_norm_(trainable, args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                if step % 20 == 0:
                    logger.info("peft epoch %d step %d loss %.4f", epoch, step, loss.item() * args.grad_accum)
    model.save_pretrained(os.path.join(args.output_dir, "adapter"))
    return model


def train_qlora(args, tokenizer):
    model = load_qlora_model(args)
    loader = make_loader(args, tokenizer)
    params = [p for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), weight_decay=0.0)
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010
    total = len(loader) * args.epochs // args.grad_accum
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.03 * total), total)
    model.train()
    for epoch in range(args.epochs):
        running = 0.0
        for i, batch in enumerate(loader):
            batch = {k: v.to("cuda", non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                outputs = model(**batch)
                loss = outputs.loss / args.grad_accum
            scaler.scale(loss).backward()
            running += loss.item()
            if (i + 1) % args.grad_accum == 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
                scaler.step(optimizer)
                scaler.update()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                logger.info("qlora epoch %d it %d loss %.4f", epoch, i, running)
                running = 0.0
    model.save_pretrained(os.path.join(args.output_dir, "qlora_adapter"))
    return model


def train_manual_lora(args, tokenizer):
    device = torch.device("cuda")
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, torch_dtype=torch.float16)
    model.requires_grad_(False)
    n = inject_lora(model, args.target_modules, args.lora_r, args.lora_alpha, args.lora_dropout)
    logger.info("injected %d LoRA layers", n)
    model.to(device)
    lora_params = [p for name, p in model.named_parameters() if "lora_" in name]
    optimizer = torch.optim.AdamW(lora_params, lr=args.lr, weight_decay=0.0)
    loader = make_loader(args, tokenizer)
    total = len(loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.03 * total), total)
    model.train()
    for epoch in range(args.epochs):
        for i, batch in enumerate(loader):
            batch = {k: v.to(device) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                loss = F.cross_entropy(
                    logits[:, :-1].reshape(-1, logits.size(-1)),
                    batch["labels"][:, 1:].reshape(-1),
                    ignore_index=-100,
                )
            loss.backward()
            torch.nn.utils.clip_grad_norm_(lora_params, args.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if i % 50 == 0:
                logger.info("manual epoch %d it %d loss %.4f", epoch, i, loss.item())
    os.makedirs(args.output_dir, exist_ok=True)
    torch.save(lora_state_dict(model), os.path.join(args.output_dir, "lora_manual.pt"))
    with open(os.path.join(args.output_dir, "lora_config.json"), "w") as f:
        json.dump({"r": args.lora_r, "alpha": args.lora_alpha, "targets": args.target_modules}, f)
    return model


def export_merged_model(args, adapter_dir):
    """Merge a peft adapter into the base and write a standalone fp16 checkpoint for vLLM."""
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, torch_dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir)
    merged = model.merge_and_unload()
    merged = merged.half()
    merged.save_pretrained(os.path.join(args.output_dir, "merged"), safe_serialization=True)


def smoke_test_cpu(args, tokenizer):
    """Tiny CPU forward so config mistakes surface before we wait for a GPU slot."""
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, torch_dtype=torch.float32)
    ids = tokenizer("Hello, my name is", return_tensors="pt").input_ids
    with torch.no_grad(), torch.cpu.amp.autocast(dtype=torch.bfloat16):  # expect: AMP009
        out = model(ids)
    logger.info("smoke test ok, logits %s", tuple(out.logits.shape))


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["peft", "qlora", "manual"], default="peft")
    p.add_argument("--model_name_or_path", required=True)
    p.add_argument("--data_path", required=True)
    p.add_argument("--output_dir", default="lora_out")
    p.add_argument("--max_len", type=int, default=1024)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--grad_accum", type=int, default=4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--max_grad_norm", type=float, default=0.3)
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--lora_alpha", type=int, default=32)
    p.add_argument("--lora_dropout", type=float, default=0.05)
    p.add_argument("--target_modules", nargs="+", default=DEFAULT_TARGETS)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--smoke_test", action="store_true")
    p.add_argument("--export", action="store_true")
    return p.parse_args()


def main():
    args = parse_args()
    logging.basicConfig(level=logging.INFO)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.unk_token
    if args.smoke_test:
        smoke_test_cpu(args, tokenizer)
        return
    trainers = {"peft": train_peft, "qlora": train_qlora, "manual": train_manual_lora}
    trainers[args.mode](args, tokenizer)
    if args.export and args.mode == "peft":
        export_merged_model(args, os.path.join(args.output_dir, "adapter"))


if __name__ == "__main__":
    main()
