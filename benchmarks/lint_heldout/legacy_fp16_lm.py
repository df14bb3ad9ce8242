"""Word-level LSTM language model with an old-style `--fp16` switch (pure fp16, no autocast)."""
import argparse
import math
import time

import torch
import torch.nn as nn

import data

parser = argparse.ArgumentParser(description="LSTM LM on WikiText-103")
parser.add_argument("--data", default="./data/wikitext-103")
parser.add_argument("--emsize", type=int, default=400)
parser.add_argument("--nhid", type=int, default=1150)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--epochs", type=int, default=20)
parser.add_argument("--bptt", type=int, default=70)
parser.add_argument("--clip", type=float, default=0.25)
parser.add_argument("--fp16", action="store_true", help="run the whole model in half precision")
args = parser.parse_args()


class RNNModel(nn.Module):
    def __init__(self, ntoken, ninp, nhid, nlayers=3, dropout=0.4):
        super().__init__()
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.drop = nn.Dropout(dropout)

    def forward(self, tokens, hidden):
        emb = self.drop(self.encoder(tokens))
        output, hidden = self.rnn(emb, hidden)
        return self.decoder(self.drop(output)), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        n, h = self.rnn.num_layers, self.rnn.hidden_size
        return weight.new_zeros(n, bsz, h), weight.new_zeros(n, bsz, h)


corpus = data.Corpus(args.data)
train_data = corpus.batchify(corpus.train, 80).cuda()
val_data = corpus.batchify(corpus.valid, 10).cuda()
ntokens = len(corpus.dictionary)

model = RNNModel(ntokens, args.emsize, args.nhid).cuda()
if args.fp16:
    model = model.half()
optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, eps=1e-8, weight_decay=1.2e-6)  # expect: AMP011
criterion = nn.CrossEntropyLoss()


def repackage(h):
    return tuple(v.detach() for v in h)


def evaluate(source):
    model.eval()
    total, hidden = 0.0, model.init_hidden(10)
    with torch.no_grad():
        for i in range(0, source.size(0) - 1, args.bptt):
            x, y = source[i:i + args.bptt], source[i + 1:i + 1 + args.bptt]
            out, hidden = model(x, hidden)
            total += len(x) * criterion(out.view(-1, ntokens).float(), y.reshape(-1)).item()
    return total / len(source)


def train_epoch(epoch):
    model.train()
    hidden = model.init_hidden(80)
    start = time.time()
    for batch, i in enumerate(range(0, train_data.size(0) - 1, args.bptt)):
        x, y = train_data[i:i + args.bptt], train_data[i + 1:i + 1 + args.bptt]
        hidden = repackage(hidden)
        optimizer.zero_grad()
        out, hidden = model(x, hidden)
        loss = criterion(out.view(-1, ntokens).float(), y.reshape(-1))
        (loss * 128.0 if args.fp16 else loss).backward()
        if args.fp16:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.div_(128.0)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        if batch % 200 == 0:
            print(f"| epoch {epoch} | batch {batch} | loss {loss.item():.2f} | ppl {math.exp(loss.item()):.1f} | {time.time() - start:.0f}s")


for epoch in range(1, args.epochs + 1):
    train_epoch(epoch)
    val = evaluate(val_data)
    print(f"| end of epoch {epoch} | valid ppl {math.exp(val):.2f}")
    with open("model.pt", "wb") as f:
        torch.save(model, f)
