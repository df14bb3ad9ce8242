"""Retrieval-augmented NMT in the fairseq style: task / criterion / optimizer wrapper / trainer.

--amp trains with autocast and an AMPOptimizer that owns a GradScaler; without it the plain
FairseqOptimizer is used. The decoder layer has a cross-attention over retrieved target-side
neighbours that was copied from an older checkout of the codebase.
"""
import argparse
import math
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F


class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.1):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.dropout = dropout

    def forward(self, query, key, value, key_padding_mask=None, attn_mask=None):
        tgt_len, bsz, embed_dim = query.size()
        src_len = key.size(0)
        q = self.q_proj(query) * self.scaling
        k = self.k_proj(key)
        v = self.v_proj(value)
        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(src_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(src_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        if attn_mask is not None:
            attn_weights += attn_mask.unsqueeze(0)
        if key_padding_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
            attn_weights = attn_weights.masked_fill(
                key_padding_mask[:, None, None, :].to(torch.bool),
                -1e8 if attn_weights.dtype == torch.float32 else -1e4,
            )
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_probs = F.softmax(attn_weights, dim=-1, dtype=torch.float32).type_as(attn_weights)
        attn_probs = F.dropout(attn_probs, p=self.dropout, training=self.training)
        attn = torch.bmm(attn_probs, v).transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        return self.out_proj(attn)


class NeighbourCrossAttention(nn.Module):
    """Single-head attention over retrieved neighbours (copied from the 2021 branch)."""

    def __init__(self, embed_dim):
        super().__init__()
        self.scaling = embed_dim ** -0.5
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x, memory, memory_padding_mask):
        scores = torch.einsum("tbd,sbd->bts", self.q_proj(x), self.k_proj(memory)) * self.scaling
        scores = scores.masked_fill(memory_padding_mask[:, None, :], -1e8)  # expect: AMP007
        return torch.einsum("bts,sbd->tbd", F.softmax(scores, dim=-1), self.v_proj(memory))


class DecoderLayer(nn.Module):
    def __init__(self, d, heads, ffn):
        super().__init__()
        self.self_attn = MultiheadAttention(d, heads)
        self.cross_attn = MultiheadAttention(d, heads)
        self.nbr_attn = NeighbourCrossAttention(d)
        self.fc1, self.fc2 = nn.Linear(d, ffn), nn.Linear(ffn, d)
        self.norms = nn.ModuleList([nn.LayerNorm(d) for _ in range(4)])

    def forward(self, x, enc, enc_pad, nbr, nbr_pad, self_attn_mask):
        x = x + self.self_attn(self.norms[0](x), self.norms[0](x), self.norms[0](x), attn_mask=self_attn_mask)
        h = self.norms[1](x)
        x = x + self.cross_attn(h, enc, enc, key_padding_mask=enc_pad)
        x = x + self.nbr_attn(self.norms[2](x), nbr, nbr_pad)
        return x + self.fc2(F.relu(self.fc1(self.norms[3](x))))


class RetrievalTransformer(nn.Module):
    def __init__(self, vocab, d=512, heads=8, ffn=2048, layers=6, pad=1):
        super().__init__()
        self.pad = pad
        self.embed = nn.Embedding(vocab, d, padding_idx=pad)
        enc_layer = nn.TransformerEncoderLayer(d, heads, ffn, norm_first=True)
        self.encoder = nn.TransformerEncoder(enc_layer, layers)
        self.layers = nn.ModuleList([DecoderLayer(d, heads, ffn) for _ in range(layers)])
        self.out = nn.Linear(d, vocab, bias=False)
        self.nbr_gate = nn.Linear(d, 1)
        self.embed_scale = math.sqrt(d)

    def forward(self, src_tokens, prev_output_tokens, nbr_tokens):
        src_pad, nbr_pad = src_tokens.eq(self.pad), nbr_tokens.eq(self.pad)
        enc = self.encoder(self.embed(src_tokens).transpose(0, 1) * self.embed_scale, src_key_padding_mask=src_pad)
        nbr = self.embed(nbr_tokens).transpose(0, 1) * self.embed_scale
        x = self.embed(prev_output_tokens).transpose(0, 1) * self.embed_scale
        t = x.size(0)
        future = torch.triu(torch.full((t, t), float("-inf"), device=x.device), 1)
        for layer in self.layers:
            x = layer(x, enc, src_pad, nbr, nbr_pad, future)
        x = x.transpose(0, 1)
        return self.out(x), {"nbr_gate": torch.sigmoid(self.nbr_gate(x)).squeeze(-1)}


class LabelSmoothedCrossEntropyCriterion(nn.Module):
    def __init__(self, eps=0.1, pad=1, gate_weight=0.1):
        super().__init__()
        self.eps, self.pad, self.gate_weight = eps, pad, gate_weight

    def forward(self, model, sample):
        logits, extra = model(**sample["net_input"])
        lprobs = F.log_softmax(logits.float(), dim=-1).view(-1, logits.size(-1))
        target = sample["target"].view(-1)
        keep = target.ne(self.pad)
        nll = -lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)[keep].sum()
        smooth = -lprobs[keep].sum()
        loss = (1.0 - self.eps) * nll + self.eps / lprobs.size(-1) * smooth
        if "gate_target" in sample:
            # probabilities, not logits: keep this loss out of autocast
            with torch.autocast("cuda", enabled=False):
                gate_loss = F.binary_cross_entropy(extra["nbr_gate"].float(), sample["gate_target"].float(), reduction="sum")
            loss = loss + self.gate_weight * gate_loss
        ntokens = int(keep.sum())
        return loss, ntokens, {"loss": loss.detach(), "nll_loss": nll.detach(), "ntokens": ntokens}


class FairseqOptimizer:
    def __init__(self, cfg, params):
        self.cfg = cfg
        self.params = list(params)
        self._optimizer = torch.optim.Adam(self.params, lr=cfg.lr, betas=(0.9, 0.98), eps=1e-8, weight_decay=cfg.weight_decay)

    def backward(self, loss):
        loss.backward()

    def multiply_grads(self, c):
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(c)

    def clip_grad_norm(self, max_norm):
        return torch.nn.utils.clip_grad_norm_(self.params, max_norm if max_norm > 0 else float("inf"))

    def step(self):
        self._optimizer.step()

    def zero_grad(self):
        self._optimizer.zero_grad(set_to_none=True)

    def set_lr(self, lr):
        for g in self._optimizer.param_groups:
            g["lr"] = lr


class AMPOptimizer(FairseqOptimizer):
    def __init__(self, cfg, params):
        super().__init__(cfg, params)
        self.scaler = torch.amp.GradScaler("cuda", init_scale=cfg.fp16_init_scale, growth_interval=cfg.fp16_scale_window)
        self.min_loss_scale = cfg.min_loss_scale

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def clip_grad_norm(self, max_norm):
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)  # expect: AMP005
        if not torch.isfinite(grad_norm) and self.scaler.get_scale() <= self.min_loss_scale:
            raise FloatingPointError(f"minimum loss scale reached ({self.min_loss_scale})")
        return grad_norm

    def step(self):
        self.scaler.step(self._optimizer)
        self.scaler.update()

    @property
    def scaling_factor(self):
        return self.scaler.get_scale()


class TranslationTask:
    def __init__(self, cfg):
        self.cfg = cfg

    def train_step(self, sample, model, criterion, optimizer, ignore_grad=False):
        model.train()
        with torch.cuda.amp.autocast(enabled=isinstance(optimizer, AMPOptimizer)):  # expect: AMP009
            loss, sample_size, logging_output = criterion(model, sample)
        if ignore_grad:
            loss *= 0
        optimizer.backward(loss)
        return loss, sample_size, logging_output

    def valid_step(self, sample, model, criterion):
        model.eval()
        with torch.no_grad():
            return criterion(model, sample)


class Trainer:
    def __init__(self, cfg, task, model, criterion):
        self.cfg, self.task = cfg, task
        self.model, self.criterion = model.cuda(), criterion.cuda()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = AMPOptimizer(cfg, params) if cfg.amp else FairseqOptimizer(cfg, params)
        self.num_updates = 0

    def lr_step(self):
        warm = self.cfg.warmup_updates
        n = max(self.num_updates, 1)
        self.optimizer.set_lr(self.cfg.lr * min(n / warm, math.sqrt(warm / n)))

    def train_step(self, samples):
        self.optimizer.zero_grad()
        logs, sample_size = [], 0
        for i, sample in enumerate(samples):
            sample = {k: (v.cuda() if torch.is_tensor(v) else {kk: vv.cuda() for kk, vv in v.items()}) for k, v in sample.items()}
            last = i == len(samples) - 1
            with (nullcontext() if last or not hasattr(self.model, "no_sync") else self.model.no_sync()):
                loss, n, log = self.task.train_step(sample, self.model, self.criterion, self.optimizer)
            logs.append(log)
            sample_size += n
        self.optimizer.multiply_grads(1.0 / max(sample_size, 1))
        grad_norm = self.optimizer.clip_grad_norm(self.cfg.clip_norm)
        self.optimizer.step()
        self.num_updates += 1
        self.lr_step()
        total = sum(float(l["loss"]) for l in logs)
        return {"loss": total / sample_size / math.log(2), "gnorm": float(grad_norm), "ntokens": sample_size}

    def valid_step(self, sample):
        loss, n, _ = self.task.valid_step(sample, self.model, self.criterion)
        return float(loss) / n / math.log(2)

    def save_checkpoint(self, path):
        state = {k: v.half() for k, v in self.model.state_dict().items()}
        torch.save({"model": state, "num_updates": self.num_updates, "cfg": vars(self.cfg)}, path)


def main(cfg):
    from nmt_data import build_iterators  # project-local

    train_itr, valid_itr, vocab = build_iterators(cfg)
    model = RetrievalTransformer(len(vocab), layers=cfg.layers)
    trainer = Trainer(cfg, TranslationTask(cfg), model, LabelSmoothedCrossEntropyCriterion(cfg.label_smoothing))
    for epoch in range(cfg.max_epoch):
        for i, samples in enumerate(train_itr.next_epoch(update_freq=cfg.update_freq)):
            stats = trainer.train_step(samples)
            if i % 100 == 0:
                print(f"epoch {epoch} update {trainer.num_updates} " + " ".join(f"{k}={v:.3f}" for k, v in stats.items()))
        valid = [trainer.valid_step(s) for s in valid_itr.next_epoch()]
        print(f"epoch {epoch} valid loss {sum(valid) / len(valid):.3f}")
        trainer.save_checkpoint(f"{cfg.save_dir}/checkpoint{epoch}.pt")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--save_dir", default="checkpoints")
    p.add_argument("--amp", action="store_true")
    p.add_argument("--fp16_init_scale", type=float, default=2.0 ** 7)
    p.add_argument("--fp16_scale_window", type=int, default=256)
    p.add_argument("--min_loss_scale", type=float, default=1e-4)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--weight_decay", type=float, default=0.0001)
    p.add_argument("--warmup_updates", type=int, default=4000)
    p.add_argument("--clip_norm", type=float, default=0.1)
    p.add_argument("--label_smoothing", type=float, default=0.1)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--update_freq", type=int, default=4)
    p.add_argument("--max_epoch", type=int, default=50)
    main(p.parse_args())
