"""Knowledge-graph embeddings in the style of the RotatE codebase: TransE, RotatE and
DistMult trained with self-adversarial negative sampling, and TuckER trained 1-N with
label smoothing.  The model is picked from a registry by name."""
import argparse
import logging
import os
from collections import defaultdict

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

PI = 3.14159265358979323846


def read_triples(path, entity2id, relation2id):
    triples = []
    with open(path) as fin:
        for line in fin:
            h, r, t = line.strip().split("\t")
            triples.append((entity2id[h], relation2id[r], entity2id[t]))
    return triples


class NegativeSamplingDataset(Dataset):
    def __init__(self, triples, nentity, negative_sample_size, mode):
        self.triples, self.nentity, self.mode = triples, nentity, mode
        self.negative_sample_size = negative_sample_size
        self.count = defaultdict(lambda: 4)
        self.true_head, self.true_tail = defaultdict(list), defaultdict(list)
        for h, r, t in triples:
            self.count[(h, r)] += 1
            self.count[(t, -r - 1)] += 1
            self.true_head[(r, t)].append(h)
            self.true_tail[(h, r)].append(t)

    def __len__(self):
        return len(self.triples)

    def __getitem__(self, idx):
        head, relation, tail = self.triples[idx]
        weight = self.count[(head, relation)] + self.count[(tail, -relation - 1)]
        subsampling_weight = torch.sqrt(1.0 / torch.tensor([weight], dtype=torch.float32))
        known = self.true_head[(relation, tail)] if self.mode == "head-batch" else self.true_tail[(head, relation)]
        chunks, n = [], 0
        while n < self.negative_sample_size:
            cand = np.random.randint(self.nentity, size=self.negative_sample_size * 2)
            cand = cand[np.isin(cand, known, assume_unique=False, invert=True)]
            chunks.append(cand)
            n += cand.size
        negative = np.concatenate(chunks)[: self.negative_sample_size]
        return torch.LongTensor([head, relation, tail]), torch.from_numpy(negative), subsampling_weight, self.mode

    @staticmethod
    def collate_fn(data):
        positive = torch.stack([d[0] for d in data])
        negative = torch.stack([d[1] for d in data])
        weight = torch.cat([d[2] for d in data])
        return positive, negative, weight, data[0][3]


class KGEModel(nn.Module):
    regime = "negative_sampling"

    def __init__(self, nentity, nrelation, args, double_entity=False, double_relation=False):
        super().__init__()
        self.gamma = nn.Parameter(torch.Tensor([args.gamma]), requires_grad=False)
        self.embedding_range = nn.Parameter(torch.Tensor([(args.gamma + 2.0) / args.hidden_dim]), requires_grad=False)
        entity_dim = args.hidden_dim * 2 if double_entity else args.hidden_dim
        relation_dim = args.hidden_dim * 2 if double_relation else args.hidden_dim
        self.entity_embedding = nn.Parameter(torch.zeros(nentity, entity_dim))
        self.relation_embedding = nn.Parameter(torch.zeros(nrelation, relation_dim))
        nn.init.uniform_(self.entity_embedding, -self.embedding_range.item(), self.embedding_range.item())
        nn.init.uniform_(self.relation_embedding, -self.embedding_range.item(), self.embedding_range.item())

    def score(self, head, relation, tail, mode):
        raise NotImplementedError

    def forward(self, sample, mode="single"):
        if mode == "single":
            head = torch.index_select(self.entity_embedding, 0, sample[:, 0]).unsqueeze(1)
            relation = torch.index_select(self.relation_embedding, 0, sample[:, 1]).unsqueeze(1)
            tail = torch.index_select(self.entity_embedding, 0, sample[:, 2]).unsqueeze(1)
        else:
            positive, negative = sample
            b, n = negative.shape
            relation = torch.index_select(self.relation_embedding, 0, positive[:, 1]).unsqueeze(1)
            neg = torch.index_select(self.entity_embedding, 0, negative.view(-1)).view(b, n, -1)
            if mode == "head-batch":
                head, tail = neg, torch.index_select(self.entity_embedding, 0, positive[:, 2]).unsqueeze(1)
            else:
                head, tail = torch.index_select(self.entity_embedding, 0, positive[:, 0]).unsqueeze(1), neg
        return self.score(head, relation, tail, mode)


class TransE(KGEModel):
    def score(self, head, relation, tail, mode):
        score = head + (relation - tail) if mode == "head-batch" else (head + relation) - tail
        return self.gamma.item() - torch.norm(score, p=1, dim=2)


class DistMult(KGEModel):
    def score(self, head, relation, tail, mode):
        score = head * (relation * tail) if mode == "head-batch" else (head * relation) * tail
        return score.sum(dim=2)


class RotatE(KGEModel):
    def __init__(self, nentity, nrelation, args):
        super().__init__(nentity, nrelation, args, double_entity=True)

    def score(self, head, relation, tail, mode):
        re_head, im_head = torch.chunk(head, 2, dim=2)
        re_tail, im_tail = torch.chunk(tail, 2, dim=2)
        phase = relation / (self.embedding_range.item() / PI)
        re_rel, im_rel = torch.cos(phase), torch.sin(phase)
        if mode == "head-batch":
            re_score = re_rel * re_tail + im_rel * im_tail - re_head
            im_score = re_rel * im_tail - im_rel * re_tail - im_head
        else:
            re_score = re_head * re_rel - im_head * im_rel - re_tail
            im_score = re_head * im_rel + im_head * re_rel - im_tail
        score = torch.stack([re_score, im_score], dim=0).norm(dim=0)
        return self.gamma.item() - score.sum(dim=2)


class TuckER(nn.Module):
    regime = "1-N"

    def __init__(self, nentity, nrelation, args):
        super().__init__()
        d1, d2 = args.hidden_dim, args.relation_dim
        self.E = nn.Embedding(nentity, d1)
        self.R = nn.Embedding(nrelation, d2)
        self.W = nn.Parameter(torch.tensor(np.random.uniform(-1, 1, (d2, d1, d1)), dtype=torch.float32))
        self.input_dropout, self.hidden_dropout1, self.hidden_dropout2 = nn.Dropout(0.3), nn.Dropout(0.4), nn.Dropout(0.5)
        self.bn0, self.bn1 = nn.BatchNorm1d(d1), nn.BatchNorm1d(d1)
        self.label_smoothing = args.label_smoothing
        nn.init.xavier_normal_(self.E.weight.data)
        nn.init.xavier_normal_(self.R.weight.data)

    def forward(self, e1_idx, r_idx, targets=None):
        e1 = self.E(e1_idx)
        x = self.input_dropout(self.bn0(e1)).view(-1, 1, e1.size(1))
        W_mat = torch.mm(self.R(r_idx), self.W.view(self.W.size(0), -1)).view(-1, e1.size(1), e1.size(1))
        x = torch.bmm(x, self.hidden_dropout1(W_mat)).view(-1, e1.size(1))
        x = self.hidden_dropout2(self.bn1(x))
        pred = torch.sigmoid(torch.mm(x, self.E.weight.transpose(1, 0)))
        if targets is None:
            return pred
        targets = (1.0 - self.label_smoothing) * targets + 1.0 / targets.size(1)
        log_p = torch.log(pred + 1e-10)  # expect: AMP011
        log_not_p = torch.log(1.0 - pred + 1e-10)  # expect: AMP011
        loss = -(targets * log_p + (1.0 - targets) * log_not_p).mean()
        return pred, loss


MODEL_REGISTRY = {"TransE": TransE, "DistMult": DistMult, "RotatE": RotatE, "TuckER": TuckER}


def train_step(model, optimizer, scaler, batch, args):
    model.train()
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
        if model.regime == "1-N":
            e1, rel, targets = (t.cuda() for t in batch)
            _, loss = model(e1, rel, targets)
            log = {"loss": loss.item()}
        else:
            positive, negative, weight, mode = batch
            positive, negative, weight = positive.cuda(), negative.cuda(), weight.cuda()
            negative_score = model((positive, negative), mode=mode)
            negative_score = (F.softmax(negative_score * args.adversarial_temperature, dim=1).detach()
                              * F.logsigmoid(-negative_score)).sum(dim=1)
            positive_score = F.logsigmoid(model(positive)).squeeze(dim=1)
            if args.uni_weight:
                positive_loss, negative_loss = -positive_score.mean(), -negative_score.mean()
            else:
                positive_loss = -(weight * positive_score).sum() / weight.sum()
                negative_loss = -(weight * negative_score).sum() / weight.sum()
            loss = (positive_loss + negative_loss) / 2
            if args.regularization > 0:
                loss = loss + args.regularization * (model.entity_embedding.norm(p=3) ** 3
                                                     + model.relation_embedding.norm(p=3) ** 3)
            log = {"positive_loss": positive_loss.item(), "negative_loss": negative_loss.item(), "loss": loss.item()}
    loss = scaler.scale(loss)
    loss.backward()
    optimizer.step()  # expect: AMP006
    return log


@torch.no_grad()
def evaluate_ranking(model, triples, all_true, nentity, batch_size=64):
    model.eval()
    ranks = []
    for i in range(0, len(triples), batch_size):
        batch = torch.tensor(triples[i:i + batch_size]).cuda()
        if model.regime == "1-N":
            scores = model(batch[:, 0], batch[:, 1])
        else:
            cands = torch.arange(nentity, device=batch.device).expand(batch.size(0), -1)
            scores = model((batch, cands), mode="tail-batch")
        for j, (h, r, t) in enumerate(batch.tolist()):
            filt = [e for e in all_true[(h, r)] if e != t]
            scores[j, filt] = float("-inf")
        target = scores.gather(1, batch[:, 2:3])
        ranks.append(1 + (scores > target).sum(dim=1).float())
    ranks = torch.cat(ranks)
    return {"MRR": (1.0 / ranks).mean().item(), "HITS@1": (ranks <= 1).float().mean().item(),
            "HITS@10": (ranks <= 10).float().mean().item()}


def one_to_n_batches(triples, nentity, batch_size):
    er_vocab = defaultdict(list)
    for h, r, t in triples:
        er_vocab[(h, r)].append(t)
    keys = list(er_vocab)
    np.random.shuffle(keys)
    for i in range(0, len(keys), batch_size):
        chunk = keys[i:i + batch_size]
        targets = np.zeros((len(chunk), nentity), dtype=np.float32)
        for row, key in enumerate(chunk):
            targets[row, er_vocab[key]] = 1.0
        pairs = torch.tensor(chunk)
        yield pairs[:, 0], pairs[:, 1], torch.from_numpy(targets)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data_path", required=True)
    p.add_argument("--model", default="RotatE", choices=list(MODEL_REGISTRY))
    p.add_argument("--hidden_dim", type=int, default=1000)
    p.add_argument("--relation_dim", type=int, default=200)
    p.add_argument("--gamma", type=float, default=24.0)
    p.add_argument("--adversarial_temperature", type=float, default=1.0)
    p.add_argument("--negative_sample_size", type=int, default=256)
    p.add_argument("--batch_size", type=int, default=1024)
    p.add_argument("--regularization", type=float, default=0.0)
    p.add_argument("--label_smoothing", type=float, default=0.1)
    p.add_argument("--uni_weight", action="store_true")
    p.add_argument("--amp", action="store_true")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max_steps", type=int, default=100000)
    args = p.parse_args()

    with open(os.path.join(args.data_path, "entities.dict")) as f:
        entity2id = {name: int(i) for i, name in (line.strip().split("\t") for line in f)}
    with open(os.path.join(args.data_path, "relations.dict")) as f:
        relation2id = {name: int(i) for i, name in (line.strip().split("\t") for line in f)}
    train = read_triples(os.path.join(args.data_path, "train.txt"), entity2id, relation2id)
    valid = read_triples(os.path.join(args.data_path, "valid.txt"), entity2id, relation2id)
    nentity, nrelation = len(entity2id), len(relation2id)
    all_true = defaultdict(list)
    for h, r, t in train + valid:
        all_true[(h, r)].append(t)

    model = MODEL_REGISTRY[args.model](nentity, nrelation, args).cuda()
    optimizer = torch.optim.Adam(filter(lambda q: q.requires_grad, model.parameters()), lr=args.lr)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)  # expect: AMP009

    if model.regime == "1-N":
        def batches():
            while True:
                yield from one_to_n_batches(train, nentity, args.batch_size)
    else:
        loaders = [DataLoader(NegativeSamplingDataset(train, nentity, args.negative_sample_size, m),
                              batch_size=args.batch_size, shuffle=True, num_workers=4,
                              collate_fn=NegativeSamplingDataset.collate_fn) for m in ("head-batch", "tail-batch")]

        def batches():
            while True:
                for head_batch, tail_batch in zip(*loaders):
                    yield head_batch
                    yield tail_batch
    stream = batches()
    for step in range(args.max_steps):
        log = train_step(model, optimizer, scaler, next(stream), args)
        if step % 100 == 0:
            logging.info("step %d %s", step, log)
        if step % 10000 == 0 and step > 0:
            logging.info("valid %s", evaluate_ranking(model, valid, all_true, nentity))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main()
