"""Late-interaction dense retrieval (ColBERT-style) with a compact in-repo encoder.

Queries and passages are encoded independently into per-token vectors; relevance
is the sum over query tokens of the max similarity to any passage token.
Passage tokens are pruned by a learned term-importance score and softly gated.
"""
import argparse
import math
import os
import time
from dataclasses import dataclass
from typing import Dict, List

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class RetrieverConfig:
    vocab_size: int = 30522
    hidden: int = 384
    layers: int = 6
    heads: int = 6
    max_len: int = 512
    dim: int = 128
    doc_keep: int = 96
    dropout: float = 0.1
    temperature: float = 0.05
    coarse_weight: float = 0.1
    gate_weight: float = 1e-3
    lr: float = 5e-5
    max_grad_norm: float = 1.0
    amp: bool = True
    compile: bool = False


class FP32LayerNorm(nn.LayerNorm):
    def forward(self, x):
        out = F.layer_norm(x.float(), self.normalized_shape, self.weight.float(), self.bias.float(), self.eps)
        return out.type_as(x)


class SelfAttention(nn.Module):
    def __init__(self, hidden, heads, dropout):
        super().__init__()
        self.heads = heads
        self.head_dim = hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, ext_mask):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        scores = scores + ext_mask
        probs = self.drop(scores.softmax(dim=-1))
        ctx = torch.matmul(probs, v).transpose(1, 2).reshape(b, n, -1)
        return self.out(ctx)


class EncoderLayer(nn.Module):
    def __init__(self, hidden, heads, dropout):
        super().__init__()
        self.attn = SelfAttention(hidden, heads, dropout)
        self.ln1 = FP32LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)
        self.ln2 = FP32LayerNorm(hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, ext_mask):
        x = self.ln1(x + self.drop(self.attn(x, ext_mask)))
        return self.ln2(x + self.drop(self.fc2(F.gelu(self.fc1(x)))))


class Encoder(nn.Module):
    def __init__(self, cfg: RetrieverConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden, padding_idx=0)
        self.pos = nn.Embedding(cfg.max_len, cfg.hidden)
        self.ln = FP32LayerNorm(cfg.hidden)
        self.layers = nn.ModuleList([EncoderLayer(cfg.hidden, cfg.heads, cfg.dropout) for _ in range(cfg.layers)])

    def forward(self, input_ids, attention_mask):
        pos = torch.arange(input_ids.size(1), device=input_ids.device)
        h = self.ln(self.tok(input_ids) + self.pos(pos)[None])
        ext_mask = (1.0 - attention_mask[:, None, None, :].to(h.dtype)) * -10000.0
        for layer in self.layers:
            h = layer(h, ext_mask)
        return h


class Projection(nn.Module):
    def __init__(self, hidden, dim, eps=1e-6):
        super().__init__()
        self.proj_in = nn.Linear(hidden, hidden)
        self.proj_out = nn.Linear(hidden, dim, bias=False)
        self.eps = eps

    def forward(self, x):
        h = F.gelu(self.proj_in(x))
        h = h * torch.rsqrt((h * h).mean(-1, keepdim=True) + self.eps)  # expect: AMP004
        return self.proj_out(h)


def late_interaction(q, d, d_mask):
    sim = torch.einsum("qtd,bsd->qbts", q, d)
    sim = torch.where(d_mask[None, :, None, :].bool(), sim, torch.tensor(-1e9, device=sim.device))  # expect: AMP007
    return sim.max(dim=-1).values.sum(dim=-1)


class ColBERT(nn.Module):
    def __init__(self, cfg: RetrieverConfig):
        super().__init__()
        self.encoder = Encoder(cfg)
        self.proj = Projection(cfg.hidden, cfg.dim)
        self.term_weight = nn.Linear(cfg.hidden, 1)
        self.gate = nn.Linear(cfg.hidden, 1)
        self.doc_keep = cfg.doc_keep

    def encode_query(self, ids, mask):
        h = self.encoder(ids, mask)
        q = self.proj(h)
        imp = self.term_weight(h).squeeze(-1)
        imp = imp - imp.mean(dim=1, keepdim=True)  # expect: AMP004
        q = q * torch.sigmoid(imp).unsqueeze(-1)
        return F.normalize(q, p=2, dim=-1)

    def encode_doc(self, ids, mask):
        h = self.encoder(ids, mask)
        d = self.proj(h)
        centroid = d.mean(dim=1)  # expect: AMP004
        gate = F.relu(self.gate(h)).squeeze(-1)
        log_gate = torch.log(gate + 1e-8)  # expect: AMP011
        score = self.term_weight(h).squeeze(-1)
        score = score.masked_fill(mask == 0, -1e9)  # expect: AMP007
        keep = score.topk(min(self.doc_keep, score.size(1)), dim=1).indices
        d = d * gate.unsqueeze(-1)
        d = torch.gather(d, 1, keep.unsqueeze(-1).expand(-1, -1, d.size(-1)))
        d_mask = torch.gather(mask, 1, keep)
        return F.normalize(d, p=2, dim=-1), d_mask, centroid, log_gate

    def forward(self, q_ids, q_mask, d_ids, d_mask):
        q = self.encode_query(q_ids, q_mask)
        d, d_keep_mask, centroid, log_gate = self.encode_doc(d_ids, d_mask)
        scores = late_interaction(q, d, d_keep_mask)
        coarse = q.mean(dim=1) @ F.normalize(centroid, dim=-1).t()
        gate_reg = (log_gate.clamp(min=-10.0) * d_mask).sum(1).mean()
        return {"scores": scores, "coarse": coarse, "gate_reg": gate_reg}


class Trainer:
    def __init__(self, model: ColBERT, cfg: RetrieverConfig, device="cuda"):
        self.cfg = cfg
        self.device = torch.device(device)
        self.raw_model = model.to(self.device)
        self.model = torch.compile(self.raw_model) if cfg.compile else self.raw_model
        decay = [p for n, p in self.raw_model.named_parameters() if p.ndim > 1 and "tok" not in n]
        no_decay = [p for n, p in self.raw_model.named_parameters() if p.ndim <= 1 or "tok" in n]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr
        )
        self.use_amp = cfg.amp
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.use_amp)
        self.loss_fn = nn.CrossEntropyLoss()
        self.step = 0

    def _to_device(self, batch):
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def train_step(self, batch: Dict[str, torch.Tensor]) -> Dict[str, float]:
        self.model.train()
        batch = self._to_device(batch)
        labels = torch.arange(batch["q_ids"].size(0), device=self.device)
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.use_amp):
            out = self.model(**batch)
            loss = self.loss_fn(out["scores"] / self.cfg.temperature, labels)
            loss = loss + self.cfg.coarse_weight * self.loss_fn(out["coarse"] / self.cfg.temperature, labels)
            loss = loss + self.cfg.gate_weight * out["gate_reg"]
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), self.cfg.max_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.step += 1
        with torch.no_grad():
            probs = out["scores"].float().softmax(-1)
            entropy = -(probs * torch.log(probs + 1e-9)).sum(-1).mean()
        return {"loss": loss.item(), "grad_norm": grad_norm.item(), "entropy": entropy.item(),
                "scale": self.scaler.get_scale()}

    def distill_step(self, batch: Dict[str, torch.Tensor], teacher_scores: torch.Tensor) -> float:
        self.model.train()
        batch = self._to_device(batch)
        teacher_scores = teacher_scores.to(self.device)
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.use_amp):
            out = self.model(**batch)
            student = F.log_softmax(out["scores"] / self.cfg.temperature, dim=-1)
            teacher = F.log_softmax(teacher_scores.float(), dim=-1)
            loss = F.kl_div(student, teacher, log_target=True, reduction="batchmean")
            self.scaler.scale(loss).backward()  # expect: AMP008
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return loss.item()

    @torch.no_grad()
    def encode_corpus(self, loader):
        self.raw_model.eval()
        embs, masks = [], []
        with torch.cuda.amp.autocast(enabled=self.use_amp):  # expect: AMP009
            for batch in loader:
                d, d_mask, _, _ = self.raw_model.encode_doc(batch["ids"].to(self.device), batch["mask"].to(self.device))
                embs.append(d.half().cpu())
                masks.append(d_mask.cpu())
        self.raw_model.train()
        return embs, masks

    def save(self, path):
        torch.save({"model": self.raw_model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "scaler": self.scaler.state_dict(), "step": self.step}, path)


@torch.inference_mode()
def rerank(q_emb, doc_embs, doc_masks, k=10):
    sims = torch.einsum("td,nsd->nts", q_emb.float(), doc_embs.float())
    sims = sims.masked_fill(~doc_masks[:, None, :].bool(), -1e9)
    scores = sims.max(-1).values.sum(-1)
    return scores.topk(min(k, scores.numel()))


def mrr_at_k(ranked: List[List[int]], positives: List[set], k=10) -> float:
    total = 0.0
    for ranking, pos in zip(ranked, positives):
        for rank, pid in enumerate(ranking[:k]):
            if pid in pos:
                total += 1.0 / (rank + 1)
                break
    return total / max(len(ranked), 1)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--triples", required=True)
    p.add_argument("--distill-scores", default=None)
    p.add_argument("--steps", type=int, default=200_000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--distill-every", type=int, default=4)
    p.add_argument("--no-amp", action="store_true")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--out", default="checkpoints/colbert")
    return p.parse_args()


def main():
    args = parse_args()
    cfg = RetrieverConfig(amp=not args.no_amp, compile=args.compile)
    from torch.utils.data import DataLoader
    from datasets import load_from_disk

    triples = load_from_disk(args.triples).with_format("torch")
    loader = DataLoader(triples, batch_size=args.batch_size, shuffle=True, num_workers=4, drop_last=True)
    trainer = Trainer(ColBERT(cfg), cfg)
    os.makedirs(args.out, exist_ok=True)
    best_loss = 1e9
    t0 = time.time()
    while trainer.step < args.steps:
        for raw in loader:
            batch = {k: raw[k] for k in ("q_ids", "q_mask", "d_ids", "d_mask")}
            if args.distill_scores and trainer.step % args.distill_every == 0:
                loss = trainer.distill_step(batch, raw["teacher_scores"])
                stats: Dict[str, float] = {"loss": loss}
            else:
                stats = trainer.train_step(batch)
            if trainer.step % 500 == 0:
                print(f"step {trainer.step} {stats} {time.time() - t0:.0f}s")
                if stats["loss"] < best_loss:
                    best_loss = stats["loss"]
                    trainer.save(os.path.join(args.out, "best.pt"))
            if trainer.step >= args.steps:
                break
    trainer.save(os.path.join(args.out, "last.pt"))


if __name__ == "__main__":
    main()
