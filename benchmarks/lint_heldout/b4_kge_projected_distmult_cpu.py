"""Knowledge-graph embedding (projected DistMult with 1-N scoring) trained on a CPU cluster with bf16 autocast."""
import argparse
import time
from collections import defaultdict

import torch
import torch.nn as nn
import torch.nn.functional as F


class ProjectedDistMult(nn.Module):
    def __init__(self, num_entities, num_relations, dim=256, input_dropout=0.2, label_smoothing=0.1):
        super().__init__()
        self.ent = nn.Embedding(num_entities, dim)
        self.rel = nn.Embedding(num_relations, dim)
        self.ent_proj = nn.Linear(dim, dim)
        self.rel_proj = nn.Linear(dim, dim)
        self.input_dropout = nn.Dropout(input_dropout)
        self.bn = nn.BatchNorm1d(dim)
        self.label_smoothing = label_smoothing
        self.bce = nn.BCELoss()
        nn.init.xavier_normal_(self.ent.weight)
        nn.init.xavier_normal_(self.rel.weight)

    def encode(self, h, r):
        hp = self.ent_proj(self.input_dropout(self.ent(h)))
        rr = self.rel_proj(self.rel(r))
        return hp, rr

    def forward(self, h, r):
        hp, rr = self.encode(h, r)
        x = self.bn(hp * rr)
        all_ent = self.ent_proj(self.ent.weight)
        return torch.sigmoid(torch.mm(x, all_ent.t()))

    def n3(self, h, r):
        return (self.ent(h).abs() ** 3).sum() + (self.rel(r).abs() ** 3).sum()


def triple_scores(model, h, r, t):
    hp, rr = model.encode(h, r)
    tp = model.ent_proj(model.ent(t))
    return (hp * rr * tp).sum(dim=-1)  # expect: AMP004


def build_vocab(triples):
    sr_vocab = defaultdict(list)
    for h, r, t in triples:
        sr_vocab[(h, r)].append(t)
    return sr_vocab


def batches(sr_vocab, batch_size, num_entities):
    keys = list(sr_vocab.keys())
    perm = torch.randperm(len(keys)).tolist()
    for i in range(0, len(keys), batch_size):
        chunk = [keys[j] for j in perm[i : i + batch_size]]
        h = torch.tensor([k[0] for k in chunk])
        r = torch.tensor([k[1] for k in chunk])
        targets = torch.zeros(len(chunk), num_entities)
        for row, k in enumerate(chunk):
            targets[row, sr_vocab[k]] = 1.0
        yield h, r, targets


@torch.no_grad()
def evaluate(model, test_triples, filter_vocab, hits_at=(1, 3, 10)):
    model.eval()
    ranks = []
    for i in range(0, len(test_triples), 512):
        chunk = test_triples[i : i + 512]
        h = torch.tensor([x[0] for x in chunk])
        r = torch.tensor([x[1] for x in chunk])
        t = torch.tensor([x[2] for x in chunk])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            scores = model(h, r)
            for row, (hh, rr, tt) in enumerate(chunk):
                filt = [e for e in filter_vocab[(hh, rr)] if e != tt]
                scores[row, filt] = -1e9
        target_score = scores[torch.arange(len(chunk)), t].unsqueeze(1)
        ranks.append((scores > target_score).sum(dim=1) + 1)
    ranks = torch.cat(ranks).float()
    model.train()
    out = {f"hits@{k}": (ranks <= k).float().mean().item() for k in hits_at}
    out["mrr"] = (1.0 / ranks).mean().item()
    return out


def train(args, train_triples, valid_triples, num_entities, num_relations):
    torch.set_num_threads(args.threads)
    model = ProjectedDistMult(num_entities, num_relations, args.dim, label_smoothing=args.label_smoothing)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler("cpu")  # expect: AMP010
    sr_vocab = build_vocab(train_triples)
    all_vocab = build_vocab(train_triples + valid_triples)
    neg_size = args.negatives

    for epoch in range(args.epochs):
        t0, total = time.time(), 0.0
        for h, r, targets in batches(sr_vocab, args.batch_size, num_entities):
            targets = (1.0 - model.label_smoothing) * targets + 1.0 / num_entities
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                pred = model(h, r)
                loss = model.bce(pred, targets)  # expect: AMP003
                t_pos = targets.argmax(dim=1)
                t_neg = torch.randint(0, num_entities, (len(h), neg_size))
                pos = triple_scores(model, h, r, t_pos)
                neg = triple_scores(model, h.repeat_interleave(neg_size), r.repeat_interleave(neg_size), t_neg.flatten())
                neg = neg.view(len(h), neg_size)
                pos = pos.unsqueeze(1).expand_as(neg)
                margin = F.margin_ranking_loss(pos, neg, torch.ones_like(neg), margin=args.margin)
                loss = loss + args.margin_weight * margin + args.reg * model.n3(h, r)
                scaler.scale(loss).backward()  # expect: AMP008
            scaler.step(optimizer)
            scaler.update()
            total += loss.item()
        print(f"epoch {epoch} loss {total:.3f} ({time.time() - t0:.0f}s)")
        if (epoch + 1) % args.eval_every == 0:
            print(evaluate(model, valid_triples, all_vocab))
    return model


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch_size", type=int, default=1024)
    p.add_argument("--negatives", type=int, default=32)
    p.add_argument("--margin", type=float, default=6.0)
    p.add_argument("--margin_weight", type=float, default=0.1)
    p.add_argument("--reg", type=float, default=1e-3)
    p.add_argument("--label_smoothing", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=32)
    p.add_argument("--eval_every", type=int, default=10)
    args = p.parse_args()
