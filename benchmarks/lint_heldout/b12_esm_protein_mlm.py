"""Masked-LM pretraining of a small ESM-style protein language model on UniRef50 crops.

Single node, fp16 autocast, gradient accumulation to ~1M tokens per update.
Rotary position embeddings, pre-LN blocks, tied input/output embeddings (ESM-2 layout).
"""

import math
import os
import random
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch as th
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset

AMINO = "LAGVSERTIDPKQNFYMHWCXBUZO"
PAD, CLS, EOS, MASK = 0, 1, 2, 3
VOCAB = {a: i + 4 for i, a in enumerate(AMINO)}


@dataclass
class TrainConfig:
    data: str = "/data/uniref50/train.fasta"
    out_dir: str = "ckpt/esm_35m"
    dim: int = 480
    layers: int = 12
    heads: int = 20
    max_len: int = 1024
    batch_size: int = 16
    accum_steps: int = 32
    lr: float = 4e-4
    warmup: int = 2000
    max_steps: int = 250_000
    clip_norm: float = 1.0
    mask_prob: float = 0.15
    amp: bool = True
    seed: int = 0
    log_every: int = 20
    eval_every: int = 2000


class FastaCrops(IterableDataset):
    def __init__(self, path, max_len):
        self.path, self.max_len = path, max_len

    def _records(self):
        seq = []
        with open(self.path) as fh:
            for line in fh:
                if line.startswith(">"):
                    if seq:
                        yield "".join(seq)
                    seq = []
                else:
                    seq.append(line.strip())
        if seq:
            yield "".join(seq)

    def __iter__(self):
        for s in self._records():
            if len(s) > self.max_len - 2:
                start = random.randint(0, len(s) - (self.max_len - 2))
                s = s[start:start + self.max_len - 2]
            yield th.tensor([CLS] + [VOCAB.get(a, VOCAB["X"]) for a in s] + [EOS])


def mlm_collate(seqs, mask_prob=0.15):
    tokens = nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=PAD)
    targets = tokens.clone()
    special = tokens < 4
    probs = th.full(tokens.shape, mask_prob)
    probs.masked_fill_(special, 0.0)
    selected = th.bernoulli(probs).bool()
    targets[~selected] = -100
    replace = th.bernoulli(th.full(tokens.shape, 0.8)).bool() & selected
    tokens[replace] = MASK
    rand = th.bernoulli(th.full(tokens.shape, 0.5)).bool() & selected & ~replace
    tokens[rand] = th.randint(4, 4 + len(AMINO), tokens.shape)[rand]
    return {"tokens": tokens, "targets": targets}


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return th.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    def __init__(self, head_dim):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (th.arange(0, head_dim, 2).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, q, k):
        t = th.arange(q.shape[-2], device=q.device, dtype=self.inv_freq.dtype)
        freqs = th.outer(t, self.inv_freq)
        emb = th.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class SelfAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out_proj = nn.Linear(dim, dim)
        self.rotary = Rotary(self.head_dim)

    def forward(self, x, key_padding_mask):
        B, L, D = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = self.rotary(q * self.head_dim ** -0.5, k)
        attn = th.matmul(q, k.transpose(-2, -1))
        attn = attn.masked_fill(key_padding_mask[:, None, None, :], -1e9)  # expect: AMP007
        attn = F.softmax(attn, dim=-1, dtype=th.float32).to(v.dtype)
        out = th.matmul(attn, v).transpose(1, 2).reshape(B, L, D)
        return self.out_proj(out)


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x, key_padding_mask):
        x = x + self.attn(self.ln1(x), key_padding_mask)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class LMHead(nn.Module):
    """dense -> gelu -> layer norm (inlined, ESM-1b style eps) -> tied projection."""

    def __init__(self, dim, embed_weight):
        super().__init__()
        self.dense = nn.Linear(dim, dim)
        self.ln_weight = nn.Parameter(th.ones(dim))
        self.ln_bias = nn.Parameter(th.zeros(dim))
        self.weight = embed_weight
        self.bias = nn.Parameter(th.zeros(embed_weight.size(0)))

    def forward(self, features):
        x = F.gelu(self.dense(features))
        mu = x.mean(-1, keepdim=True)  # expect: AMP004
        var = x.var(-1, keepdim=True, unbiased=False)  # expect: AMP004
        x = (x - mu) / th.sqrt(var + 1e-12)  # expect: AMP011
        x = x * self.ln_weight + self.ln_bias
        return F.linear(x, self.weight) + self.bias


class ProteinMLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(4 + len(AMINO), cfg.dim, padding_idx=PAD)
        self.blocks = nn.ModuleList(Block(cfg.dim, cfg.heads) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.lm_head = LMHead(cfg.dim, self.embed_tokens.weight)

    def forward(self, tokens):
        padding_mask = tokens.eq(PAD)
        x = self.embed_tokens(tokens)
        x = x * (1 - padding_mask.unsqueeze(-1).type_as(x))
        for block in self.blocks:
            x = block(x, padding_mask)
        x = self.ln_f(x)
        return {"logits": self.lm_head(x), "representations": x}


def make_scaler(enabled):
    try:
        return th.amp.GradScaler("cuda", enabled=enabled)
    except (AttributeError, TypeError):
        return th.cuda.amp.GradScaler(enabled=enabled)


def lr_at(step, cfg):
    if step < cfg.warmup:
        return cfg.lr * step / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.max_steps - cfg.warmup)
    return cfg.lr * max(0.1, 1.0 - progress)


@th.no_grad()
def evaluate(model, loader, ctx, device, max_batches=50):
    model.eval()
    total, count = 0.0, 0
    for i, batch in enumerate(loader):
        if i == max_batches:
            break
        tokens, targets = batch["tokens"].to(device), batch["targets"].to(device)
        with ctx:
            logits = model(tokens)["logits"]
        nll = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1),
                              ignore_index=-100, reduction="sum")
        total += nll.item()
        count += (targets != -100).sum().item()
    model.train()
    return math.exp(total / max(count, 1))


def train(cfg: TrainConfig):
    th.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    device = "cuda" if th.cuda.is_available() else "cpu"
    os.makedirs(cfg.out_dir, exist_ok=True)

    collate = lambda b: mlm_collate(b, cfg.mask_prob)  # noqa: E731
    loader = DataLoader(FastaCrops(cfg.data, cfg.max_len), batch_size=cfg.batch_size,
                        collate_fn=collate, num_workers=4)
    val_loader = DataLoader(FastaCrops(cfg.data.replace("train", "valid"), cfg.max_len),
                            batch_size=cfg.batch_size, collate_fn=collate)

    model = ProteinMLM(cfg).to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = th.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                                {"params": no_decay, "weight_decay": 0.0}],
                               lr=cfg.lr, betas=(0.9, 0.98), eps=1e-8)
    use_amp = cfg.amp and device == "cuda"
    scaler = make_scaler(use_amp)
    ctx = th.autocast(device_type="cuda", dtype=th.float16) if use_amp else nullcontext()

    data_iter = iter(loader)
    best_ppl = float("inf")
    t0 = time.time()
    for step in range(1, cfg.max_steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        tokens_seen = 0
        for micro in range(cfg.accum_steps):
            try:
                batch = next(data_iter)
            except StopIteration:
                data_iter = iter(loader)
                batch = next(data_iter)
            tokens = batch["tokens"].to(device, non_blocking=True)
            targets = batch["targets"].to(device, non_blocking=True)
            with ctx:
                logits = model(tokens)["logits"]
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-100)  # not labelled: the head's + self.bias (an fp32 parameter) promotes the logits to fp32
            tokens_seen += int((targets != -100).sum())
            scaler.scale(loss / cfg.accum_steps).backward()
        grad_norm = th.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

        if step % cfg.log_every == 0:
            dt = time.time() - t0
            t0 = time.time()
            print(f"step {step} loss {loss.item():.4f} gnorm {float(grad_norm):.2f} "
                  f"scale {scaler.get_scale():.0f} masked tok/s {tokens_seen * cfg.log_every / dt:.0f}")
        if step % cfg.eval_every == 0:
            ppl = evaluate(model, val_loader, ctx, device)
            print(f"step {step} val ppl {ppl:.3f}")
            if ppl < best_ppl:
                best_ppl = ppl
                th.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                         "scaler": scaler.state_dict(), "config": asdict(cfg), "step": step},
                        os.path.join(cfg.out_dir, "best.pt"))


if __name__ == "__main__":
    train(TrainConfig())
