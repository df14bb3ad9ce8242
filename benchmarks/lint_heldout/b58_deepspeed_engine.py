"""A DeepSpeed-like training engine in plain PyTorch, driven by a ds_config dict.

    engine = MiniEngine(model, optimizer, ds_config)
    _, loss = engine(x, y)      # forward under the engine's autocast
    engine.backward(loss)       # scaled when fp16 is on
    engine.step()               # all-reduce, unscale, clip, step, update on the boundary
"""
import copy
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

ds_config = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "fp16": {"enabled": True, "initial_scale_power": 16, "pure": False},
    "bf16": {"enabled": False},
    "communication_data_type": "fp16",
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
}

device_type = "cuda" if torch.cuda.is_available() else "cpu"
ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=torch.float16)


@dataclass
class GPTConfig:
    vocab_size: int = 50304
    block_size: int = 256
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.n_head = cfg.n_head
        self.register_buffer("bias", torch.tril(torch.ones(cfg.block_size, cfg.block_size)).view(1, 1, cfg.block_size, cfg.block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def build_model_and_optimizer(config, vocab_size):
    model = GPT(GPTConfig(vocab_size=vocab_size)).cuda()
    if config["fp16"]["enabled"] and config["fp16"].get("pure", False):
        model = model.half()
    opt = config["optimizer"]["params"]
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": opt["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=opt["lr"], betas=tuple(opt["betas"]))  # expect: AMP011
    return model, optimizer


class MiniEngine:
    def __init__(self, model, optimizer, config):
        self.module = model
        self.optimizer = optimizer
        self.config = config
        self.gas = config["gradient_accumulation_steps"]
        self.clip = config.get("gradient_clipping", 0.0)
        self.pure_fp16 = config["fp16"].get("pure", False)
        self.amp_dtype = torch.float16 if config["fp16"]["enabled"] else torch.bfloat16
        self.amp_enabled = (config["fp16"]["enabled"] or config["bf16"]["enabled"]) and not self.pure_fp16
        use_scaler = self.amp_enabled and config["fp16"]["enabled"]
        self.scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** config["fp16"]["initial_scale_power"], enabled=use_scaler)
        self.comm_dtype = config.get("communication_data_type", "fp32")
        self.micro_steps = 0
        self.global_steps = 0
        self.skipped_steps = 0
        self.grad_norm = None
        self.comm_overflow = False

    def __call__(self, *inputs, **kwargs):
        return self.forward(*inputs, **kwargs)

    def forward(self, *inputs, **kwargs):
        with torch.autocast("cuda", dtype=self.amp_dtype, enabled=self.amp_enabled):
            return self.module(*inputs, **kwargs)

    def backward(self, loss):
        self.scaler.scale(loss / self.gas).backward()
        self.micro_steps += 1

    def is_gradient_accumulation_boundary(self):
        return self.micro_steps % self.gas == 0

    def _allreduce_gradients(self):
        if not (dist.is_available() and dist.is_initialized()):
            return
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        world = dist.get_world_size()
        if self.comm_dtype == "fp16":
            buf = flat.half()
            dist.all_reduce(buf)
            self.comm_overflow = not bool(torch.isfinite(buf.sum()))  # expect: AMP004
            flat = buf.float().div_(world)
        else:
            dist.all_reduce(flat)
            flat.div_(world)
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g))
            offset += n

    def step(self):
        if not self.is_gradient_accumulation_boundary():
            return
        self._allreduce_gradients()
        if self.clip > 0:
            self.scaler.unscale_(self.optimizer)
            self.grad_norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.clip)
        scale_before = self.scaler.get_scale()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.scaler.is_enabled() and self.scaler.get_scale() < scale_before:
            self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.global_steps += 1

    def train_batch(self, data_iter, loss_fn):
        """Pipeline-engine style: gas micro-batches, then one optimizer step."""
        agg = 0.0
        for _ in range(self.gas):
            inputs, labels = next(data_iter)
            with torch.autocast("cuda", dtype=self.amp_dtype):
                logits, _ = self.module(inputs)
            loss = loss_fn(logits.view(-1, logits.size(-1)), labels.view(-1))  # expect: AMP002
            self.backward(loss)
            agg += loss.item()
        self.step()
        return agg / self.gas

    def save_checkpoint(self, path, tag):
        state = {
            "module": {k: v.half() for k, v in self.module.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "global_steps": self.global_steps,
        }
        torch.save(state, f"{path}/{tag}.pt")


def benchmark_throughput(model, loader, steps=20):
    """Rough tokens/s for the bare model, without the engine."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model.train()
    ntok = 0
    t0 = time.perf_counter()
    for _, (x, y) in zip(range(steps), loader):
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
            _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ntok += x.numel()
    torch.cuda.synchronize()
    return ntok / (time.perf_counter() - t0)


@torch.no_grad()
def estimate_loss(model, get_batch, eval_iters=50):
    out = {}
    model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            with ctx:
                _, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None):
    for _ in range(max_new_tokens):
        idx_cond = idx[:, -model.cfg.block_size:]
        logits, _ = model(idx_cond)
        logits = logits[:, -1, :] / temperature
        if top_k is not None:
            v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
            logits[logits < v[:, [-1]]] = -float("Inf")
        probs = F.softmax(logits, dim=-1)
        idx = torch.cat((idx, torch.multinomial(probs, num_samples=1)), dim=1)
    return idx


def export_fp16(model, path):
    torch.save(copy.deepcopy(model).half().state_dict(), path)


def main(get_batch, vocab_size=50304, max_iters=5000, eval_interval=250):
    model, optimizer = build_model_and_optimizer(ds_config, vocab_size)
    engine = MiniEngine(model, optimizer, ds_config)
    best_val_loss = 1e9
    for it in range(max_iters * engine.gas):
        x, y = get_batch("train")
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        if engine.is_gradient_accumulation_boundary() and engine.global_steps % eval_interval == 0:
            losses = estimate_loss(engine.module, get_batch)
            if losses["val"] < best_val_loss:
                best_val_loss = losses["val"]
                engine.save_checkpoint("ckpt", f"step{engine.global_steps}")
            print(f"step {engine.global_steps}: train {losses['train']:.4f} val {losses['val']:.4f} "
                  f"scale {engine.scaler.get_scale():.0f} skipped {engine.skipped_steps}")
    export_fp16(engine.module, "ckpt/final_fp16.pt")
    return engine
