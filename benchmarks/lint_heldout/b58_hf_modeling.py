# coding=utf-8
"""PyTorch TinyRoBERTa-MoE model, the model file used by ``b58_hf_trainer.py``.

Written in the style of ``transformers/models/*/modeling_*.py``: a config class,
embeddings, attention, a mixture-of-experts feed-forward and task heads whose
``forward`` returns the loss (the Trainer reads ``outputs.loss``).
"""
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn import BCEWithLogitsLoss, CrossEntropyLoss, MSELoss
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import ModelOutput


class TinyRobertaMoEConfig(PretrainedConfig):
    model_type = "tiny-roberta-moe"

    def __init__(self, vocab_size=50265, hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
                 intermediate_size=1024, num_experts=4, max_position_embeddings=514, layer_norm_eps=1e-12,
                 rms_norm_eps=1e-6, hidden_dropout_prob=0.1, router_aux_loss_coef=0.01, pad_token_id=1, **kwargs):
        super().__init__(pad_token_id=pad_token_id, **kwargs)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.num_experts = num_experts
        self.max_position_embeddings = max_position_embeddings
        self.layer_norm_eps = layer_norm_eps
        self.rms_norm_eps = rms_norm_eps
        self.hidden_dropout_prob = hidden_dropout_prob
        self.router_aux_loss_coef = router_aux_loss_coef


@dataclass
class MoESequenceClassifierOutput(ModelOutput):
    loss: Optional[torch.FloatTensor] = None
    aux_loss: Optional[torch.FloatTensor] = None
    logits: torch.FloatTensor = None
    hidden_states: Optional[Tuple[torch.FloatTensor, ...]] = None


class TinyRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class TinyRotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        pos = position_ids[:, None, :].float()
        with torch.autocast(device_type=x.device.type, enabled=False):
            freqs = (inv_freq.float() @ pos.float()).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    @torch.cuda.amp.custom_bwd  # expect: AMP009
    def backward(ctx, grad_out):
        gate, up = ctx.saved_tensors
        sig = torch.sigmoid(gate)
        silu = gate * sig
        d_gate = grad_out * up * (sig + silu * (1 - sig))
        return d_gate, grad_out * silu


class TinyRobertaEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids):
        return self.dropout(self.LayerNorm(self.word_embeddings(input_ids)))


class TinyRobertaSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden_states, attention_mask=None, cos_sin=None):
        b, t, _ = hidden_states.shape
        q, k, v = self.qkv(hidden_states).view(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if cos_sin is not None:
            cos, sin = cos_sin
            q = q * cos[:, None] + rotate_half(q) * sin[:, None]
            k = k * cos[:, None] + rotate_half(k) * sin[:, None]
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        if attention_mask is not None:
            scores = scores + attention_mask
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        ctx = torch.matmul(probs, v).transpose(1, 2).reshape(b, t, -1)
        return self.o_proj(ctx)


class TinyRobertaCrossAttention(nn.Module):
    """Copied from an older encoder-decoder port (memory attention over retrieved passages)."""

    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.q = nn.Linear(config.hidden_size, config.hidden_size)
        self.kv = nn.Linear(config.hidden_size, 2 * config.hidden_size)
        self.top_k = getattr(config, "memory_top_k", None)

    def forward(self, hidden_states, memory, memory_mask=None):
        b, t, _ = hidden_states.shape
        q = self.q(hidden_states).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(memory).view(b, memory.size(1), 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        attn_weights = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        if memory_mask is not None:
            attn_weights = attn_weights.masked_fill(memory_mask[:, None, None, :] == 0, -1e9)  # expect: AMP007
        if self.top_k is not None and self.top_k < attn_weights.size(-1):
            kth = attn_weights.topk(self.top_k, dim=-1).values[..., -1:]
            attn_weights = attn_weights.masked_fill(attn_weights < kth, -1e8 if attn_weights.dtype == torch.float32 else -1e4)
        attn = attn_weights.softmax(dim=-1)
        return torch.matmul(attn, v).transpose(1, 2).reshape(b, t, -1)


class TinyMoEBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.w_gate = nn.ModuleList(nn.Linear(config.hidden_size, config.intermediate_size) for _ in range(config.num_experts))
        self.w_up = nn.ModuleList(nn.Linear(config.hidden_size, config.intermediate_size) for _ in range(config.num_experts))
        self.w_down = nn.ModuleList(nn.Linear(config.intermediate_size, config.hidden_size) for _ in range(config.num_experts))

    def forward(self, hidden_states):
        b, t, h = hidden_states.shape
        flat = hidden_states.reshape(-1, h)
        with torch.autocast(device_type="cuda", enabled=False):
            router_logits = self.gate(flat.float())
            probs = torch.softmax(router_logits, dim=-1)
            top_p, top_i = probs.max(dim=-1)
        out = torch.zeros_like(flat)
        for e in range(self.num_experts):
            sel = top_i == e
            if sel.any():
                x = flat[sel]
                y = _SwiGLU.apply(self.w_gate[e](x), self.w_up[e](x))
                out[sel] = (self.w_down[e](y) * top_p[sel, None].to(y.dtype)).to(out.dtype)
        density = F.one_hot(top_i, self.num_experts).float().mean(0)
        aux = self.num_experts * (density * probs.mean(0)).sum()
        z_loss = torch.logsumexp(router_logits, dim=-1).pow(2).mean()
        return out.view(b, t, h), aux + 1e-3 * z_loss


class TinyRobertaLayer(nn.Module):
    def __init__(self, config, with_memory=False):
        super().__init__()
        self.norm1 = TinyRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attn = TinyRobertaSelfAttention(config)
        self.cross = TinyRobertaCrossAttention(config) if with_memory else None
        self.norm2 = TinyRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.moe = TinyMoEBlock(config)

    def forward(self, x, attention_mask=None, cos_sin=None, memory=None, memory_mask=None):
        x = x + self.attn(self.norm1(x), attention_mask, cos_sin)
        if self.cross is not None and memory is not None:
            x = x + self.cross(x, memory, memory_mask)
        y, aux = self.moe(self.norm2(x))
        return x + y, aux


class TinyRobertaPreTrainedModel(PreTrainedModel):
    config_class = TinyRobertaMoEConfig
    base_model_prefix = "roberta"
    supports_gradient_checkpointing = True

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=0.02)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=0.02)
            if module.padding_idx is not None:
                module.weight.data[module.padding_idx].zero_()


class TinyRobertaModel(TinyRobertaPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embeddings = TinyRobertaEmbeddings(config)
        self.rotary = TinyRotaryEmbedding(config.hidden_size // config.num_attention_heads)
        self.layers = nn.ModuleList(TinyRobertaLayer(config, with_memory=(i % 3 == 2)) for i in range(config.num_hidden_layers))
        self.final_norm = TinyRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_init()

    def get_extended_attention_mask(self, attention_mask, dtype):
        extended = attention_mask[:, None, None, :].to(dtype=dtype)
        return (1.0 - extended) * torch.finfo(dtype).min

    def forward(self, input_ids, attention_mask=None, memory=None, memory_mask=None, output_hidden_states=False):
        hidden = self.embeddings(input_ids)
        position_ids = torch.arange(input_ids.size(1), device=input_ids.device)[None].expand_as(input_ids)
        cos_sin = self.rotary(hidden, position_ids)
        ext = None
        if attention_mask is not None:
            ext = self.get_extended_attention_mask(attention_mask, hidden.dtype)
        causal = torch.full((input_ids.size(1), input_ids.size(1)), float("-inf"), device=hidden.device).triu(1)
        if self.config.is_decoder:
            ext = causal.to(hidden.dtype) if ext is None else ext + causal.to(hidden.dtype)
        all_hidden = () if output_hidden_states else None
        aux_total = hidden.new_zeros(())
        for layer in self.layers:
            if output_hidden_states:
                all_hidden = all_hidden + (hidden,)
            hidden, aux = layer(hidden, ext, cos_sin, memory, memory_mask)
            aux_total = aux_total + aux
        hidden = self.final_norm(hidden)
        return hidden, aux_total / len(self.layers), all_hidden


class TinyRobertaForSequenceClassification(TinyRobertaPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.roberta = TinyRobertaModel(config)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids, attention_mask=None, labels=None, memory=None, memory_mask=None,
                output_hidden_states=False, output_router_logits=False):
        hidden, aux_loss, all_hidden = self.roberta(input_ids, attention_mask, memory, memory_mask, output_hidden_states)
        if attention_mask is not None:
            m = attention_mask[..., None].to(hidden.dtype)
            pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1.0)
        else:
            pooled = hidden.mean(dim=1)
        logits = self.out_proj(torch.tanh(self.dense(pooled)))

        loss = None
        if labels is not None:
            if self.config.problem_type is None:
                if self.num_labels == 1:
                    self.config.problem_type = "regression"
                elif labels.dtype in (torch.long, torch.int):
                    self.config.problem_type = "single_label_classification"
                else:
                    self.config.problem_type = "multi_label_classification"
            if self.config.problem_type == "regression":
                loss = MSELoss()(logits.squeeze(-1).float(), labels.float())
            elif self.config.problem_type == "single_label_classification":
                loss = CrossEntropyLoss()(logits.view(-1, self.num_labels), labels.view(-1))
            else:
                loss = BCEWithLogitsLoss()(logits, labels.to(logits.dtype))
            loss = loss + self.config.router_aux_loss_coef * aux_loss
        return MoESequenceClassifierOutput(loss=loss, aux_loss=aux_loss, logits=logits, hidden_states=all_hidden)

    def half_state_dict(self):
        return {k: v.half() for k, v in self.state_dict().items()}

    @torch.inference_mode()
    def predict_scores(self, input_ids, attention_mask=None):
        logits = self(input_ids, attention_mask).logits
        probs = torch.sigmoid(logits.float())
        return torch.log(probs + 1e-8) - torch.log1p(-probs + 1e-8)
