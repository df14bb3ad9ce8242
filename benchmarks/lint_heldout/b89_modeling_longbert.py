# coding=utf-8
# Copyright 2023 The LongBert Authors and The HuggingFace Inc. team.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
""" PyTorch LongBert model: BERT with sliding-window local attention."""

import math
from typing import Optional, Tuple

import torch
import torch.utils.checkpoint
from torch import nn
from torch.nn import BCEWithLogitsLoss, CrossEntropyLoss, MSELoss


class LongBertConfig:
    model_type = "longbert"

    def __init__(
        self,
        vocab_size=30522,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
        attention_window=128,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        max_position_embeddings=4096,
        layer_norm_eps=1e-12,
        num_labels=2,
        problem_type=None,
        add_cross_attention=False,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.attention_window = attention_window
        self.hidden_dropout_prob = hidden_dropout_prob
        self.attention_probs_dropout_prob = attention_probs_dropout_prob
        self.max_position_embeddings = max_position_embeddings
        self.layer_norm_eps = layer_norm_eps
        self.num_labels = num_labels
        self.problem_type = problem_type
        self.add_cross_attention = add_cross_attention


def get_extended_attention_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    extended_attention_mask = attention_mask[:, None, None, :].to(dtype=dtype)
    return (1.0 - extended_attention_mask) * torch.finfo(dtype).min


class LongBertEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.register_buffer(
            "position_ids", torch.arange(config.max_position_embeddings).expand((1, -1)), persistent=False
        )

    def forward(self, input_ids: torch.LongTensor) -> torch.Tensor:
        seq_length = input_ids.size(1)
        position_ids = self.position_ids[:, :seq_length]
        embeddings = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        embeddings = self.LayerNorm(embeddings)
        return self.dropout(embeddings)


class LongBertLocalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.window = config.attention_window
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def _shape(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq_len, _ = x.size()
        return x.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, hidden_states, attention_mask: Optional[torch.Tensor] = None):
        q = self._shape(self.query(hidden_states)) / math.sqrt(self.head_dim)
        k = self._shape(self.key(hidden_states))
        v = self._shape(self.value(hidden_states))

        attn_scores = torch.matmul(q, k.transpose(-1, -2))
        seq_len = hidden_states.size(1)
        idx = torch.arange(seq_len, device=hidden_states.device)
        window_mask = (idx[None, :] - idx[:, None]).abs() <= self.window
        attn_scores = attn_scores.masked_fill(~window_mask, -1e9)  # expect: AMP007

        if attention_mask is not None:
            attn_scores = attn_scores + attention_mask

        attn_probs = nn.functional.softmax(attn_scores, dim=-1, dtype=torch.float32).to(q.dtype)
        attn_probs = self.dropout(attn_probs)
        context = torch.matmul(attn_probs, v).transpose(1, 2).contiguous()
        return context.view(context.size(0), seq_len, -1), attn_probs


# Copied from transformers.models.bart.modeling_bart.BartAttention with Bart->LongBert, decoder only
class LongBertCrossAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden_states, encoder_hidden_states, encoder_attention_mask=None):
        bsz, tgt_len, embed_dim = hidden_states.size()
        src_len = encoder_hidden_states.size(1)
        q = (self.q_proj(hidden_states) * self.scaling).view(bsz, tgt_len, self.num_heads, self.head_dim)
        k = self.k_proj(encoder_hidden_states).view(bsz, src_len, self.num_heads, self.head_dim)
        v = self.v_proj(encoder_hidden_states).view(bsz, src_len, self.num_heads, self.head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

        attn_weights = torch.matmul(q, k.transpose(-1, -2))
        if encoder_attention_mask is not None:
            attn_weights.masked_fill_(encoder_attention_mask[:, None, None, :] == 0, -1e8)  # expect: AMP007

        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, v).transpose(1, 2).reshape(bsz, tgt_len, embed_dim)
        return self.out_proj(attn_output)


class LongBertDecoderSelfAttention(LongBertCrossAttention):
    def forward(self, hidden_states, causal: bool = True):
        bsz, tgt_len, embed_dim = hidden_states.size()
        q = (self.q_proj(hidden_states) * self.scaling).view(bsz, tgt_len, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(bsz, tgt_len, self.num_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(bsz, tgt_len, self.num_heads, self.head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

        attn_weights = torch.matmul(q, k.transpose(-1, -2))
        if causal:
            future = torch.ones(tgt_len, tgt_len, dtype=torch.bool, device=q.device).triu(1)
            mask_value = -1e8 if attn_weights.dtype == torch.float32 else -1e4
            attn_weights = attn_weights.masked_fill(future, mask_value)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, v).transpose(1, 2).reshape(bsz, tgt_len, embed_dim)
        return self.out_proj(attn_output)


class LongBertPooler(nn.Module):
    """Mean or max pooling over non-padding tokens, as in sentence-transformers."""

    def __init__(self, config, mode: str = "mean"):
        super().__init__()
        self.mode = mode
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, token_embeddings: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        input_mask_expanded = attention_mask.unsqueeze(-1).expand(token_embeddings.size()).float()
        if self.mode == "max":
            token_embeddings = token_embeddings.clone()
            token_embeddings[input_mask_expanded == 0] = -1e9  # expect: AMP007
            pooled = torch.max(token_embeddings, 1)[0]
        else:
            sum_embeddings = torch.sum(token_embeddings * input_mask_expanded, 1)
            sum_mask = torch.clamp(input_mask_expanded.sum(1), min=1e-9)
            pooled = sum_embeddings / sum_mask
        return self.activation(self.dense(pooled))


class LongBertForSequenceClassification(nn.Module):
    def __init__(self, config, encoder: nn.Module):
        super().__init__()
        self.config = config
        self.num_labels = config.num_labels
        self.embeddings = LongBertEmbeddings(config)
        self.encoder = encoder
        self.pooler = LongBertPooler(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
    ) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden_states = self.embeddings(input_ids)
        extended_mask = get_extended_attention_mask(attention_mask, hidden_states.dtype)
        hidden_states = self.encoder(hidden_states, extended_mask)
        pooled_output = self.dropout(self.pooler(hidden_states, attention_mask))
        logits = self.classifier(pooled_output)

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
                loss_fct = MSELoss()
                loss = loss_fct(logits.squeeze(), labels.squeeze())
            elif self.config.problem_type == "single_label_classification":
                loss_fct = CrossEntropyLoss()
                loss = loss_fct(logits.view(-1, self.num_labels), labels.view(-1))
            else:
                loss_fct = BCEWithLogitsLoss()
                loss = loss_fct(logits, labels)
        return loss, logits
