"""AWD-LSTM language model with a Mixture-of-Softmaxes output layer (Yang et al., 2018).

    python mos_lm.py --data data/penn --n-experts 15 --epochs 300 --bptt 70
"""
import argparse
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


amp_ctx = torch.autocast(device_type="cuda", dtype=torch.float16)


class Corpus:
    def __init__(self, path):
        self.dictionary = {}
        self.train = self.tokenize(os.path.join(path, "train.txt"))
        self.valid = self.tokenize(os.path.join(path, "valid.txt"))
        self.test = self.tokenize(os.path.join(path, "test.txt"))

    def tokenize(self, path):
        ids = []
        with open(path, encoding="utf8") as f:
            for line in f:
                for word in line.split() + ["<eos>"]:
                    if word not in self.dictionary:
                        self.dictionary[word] = len(self.dictionary)
                    ids.append(self.dictionary[word])
        return torch.tensor(ids, dtype=torch.long)


def batchify(data, bsz, device):
    nbatch = data.size(0) // bsz
    return data[: nbatch * bsz].view(bsz, -1).t().contiguous().to(device)


def get_batch(source, i, seq_len):
    seq_len = min(seq_len, len(source) - 1 - i)
    return source[i:i + seq_len], source[i + 1:i + 1 + seq_len].reshape(-1)


def repackage_hidden(h):
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


class LockedDropout(nn.Module):
    def forward(self, x, p=0.5):
        if not self.training or p == 0:
            return x
        mask = x.new_empty(1, x.size(1), x.size(2)).bernoulli_(1 - p) / (1 - p)
        return x * mask


class MoSHead(nn.Module):
    def __init__(self, nhid, emb_dim, ntoken, n_experts):
        super().__init__()
        self.emb_dim = emb_dim
        self.prior = nn.Linear(nhid, n_experts, bias=False)
        self.latent = nn.Linear(nhid, n_experts * emb_dim)
        self.decoder = nn.Linear(emb_dim, ntoken)


def mixture_of_softmaxes(hidden, head, n_experts, expert_dropout=0.0):
    """hidden: (N, nhid) -> log p(w | context), shape (N, ntoken)."""
    prior_logit = hidden @ head.prior.weight.t()
    # keep the gate logits centred, helps when whole experts are dropped
    prior_logit = prior_logit - prior_logit.mean(dim=-1, keepdim=True)  # expect: AMP004
    if expert_dropout > 0.0:
        drop = torch.rand_like(prior_logit) < expert_dropout
        prior_logit = prior_logit.masked_fill(drop, -1e9)  # expect: AMP007
    prior = F.softmax(prior_logit, dim=-1)
    latent = torch.tanh(head.latent(hidden)).view(-1, head.emb_dim)
    probs = F.softmax(head.decoder(latent), dim=-1).view(hidden.size(0), n_experts, -1)
    prob = (probs * prior.unsqueeze(-1)).sum(dim=1)
    return torch.log(prob + 1e-8)


class RNNModel(nn.Module):
    def __init__(self, ntoken, ninp, nhid, nlayers, n_experts, dropout=0.4, dropouth=0.25, dropouti=0.4):
        super().__init__()
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnns = nn.ModuleList([
            nn.LSTM(ninp if l == 0 else nhid, nhid if l != nlayers - 1 else ninp, 1)
            for l in range(nlayers)
        ])
        self.lockdrop = LockedDropout()
        self.mos = MoSHead(ninp, ninp, ntoken, n_experts)
        self.mos.decoder.weight = self.encoder.weight
        self.dropout, self.dropouth, self.dropouti = dropout, dropouth, dropouti
        self.encoder.weight.data.uniform_(-0.1, 0.1)

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return [
            (weight.new_zeros(1, bsz, rnn.hidden_size), weight.new_zeros(1, bsz, rnn.hidden_size))
            for rnn in self.rnns
        ]

    def forward(self, input, hidden, return_h=False):
        raw_output = self.lockdrop(self.encoder(input), self.dropouti)
        new_hidden, raw_outputs, outputs = [], [], []
        for l, rnn in enumerate(self.rnns):
            raw_output, new_h = rnn(raw_output, hidden[l])
            new_hidden.append(new_h)
            raw_outputs.append(raw_output)
            if l != len(self.rnns) - 1:
                raw_output = self.lockdrop(raw_output, self.dropouth)
                outputs.append(raw_output)
        output = self.lockdrop(raw_output, self.dropout)
        outputs.append(output)
        output = output.view(-1, output.size(2))
        if return_h:
            return output, new_hidden, raw_outputs, outputs
        return output, new_hidden


@torch.no_grad()
def evaluate(model, data_source, args, batch_size=10):
    model.eval()
    total_loss = 0.0
    hidden = model.init_hidden(batch_size)
    for i in range(0, data_source.size(0) - 1, args.bptt):
        data, targets = get_batch(data_source, i, args.bptt)
        with amp_ctx:
            output, hidden = model(data, hidden)
            log_prob = mixture_of_softmaxes(output, model.mos, args.n_experts)
            loss = F.nll_loss(log_prob, targets)
        total_loss += len(data) * loss.item()
        hidden = repackage_hidden(hidden)
    model.train()
    return total_loss / len(data_source)


def train_epoch(model, train_data, optimizer, scaler, params, args, epoch):
    model.train()
    hidden = model.init_hidden(args.batch_size)
    total_loss, start, batch, i = 0.0, time.time(), 0, 0
    while i < train_data.size(0) - 2:
        bptt = args.bptt if torch.rand(1).item() < 0.95 else args.bptt / 2
        seq_len = max(5, int(torch.normal(torch.tensor(float(bptt)), torch.tensor(5.0)).item()))
        for group in optimizer.param_groups:
            group["lr"] = args.lr * seq_len / args.bptt
        data, targets = get_batch(train_data, i, seq_len)
        hidden = repackage_hidden(hidden)
        optimizer.zero_grad(set_to_none=True)

        with amp_ctx:
            output, hidden, raw_outputs, outputs = model(data, hidden, return_h=True)
            log_prob = mixture_of_softmaxes(output, model.mos, args.n_experts, args.expert_dropout)
            raw_loss = F.nll_loss(log_prob, targets)
            # activation regularisation (AR) and temporal activation regularisation (TAR)
            loss = raw_loss + args.alpha * outputs[-1].pow(2).mean()
            loss = loss + args.beta * (raw_outputs[-1][1:] - raw_outputs[-1][:-1]).pow(2).mean()
            scaler.scale(loss).backward()  # expect: AMP008

        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, args.clip)
        scaler.step(optimizer)
        scaler.update()

        total_loss += raw_loss.item()
        batch += 1
        i += seq_len
        if batch % args.log_interval == 0:
            cur = total_loss / args.log_interval
            ms = (time.time() - start) * 1000 / args.log_interval
            print(f"| epoch {epoch:3d} | {batch:5d} batches | {ms:5.1f} ms/batch | loss {cur:5.2f} | ppl {math.exp(cur):8.2f}")
            total_loss, start = 0.0, time.time()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/penn")
    ap.add_argument("--emsize", type=int, default=280)
    ap.add_argument("--nhid", type=int, default=960)
    ap.add_argument("--nlayers", type=int, default=3)
    ap.add_argument("--n-experts", type=int, default=15)
    ap.add_argument("--expert-dropout", type=float, default=0.0)
    ap.add_argument("--lr", type=float, default=20.0)
    ap.add_argument("--clip", type=float, default=0.25)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=12)
    ap.add_argument("--bptt", type=int, default=70)
    ap.add_argument("--alpha", type=float, default=2.0)
    ap.add_argument("--beta", type=float, default=1.0)
    ap.add_argument("--wdecay", type=float, default=1.2e-6)
    ap.add_argument("--log-interval", type=int, default=200)
    ap.add_argument("--save", default="mos_lm.pt")
    args = ap.parse_args()

    device = torch.device("cuda")
    corpus = Corpus(args.data)
    train_data = batchify(corpus.train, args.batch_size, device)
    val_data = batchify(corpus.valid, 10, device)
    ntokens = len(corpus.dictionary)

    model = RNNModel(ntokens, args.emsize, args.nhid, args.nlayers, args.n_experts).to(device)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=args.lr, weight_decay=args.wdecay)
    scaler = torch.amp.GradScaler("cuda")

    best_val = 1e9
    for epoch in range(1, args.epochs + 1):
        train_epoch(model, train_data, optimizer, scaler, params, args, epoch)
        val_loss = evaluate(model, val_data, args)
        print(f"| end of epoch {epoch:3d} | valid loss {val_loss:5.2f} | valid ppl {math.exp(val_loss):8.2f}")
        if val_loss < best_val:
            best_val = val_loss
            torch.save(model.state_dict(), args.save)


if __name__ == "__main__":
    main()
