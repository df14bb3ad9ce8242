"""Transformer LM with local (windowed) attention layers and a fairseq-like trainer."""
import logging
import math
from typing import Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

logger = logging.getLogger(__name__)


def fill_with_neg_inf(t):
    """FP16-compatible function that fills a tensor with -inf."""
    return t.float().fill_(float("-inf")).type_as(t)


def utils_softmax(x, dim: int):
    return F.softmax(x, dim=dim, dtype=torch.float32)


class Fp32LayerNorm(nn.LayerNorm):
    def forward(self, input):
        output = F.layer_norm(input.float(), self.normalized_shape, self.weight.float(), self.bias.float(), self.eps)
        return output.type_as(input)


class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, window: Optional[int] = None, dropout=0.0):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.window = window
        self.dropout = dropout
        self.in_proj = nn.Linear(embed_dim, 3 * embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x: Tensor, attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor], segment_ids: Optional[Tensor] = None):
        tgt_len, bsz, _ = x.size()
        q, k, v = self.in_proj(x).chunk(3, dim=-1)
        q = (q * self.scaling).contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        if attn_mask is not None:
            attn_weights += attn_mask.unsqueeze(0)
        if self.window is not None:
            pos = torch.arange(tgt_len, device=x.device)
            outside_window = (pos[None, :] - pos[:, None]).abs() > self.window
            attn_weights.masked_fill_(outside_window.unsqueeze(0), -1e8)  # expect: AMP007
        if segment_ids is not None:
            # packed sequences: forbid attention across document boundaries
            cross = (segment_ids.unsqueeze(2) != segment_ids.unsqueeze(1)).repeat_interleave(self.num_heads, dim=0)
            attn_weights = torch.where(cross, torch.tensor(-1e9, device=attn_weights.device), attn_weights)  # expect: AMP007
        if key_padding_mask is not None:
            min_val = -1e8 if attn_weights.dtype == torch.float32 else -1e4
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, -1)
            attn_weights = attn_weights.masked_fill(key_padding_mask[:, None, None, :].to(torch.bool), min_val)
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, -1)
        attn_probs = utils_softmax(attn_weights, dim=-1).type_as(attn_weights)
        attn_probs = F.dropout(attn_probs, p=self.dropout, training=self.training)
        attn = torch.bmm(attn_probs, v).transpose(0, 1).contiguous().view(tgt_len, bsz, self.embed_dim)
        return self.out_proj(attn)


class DecoderLayer(nn.Module):
    def __init__(self, dim, heads, ffn_dim, window=None):
        super().__init__()
        self.self_attn = MultiheadAttention(dim, heads, window=window)
        self.attn_ln = Fp32LayerNorm(dim)
        self.fc1 = nn.Linear(dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, dim)
        self.ffn_ln = Fp32LayerNorm(dim)

    def forward(self, x, attn_mask, key_padding_mask, segment_ids=None):
        x = x + self.self_attn(self.attn_ln(x), attn_mask, key_padding_mask, segment_ids)
        return x + self.fc2(F.gelu(self.fc1(self.ffn_ln(x))))


class LocalTransformerLM(nn.Module):
    def __init__(self, vocab, dim=768, heads=12, layers=12, ffn_dim=3072, window=256, padding_idx=1):
        super().__init__()
        self.padding_idx = padding_idx
        self.embed_tokens = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        # every other layer is local
        self.layers = nn.ModuleList([DecoderLayer(dim, heads, ffn_dim, window if i % 2 else None) for i in range(layers)])
        self.ln = Fp32LayerNorm(dim)
        self._future_mask = torch.empty(0)

    def buffered_future_mask(self, tensor):
        dim = tensor.size(0)
        if self._future_mask.size(0) < dim or self._future_mask.device != tensor.device:
            self._future_mask = torch.triu(fill_with_neg_inf(torch.zeros([dim, dim])), 1).to(tensor)
        return self._future_mask[:dim, :dim]

    def forward(self, src_tokens, segment_ids=None):
        x = self.embed_tokens(src_tokens).transpose(0, 1)
        pad = src_tokens.eq(self.padding_idx)
        mask = self.buffered_future_mask(x)
        for layer in self.layers:
            x = layer(x, mask, pad if pad.any() else None, segment_ids)
        return F.linear(self.ln(x).transpose(0, 1), self.embed_tokens.weight)


def label_smoothed_nll_loss(lprobs, target, epsilon, ignore_index):
    nll_loss = -lprobs.gather(dim=-1, index=target.unsqueeze(-1)).squeeze(-1)
    smooth_loss = -lprobs.sum(dim=-1)
    pad = target.eq(ignore_index)
    nll_loss, smooth_loss = nll_loss.masked_fill(pad, 0.0).sum(), smooth_loss.masked_fill(pad, 0.0).sum()
    eps_i = epsilon / (lprobs.size(-1) - 1)
    return (1.0 - epsilon - eps_i) * nll_loss + eps_i * smooth_loss, nll_loss


class LabelSmoothedCrossEntropyCriterion(nn.Module):
    def __init__(self, padding_idx, eps=0.1):
        super().__init__()
        self.padding_idx = padding_idx
        self.eps = eps

    def forward(self, model, sample):
        net_output = model(sample["net_input"]["src_tokens"], sample["net_input"].get("segment_ids"))
        lprobs = F.log_softmax(net_output.float(), dim=-1)
        loss, nll_loss = label_smoothed_nll_loss(lprobs.view(-1, lprobs.size(-1)), sample["target"].view(-1), self.eps, self.padding_idx)
        return loss, sample["ntokens"], {"loss": loss.detach(), "nll_loss": nll_loss.detach(), "ntokens": sample["ntokens"]}


class LMTrainer:
    def __init__(self, cfg, model, criterion, optimizer, lr_scheduler):
        self.cfg = cfg
        self.model = model.cuda()
        self.criterion = criterion
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.use_amp = cfg.fp16 or cfg.bf16
        self.amp_dtype = torch.bfloat16 if cfg.bf16 else torch.float16
        try:
            self.scaler = torch.amp.GradScaler("cuda", init_scale=cfg.fp16_init_scale, enabled=cfg.fp16)
        except (AttributeError, TypeError):  # torch < 2.3
            self.scaler = torch.cuda.amp.GradScaler(init_scale=cfg.fp16_init_scale, enabled=cfg.fp16)
        self.num_updates = 0

    def _autocast(self):
        return torch.autocast("cuda", dtype=self.amp_dtype, enabled=self.use_amp)

    def train_step(self, samples: List[Dict]):
        self.model.train()
        self.optimizer.zero_grad()
        logging_outputs, sample_size = [], 0
        for sample in samples:
            with self._autocast():
                loss, sample_size_i, logging_output = self.criterion(self.model, sample)
                torch.autograd.backward(self.scaler.scale(loss))  # expect: AMP008
            logging_outputs.append(logging_output)
            sample_size += sample_size_i
        self.scaler.unscale_(self.optimizer)
        self.multiply_grads(1.0 / max(sample_size, 1))
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip_norm)
        if not torch.isfinite(grad_norm):
            logger.warning("non-finite grad norm (%s); the scaler will skip this update", grad_norm)
        self._take_step()
        self.num_updates += 1
        self.lr_scheduler.step_update(self.num_updates)
        return {"loss": sum(lo["loss"] for lo in logging_outputs).item() / max(sample_size, 1), "gnorm": grad_norm.item()}

    def multiply_grads(self, c):
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.data.mul_(c)

    def _take_step(self):
        self.scaler.step(self.optimizer)  # expect: AMP006
        self.optimizer.zero_grad(set_to_none=True)
