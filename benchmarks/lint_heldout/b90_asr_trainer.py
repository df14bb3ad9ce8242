# -*- coding: utf-8 -*-
"""Attention encoder-decoder ASR trainer (filterbank features -> BPE tokens).

Originally written against torch 1.10; still used for the librispeech-100 baselines.
"""
from __future__ import absolute_import, division, print_function

import argparse
import logging
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import clip_grad_value_

from asr.data import build_loaders  # project-local

logger = logging.getLogger("asr.train")


def make_pad_mask(lengths, max_len):
    rng = torch.arange(max_len, device=lengths.device)
    return rng.unsqueeze(0) >= lengths.unsqueeze(1)


def add_sos_eos(tokens, sos, eos, pad):
    ys = [y[y != pad] for y in tokens]
    ys_in = [F.pad(y, (1, 0), value=sos) for y in ys]
    ys_out = [F.pad(y, (0, 1), value=eos) for y in ys]
    ys_in = nn.utils.rnn.pad_sequence(ys_in, batch_first=True, padding_value=eos)
    ys_out = nn.utils.rnn.pad_sequence(ys_out, batch_first=True, padding_value=pad)
    return ys_in, ys_out


class Conv2dSubsampling(nn.Module):
    def __init__(self, idim, odim):
        super(Conv2dSubsampling, self).__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, odim, 3, 2), nn.ReLU(), nn.Conv2d(odim, odim, 3, 2), nn.ReLU())
        self.proj = nn.Linear(odim * (((idim - 1) // 2 - 1) // 2), odim)

    def forward(self, x, lengths):
        x = self.conv(x.unsqueeze(1))
        b, c, t, f = x.size()
        x = self.proj(x.transpose(1, 2).contiguous().view(b, t, c * f))
        return x, ((lengths - 1) // 2 - 1) // 2


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, max_len=5000):
        super(PositionalEncoding, self).__init__()
        pe = torch.zeros(max_len, d_model)
        pos = torch.arange(0, max_len).unsqueeze(1).float()
        div = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)
        self.register_buffer("pe", pe.unsqueeze(0))
        self.xscale = math.sqrt(d_model)

    def forward(self, x):
        return x * self.xscale + self.pe[:, : x.size(1)]


class SpeechTransformer(nn.Module):
    def __init__(self, idim, vocab, d_model=256, nhead=4, num_enc=12, num_dec=6):
        super(SpeechTransformer, self).__init__()
        self.subsample = Conv2dSubsampling(idim, d_model)
        self.pos = PositionalEncoding(d_model)
        self.embed = nn.Embedding(vocab, d_model)
        self.transformer = nn.Transformer(d_model, nhead, num_enc, num_dec, dim_feedforward=2048,
                                          dropout=0.1, batch_first=True)
        self.out = nn.Linear(d_model, vocab)

    def forward(self, feats, feat_lens, ys_in):
        x, x_lens = self.subsample(feats, feat_lens)
        src_pad = make_pad_mask(x_lens, x.size(1))
        tgt_mask = self.transformer.generate_square_subsequent_mask(ys_in.size(1)).to(ys_in.device)
        h = self.transformer(self.pos(x), self.pos(self.embed(ys_in)), tgt_mask=tgt_mask,
                             src_key_padding_mask=src_pad, memory_key_padding_mask=src_pad)
        return self.out(h)


class NoamScheduler(object):
    def __init__(self, optimizer, d_model, warmup, factor=5.0):
        self.optimizer, self.d_model, self.warmup, self.factor = optimizer, d_model, warmup, factor
        self.n = 0

    def step(self):
        self.n += 1
        lr = self.factor * self.d_model ** -0.5 * min(self.n ** -0.5, self.n * self.warmup ** -1.5)
        for g in self.optimizer.param_groups:
            g["lr"] = lr


class Trainer(object):
    def __init__(self, model, train_loader, dev_loader, args):
        self.model = model.cuda()
        self.train_loader, self.dev_loader, self.args = train_loader, dev_loader, args
        self.sos = self.eos = args.vocab - 1
        self.pad = 0
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.0, betas=(0.9, 0.98))
        self.scheduler = NoamScheduler(self.optimizer, args.d_model, args.warmup)
        self.scaler = torch.cuda.amp.GradScaler(init_scale=2.0 ** 16)  # expect: AMP009

    def train_epoch(self, epoch):
        self.model.train()
        total = 0.0
        for step, (feats, feat_lens, tokens, _) in enumerate(self.train_loader):
            feats = feats.type(torch.cuda.HalfTensor)  # expect: AMP001
            feat_lens, tokens = feat_lens.cuda(), tokens.cuda()
            ys_in, ys_out = add_sos_eos(tokens, self.sos, self.eos, self.pad)

            with torch.cuda.amp.autocast():  # expect: AMP009
                logits = self.model(feats, feat_lens, ys_in)
                loss = F.cross_entropy(logits.transpose(1, 2), ys_out, ignore_index=self.pad,
                                       label_smoothing=self.args.lsm_weight)

            self.optimizer.zero_grad()
            self.scaler.scale(loss).backward()
            clip_grad_value_(self.model.parameters(), self.args.clip_value)  # expect: AMP005
            self.scaler.step(self.optimizer)  # expect: AMP006
            self.scheduler.step()

            total += loss.item()
            if step % self.args.log_interval == 0:
                logger.info("epoch %d step %d loss %.4f lr %.6f", epoch, step, loss.item(),
                            self.optimizer.param_groups[0]["lr"])
        return total / (step + 1)

    @torch.no_grad()
    def validate(self):
        self.model.eval()
        total, n = 0.0, 0
        for feats, feat_lens, tokens, _ in self.dev_loader:
            feats, feat_lens, tokens = feats.cuda(), feat_lens.cuda(), tokens.cuda()
            ys_in, ys_out = add_sos_eos(tokens, self.sos, self.eos, self.pad)
            logits = self.model(feats, feat_lens, ys_in)
            total += F.cross_entropy(logits.transpose(1, 2), ys_out, ignore_index=self.pad).item()
            n += 1
        return total / max(n, 1)

    def save(self, path, epoch):
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "scaler": self.scaler.state_dict(), "noam_step": self.scheduler.n,
                    "epoch": epoch}, path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", default="data/librispeech100")
    parser.add_argument("--exp-dir", default="exp/transformer")
    parser.add_argument("--idim", type=int, default=80)
    parser.add_argument("--vocab", type=int, default=5000)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=25000)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--lsm-weight", type=float, default=0.1)
    parser.add_argument("--clip-value", type=float, default=5.0)
    parser.add_argument("--log-interval", type=int, default=100)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    os.makedirs(args.exp_dir, exist_ok=True)

    train_loader, dev_loader = build_loaders(args.data_dir)
    model = SpeechTransformer(args.idim, args.vocab, d_model=args.d_model)
    trainer = Trainer(model, train_loader, dev_loader, args)
    best = float("inf")
    for epoch in range(args.epochs):
        train_loss = trainer.train_epoch(epoch)
        dev_loss = trainer.validate()
        logger.info("epoch %d train %.4f dev %.4f", epoch, train_loss, dev_loss)
        trainer.save(os.path.join(args.exp_dir, "last.pth"), epoch)
        if dev_loss < best:
            best = dev_loss
            trainer.save(os.path.join(args.exp_dir, "best.pth"), epoch)


if __name__ == "__main__":
    main()
