"""modeling_tiny_llm.py - a small decoder-only LM in the Hugging Face layout."""
import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput


class TinyConfig(PretrainedConfig):
    model_type = "tiny_llm"

    def __init__(self, vocab_size=32000, hidden_size=768, num_layers=12, num_heads=12, max_len=2048, **kw):
        super().__init__(**kw)
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.num_layers, self.num_heads, self.max_len = num_layers, num_heads, max_len


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def build_causal_bias(seq_len: int, dtype: torch.dtype, device) -> torch.Tensor:
    bias = torch.full((seq_len, seq_len), -1e9, dtype=dtype, device=device)  # expect: AMP007
    return torch.triu(bias, diagonal=1)


class Attention(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.h, self.d = cfg.num_heads, cfg.hidden_size // cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=False)
        self.o = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, self.d).permute(2, 0, 3, 1, 4)
        w = (q @ k.transpose(-1, -2)) / math.sqrt(self.d)
        w = w + build_causal_bias(n, w.dtype, w.device)
        if attention_mask is not None:
            w.masked_fill_(attention_mask[:, None, None, :] == 0, -1e9)  # expect: AMP007
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        return self.o((w @ v).transpose(1, 2).reshape(b, n, -1))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n1, self.n2 = RMSNorm(cfg.hidden_size), RMSNorm(cfg.hidden_size)
        self.attn = Attention(cfg)
        self.mlp = nn.Sequential(nn.Linear(cfg.hidden_size, 4 * cfg.hidden_size), nn.GELU(), nn.Linear(4 * cfg.hidden_size, cfg.hidden_size))

    def forward(self, x, mask=None):
        x = x + self.attn(self.n1(x), mask)
        return x + self.mlp(self.n2(x))


class TinyLLM(PreTrainedModel):
    config_class = TinyConfig

    def __init__(self, cfg: TinyConfig):
        super().__init__(cfg)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask=None, labels=None, banned_token_ids: Optional[Tuple[int, ...]] = None):
        h = self.embed(input_ids)
        for blk in self.blocks:
            h = blk(h, attention_mask)
        logits = self.lm_head(self.norm(h))
        if banned_token_ids:
            logits[..., list(banned_token_ids)] = -1e9  # expect: AMP007
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)

    @torch.no_grad()
    def generate_greedy(self, input_ids, max_new_tokens=32, eos_token_id=2):
        for _ in range(max_new_tokens):
            logits = self(input_ids).logits[:, -1].float()
            logits[:, self.config.vocab_size - 1] = -1e9
            nxt = logits.argmax(-1, keepdim=True)
            input_ids = torch.cat([input_ids, nxt], dim=1)
            if (nxt == eos_token_id).all():
                break
        return input_ids
