"""BERT pretraining: masked LM with a decoder tied to the word embeddings + sentence-order
prediction, written nanoGPT-style in one file. Override config with --key=value.

Mixed precision: dtype comes from the config string; the scaler is only active for fp16
(the old torch.cuda.amp.GradScaler spelling is kept for the cluster's torch 1.13 image).
"""
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

PAD_ID, CLS_ID, SEP_ID, MASK_ID = 0, 101, 102, 103


@dataclass
class TrainConfig:
    vocab_size: int = 30522
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    max_position: int = 512
    type_vocab_size: int = 2
    dropout: float = 0.1
    block_size: int = 128
    batch_size: int = 32
    grad_accum: int = 8
    learning_rate: float = 1e-4
    min_lr: float = 1e-5
    max_iters: int = 100000
    warmup_iters: int = 10000
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    mlm_prob: float = 0.15
    sop_weight: float = 1.0
    eval_interval: int = 2000
    eval_iters: int = 50
    log_interval: int = 10
    out_dir: str = "out-bert"
    device: str = "cuda"
    dtype: str = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float16"
    compile: bool = False


def mask_tokens(inputs, attention_mask, cfg):
    labels = inputs.clone()
    prob = torch.full(labels.shape, cfg.mlm_prob)
    prob.masked_fill_(attention_mask == 0, 0.0)
    prob[:, 0] = 0.0
    masked = torch.bernoulli(prob).bool()
    labels[~masked] = -100
    replaced = torch.bernoulli(torch.full(labels.shape, 0.8)).bool() & masked
    inputs[replaced] = MASK_ID
    random_words = torch.bernoulli(torch.full(labels.shape, 0.5)).bool() & masked & ~replaced
    inputs[random_words] = torch.randint(cfg.vocab_size, labels.shape)[random_words]
    return inputs, labels


def get_batch(cfg, split):
    """Stub for the pre-tokenised shards: two segments per row, random lengths."""
    B, T = cfg.batch_size, cfg.block_size
    ids = torch.randint(1000, cfg.vocab_size, (B, T))
    ids[:, 0], ids[:, T // 2] = CLS_ID, SEP_ID
    token_type_ids = torch.zeros_like(ids)
    token_type_ids[:, T // 2 + 1 :] = 1
    lengths = torch.randint(T // 2 + 2, T + 1, (B,))
    attention_mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    ids[attention_mask == 0] = PAD_ID
    sop_labels = torch.randint(0, 2, (B,))
    input_ids, mlm_labels = mask_tokens(ids, attention_mask, cfg)
    tensors = (input_ids, token_type_ids, attention_mask, mlm_labels, sop_labels)
    if "cuda" in cfg.device:
        return tuple(t.pin_memory().to(cfg.device, non_blocking=True) for t in tensors)
    return tuple(t.to(cfg.device) for t in tensors)


class BertEmbeddings(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.n_embd, padding_idx=PAD_ID)
        self.position_embeddings = nn.Embedding(cfg.max_position, cfg.n_embd)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.n_embd)
        self.LayerNorm = nn.LayerNorm(cfg.n_embd, eps=1e-12)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, input_ids, token_type_ids):
        pos = torch.arange(input_ids.size(1), device=input_ids.device)[None]
        x = self.word_embeddings(input_ids) + self.position_embeddings(pos) + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.LayerNorm(x))


class BertSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head = cfg.n_head
        self.query = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.key = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.value = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.attn_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, attention_mask):
        B, T, C = x.size()
        q = self.query(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = self.key(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = self.value(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        scores = scores.masked_fill(attention_mask[:, None, None, :] == 0, -1e9)  # expect: AMP007
        probs = self.attn_dropout(F.softmax(scores, dim=-1))
        return (probs @ v).transpose(1, 2).contiguous().view(B, T, C)


class BertLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C = cfg.n_embd
        self.attention = BertSelfAttention(cfg)
        self.attn_out = nn.Linear(C, C)
        self.attn_ln = nn.LayerNorm(C, eps=1e-12)
        self.intermediate = nn.Linear(C, 4 * C)
        self.output = nn.Linear(4 * C, C)
        self.out_ln = nn.LayerNorm(C, eps=1e-12)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, attention_mask):
        x = self.attn_ln(x + self.dropout(self.attn_out(self.attention(x, attention_mask))))
        return self.out_ln(x + self.dropout(self.output(F.gelu(self.intermediate(x)))))


class BertForPreTraining(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C = cfg.n_embd
        self.embeddings = BertEmbeddings(cfg)
        self.layers = nn.ModuleList([BertLayer(cfg) for _ in range(cfg.n_layer)])
        self.pooler = nn.Linear(C, C)
        self.transform = nn.Linear(C, C)
        self.transform_ln = nn.LayerNorm(C, eps=1e-12)
        self.decoder = nn.Linear(C, cfg.vocab_size, bias=False)
        self.decoder.weight = self.embeddings.word_embeddings.weight
        self.decoder.bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        self.sop_head = nn.Linear(C, 1)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids, token_type_ids, attention_mask):
        x = self.embeddings(input_ids, token_type_ids)
        for layer in self.layers:
            x = layer(x, attention_mask)
        pooled = torch.tanh(self.pooler(x[:, 0]))
        mlm_logits = self.decoder(self.transform_ln(F.gelu(self.transform(x))))
        mlm_logits[..., PAD_ID] = torch.finfo(mlm_logits.dtype).min
        return mlm_logits, self.sop_head(pooled).squeeze(-1), pooled


def configure_optimizers(model, cfg):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(0.9, 0.999), eps=1e-6)


def get_lr(it, cfg):
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    ratio = (it - cfg.warmup_iters) / max(1, cfg.max_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))) * (cfg.learning_rate - cfg.min_lr)


@torch.no_grad()
def estimate_loss(model, cfg, ctx):
    out = {}
    model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(cfg.eval_iters)
        sop_acc = torch.zeros(cfg.eval_iters)
        for k in range(cfg.eval_iters):
            input_ids, token_type_ids, attention_mask, mlm_labels, sop_labels = get_batch(cfg, split)
            with ctx:
                mlm_logits, sop_logits, _ = model(input_ids, token_type_ids, attention_mask)
                loss = F.cross_entropy(mlm_logits.view(-1, mlm_logits.size(-1)), mlm_labels.view(-1), ignore_index=-100)
            losses[k] = loss.item()
            sop_acc[k] = ((sop_logits > 0).long() == sop_labels).float().mean().item()
        out[split], out[split + "_sop_acc"] = losses.mean().item(), sop_acc.mean().item()
    model.train()
    return out


def train_probe(model, cfg, num_labels=2, steps=500):
    """Linear probe on the frozen pooled [CLS] output, a quick downstream sanity check."""
    probe = nn.Linear(cfg.n_embd, num_labels).to(cfg.device)
    opt = torch.optim.AdamW(probe.parameters(), lr=1e-3)
    model.eval()
    for _ in range(steps):
        input_ids, token_type_ids, attention_mask, _, sop_labels = get_batch(cfg, "val")
        with torch.no_grad():
            _, _, pooled = model(input_ids, token_type_ids, attention_mask)
        with torch.autocast(device_type="cuda", dtype=torch.float16):  # expect: AMP010
            logits = probe(pooled)
            loss = F.cross_entropy(logits, sop_labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.train()
    return loss.item()


def export_for_inference(model, cfg, path):
    state = {k: v.half() for k, v in model.state_dict().items()}
    torch.save({"config": asdict(cfg), "model": state}, path)


def main():
    cfg = TrainConfig()
    for arg in sys.argv[1:]:
        key, val = arg[2:].split("=", 1)
        setattr(cfg, key, type(getattr(cfg, key))(val))
    os.makedirs(cfg.out_dir, exist_ok=True)
    torch.manual_seed(1337)
    torch.backends.cuda.matmul.allow_tf32 = True
    device_type = "cuda" if "cuda" in cfg.device else "cpu"
    ptdtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.dtype]
    ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=ptdtype)
    model = BertForPreTraining(cfg).to(cfg.device)
    scaler = torch.cuda.amp.GradScaler(enabled=(cfg.dtype == "float16"))  # expect: AMP009
    optimizer = configure_optimizers(model, cfg)
    raw_model = model
    if cfg.compile:
        model = torch.compile(model)
    iter_num, best_val_loss, t0 = 0, 1e9, time.time()
    batch = get_batch(cfg, "train")
    while iter_num < cfg.max_iters:
        lr = get_lr(iter_num, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if iter_num % cfg.eval_interval == 0:
            losses = estimate_loss(model, cfg, ctx)
            print(f"step {iter_num}: train {losses['train']:.4f} val {losses['val']:.4f} sop {losses['val_sop_acc']:.3f}")
            if losses["val"] < best_val_loss:
                best_val_loss = losses["val"]
                checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                              "iter_num": iter_num, "best_val_loss": best_val_loss, "config": asdict(cfg)}
                torch.save(checkpoint, os.path.join(cfg.out_dir, "ckpt.pt"))
        for _ in range(cfg.grad_accum):
            input_ids, token_type_ids, attention_mask, mlm_labels, sop_labels = batch
            with ctx:
                mlm_logits, sop_logits, _ = model(input_ids, token_type_ids, attention_mask)
                sop_loss = F.binary_cross_entropy(torch.sigmoid(sop_logits), sop_labels.float())  # expect: AMP003
            mlm_loss = F.cross_entropy(mlm_logits.view(-1, mlm_logits.size(-1)), mlm_labels.view(-1), ignore_index=-100)  # expect: AMP002
            loss = (mlm_loss + cfg.sop_weight * sop_loss) / cfg.grad_accum
            batch = get_batch(cfg, "train")
            scaler.scale(loss).backward()
        if cfg.grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if iter_num % cfg.log_interval == 0:
            dt, t0 = time.time() - t0, time.time()
            print(f"iter {iter_num}: loss {loss.item() * cfg.grad_accum:.4f}, lr {lr:.2e}, {dt * 1000:.0f}ms")
        iter_num += 1
    print(f"probe loss {train_probe(raw_model, cfg):.4f}")
    export_for_inference(raw_model, cfg, os.path.join(cfg.out_dir, "bert_fp16.pt"))


if __name__ == "__main__":
    main()
