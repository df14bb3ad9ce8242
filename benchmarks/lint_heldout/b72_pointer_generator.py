"""Pointer-generator network with coverage (See et al., 2017) for abstractive summarisation.

The copy switch p_gen can also be supervised directly ("gate loss") with the oracle
generate/copy decisions that the batcher derives from the reference summary.
"""
import argparse
import logging
import os
import time
from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.nn.utils import clip_grad_norm_

from summ.data import SummarizationBatcher, Vocab
from summ.rouge import rouge_scores
from summ.utils import load_checkpoint, save_checkpoint

logger = logging.getLogger(__name__)


class Encoder(nn.Module):
    def __init__(self, vocab_size, emb_dim, hidden_dim):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, emb_dim, padding_idx=0)
        self.lstm = nn.LSTM(emb_dim, hidden_dim, num_layers=1, batch_first=True, bidirectional=True)
        self.W_h = nn.Linear(hidden_dim * 2, hidden_dim * 2, bias=False)

    def forward(self, enc_input, enc_lens):
        embedded = self.embedding(enc_input)
        packed = nn.utils.rnn.pack_padded_sequence(embedded, enc_lens.cpu(), batch_first=True, enforce_sorted=False)
        output, hidden = self.lstm(packed)
        enc_outputs, _ = nn.utils.rnn.pad_packed_sequence(output, batch_first=True, total_length=enc_input.size(1))
        return enc_outputs, self.W_h(enc_outputs), hidden


class ReduceState(nn.Module):
    def __init__(self, hidden_dim):
        super().__init__()
        self.hidden_dim = hidden_dim
        self.reduce_h = nn.Linear(hidden_dim * 2, hidden_dim)
        self.reduce_c = nn.Linear(hidden_dim * 2, hidden_dim)

    def forward(self, hidden):
        h, c = hidden  # 2 x B x H each
        h_in = h.transpose(0, 1).reshape(-1, self.hidden_dim * 2)
        c_in = c.transpose(0, 1).reshape(-1, self.hidden_dim * 2)
        return F.relu(self.reduce_h(h_in)).unsqueeze(0), F.relu(self.reduce_c(c_in)).unsqueeze(0)


class Attention(nn.Module):
    def __init__(self, hidden_dim, use_coverage):
        super().__init__()
        self.decode_proj = nn.Linear(hidden_dim * 2, hidden_dim * 2)
        self.v = nn.Linear(hidden_dim * 2, 1, bias=False)
        self.W_c = nn.Linear(1, hidden_dim * 2, bias=False) if use_coverage else None

    def forward(self, s_t_hat, enc_outputs, enc_feature, enc_padding_mask, coverage):
        att_features = enc_feature + self.decode_proj(s_t_hat).unsqueeze(1)
        if self.W_c is not None:
            att_features = att_features + self.W_c(coverage.unsqueeze(-1))
        scores = self.v(torch.tanh(att_features)).squeeze(-1)  # B x T_enc
        scores = scores.masked_fill(enc_padding_mask == 0, -1e10)  # expect: AMP007
        attn_dist = F.softmax(scores, dim=1)
        c_t = torch.bmm(attn_dist.unsqueeze(1), enc_outputs).squeeze(1)
        if self.W_c is not None:
            coverage = coverage + attn_dist
        return c_t, attn_dist, coverage


class Decoder(nn.Module):
    def __init__(self, vocab_size, emb_dim, hidden_dim, use_coverage):
        super().__init__()
        self.hidden_dim = hidden_dim
        self.embedding = nn.Embedding(vocab_size, emb_dim, padding_idx=0)
        self.attention = Attention(hidden_dim, use_coverage)
        self.x_context = nn.Linear(hidden_dim * 2 + emb_dim, emb_dim)
        self.lstm = nn.LSTM(emb_dim, hidden_dim, batch_first=True)
        self.p_gen_linear = nn.Linear(hidden_dim * 4 + emb_dim, 1)
        self.out1 = nn.Linear(hidden_dim * 3, hidden_dim)
        self.out2 = nn.Linear(hidden_dim, vocab_size)

    def forward(self, y_t_1, s_t_1, enc_outputs, enc_feature, enc_padding_mask, c_t_1, extra_zeros,
                enc_batch_extend_vocab, coverage):
        x = self.x_context(torch.cat((c_t_1, self.embedding(y_t_1)), 1))
        lstm_out, s_t = self.lstm(x.unsqueeze(1), s_t_1)
        h_dec, c_dec = s_t
        s_t_hat = torch.cat((h_dec.view(-1, self.hidden_dim), c_dec.view(-1, self.hidden_dim)), 1)
        c_t, attn_dist, coverage_next = self.attention(s_t_hat, enc_outputs, enc_feature, enc_padding_mask, coverage)
        p_gen = torch.sigmoid(self.p_gen_linear(torch.cat((c_t, s_t_hat, x), 1)))
        output = torch.cat((lstm_out.view(-1, self.hidden_dim), c_t), 1)
        vocab_dist = F.softmax(self.out2(self.out1(output)), dim=1)
        # mix the two distributions in fp32: the copy probabilities can be tiny
        p = p_gen.float()
        vocab_dist_ = p * vocab_dist.float()
        attn_dist_ = (1 - p) * attn_dist.float()
        if extra_zeros is not None:
            vocab_dist_ = torch.cat([vocab_dist_, extra_zeros], 1)
        final_dist = vocab_dist_.scatter_add(1, enc_batch_extend_vocab, attn_dist_)
        return final_dist, s_t, c_t, attn_dist, p_gen, coverage_next


class PointerGenerator(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.hidden_dim = cfg.hidden_dim
        self.use_coverage = cfg.use_coverage
        self.encoder = Encoder(cfg.vocab_size, cfg.emb_dim, cfg.hidden_dim)
        self.reduce_state = ReduceState(cfg.hidden_dim)
        self.decoder = Decoder(cfg.vocab_size, cfg.emb_dim, cfg.hidden_dim, cfg.use_coverage)
        self.decoder.embedding.weight = self.encoder.embedding.weight

    def encode(self, batch):
        enc_outputs, enc_feature, enc_hidden = self.encoder(batch.enc_input, batch.enc_lens)
        return enc_outputs, enc_feature, self.reduce_state(enc_hidden)

    def forward(self, batch):
        enc_outputs, enc_feature, s_t = self.encode(batch)
        B, T_dec = batch.dec_input.shape
        c_t = enc_outputs.new_zeros(B, 2 * self.hidden_dim)
        coverage = torch.zeros(batch.enc_input.shape, device=batch.enc_input.device) if self.use_coverage else None
        final_dists, attn_dists, coverages, p_gens = [], [], [], []
        for di in range(T_dec):
            final_dist, s_t, c_t, attn_dist, p_gen, next_coverage = self.decoder(
                batch.dec_input[:, di], s_t, enc_outputs, enc_feature, batch.enc_padding_mask, c_t,
                batch.extra_zeros, batch.enc_batch_extend_vocab, coverage,
            )
            final_dists.append(final_dist)
            attn_dists.append(attn_dist)
            coverages.append(coverage)
            p_gens.append(p_gen.squeeze(1))
            coverage = next_coverage
        return {
            "final_dists": torch.stack(final_dists, 1),
            "attn_dists": torch.stack(attn_dists, 1),
            "coverages": torch.stack(coverages, 1) if self.use_coverage else None,
            "p_gens": torch.stack(p_gens, 1),
        }

    @torch.no_grad()
    def greedy_decode(self, batch, max_dec_steps, min_dec_steps, vocab):
        enc_outputs, enc_feature, s_t = self.encode(batch)
        B = enc_outputs.size(0)
        c_t = enc_outputs.new_zeros(B, 2 * self.hidden_dim)
        coverage = torch.zeros(batch.enc_input.shape, device=enc_outputs.device) if self.use_coverage else None
        y_t = torch.full((B,), vocab.start_id, dtype=torch.long, device=enc_outputs.device)
        out = []
        for step in range(max_dec_steps):
            final_dist, s_t, c_t, _, _, coverage = self.decoder(
                y_t, s_t, enc_outputs, enc_feature, batch.enc_padding_mask, c_t,
                batch.extra_zeros, batch.enc_batch_extend_vocab, coverage,
            )
            log_probs = torch.log(final_dist.float() + 1e-12)
            log_probs[:, vocab.unk_id] = -1e9
            if step < min_dec_steps:
                log_probs[:, vocab.stop_id] = -1e9
            y_t = log_probs.argmax(1)
            out.append(y_t)
            # copied OOV ids are fed back as UNK
            y_t = y_t.masked_fill(y_t >= vocab.size(), vocab.unk_id)
        return torch.stack(out, 1)


class PGCriterion(nn.Module):
    def __init__(self, cov_loss_wt=1.0, gate_loss_wt=0.0, eps=1e-12):
        super().__init__()
        self.cov_loss_wt = cov_loss_wt
        self.gate_loss_wt = gate_loss_wt
        self.eps = eps
        self.gate_criterion = nn.BCELoss(reduction="none")

    def forward(self, outputs, batch):
        dec_mask = batch.dec_padding_mask.float()
        dec_lens = dec_mask.sum(1)
        final = outputs["final_dists"].float()
        gold_probs = torch.gather(final, 2, batch.target.unsqueeze(2)).squeeze(2)
        step_losses = -torch.log(gold_probs + self.eps)
        losses = {"nll": ((step_losses * dec_mask).sum(1) / dec_lens).mean()}
        if outputs["coverages"] is not None:
            attn = outputs["attn_dists"].float()
            cov = torch.sum(torch.min(attn, outputs["coverages"].float()), dim=2)
            losses["coverage"] = self.cov_loss_wt * ((cov * dec_mask).sum(1) / dec_lens).mean()
        if self.gate_loss_wt > 0:
            gate = self.gate_criterion(outputs["p_gens"], batch.gen_labels.float())  # expect: AMP003
            losses["gate"] = self.gate_loss_wt * ((gate.float() * dec_mask).sum(1) / dec_lens).mean()
        return losses


def train_epoch(model, loader, criterion, optimizer, scaler, amp_ctx, epoch, args):
    model.train()
    start = time.time()
    for step, batch in enumerate(loader):
        batch = batch.to(args.device)
        with amp_ctx:
            outputs = model(batch)
            losses = criterion(outputs, batch)
        loss = sum(losses.values())

        optimizer.zero_grad()
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            clip_grad_norm_(model.parameters(), args.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()  # expect: AMP006

        if step % args.log_every == 0:
            parts = ", ".join(f"{k} {v.item():.4f}" for k, v in losses.items())
            logger.info("epoch %d step %d | %s | %.2fs/step", epoch, step, parts,
                        (time.time() - start) / (step + 1))


@torch.no_grad()
def validate(model, loader, criterion, amp_ctx, args):
    model.eval()
    total, n = 0.0, 0
    for batch in loader:
        batch = batch.to(args.device)
        with amp_ctx:
            losses = criterion(model(batch), batch)
        total += losses["nll"].item()
        n += 1
    return total / max(n, 1)


@torch.inference_mode()
def decode(model, loader, vocab, args):
    model.eval()
    hyps, refs = [], []
    for batch in loader:
        batch = batch.to(args.device)
        ids = model.greedy_decode(batch, args.max_dec_steps, args.min_dec_steps, vocab)
        for row, oovs, ref in zip(ids.tolist(), batch.art_oovs, batch.original_abstracts):
            hyps.append(vocab.decode(row, oovs))
            refs.append(ref)
    return rouge_scores(hyps, refs)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--vocab", required=True)
    p.add_argument("--log-root", default="log/pg")
    p.add_argument("--emb-dim", type=int, default=128)
    p.add_argument("--hidden-dim", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=50000)
    p.add_argument("--coverage", action="store_true")
    p.add_argument("--cov-loss-wt", type=float, default=1.0)
    p.add_argument("--gate-loss-wt", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=0.15)
    p.add_argument("--max-grad-norm", type=float, default=2.0)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--max-dec-steps", type=int, default=120)
    p.add_argument("--min-dec-steps", type=int, default=35)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO)

    vocab = Vocab(args.vocab, args.vocab_size)
    train_loader = SummarizationBatcher(args.data, "train", vocab, batch_size=16, shuffle=True)
    val_loader = SummarizationBatcher(args.data, "val", vocab, batch_size=32)
    cfg = argparse.Namespace(vocab_size=args.vocab_size, emb_dim=args.emb_dim, hidden_dim=args.hidden_dim,
                             use_coverage=args.coverage)
    model = PointerGenerator(cfg).to(args.device)
    criterion = PGCriterion(args.cov_loss_wt, args.gate_loss_wt)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=args.lr, initial_accumulator_value=0.1)
    scaler = torch.amp.GradScaler("cuda") if args.amp else None
    amp_ctx = torch.autocast("cuda", dtype=torch.float16) if args.amp else nullcontext()

    best_val = 1e9
    for epoch in range(args.epochs):
        train_epoch(model, train_loader, criterion, optimizer, scaler, amp_ctx, epoch, args)
        val_loss = validate(model, val_loader, criterion, amp_ctx, args)
        logger.info("epoch %d val nll %.4f", epoch, val_loss)
        if val_loss < best_val:
            best_val = val_loss
            save_checkpoint(os.path.join(args.log_root, "best.pt"), model, optimizer, scaler, epoch)
    load_checkpoint(os.path.join(args.log_root, "best.pt"), model)
    logger.info("ROUGE: %s", decode(model, val_loader, vocab, args))


if __name__ == "__main__":
    main()
