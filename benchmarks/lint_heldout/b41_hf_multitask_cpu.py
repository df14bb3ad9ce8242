"""Pre-LN text encoder with per-task heads, written in the transformers layout; trained on CPU in bf16."""
import math
from dataclasses import dataclass, fields
from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F


class MTConfig:
    model_type = "mt-encoder"

    def __init__(self, vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=6,
                 intermediate_size=1536, hidden_dropout_prob=0.1, max_position_embeddings=512,
                 layer_norm_eps=1e-12, initializer_range=0.02, task_labels=None, pooling="avg"):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.hidden_dropout_prob = hidden_dropout_prob
        self.max_position_embeddings = max_position_embeddings
        self.layer_norm_eps = layer_norm_eps
        self.initializer_range = initializer_range
        self.task_labels = task_labels or {"sentiment": 3, "ner": 9, "sts": 1}
        self.pooling = pooling


class ModelOutput:
    def to_tuple(self) -> Tuple:
        return tuple(getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None)


@dataclass
class EncoderOutput(ModelOutput):
    last_hidden_state: torch.FloatTensor = None
    pooler_output: Optional[torch.FloatTensor] = None


@dataclass
class MultiTaskOutput(ModelOutput):
    loss: Optional[torch.FloatTensor] = None
    logits: Optional[Dict[str, torch.FloatTensor]] = None
    sentence_embedding: Optional[torch.FloatTensor] = None
    pooler_output: Optional[torch.FloatTensor] = None


class MTEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=0)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.register_buffer("position_ids", torch.arange(config.max_position_embeddings).expand((1, -1)), persistent=False)

    def forward(self, input_ids):
        position_ids = self.position_ids[:, : input_ids.size(1)]
        return self.dropout(self.word_embeddings(input_ids) + self.position_embeddings(position_ids))


class MTSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def _split(self, x):
        return x.view(x.size(0), x.size(1), self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, hidden_states, extended_attention_mask):
        q, k, v = self._split(self.query(hidden_states)), self._split(self.key(hidden_states)), self._split(self.value(hidden_states))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        scores = scores + extended_attention_mask
        probs = self.dropout(F.softmax(scores, dim=-1))
        context = torch.matmul(probs, v).transpose(1, 2).flatten(2)
        return self.dense(context)


class MTLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention = MTSelfAttention(config)
        self.ln_ffn = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.ffn = nn.Sequential(nn.Linear(config.hidden_size, config.intermediate_size), nn.GELU(),
                                 nn.Linear(config.intermediate_size, config.hidden_size))
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, extended_attention_mask):
        hidden_states = hidden_states + self.dropout(self.attention(self.ln_attn(hidden_states), extended_attention_mask))
        return hidden_states + self.dropout(self.ffn(self.ln_ffn(hidden_states)))


class MTEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer = nn.ModuleList([MTLayer(config) for _ in range(config.num_hidden_layers)])
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, extended_attention_mask):
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, extended_attention_mask)
        return self.final_layer_norm(hidden_states)


class MTPreTrainedModel(nn.Module):
    config_class = MTConfig
    base_model_prefix = "mt"

    def __init__(self, config):
        super().__init__()
        self.config = config

    @property
    def dtype(self):
        return next(self.parameters()).dtype

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=self.config.initializer_range)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=self.config.initializer_range)
            if module.padding_idx is not None:
                module.weight.data[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            module.bias.data.zero_()
            module.weight.data.fill_(1.0)

    def post_init(self):
        self.apply(self._init_weights)

    def get_extended_attention_mask(self, attention_mask, dtype=None):
        dtype = dtype or self.dtype
        extended = attention_mask[:, None, None, :].to(dtype=dtype)
        return (1.0 - extended) * torch.finfo(dtype).min


class MTModel(MTPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embeddings = MTEmbeddings(config)
        self.encoder = MTEncoder(config)
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size)
        self.post_init()

    def forward(self, input_ids, attention_mask=None):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        ext = self.get_extended_attention_mask(attention_mask)
        sequence_output = self.encoder(self.embeddings(input_ids), ext)
        pooled_output = torch.tanh(self.pooler(sequence_output[:, 0]))
        return EncoderOutput(last_hidden_state=sequence_output, pooler_output=pooled_output)


class ClassificationHead(nn.Module):
    def __init__(self, config, num_labels):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.out_proj = nn.Linear(config.hidden_size, num_labels)

    def forward(self, features, attention_mask):
        x = self.dropout(torch.tanh(self.dense(self.dropout(features[:, 0, :]))))
        return self.out_proj(x)


class TokenClassificationHead(nn.Module):
    def __init__(self, config, num_labels):
        super().__init__()
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, num_labels)

    def forward(self, features, attention_mask):
        return self.classifier(self.dropout(features))


class AttentionPoolRegressionHead(nn.Module):
    def __init__(self, config, num_labels=1):
        super().__init__()
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.score = nn.Linear(config.hidden_size, 1)
        self.out = nn.Linear(config.hidden_size, num_labels)

    def forward(self, features, attention_mask):
        h = torch.tanh(self.proj(features))
        scores = self.score(h).squeeze(-1)
        scores = scores.masked_fill(attention_mask == 0, torch.finfo(scores.dtype).min)
        weights = scores.softmax(dim=-1)
        pooled = (weights.unsqueeze(-1) * h).sum(dim=1)  # expect: AMP004
        return self.out(pooled).squeeze(-1)


class MTForMultiTask(MTPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.mt = MTModel(config)
        n = config.task_labels
        self.heads = nn.ModuleDict({
            "sentiment": ClassificationHead(config, n["sentiment"]),
            "ner": TokenClassificationHead(config, n["ner"]),
            "sts": AttentionPoolRegressionHead(config, n["sts"]),
        })
        self.post_init()

    def forward(self, input_ids, attention_mask=None, labels: Optional[Dict[str, torch.Tensor]] = None, task=None):
        outputs = self.mt(input_ids, attention_mask=attention_mask)
        sequence_output = outputs.last_hidden_state
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)

        logits = {}
        for name, head in self.heads.items():
            if task is None or name == task:
                logits[name] = head(sequence_output, attention_mask)

        mask = attention_mask.unsqueeze(-1).to(sequence_output.dtype)
        summed = (sequence_output * mask).sum(dim=1)  # fp32: the residual stream of fp32 embeddings stays fp32 (label removed)
        denom = attention_mask.sum(dim=1, keepdim=True).clamp(min=1)
        sentence_embedding = summed / denom

        loss = None
        if labels is not None:
            losses = []
            if "sentiment" in labels and "sentiment" in logits:
                losses.append(F.cross_entropy(logits["sentiment"], labels["sentiment"]))
            if "ner" in labels and "ner" in logits:
                losses.append(F.cross_entropy(logits["ner"].flatten(0, 1), labels["ner"].flatten(), ignore_index=-100))
            if "sts" in labels and "sts" in logits:
                losses.append(F.mse_loss(logits["sts"], labels["sts"].to(logits["sts"].dtype)))
            loss = sum(losses)
        return MultiTaskOutput(loss=loss, logits=logits, sentence_embedding=sentence_embedding,
                               pooler_output=outputs.pooler_output)


def train(args, loader):
    torch.manual_seed(args.seed)
    config = MTConfig(num_hidden_layers=args.layers, pooling="avg")
    model = MTForMultiTask(config)
    model = torch.compile(model) if args.compile else model
    no_decay = ("bias", "LayerNorm.weight", "layer_norm", "ln_")
    grouped = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(grouped, lr=args.lr, eps=1e-8)
    scaler = torch.amp.GradScaler("cpu", enabled=args.amp)  # expect: AMP010
    model.train()
    for step, batch in enumerate(loader):
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16, enabled=args.amp):
            out = model(**batch)
            loss = out.loss
            # representation-collapse guard on the pooled [CLS] vector
            pooled_std = out.pooler_output.std(dim=0).mean()  # expect: AMP004
            if args.collapse_weight > 0:
                loss = loss + args.collapse_weight * F.relu(args.min_std - pooled_std)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if step % args.logging_steps == 0:
            print(f"step {step} loss {loss.item():.4f} pooled_std {pooled_std.item():.3f}")
    return model


@torch.inference_mode()
def evaluate_sts(model, loader):
    model.eval()
    preds, golds = [], []
    for batch in loader:
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            out = model(batch["input_ids"], batch["attention_mask"], task="sts")
        preds.append(out.logits["sts"].float())
        golds.append(batch["labels"]["sts"].float())
        spread = out.sentence_embedding.std(dim=0).mean()
    p, g = torch.cat(preds), torch.cat(golds)
    p, g = p - p.mean(), g - g.mean()
    return float((p * g).sum() / (p.norm() * g.norm() + 1e-8)), float(spread)
