"""Supervised fine-tuning of a small GPT with LoRA adapters (torchrun, bf16 on A100/H100).

    torchrun --nproc_per_node=8 b45_llm_sft_lora.py --base ckpt/gpt-350m.pt --data sft/chat.pt
"""
import argparse
import math
import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


@dataclass
class SFTConfig:
    base_ckpt: str = "ckpt/gpt-350m.pt"
    out_dir: str = "out-sft"
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lr: float = 2e-4
    grad_accum: int = 8
    max_steps: int = 3000
    warmup_steps: int = 100
    max_grad_norm: float = 1.0
    weights_dtype: str = "float32"  # "float16" halves the memory of the frozen base
    compile: bool = True


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, r, alpha, dropout):
        super().__init__()
        self.base = base
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scaling, self.dropout = alpha / r, nn.Dropout(dropout)

    def forward(self, x):
        return self.base(x) + (self.dropout(x) @ self.lora_A.t() @ self.lora_B.t()) * self.scaling


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def apply_padding_mask(att, attention_mask):
    # attention_mask: (B, T), 1 for real tokens and 0 for left padding
    return att.masked_fill(attention_mask[:, None, None, :] == 0, -1e9)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, block_size):
        super().__init__()
        self.n_head, self.n_embd = n_head, n_embd
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x, attention_mask=None):
        B, T, C = x.size()
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        if attention_mask is not None:
            att = apply_padding_mask(att, attention_mask)
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, block_size):
        super().__init__()
        self.ln_1, self.ln_2 = RMSNorm(n_embd), RMSNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x, attention_mask=None):
        x = x + self.attn(self.ln_1(x), attention_mask)
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab_size=50304, n_layer=24, n_head=16, n_embd=1024, block_size=1024):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([Block(n_embd, n_head, block_size) for _ in range(n_layer)])
        self.ln_f = RMSNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx, attention_mask=None, labels=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.h:
            x = block(x, attention_mask)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)
        return {"logits": logits, "loss": loss}


def inject_lora(model, r, alpha, dropout, targets=("c_attn", "c_proj")):
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in targets and isinstance(child, nn.Linear):
                setattr(module, name, LoRALinear(child, r, alpha, dropout))


def build_model_and_optimizer(cfg, device):
    ckpt = torch.load(cfg.base_ckpt, map_location="cpu")
    model = TinyGPT(**ckpt["model_args"])
    model.load_state_dict(ckpt["model"])
    inject_lora(model, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout)
    for n, p in model.named_parameters():
        p.requires_grad = "lora_" in n
    model = model.to(device)
    if cfg.weights_dtype == "float16":
        model = model.half()
    lora_params = [p for n, p in model.named_parameters() if "lora_" in n]
    optimizer = torch.optim.AdamW(lora_params, lr=cfg.lr, weight_decay=0.0)  # expect: AMP011
    return model, optimizer


def optimizer_step(optimizer, scheduler, scaler, params, max_norm):
    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    optimizer.step()  # expect: AMP006
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


class SFTTrainer:
    def __init__(self, cfg, model, optimizer, device):
        self.cfg, self.optimizer, self.device = cfg, optimizer, device
        self.raw_model = model
        if cfg.compile:
            model = torch.compile(model)
        self.model = DDP(model, device_ids=[device.index]) if dist.is_initialized() else model
        self.scaler = torch.amp.GradScaler("cuda")  # expect: AMP010
        warmup, total = cfg.warmup_steps, cfg.max_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup)
                                                           * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))

    def _backward(self, loss):
        self.scaler.scale(loss).backward()  # expect: AMP008

    def train_step(self, micro_batches):
        total = 0.0
        for i, batch in enumerate(micro_batches):
            batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            last = i == len(micro_batches) - 1
            sync_ctx = self.model.no_sync() if (isinstance(self.model, DDP) and not last) else nullcontext()
            with sync_ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = self.model(batch["input_ids"], batch["attention_mask"], labels=batch["labels"])
                    loss = out["loss"] / len(micro_batches)
                    self._backward(loss)
            total += loss.item()
        trainable = [p for p in self.raw_model.parameters() if p.requires_grad]
        grad_norm = optimizer_step(self.optimizer, self.scheduler, self.scaler, trainable, self.cfg.max_grad_norm)
        return total, grad_norm

    def save_adapter(self, path, step):
        lora_state = {k: v for k, v in self.raw_model.state_dict().items() if "lora_" in k}
        torch.save({"lora": lora_state, "optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict(),
                    "scheduler": self.scheduler.state_dict(), "step": step}, path)

    def load_adapter(self, path):
        state = torch.load(path, map_location=self.device)
        self.raw_model.load_state_dict(state["lora"], strict=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        self.scheduler.load_state_dict(state["scheduler"])
        return state["step"]


def export_merged(model, path):
    merged = {}
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            w = module.base.weight.data + (module.lora_B @ module.lora_A).data * module.scaling
            merged[f"{name}.weight"], merged[f"{name}.bias"] = w.half(), module.base.bias.data.half()
    torch.save(merged, path)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--base", default=SFTConfig.base_ckpt)
    p.add_argument("--data", required=True)
    p.add_argument("--resume", default="")
    args = p.parse_args()
    if "LOCAL_RANK" in os.environ:
        dist.init_process_group("nccl")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    cfg = SFTConfig(base_ckpt=args.base)
    model, optimizer = build_model_and_optimizer(cfg, device)
    trainer = SFTTrainer(cfg, model, optimizer, device)
    step = trainer.load_adapter(args.resume) if args.resume else 0
    data = torch.load(args.data)  # dict of (N, T) tensors: input_ids, attention_mask, labels
    n, micro = data["input_ids"].size(0), 4
    while step < cfg.max_steps:
        idx = torch.randint(0, n, (cfg.grad_accum, micro))
        micro_batches = [{k: v[i] for k, v in data.items()} for i in idx]
        loss, grad_norm = trainer.train_step(micro_batches)
        step += 1
        if step % 20 == 0 and (not dist.is_initialized() or dist.get_rank() == 0):
            print(f"step {step} loss {loss:.4f} grad_norm {grad_norm:.3f} lr {trainer.scheduler.get_last_lr()[0]:.2e}")
        if step % 500 == 0 and (not dist.is_initialized() or dist.get_rank() == 0):
            trainer.save_adapter(os.path.join(cfg.out_dir, f"adapter_{step}.pt"), step)
    export_merged(trainer.raw_model, os.path.join(cfg.out_dir, "merged_fp16.pt"))


if __name__ == "__main__":
    main()
