"""QLoRA-style supervised fine-tuning.

The base model's linear layers are quantised to 4-bit NF4 and frozen; small LoRA
adapters are trained on top.  Compute runs in bf16 under autocast.
"""

import argparse
import json
import math
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

COMPUTE_DTYPE = torch.bfloat16
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NF4_LEVELS = torch.tensor([
    -1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
    0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0,
])


@dataclass
class SFTConfig:
    model: str = "meta-llama/Llama-2-7b-hf"
    data: str = "data/alpaca.jsonl"
    output_dir: str = "out/qlora"
    lora_r: int = 64
    lora_alpha: float = 16.0
    lora_dropout: float = 0.05
    lora_targets: tuple = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    compute_dtype: str = "bf16"
    lr: float = 2e-4
    warmup_steps: int = 100
    max_steps: int = 10000
    epochs: int = 3
    batch_size: int = 4
    grad_accum: int = 4
    max_grad_norm: float = 0.3
    max_len: int = 1024
    seed: int = 42
    sample_every: int = 500
    prompts: list = field(default_factory=lambda: ["Write a haiku about gradients."])


class NF4Linear(nn.Module):
    """Frozen 4-bit linear layer with blockwise absmax scaling, dequantised on the fly."""

    def __init__(self, linear, compute_dtype, block_size=64):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.block_size = block_size
        self.compute_dtype = compute_dtype
        weight = linear.weight.detach().float().reshape(-1, block_size)
        absmax = weight.abs().amax(dim=1, keepdim=True).clamp_min(1e-6)
        codes = (weight / absmax).unsqueeze(-1).sub(NF4_LEVELS).abs().argmin(dim=-1)
        self.register_buffer("codes", codes.to(torch.uint8))
        self.register_buffer("absmax", absmax)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def dequantize(self):
        levels = NF4_LEVELS.to(self.codes.device)
        w = levels[self.codes.long()] * self.absmax
        return w.reshape(self.out_features, self.in_features).to(self.compute_dtype)

    def forward(self, x):
        return F.linear(x.to(self.compute_dtype), self.dequantize(), self.bias)


def quantize_linear_layers(model, compute_dtype, skip=("lm_head",)):
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child_name not in skip:
                setattr(module, child_name, NF4Linear(child, compute_dtype))
    return model


class LoraAdapters(nn.Module):
    """A/B matrices for every targeted projection, attached with forward hooks."""

    def __init__(self, base, r, alpha, dropout, targets):
        super().__init__()
        self.scaling = alpha / r
        self.dropout = nn.Dropout(dropout)
        self.names = [n for n, m in base.named_modules() if isinstance(m, NF4Linear) and n.endswith(targets)]
        modules = dict(base.named_modules())
        self.A = nn.ModuleDict()
        self.B = nn.ModuleDict()
        for n in self.names:
            key = n.replace(".", "__")
            self.A[key] = nn.Linear(modules[n].in_features, r, bias=False)
            self.B[key] = nn.Linear(r, modules[n].out_features, bias=False)
            nn.init.kaiming_uniform_(self.A[key].weight, a=math.sqrt(5))
            nn.init.zeros_(self.B[key].weight)
        self._handles = []

    def delta(self, key, x):
        a = self.A[key]
        h = a(self.dropout(x.to(a.weight.dtype)))
        return self.B[key](h) * self.scaling

    def attach(self, base):
        modules = dict(base.named_modules())
        for n in self.names:
            key = n.replace(".", "__")
            hook = (lambda k: lambda mod, inp, out: out + self.delta(k, inp[0]).to(out.dtype))(key)
            self._handles.append(modules[n].register_forward_hook(hook))


def load_quantized_base(name_or_path, compute_dtype):
    base = AutoModelForCausalLM.from_pretrained(name_or_path, torch_dtype=torch.float32, low_cpu_mem_usage=True)
    quantize_linear_layers(base, compute_dtype)
    base.requires_grad_(False)
    base.eval()
    # embeddings, norms and lm_head stay unquantised: keep them in the compute dtype
    base.to(dtype=COMPUTE_DTYPE)
    for name, param in base.named_parameters():
        if "norm" in name and param.dtype in (torch.float16, torch.bfloat16):
            param.data = param.data.to(torch.float32)
    base.gradient_checkpointing_enable()
    base.enable_input_require_grads()
    return base


def build_adapters(base, cfg):
    adapters = LoraAdapters(base, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets)
    adapters.to(base.device)
    return adapters.bfloat16()  # expect: AMP001


class SFTDataset(Dataset):
    def __init__(self, path, tokenizer, max_len):
        self.rows = [json.loads(line) for line in open(path)]
        self.tokenizer = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = self.rows[i]
        prompt = f"### Instruction:\n{row['instruction']}\n\n### Response:\n"
        p_ids = self.tokenizer(prompt, add_special_tokens=True).input_ids
        r_ids = self.tokenizer(row["output"], add_special_tokens=False).input_ids + [self.tokenizer.eos_token_id]
        ids = (p_ids + r_ids)[: self.max_len]
        labels = ([-100] * len(p_ids) + r_ids)[: self.max_len]
        weights = np.asarray([0.0] * len(p_ids) + [1.0] * len(r_ids))[: self.max_len].astype(np.float16)
        return np.asarray(ids, dtype=np.int64), np.asarray(labels, dtype=np.int64), weights


def pad_collate(rows, pad_id):
    n = max(len(ids) for ids, _, _ in rows)
    input_ids = torch.full((len(rows), n), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), n), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), n), dtype=torch.long)
    for i, (ids, lab, _) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.from_numpy(ids)
        labels[i, : len(lab)] = torch.from_numpy(lab)
        mask[i, : len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask}


def causal_lm_loss(logits, labels):
    shift_logits = logits[:, :-1, :].contiguous()
    shift_labels = labels[:, 1:].contiguous()
    return F.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)).float(), shift_labels.view(-1),
                           ignore_index=-100)


def cosine_with_warmup(optimizer, warmup, total):
    def factor(step):
        if step < warmup:
            return step / max(1, warmup)
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def generate_samples(base, tokenizer, prompts, max_new_tokens=64):
    outputs = []
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids.to(base.device)
            for _ in range(max_new_tokens):
                logits = base(input_ids=ids).logits[:, -1, :].float()
                next_id = logits.argmax(dim=-1, keepdim=True)
                ids = torch.cat([ids, next_id], dim=1)
                if next_id.item() == tokenizer.eos_token_id:
                    break
            outputs.append(tokenizer.decode(ids[0], skip_special_tokens=True))
    return outputs


def save_adapter(adapters, path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({k: v.to(torch.bfloat16) for k, v in adapters.state_dict().items()}, path)


def train(cfg):
    torch.manual_seed(cfg.seed)
    device = torch.device("cuda")
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    base = load_quantized_base(cfg.model, DTYPES[cfg.compute_dtype]).to(device)
    adapters = build_adapters(base, cfg)
    adapters.attach(base)
    adapters.train()

    optimizer = torch.optim.AdamW(adapters.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.999))
    scheduler = cosine_with_warmup(optimizer, cfg.warmup_steps, cfg.max_steps)
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010
    loader = DataLoader(SFTDataset(cfg.data, tokenizer, cfg.max_len), batch_size=cfg.batch_size, shuffle=True,
                        collate_fn=lambda rows: pad_collate(rows, tokenizer.pad_token_id), num_workers=2)

    step, micro, t0 = 0, 0, time.time()
    for epoch in range(cfg.epochs):
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                loss = causal_lm_loss(logits, batch["labels"])
            scaler.scale(loss / cfg.grad_accum).backward()
            micro += 1
            if micro % cfg.grad_accum:
                continue
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(adapters.parameters(), cfg.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step += 1
            if step % 10 == 0:
                dt = (time.time() - t0) / 10
                t0 = time.time()
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} gnorm {grad_norm:.3f} {dt:.2f}s/it")
            if step % cfg.sample_every == 0:
                for text in generate_samples(base, tokenizer, cfg.prompts):
                    print(text)
                save_adapter(adapters, os.path.join(cfg.output_dir, f"step-{step}", "adapter.pt"))
            if step >= cfg.max_steps:
                return adapters
    return adapters


def merge_and_export(base, adapters, out_dir):
    """Fold the adapters into dequantised fp16 weights for serving with vLLM / TGI."""
    merged = {}
    modules = dict(base.named_modules())
    with torch.no_grad():
        for n in adapters.names:
            key = n.replace(".", "__")
            w = modules[n].dequantize().float()
            delta = adapters.B[key].weight.float() @ adapters.A[key].weight.float()
            merged[n + ".weight"] = (w + adapters.scaling * delta).half().cpu()
        for name, param in base.named_parameters():
            merged.setdefault(name, param.detach().to(torch.float16).cpu())
    os.makedirs(out_dir, exist_ok=True)
    torch.save(merged, os.path.join(out_dir, "pytorch_model.bin"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=None)
    parser.add_argument("--merge", action="store_true")
    args = parser.parse_args()
    cfg = SFTConfig(**json.load(open(args.config))) if args.config else SFTConfig()
    adapters = train(cfg)
    save_adapter(adapters, os.path.join(cfg.output_dir, "final", "adapter.pt"))
    if args.merge:
        base = load_quantized_base(cfg.model, DTYPES[cfg.compute_dtype])
        merge_and_export(base, adapters, os.path.join(cfg.output_dir, "merged"))


if __name__ == "__main__":
    main()
