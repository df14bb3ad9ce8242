# coding=utf-8
# Copyright 2024 The TinyLM Authors. Licensed under the Apache License, Version 2.0.
"""PyTorch TinyLlama-style causal language model (HF ``modeling_*.py`` layout), with a
minimal pretraining script: fp32 RMSNorm, rotary embeddings, GQA, upcast logits."""

import argparse
import copy
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class TinyLlamaConfig:
    vocab_size: int = 32000
    hidden_size: int = 768
    intermediate_size: int = 2048
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_key_value_heads: int = 4
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    z_loss_weight: float = 1e-4
    pad_token_id: int = 0


class TinyLlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(torch.ones(hidden_size)), eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class TinyLlamaRotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        position_ids_expanded = position_ids[:, None, :].float()
        device_type = x.device.type if x.device.type != "mps" else "cpu"
        with torch.autocast(device_type=device_type, enabled=False):
            freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos = emb.cos()
            sin = emb.sin()
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class TinyLlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TinyLlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        self.attention_dropout = config.attention_dropout
        kv_dim = config.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv_dim, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, document_ids=None):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        key_states = key_states.repeat_interleave(self.num_key_value_groups, dim=1)
        value_states = value_states.repeat_interleave(self.num_key_value_groups, dim=1)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        if document_ids is not None:
            # packed sequences: a token may only attend to tokens of its own document
            cross_doc = document_ids[:, None, :, None] != document_ids[:, None, None, :]
            attn_weights = attn_weights.masked_fill(cross_doc, -1e9)  # expect: AMP007
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]

        # upcast attention to fp32
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_weights = F.dropout(attn_weights, p=self.attention_dropout, training=self.training)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(attn_output)


class TinyLlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = TinyLlamaAttention(config, layer_idx)
        self.mlp = TinyLlamaMLP(config)
        self.input_layernorm = TinyLlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = TinyLlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, document_ids=None):
        attn_in = self.input_layernorm(hidden_states)
        hidden_states = hidden_states + self.self_attn(attn_in, position_embeddings, attention_mask, document_ids)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class TinyLlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([TinyLlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = TinyLlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        head_dim = config.hidden_size // config.num_attention_heads
        self.rotary_emb = TinyLlamaRotaryEmbedding(head_dim, base=config.rope_theta)

    def _update_causal_mask(self, attention_mask, input_tensor):
        dtype, device = input_tensor.dtype, input_tensor.device
        seq_len = input_tensor.shape[1]
        min_dtype = torch.finfo(dtype).min
        causal_mask = torch.full((seq_len, seq_len), fill_value=min_dtype, dtype=dtype, device=device)
        causal_mask = torch.triu(causal_mask, diagonal=1)
        causal_mask = causal_mask[None, None, :, :].expand(input_tensor.shape[0], 1, -1, -1).clone()
        if attention_mask is not None:
            padding_mask = attention_mask[:, None, None, :] == 0
            causal_mask = causal_mask.masked_fill(padding_mask, min_dtype)
        return causal_mask

    def forward(self, input_ids, attention_mask=None, document_ids=None):
        inputs_embeds = self.embed_tokens(input_ids)
        if attention_mask is not None:
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids = position_ids.masked_fill(attention_mask == 0, 1)
        else:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand_as(input_ids)
        causal_mask = self._update_causal_mask(attention_mask, inputs_embeds)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        hidden_states = inputs_embeds
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, position_embeddings, causal_mask, document_ids)
        return self.norm(hidden_states)


class TinyLlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = TinyLlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.data.normal_(mean=0.0, std=config.initializer_range)

    def forward(self, input_ids, attention_mask=None, labels=None, document_ids=None):
        hidden_states = self.model(input_ids, attention_mask, document_ids)
        logits = self.lm_head(hidden_states).float()
        loss = None
        if labels is not None:
            shift_logits = logits[..., :-1, :].contiguous()
            shift_labels = labels[..., 1:].contiguous()
            loss = F.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1), ignore_index=-100)
            if self.config.z_loss_weight > 0:
                log_z = torch.logsumexp(shift_logits, dim=-1)
                valid = (shift_labels != -100).float()
                z_loss = (log_z.pow(2) * valid).sum() / valid.sum().clamp(min=1.0)
                loss = loss + self.config.z_loss_weight * z_loss
        return {"loss": loss, "logits": logits}

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens, temperature=1.0, top_k=None, ban_pad=True):
        for _ in range(max_new_tokens):
            idx_cond = input_ids[:, -self.config.max_position_embeddings :]
            logits = self(idx_cond)["logits"][:, -1, :].float() / temperature
            if ban_pad:
                logits[:, self.config.pad_token_id] = -1e9
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("Inf")
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1)
            input_ids = torch.cat((input_ids, idx_next), dim=1)
        return input_ids


# ----------------------------------------------------------------------------- training


def get_batch(data, block_size, batch_size, device):
    ix = torch.randint(len(data) - block_size - 1, (batch_size,)).tolist()
    x = torch.stack([torch.from_numpy(data[i : i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + block_size].astype(np.int64)) for i in ix])
    return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)


@torch.no_grad()
def estimate_loss(model, splits, amp_ctx, args):
    out = {}
    model.eval()
    for split, data in splits.items():
        losses = torch.zeros(args.eval_iters)
        for k in range(args.eval_iters):
            X, Y = get_batch(data, args.block_size, args.batch_size, args.device)
            with amp_ctx:
                losses[k] = model(X, labels=Y)["loss"].item()
        out[split] = losses.mean().item()
    model.train()
    return out


def configure_optimizer(model, weight_decay, learning_rate, betas):
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, eps=1e-8, fused=torch.cuda.is_available())


def get_lr(it, args):
    warm = args.learning_rate * (it + 1) / (args.warmup_iters + 1)
    ratio = min(1.0, (it - args.warmup_iters) / max(1, args.max_iters - args.warmup_iters))
    return warm if it < args.warmup_iters else args.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.learning_rate - args.min_lr)


def save_checkpoint(model, optimizer, it, best_val_loss, out_dir, half_weights=True):
    raw = model._orig_mod if hasattr(model, "_orig_mod") else model
    state = raw.state_dict()
    if half_weights:
        state = {k: v.half() if v.is_floating_point() else v for k, v in state.items()}
    ckpt = {"model": state, "optimizer": optimizer.state_dict(), "iter_num": it, "best_val_loss": best_val_loss}
    torch.save(ckpt, os.path.join(out_dir, "ckpt.pt"))


def export_for_inference(model, path):
    serving = copy.deepcopy(model).half().eval()
    torch.save(serving.state_dict(), path)


def benchmark_throughput(model, optimizer, scaler, batch, n_iters=20):
    """Rough tokens/s of a full step; used by ``--benchmark``, not during training."""
    t0 = time.perf_counter()
    for _ in range(n_iters):
        with torch.cuda.amp.autocast(dtype=torch.float16):  # expect: AMP009
            loss = model(batch, labels=batch)["loss"]
            scaler.scale(loss).backward()  # expect: AMP008
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return n_iters * batch.numel() / (dt + 1e-8)


def parse_args():
    p = argparse.ArgumentParser()
    for flag in ("--amp", "--compile", "--benchmark"):
        p.add_argument(flag, action="store_true")
    defaults = dict(data="data/train.bin", out_dir="out", batch_size=16, block_size=1024, grad_accum=4,
                    max_iters=20000, warmup_iters=1000, eval_interval=500, eval_iters=100,
                    learning_rate=6e-4, min_lr=6e-5, grad_clip=1.0, device="cuda")
    for name, value in defaults.items():
        p.add_argument(f"--{name}", type=type(value), default=value)
    return p.parse_args()


def main():
    args = parse_args()
    use_amp = args.amp and torch.cuda.is_available()
    amp_ctx = torch.amp.autocast(device_type="cuda", dtype=torch.float16) if use_amp else nullcontext()
    scaler = torch.amp.GradScaler("cuda", enabled=use_amp)
    data = np.memmap(args.data, dtype=np.uint16, mode="r")
    n = int(0.98 * len(data))
    splits = {"train": data[:n], "val": data[n:]}

    model = TinyLlamaForCausalLM(TinyLlamaConfig()).to(args.device)
    optimizer = configure_optimizer(model, 0.1, args.learning_rate, (0.9, 0.95))
    if args.compile:
        model = torch.compile(model)
    if args.benchmark:
        X, _ = get_batch(splits["train"], args.block_size, args.batch_size, args.device)
        print(f"{benchmark_throughput(model, optimizer, scaler, X):.0f} tok/s")
        return
    best_val_loss = 1e9
    X, Y = get_batch(splits["train"], args.block_size, args.batch_size, args.device)
    for it in range(args.max_iters):
        lr = get_lr(it, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if it % args.eval_interval == 0:
            losses = estimate_loss(model, splits, amp_ctx, args)
            if losses["val"] < best_val_loss:
                best_val_loss = losses["val"]
                save_checkpoint(model, optimizer, it, best_val_loss, args.out_dir)
        for _ in range(args.grad_accum):
            with amp_ctx:
                loss = model(X, labels=Y)["loss"]
                loss = loss / args.grad_accum
            X, Y = get_batch(splits["train"], args.block_size, args.batch_size, args.device)
            scaler.scale(loss).backward()
        if args.grad_clip > 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    export_for_inference(model._orig_mod if args.compile else model, os.path.join(args.out_dir, "model_fp16.pt"))


if __name__ == "__main__":
    main()
