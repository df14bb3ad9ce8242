"""LoRA / QLoRA-style supervised fine-tuning of a causal LM.

The base model is loaded in bf16 and frozen; LoRA adapters and norms are kept in
fp32. Training runs under bf16 autocast. The script also evaluates perplexity,
samples generations and exports a merged fp16 checkpoint.
"""
import argparse
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

from sft_data import build_loader


class LoRALinear(nn.Module):
    """y = W x + (B A x) * alpha / r, with W frozen and A, B trainable in fp32."""

    def __init__(self, base: nn.Linear, r=16, alpha=32, dropout=0.05):
        super().__init__()
        self.base = base
        self.base.requires_grad_(False)
        dev = base.weight.device
        self.lora_A = nn.Linear(base.in_features, r, bias=False, device=dev, dtype=torch.float32)
        self.lora_B = nn.Linear(r, base.out_features, bias=False, device=dev, dtype=torch.float32)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / r
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        result = self.base(x)
        lora_x = x.to(self.lora_A.weight.dtype)
        update = self.lora_B(self.lora_A(self.dropout(lora_x))) * self.scaling
        return result + update.to(result.dtype)

    @torch.no_grad()
    def merge(self):
        delta = (self.lora_B.weight @ self.lora_A.weight) * self.scaling
        self.base.weight += delta.to(self.base.weight.dtype)


def add_lora(model, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"), r=16, alpha=32):
    for _, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in target_modules and isinstance(child, nn.Linear):
                setattr(module, child_name, LoRALinear(child, r=r, alpha=alpha))
    return model


def prepare_model_for_kbit_training(model, use_gradient_checkpointing=True):
    """Freeze the base model and upcast the small 1-d parameters (norms, biases) to fp32."""
    for param in model.parameters():
        param.requires_grad = False
    for _, param in model.named_parameters():
        if param.ndim == 1 and param.dtype in (torch.float16, torch.bfloat16):
            param.data = param.data.to(torch.float32)
    if use_gradient_checkpointing:
        model.enable_input_require_grads()
        model.gradient_checkpointing_enable()
    return model


def get_model(args):
    compute_dtype = torch.bfloat16 if args.bf16 else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model_name, torch_dtype=compute_dtype, device_map={"": 0})
    model = prepare_model_for_kbit_training(model, args.gradient_checkpointing)
    model = add_lora(model, r=args.lora_r, alpha=args.lora_alpha)
    for name, module in model.named_modules():
        if "norm" in name:
            module.to(torch.float32)
        if "lm_head" in name or "embed_tokens" in name:
            if hasattr(module, "weight") and module.weight.dtype == torch.float32:
                if args.bf16:
                    module.to(torch.bfloat16)
    return model


def mask_banned_tokens(logits, banned_ids):
    logits[:, banned_ids] = torch.finfo(logits.dtype).min
    return logits


@torch.no_grad()
def evaluate_perplexity(model, loader):
    model.eval()
    nll, count = 0.0, 0
    for batch in loader:
        ids = batch["input_ids"].cuda(non_blocking=True)
        attn = batch["attention_mask"].cuda(non_blocking=True)
        labels = batch["labels"].cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=ids, attention_mask=attn).logits
        logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
        tgt = labels[:, 1:]
        valid = tgt != -100
        tok_nll = -logp.gather(-1, tgt.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        nll += (tok_nll * valid).sum().item()
        count += valid.sum().item()
    model.train()
    return math.exp(nll / max(count, 1))


@torch.inference_mode()
def generate_samples(model, tokenizer, prompts, banned_ids=(), max_new_tokens=128):
    model = model.to(torch.float16).eval()
    outputs = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids.cuda()
        for _ in range(max_new_tokens):
            logits = model(input_ids=ids).logits[:, -1, :]
            logits = mask_banned_tokens(logits, list(banned_ids))
            next_id = torch.argmax(logits, dim=-1, keepdim=True)
            ids = torch.cat([ids, next_id], dim=-1)
            if next_id.item() == tokenizer.eos_token_id:
                break
        outputs.append(tokenizer.decode(ids[0], skip_special_tokens=True))
    return outputs


def save_adapter(model, path):
    adapter = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items() if "lora_" in k}
    torch.save(adapter, path)


def export_merged_fp16(model, out_dir):
    for module in model.modules():
        if isinstance(module, LoRALinear):
            module.merge()
    state = {k: v.to(torch.float16) for k, v in model.state_dict().items() if "lora_" not in k}
    os.makedirs(out_dir, exist_ok=True)
    torch.save(state, os.path.join(out_dir, "pytorch_model.bin"))


def train_packed(model, loader, optimizer, scheduler, args):
    """Packed-sequence variant: the model returns logits only, the loss is computed here."""
    model.train()
    for i, batch in enumerate(loader):
        input_ids = batch["input_ids"].cuda(non_blocking=True)
        labels = batch["labels"].cuda(non_blocking=True)
        position_ids = batch["position_ids"].cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=input_ids, position_ids=position_ids).logits
        shift_logits = logits[:, :-1, :].contiguous()
        shift_labels = labels[:, 1:].contiguous()
        loss = F.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1), ignore_index=-100)  # expect: AMP002
        (loss / args.grad_accum).backward()
        if (i + 1) % args.grad_accum == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)


def train(args):
    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    model = get_model(args)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, args.max_steps)
    train_loader = build_loader(tokenizer, args.train_file, args.batch_size, packed=args.packed)
    eval_loader = build_loader(tokenizer, args.eval_file, args.batch_size, packed=False)

    if args.packed:
        for _ in range(args.epochs):
            train_packed(model, train_loader, optimizer, scheduler, args)
        return model

    scaler = torch.cuda.amp.GradScaler()  # expect: AMP009, AMP010
    best_ppl = 1e9
    step = 0
    model.train()
    for _ in range(args.epochs):
        for i, batch in enumerate(train_loader):
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                outputs = model(**batch)
                loss = outputs.loss / args.grad_accum
            scaler.scale(loss).backward()
            if (i + 1) % args.grad_accum == 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(trainable, args.max_grad_norm)
                scaler.step(optimizer)
                scaler.update()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                if step % args.eval_every == 0:
                    ppl = evaluate_perplexity(model, eval_loader)
                    if ppl < best_ppl:
                        best_ppl = ppl
                        save_adapter(model, os.path.join(args.output_dir, "adapter_best.bin"))
    return model


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name", required=True)
    p.add_argument("--train_file", required=True)
    p.add_argument("--eval_file", required=True)
    p.add_argument("--output_dir", default="out")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--packed", action="store_true")
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--lora_alpha", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--grad_accum", type=int, default=8)
    p.add_argument("--max_grad_norm", type=float, default=0.3)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--warmup_steps", type=int, default=100)
    p.add_argument("--max_steps", type=int, default=10000)
    p.add_argument("--eval_every", type=int, default=200)
    return p.parse_args()


if __name__ == "__main__":
    args = parse_args()
    model = train(args)
    tok = AutoTokenizer.from_pretrained(args.model_name)
    print(generate_samples(model, tok, ["### Instruction: say hi\n### Response:"]))
    export_merged_fp16(model, os.path.join(args.output_dir, "merged"))
