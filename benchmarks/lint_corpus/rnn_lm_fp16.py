"""Word-level LSTM language model (pytorch/examples word_language_model) with fp16 options."""
import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class RNNModel(nn.Module):
    def __init__(self, ntoken, ninp, nhid, nlayers, dropout=0.5, tie_weights=False):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        if tie_weights:
            self.decoder.weight = self.encoder.weight
        self.nlayers = nlayers
        self.nhid = nhid

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output).view(-1, self.decoder.out_features)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid))


def repackage_hidden(h):
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def get_batch(source, i, bptt):
    seq_len = min(bptt, len(source) - 1 - i)
    return source[i : i + seq_len], source[i + 1 : i + 1 + seq_len].view(-1)


def train_epoch(model, train_data, criterion, lr, args, epoch):
    model.train()
    total_loss = 0.0
    start_time = time.time()
    hidden = model.init_hidden(args.batch_size)
    for batch, i in enumerate(range(0, train_data.size(0) - 1, args.bptt)):
        data, targets = get_batch(train_data, i, args.bptt)
        model.zero_grad()
        hidden = repackage_hidden(hidden)
        if args.fp16_hidden:
            hidden = tuple(h.half() for h in hidden)
        output, hidden = model(data, hidden)
        loss = criterion(output, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        total_loss += loss.item()
        if batch % args.log_interval == 0 and batch > 0:
            cur_loss = total_loss / args.log_interval
            print(f"| epoch {epoch:3d} | lr {lr:02.2f} | loss {cur_loss:5.2f} | ppl {math.exp(cur_loss):8.2f}"
                  f" | {(time.time() - start_time) * 1000 / args.log_interval:5.2f} ms/batch")
            total_loss = 0
            start_time = time.time()


def train_epoch_amp(model, train_data, criterion, optimizer, args):
    model.train()
    hidden = model.init_hidden(args.batch_size)
    for batch, i in enumerate(range(0, train_data.size(0) - 1, args.bptt)):
        data, targets = get_batch(train_data, i, args.bptt)
        hidden = repackage_hidden(hidden)
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
            output, hidden = model(data, hidden)
            loss = criterion(output, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()


def evaluate(model, data_source, criterion, args):
    model.eval()
    model.half()
    total_loss = 0.0
    hidden = model.init_hidden(10)
    with torch.no_grad():
        for i in range(0, data_source.size(0) - 1, args.bptt):
            data, targets = get_batch(data_source, i, args.bptt)
            output, hidden = model(data, hidden)
            total_loss += len(data) * criterion(output.float(), targets).item()
            hidden = repackage_hidden(hidden)
    model.float()
    return total_loss / (len(data_source) - 1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=20)
    parser.add_argument("--clip", type=float, default=0.25)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--batch_size", type=int, default=20)
    parser.add_argument("--bptt", type=int, default=35)
    parser.add_argument("--log-interval", type=int, default=200)
    parser.add_argument("--fp16-hidden", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda")
    train_data = torch.randint(0, 10000, (100000, args.batch_size), device=device)
    model = RNNModel(10000, 650, 650, 2).to(device)
    model = model.to(torch.half)  # expect: AMP001
    criterion = nn.NLLLoss()
    lr = args.lr
    best_val_loss = None
    for epoch in range(1, args.epochs + 1):
        train_epoch(model, train_data, criterion, lr, args, epoch)
        val_loss = evaluate(model, train_data[:1000], criterion, args)
        if best_val_loss is None or val_loss < best_val_loss:
            with open("model.pt", "wb") as f:
                torch.save(model, f)
            best_val_loss = val_loss
        else:
            lr /= 4.0


if __name__ == "__main__":
    main()
