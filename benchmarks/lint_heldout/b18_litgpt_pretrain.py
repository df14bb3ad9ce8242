"""TinyLlama-style pretraining (single file, no Fabric): packed SlimPajama rows,
documents kept apart with a block-diagonal causal mask. ``torchrun --nproc_per_node=8 pretrain.py``"""
import glob
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from lit_gpt.fused_cross_entropy import FusedCrossEntropyLoss
from lit_gpt.packed_dataset import CombinedDataset, PackedDataset

model_name = "tiny_LLaMA_120M"
name = "tinyllama_120M"
out_dir = Path("out") / name
num_of_devices = int(os.environ.get("WORLD_SIZE", 1))
global_batch_size = 512
learning_rate = 4e-4
micro_batch_size = 8
max_step = 50000
warmup_steps = 2000
log_step_interval, eval_iters, save_step_interval, eval_step_interval = 10, 100, 5000, 5000
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
decay_lr = True
min_lr = 4e-5
eos_id = 2

batch_size = global_batch_size // num_of_devices
gradient_accumulation_steps = batch_size // micro_batch_size
max_iters = max_step * gradient_accumulation_steps
hparams = {k: v for k, v in locals().items() if isinstance(v, (int, float, str)) and not k.startswith("_")}


@dataclass
class Config:
    block_size: int = 2048
    vocab_size: int = 32000
    n_layer: int = 12
    n_head: int = 12
    n_query_groups: int = 4
    n_embd: int = 768
    intermediate_size: int = 2048
    rope_base: int = 10000
    norm_eps: float = 1e-5

    @classmethod
    def from_name(cls, name: str) -> "Config":
        return cls() if name == "tiny_LLaMA_120M" else cls(n_layer=22, n_head=32, n_embd=2048, intermediate_size=5632)

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head


class RMSNorm(nn.Module):
    def __init__(self, size: int, dim: int = -1, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        norm_x = torch.mean(x * x, dim=self.dim, keepdim=True)
        x_normed = x * torch.rsqrt(norm_x + self.eps)
        return (self.weight * x_normed).to(dtype=dtype)


def build_rope_cache(seq_len: int, n_elem: int, device: torch.device, base: int = 10000) -> Tuple[torch.Tensor, torch.Tensor]:
    theta = 1.0 / (base ** (torch.arange(0, n_elem, 2, device=device).float() / n_elem))
    idx_theta = torch.outer(torch.arange(seq_len, device=device).float(), theta).repeat(1, 2)
    return torch.cos(idx_theta), torch.sin(idx_theta)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    head_size = x.size(-1)
    x1, x2 = x[..., : head_size // 2], x[..., head_size // 2 :]
    rotated = torch.cat((-x2, x1), dim=-1)
    roped = (x * cos) + (rotated * sin)
    return roped.to(dtype=x.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        qkv = (config.n_head + 2 * config.n_query_groups) * config.head_size
        self.attn = nn.Linear(config.n_embd, qkv, bias=False)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x, cos, sin, doc_ids: Optional[torch.Tensor] = None):
        B, T, C = x.size()
        cfg = self.config
        q_per_kv = cfg.n_head // cfg.n_query_groups
        qkv = self.attn(x).view(B, T, cfg.n_query_groups, q_per_kv + 2, cfg.head_size).permute(0, 2, 3, 1, 4)
        q, k, v = qkv.split((q_per_kv, 1, 1), dim=2)
        k = k.expand(B, cfg.n_query_groups, q_per_kv, T, cfg.head_size)
        v = v.expand(B, cfg.n_query_groups, q_per_kv, T, cfg.head_size)
        q, k, v = (t.reshape(B, -1, T, cfg.head_size) for t in (q, k, v))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if doc_ids is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(cfg.head_size))
            causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            allowed = (doc_ids[:, None, :, None] == doc_ids[:, None, None, :]) & causal
            att = torch.where(allowed, att, torch.full_like(att, -1e9))  # expect: AMP007
            y = F.softmax(att, dim=-1) @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class LLaMAMLP(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.fc_1 = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.fc_2 = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=False)

    def forward(self, x):
        return self.proj(F.silu(self.fc_1(x)) * self.fc_2(x))


class Block(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.norm_1 = RMSNorm(config.n_embd, eps=config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.norm_2 = RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = LLaMAMLP(config)

    def forward(self, x, cos, sin, doc_ids=None):
        x = x + self.attn(self.norm_1(x), cos, sin, doc_ids)
        return x + self.mlp(self.norm_2(x))


class GPT(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = RMSNorm(config.n_embd, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def _init_weights(self, module: nn.Module, n_layer: int) -> None:
        """Meta's "small init" for embeddings/linears, GPT-NeoX scaled init for the output projections."""
        if isinstance(module, (nn.Embedding, nn.Linear)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=math.sqrt(2.0 / 5 / self.config.n_embd))
        for name, p in module.named_parameters():
            if name == "proj.weight" and isinstance(module, (LLaMAMLP, CausalSelfAttention)):
                nn.init.normal_(p, mean=0.0, std=1 / math.sqrt(self.config.n_embd) / n_layer)

    def forward(self, idx: torch.Tensor, doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        T = idx.size(1)
        cos, sin = build_rope_cache(T, self.config.head_size, idx.device, self.config.rope_base)
        x = self.wte(idx)
        for block in self.h:
            x = block(x, cos, sin, doc_ids)
        return self.lm_head(self.ln_f(x))


def get_lr(it: int) -> float:
    if it < warmup_steps:
        return learning_rate * it / warmup_steps
    if it > max_step:
        return min_lr
    decay_ratio = (it - warmup_steps) / (max_step - warmup_steps)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


@torch.no_grad()
def validate(model: nn.Module, val_dataloader: DataLoader, device: torch.device) -> torch.Tensor:
    model.eval()
    losses = torch.zeros(eval_iters, device=device)
    for k, val_data in enumerate(val_dataloader):
        if k >= eval_iters:
            break
        input_ids = val_data[:, 0:-1].contiguous().to(device)
        targets = val_data[:, 1:].contiguous().to(device)
        with torch.cuda.amp.autocast(dtype=torch.float16):  # expect: AMP009
            logits = model(input_ids)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        losses[k] = loss.item()
    model.train()
    return losses.mean()


def fit(state: dict, train_dataloader: DataLoader, val_dataloader: Optional[DataLoader], device: torch.device) -> None:
    model = state["model"]
    optimizer = state["optimizer"]
    loss_func = FusedCrossEntropyLoss()
    ctx = torch.autocast(device_type="cuda", dtype=torch.float16) if device.type == "cuda" else nullcontext()  # expect: AMP010
    master = int(os.environ.get("RANK", 0)) == 0
    state.setdefault("best_val_loss", 1e9)

    if val_dataloader is not None:
        validate(model, val_dataloader, device)  # sanity check

    total_t0 = time.perf_counter()
    for train_data in train_dataloader:
        if state["iter_num"] >= max_iters:
            break
        lr = get_lr(state["step_count"]) if decay_lr else learning_rate
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr

        iter_t0 = time.perf_counter()
        input_ids = train_data[:, 0:-1].contiguous().to(device, non_blocking=True)
        targets = train_data[:, 1:].contiguous().to(device, non_blocking=True)
        doc_ids = torch.cumsum((input_ids == eos_id).int(), dim=1)

        is_accumulating = (state["iter_num"] + 1) % gradient_accumulation_steps != 0
        sync_ctx = model.no_sync if (is_accumulating and isinstance(model, DDP)) else nullcontext
        with sync_ctx():
            with ctx:
                logits = model(input_ids, doc_ids)
            loss = loss_func(logits, targets)  # expect: AMP002
            (loss / gradient_accumulation_steps).backward()

        if not is_accumulating:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            state["step_count"] += 1
        state["iter_num"] += 1

        if master and state["iter_num"] % log_step_interval == 0:
            print(f"iter {state['iter_num']} step {state['step_count']}: loss {loss.item():.4f}, lr {lr:.2e}, iter time: {(time.perf_counter() - iter_t0) * 1000:.2f}ms, total {time.perf_counter() - total_t0:.0f}s")

        if val_dataloader is not None and not is_accumulating and state["step_count"] % eval_step_interval == 0:
            val_loss = validate(model, val_dataloader, device).item()
            state["best_val_loss"] = min(state["best_val_loss"], val_loss)
            if master:
                print(f"step {state['step_count']}: val loss {val_loss:.4f}, val ppl {math.exp(val_loss):.4f}")
        if master and not is_accumulating and state["step_count"] % save_step_interval == 0:
            raw = model.module if isinstance(model, DDP) else model
            torch.save({"model": raw.state_dict(), "optimizer": optimizer.state_dict(), **{k: v for k, v in state.items() if k not in ("model", "optimizer")}}, out_dir / f"iter-{state['iter_num']:06d}-ckpt.pth")


def create_dataloader(data_dir: Path, block_size: int, shuffle: bool, seed: int, prefix: str) -> DataLoader:
    filenames = sorted(glob.glob(str(data_dir / f"{prefix}*")))
    rank, world = int(os.environ.get("RANK", 0)), num_of_devices
    dataset = PackedDataset(filenames, n_chunks=8 if shuffle else 1, block_size=block_size + 1, shuffle=shuffle, seed=seed + rank, num_processes=world, process_rank=rank)
    return DataLoader(CombinedDataset([dataset], seed=seed, weights=[1.0]), batch_size=micro_batch_size, shuffle=False, pin_memory=True)


def setup(train_data_dir: Path = Path("data/slim_star_combined"), val_data_dir: Optional[Path] = None, resume: Union[bool, Path] = False) -> None:
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if num_of_devices > 1:
        dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    torch.manual_seed(3407 + local_rank)
    out_dir.mkdir(parents=True, exist_ok=True)

    config = Config.from_name(model_name)
    model = GPT(config)
    model.apply(partial(model._init_weights, n_layer=config.n_layer))
    model.to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=learning_rate, betas=(beta1, beta2), eps=1e-8, foreach=False)
    if num_of_devices > 1:
        model = DDP(model, device_ids=[local_rank])

    state = {"model": model, "optimizer": optimizer, "hparams": hparams, "iter_num": 0, "step_count": 0}
    if resume is True:
        resume = sorted(out_dir.glob("*.pth"))[-1]
    if resume:
        checkpoint = torch.load(resume, map_location=device)
        (model.module if isinstance(model, DDP) else model).load_state_dict(checkpoint.pop("model"))
        optimizer.load_state_dict(checkpoint.pop("optimizer"))
        state.update(checkpoint)

    train_dataloader = create_dataloader(train_data_dir, config.block_size, shuffle=True, seed=3407, prefix="train_slim")
    val_dataloader = create_dataloader(val_data_dir, config.block_size, shuffle=False, seed=3407, prefix="validation") if val_data_dir else None
    fit(state, train_dataloader, val_dataloader, device)


if __name__ == "__main__":
    torch.set_float32_matmul_precision("high")
    setup(Path(sys.argv[1])) if len(sys.argv) > 1 else setup()
