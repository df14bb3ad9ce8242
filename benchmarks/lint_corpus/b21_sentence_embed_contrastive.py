"""Dense retrieval / sentence-embedding fine-tuning.

InfoNCE over in-batch negatives plus one mined hard negative per query,
with margin-MSE distillation from cross-encoder teacher scores.
Input: JSONL rows {"query", "pos", "neg", "pos_doc_id", "teacher_pos", "teacher_neg"}.
"""
import argparse
import json
import logging
import os
import random
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

log = logging.getLogger(__name__)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="org/minilm-l12-base")
    p.add_argument("--train", default="data/msmarco_hardneg.jsonl")
    p.add_argument("--corpus", default="data/dev_corpus.jsonl")
    p.add_argument("--queries", default="data/dev_queries.jsonl")
    p.add_argument("--out", default="ckpt/embedder")
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.05)
    p.add_argument("--distill-weight", type=float, default=0.5)
    p.add_argument("--amp", action="store_true")
    return p.parse_args()


class TripletJsonl(Dataset):
    def __init__(self, path):
        with open(path) as f:
            self.rows = [json.loads(line) for line in f]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        neg = random.choice(r["neg"]) if isinstance(r["neg"], list) else r["neg"]
        return r["query"], r["pos"], neg["text"], r["pos_doc_id"], r["teacher_pos"] - neg["teacher_score"]


class Collator:
    def __init__(self, tokenizer, max_len):
        self.tok, self.max_len = tokenizer, max_len

    def _enc(self, texts):
        return dict(self.tok(list(texts), padding=True, truncation=True, max_length=self.max_len, return_tensors="pt"))

    def __call__(self, batch):
        queries, pos, neg, doc_ids, margins = zip(*batch)
        doc_ids = torch.tensor(doc_ids)
        # the same passage can be the positive of two queries in one batch
        dup = doc_ids.unsqueeze(1) == doc_ids.unsqueeze(0)
        dup.fill_diagonal_(False)
        return {"query": self._enc(queries), "pos": self._enc(pos), "neg": self._enc(neg),
                "dup_mask": torch.cat([dup, torch.zeros_like(dup)], dim=1),
                "teacher_margin": torch.tensor(margins, dtype=torch.float32)}


class SentenceEncoder(nn.Module):
    def __init__(self, name, dim):
        super().__init__()
        self.backbone = AutoModel.from_pretrained(name)
        self.proj = nn.Linear(self.backbone.config.hidden_size, dim)

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).float()
        summed = (out * mask).sum(dim=1)
        counts = mask.sum(dim=1).clamp(min=1e-9)
        return self.proj(summed / counts)


class InBatchNegativesLoss(nn.Module):
    def __init__(self, temperature=0.05):
        super().__init__()
        self.temperature = temperature

    def forward(self, q, docs, dup_mask=None):
        scores = q @ docs.T / self.temperature
        if dup_mask is not None:
            scores = scores.masked_fill(dup_mask, -1e9)  # expect: AMP007
        labels = torch.arange(q.size(0), device=q.device)
        return F.cross_entropy(scores, labels)


def to_device(batch, device):
    out = {}
    for k, v in batch.items():
        out[k] = {kk: vv.to(device) for kk, vv in v.items()} if isinstance(v, dict) else v.to(device)
    return out


@torch.inference_mode()
def encode_corpus(model, tokenizer, texts, device, bs=512):
    model.eval()
    embs = []
    for i in range(0, len(texts), bs):
        enc = tokenizer(texts[i:i + bs], padding=True, truncation=True, max_length=256, return_tensors="pt").to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            e = model(enc["input_ids"], enc["attention_mask"])
        embs.append(F.normalize(e.float(), dim=-1).cpu())
    model.train()
    return torch.cat(embs)


def recall_at_k(model, tokenizer, args, device, k=10):
    with open(args.corpus) as f:
        corpus = [json.loads(line) for line in f]
    with open(args.queries) as f:
        queries = [json.loads(line) for line in f]
    d = encode_corpus(model, tokenizer, [c["text"] for c in corpus], device)
    q = encode_corpus(model, tokenizer, [x["query"] for x in queries], device)
    topk = (q @ d.T).topk(k, dim=-1).indices.numpy()
    ids = np.array([c["id"] for c in corpus])
    hits = [len(set(ids[row]) & set(x["relevant"])) > 0 for row, x in zip(topk, queries)]
    return float(np.mean(hits))


def main():
    args = parse_args()
    logging.basicConfig(level=logging.INFO)
    device = torch.device("cuda")
    tok = AutoTokenizer.from_pretrained(args.model)
    loader = DataLoader(TripletJsonl(args.train), batch_size=args.batch_size, shuffle=True, drop_last=True,
                        collate_fn=Collator(tok, args.max_len), num_workers=4)
    model = SentenceEncoder(args.model, args.dim).to(device)
    loss_fn = InBatchNegativesLoss(args.temperature)
    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, eps=1e-8)
    total = len(loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.1 * total), total)
    ctx = torch.autocast("cuda", dtype=torch.float16) if args.amp else nullcontext()  # expect: AMP010

    step, best = 0, 0.0
    for epoch in range(args.epochs):
        model.train()
        for batch in loader:
            b = to_device(batch, device)
            bs = b["query"]["input_ids"].size(0)
            with ctx:
                q_emb = model(**b["query"])
                p_emb = model(**b["pos"])
                n_emb = model(**b["neg"])
            q = F.normalize(q_emb, dim=-1)  # expect: AMP011
            d = F.normalize(torch.cat([p_emb, n_emb], dim=0), dim=-1)  # expect: AMP011
            loss_nce = loss_fn(q, d, b["dup_mask"])  # expect: AMP002
            margin_pred = torch.einsum("bd,bd->b", q, d[:bs]) - torch.einsum("bd,bd->b", q, d[bs:])
            loss_kd = F.mse_loss(margin_pred, b["teacher_margin"])  # expect: AMP002
            loss = loss_nce + args.distill_weight * loss_kd
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 100 == 0:
                with torch.no_grad():
                    # representation-collapse monitor: per-dimension spread of query embeddings
                    spread = q.detach().std(dim=0).mean().item()  # expect: AMP004
                    uniformity = torch.pdist(q.detach().float(), p=2).pow(2).mul(-2).exp().mean().log().item()
                log.info("ep %d step %d nce %.4f kd %.4f spread %.4f unif %.3f", epoch, step,
                         loss_nce.item(), loss_kd.item(), spread, uniformity)
        r10 = recall_at_k(model, tok, args, device)
        log.info("epoch %d dev R@10 %.4f", epoch, r10)
        if r10 > best:
            best = r10
            os.makedirs(args.out, exist_ok=True)
            torch.save(model.state_dict(), os.path.join(args.out, "best.pt"))


if __name__ == "__main__":
    main()
