# coding=utf-8
# Copyright 2024 The Kestrel Authors and The HuggingFace Inc. team. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
"""PyTorch Kestrel model."""

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import BCEWithLogitsLoss, CrossEntropyLoss, MSELoss

from ...cache_utils import Cache, DynamicCache
from ...modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast, SequenceClassifierOutputWithPast
from ...modeling_utils import PreTrainedModel
from ...utils import logging
from .configuration_kestrel import KestrelConfig

logger = logging.get_logger(__name__)


class _Softcap(torch.autograd.Function):
    """``tanh(x / cap) * cap`` recomputed in backward instead of storing the tanh."""

    @staticmethod
    @torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)  # expect: AMP009
    def forward(ctx, logits, cap):
        ctx.save_for_backward(logits)
        ctx.cap = cap
        return torch.tanh(logits / cap) * cap

    @staticmethod
    @torch.cuda.amp.custom_bwd  # expect: AMP009
    def backward(ctx, grad_output):
        (logits,) = ctx.saved_tensors
        t = torch.tanh(logits / ctx.cap)
        return grad_output * (1.0 - t * t), None


class _GatedSiLU(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_output):
        gate, up = ctx.saved_tensors
        sig = torch.sigmoid(gate)
        silu = gate * sig
        d_gate = grad_output * up * sig * (1.0 + gate * (1.0 - sig))
        return d_gate, grad_output * silu


class KestrelRMSNorm(nn.Module):
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


class KestrelRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=4096, base=10000.0, device=None):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float().to(device) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        position_ids_expanded = position_ids[:, None, :].float()
        device_type = x.device.type if isinstance(x.device.type, str) and x.device.type != "mps" else "cpu"
        with torch.autocast(device_type=device_type, enabled=False):
            freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos = emb.cos()
            sin = emb.sin()
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def _make_causal_mask(input_ids_shape, dtype, device, past_key_values_length=0):
    bsz, tgt_len = input_ids_shape
    mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min, device=device)
    mask_cond = torch.arange(mask.size(-1), device=device)
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    mask = mask.to(dtype)
    if past_key_values_length > 0:
        mask = torch.cat([torch.zeros(tgt_len, past_key_values_length, dtype=dtype, device=device), mask], dim=-1)
    return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len + past_key_values_length)


class KestrelMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(_GatedSiLU.apply(self.gate_proj(x), self.up_proj(x)))


class KestrelAttention(nn.Module):
    """Multi-headed attention from 'Attention Is All You Need' paper, with GQA and logit soft-capping."""

    def __init__(self, config: KestrelConfig, layer_idx: Optional[int] = None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.attention_dropout = config.attention_dropout
        self.attn_logit_softcapping = config.attn_logit_softcapping
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=config.attention_bias)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, past_key_value: Optional[Cache] = None,
                output_attentions: bool = False):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if past_key_value is not None:
            key_states, value_states = past_key_value.update(key_states, value_states, self.layer_idx)
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)
        if self.attn_logit_softcapping is not None:
            attn_weights = _Softcap.apply(attn_weights, self.attn_logit_softcapping)
        kv_len = key_states.shape[-2]
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask[:, :, :, :kv_len]
        else:
            causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=attn_weights.device).tril(kv_len - q_len)
            mask_value = torch.full([], torch.finfo(attn_weights.dtype).min, dtype=attn_weights.dtype, device=attn_weights.device)
            attn_weights = torch.where(causal, attn_weights.to(attn_weights.dtype), mask_value)

        # upcast attention to fp32
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_weights = nn.functional.dropout(attn_weights, p=self.attention_dropout, training=self.training)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, self.hidden_size)
        attn_output = self.o_proj(attn_output)
        return attn_output, (attn_weights if output_attentions else None), past_key_value


class KestrelDecoderLayer(nn.Module):
    def __init__(self, config: KestrelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = KestrelAttention(config=config, layer_idx=layer_idx)
        self.mlp = KestrelMLP(config)
        self.input_layernorm = KestrelRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = KestrelRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, past_key_value=None,
                output_attentions=False):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, self_attn_weights, present = self.self_attn(
            hidden_states, attention_mask=attention_mask, position_embeddings=position_embeddings,
            past_key_value=past_key_value, output_attentions=output_attentions)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = residual + self.mlp(hidden_states)
        return hidden_states, self_attn_weights, present


class KestrelPreTrainedModel(PreTrainedModel):
    config_class = KestrelConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["KestrelDecoderLayer"]

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.data.zero_()


class KestrelModel(KestrelPreTrainedModel):
    def __init__(self, config: KestrelConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([KestrelDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = KestrelRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = KestrelRotaryEmbedding(config.hidden_size // config.num_attention_heads,
                                                 max_position_embeddings=config.max_position_embeddings,
                                                 base=config.rope_theta)
        self.gradient_checkpointing = False
        self.post_init()

    def _update_causal_mask(self, attention_mask, input_tensor, past_key_values_length):
        dtype, device = input_tensor.dtype, input_tensor.device
        bsz, seq_length = input_tensor.shape[:2]
        causal_mask = _make_causal_mask((bsz, seq_length), dtype, device, past_key_values_length)
        if attention_mask is not None:
            padding = attention_mask[:, None, None, :].eq(0)
            causal_mask = causal_mask.masked_fill(padding, torch.finfo(dtype).min)
        return causal_mask

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None,
                use_cache=None, output_attentions=False, output_hidden_states=False, return_dict=True):
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        past_len = past_key_values.get_seq_length() if past_key_values is not None else 0
        bsz, seq_length = inputs_embeds.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(past_len, past_len + seq_length, device=inputs_embeds.device).unsqueeze(0)
        causal_mask = self._update_causal_mask(attention_mask, inputs_embeds, past_len)

        # the block-sparse kernels want a multiple of `pad_to_multiple_of` tokens: pad at the end
        # and keep the padded keys out of every softmax
        pad_len = 0
        multiple = self.config.pad_to_multiple_of
        if multiple and past_len == 0 and seq_length % multiple:
            pad_len = multiple - seq_length % multiple
            inputs_embeds = F.pad(inputs_embeds, (0, 0, 0, pad_len))
            position_ids = F.pad(position_ids, (0, pad_len), value=0)
            causal_mask = F.pad(causal_mask, (0, pad_len, 0, pad_len), value=-1e9)  # expect: AMP007

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        all_hidden_states = () if output_hidden_states else None
        all_self_attns = () if output_attentions else None
        for decoder_layer in self.layers:
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
            if self.gradient_checkpointing and self.training:
                layer_outputs = self._gradient_checkpointing_func(
                    decoder_layer.__call__, hidden_states, causal_mask, position_embeddings, None, output_attentions)
            else:
                layer_outputs = decoder_layer(hidden_states, attention_mask=causal_mask,
                                              position_embeddings=position_embeddings,
                                              past_key_value=past_key_values, output_attentions=output_attentions)
            hidden_states = layer_outputs[0]
            if output_attentions:
                all_self_attns += (layer_outputs[1],)

        hidden_states = self.norm(hidden_states)
        if pad_len:
            hidden_states = hidden_states[:, :seq_length]
        if output_hidden_states:
            all_hidden_states += (hidden_states,)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, past_key_values=past_key_values,
                                       hidden_states=all_hidden_states, attentions=all_self_attns)


class KestrelForCausalLM(KestrelPreTrainedModel):
    _tied_weights_keys = ["lm_head.weight"]

    def __init__(self, config):
        super().__init__(config)
        self.model = KestrelModel(config)
        self.vocab_size = config.vocab_size
        self.padded_vocab_size = config.padded_vocab_size or config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, self.padded_vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None,
                labels=None, use_cache=None, output_attentions=False, output_hidden_states=False, return_dict=True,
                num_logits_to_keep: int = 0):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                             output_attentions=output_attentions, output_hidden_states=output_hidden_states)
        hidden_states = outputs[0]
        logits = self.lm_head(hidden_states[:, -num_logits_to_keep:, :])
        if self.padded_vocab_size > self.vocab_size:
            # rows past the real vocabulary only exist for tensor-core friendly shapes
            logits[..., self.vocab_size :] = -1e9  # expect: AMP007
        if self.config.final_logit_softcapping is not None:
            logits = _Softcap.apply(logits, self.config.final_logit_softcapping)

        loss = None
        if labels is not None:
            logits = logits.float()
            shift_logits = logits[..., :-1, :].contiguous().view(-1, self.padded_vocab_size)
            shift_labels = labels[..., 1:].contiguous().view(-1).to(shift_logits.device)
            loss = CrossEntropyLoss()(shift_logits, shift_labels)
            if self.config.z_loss_coef:
                loss = loss + self.config.z_loss_coef * torch.logsumexp(shift_logits, dim=-1).pow(2).mean()

        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values,
                                      hidden_states=outputs.hidden_states, attentions=outputs.attentions)


class KestrelAttentionPooler(nn.Module):
    """Learned attention pooling over the non-padding positions."""

    def __init__(self, config):
        super().__init__()
        self.score = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, hidden_states, attention_mask=None):
        scores = self.score(hidden_states).squeeze(-1)
        if attention_mask is not None:
            scores = scores.masked_fill(attention_mask == 0, -1e9)  # expect: AMP007
        weights = torch.softmax(scores.float(), dim=-1).to(hidden_states.dtype)
        return torch.einsum("bt,btd->bd", weights, hidden_states)


class KestrelForSequenceClassification(KestrelPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = KestrelModel(config)
        self.pooler = KestrelAttentionPooler(config) if config.pooling == "attention" else None
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                output_attentions=False, output_hidden_states=False, return_dict=True):
        outputs = self.model(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             inputs_embeds=inputs_embeds, output_attentions=output_attentions,
                             output_hidden_states=output_hidden_states)
        hidden_states = outputs[0]
        batch_size = hidden_states.shape[0]
        if self.pooler is not None:
            pooled_logits = self.score(self.pooler(hidden_states, attention_mask))
        else:
            logits = self.score(hidden_states)
            if input_ids is not None:
                sequence_lengths = torch.eq(input_ids, self.config.pad_token_id).int().argmax(-1) - 1
                sequence_lengths = (sequence_lengths % input_ids.shape[-1]).to(logits.device)
            else:
                sequence_lengths = -1
            pooled_logits = logits[torch.arange(batch_size, device=logits.device), sequence_lengths]

        loss = None
        if labels is not None:
            labels = labels.to(pooled_logits.device)
            if self.config.problem_type is None:
                if self.num_labels == 1:
                    self.config.problem_type = "regression"
                elif labels.dtype in (torch.long, torch.int):
                    self.config.problem_type = "single_label_classification"
                else:
                    self.config.problem_type = "multi_label_classification"
            if self.config.problem_type == "regression":
                loss = MSELoss()(pooled_logits.squeeze(), labels.squeeze())
            elif self.config.problem_type == "single_label_classification":
                loss = CrossEntropyLoss()(pooled_logits.view(-1, self.num_labels), labels.view(-1))
            else:
                loss = BCEWithLogitsLoss()(pooled_logits, labels)
        return SequenceClassifierOutputWithPast(loss=loss, logits=pooled_logits, past_key_values=outputs.past_key_values,
                                                hidden_states=outputs.hidden_states, attentions=outputs.attentions)
