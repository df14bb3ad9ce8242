#!/usr/bin/env python
"""Joint CTC / attention (LAS) speech recognition: model, trainer and decoding.

    python train_asr.py --train data/train.tsv --valid data/dev.tsv --spm data/spm5k.model \
        --save-dir exp/las_ctc --epochs 60
"""
import argparse
import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import Dict, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import clip_grad_norm_
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from asr_data import SpeechDataset, TextDataset, build_loader
from asr_metrics import word_error_rate
from asr_tokenizer import SentencePieceTokenizer

logger = logging.getLogger("train_asr")


@dataclass
class TrainConfig:
    n_mels: int = 80
    enc_hidden: int = 512
    enc_layers: int = 3
    dec_hidden: int = 512
    att_dim: int = 256
    vocab_size: int = 5000
    pad_id: int = 0
    sos_id: int = 1
    eos_id: int = 2
    blank_id: int = 3
    ctc_weight: float = 0.3
    eou_weight: float = 0.1
    label_smoothing: float = 0.1
    lr: float = 1e-3
    weight_decay: float = 1e-6
    clip_norm: float = 5.0
    init_loss_scale: float = 2.0**15
    epochs: int = 60
    accum_steps: int = 1
    learn_task_weights: bool = False


class PyramidalBLSTM(nn.Module):
    """Halves the frame rate by concatenating neighbouring frames, then a BLSTM."""

    def __init__(self, input_dim: int, hidden: int):
        super().__init__()
        self.lstm = nn.LSTM(input_dim * 2, hidden, batch_first=True, bidirectional=True)

    def forward(self, x, lens):
        b, t, d = x.shape
        if t % 2:
            x = x[:, :-1]
            t -= 1
        x = x.reshape(b, t // 2, d * 2)
        lens = torch.div(lens, 2, rounding_mode="floor")
        packed = pack_padded_sequence(x, lens.cpu(), batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        out, _ = pad_packed_sequence(out, batch_first=True)
        return out, lens


class Listener(nn.Module):
    def __init__(self, cfg: TrainConfig):
        super().__init__()
        self.input_proj = nn.Linear(cfg.n_mels, cfg.enc_hidden)
        self.layers = nn.ModuleList([PyramidalBLSTM(cfg.enc_hidden, cfg.enc_hidden // 2) for _ in range(cfg.enc_layers)])

    def forward(self, feats, feat_lens):
        x, lens = self.input_proj(feats), feat_lens
        for layer in self.layers:
            x, lens = layer(x, lens)
        return x, lens


class BahdanauAttention(nn.Module):
    def __init__(self, query_dim: int, key_dim: int, att_dim: int):
        super().__init__()
        self.query_proj = nn.Linear(query_dim, att_dim, bias=False)
        self.key_proj = nn.Linear(key_dim, att_dim)
        self.v = nn.Linear(att_dim, 1, bias=False)

    def forward(self, query, keys, proj_keys, mask):
        # query (B, Hq); keys (B, T, Hk); proj_keys (B, T, A); mask (B, T), True on valid frames
        energy = self.v(torch.tanh(proj_keys + self.query_proj(query).unsqueeze(1))).squeeze(-1)
        energy.masked_fill_(~mask, -1e10)  # expect: AMP007
        weights = F.softmax(energy, dim=-1)
        context = torch.bmm(weights.unsqueeze(1), keys).squeeze(1)
        return context, weights


class Speller(nn.Module):
    def __init__(self, cfg: TrainConfig):
        super().__init__()
        self.sos_id = cfg.sos_id
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dec_hidden, padding_idx=cfg.pad_id)
        self.cell = nn.LSTMCell(cfg.dec_hidden + cfg.enc_hidden, cfg.dec_hidden)
        self.attention = BahdanauAttention(cfg.dec_hidden, cfg.enc_hidden, cfg.att_dim)
        self.out = nn.Linear(cfg.dec_hidden + cfg.enc_hidden, cfg.vocab_size)

    def forward(self, enc_out, enc_mask, prev_tokens):
        b, u = prev_tokens.shape
        emb = self.embed(prev_tokens)
        h = enc_out.new_zeros(b, self.cell.hidden_size)
        c = enc_out.new_zeros(b, self.cell.hidden_size)
        context = enc_out.new_zeros(b, enc_out.size(-1))
        proj_keys = self.attention.key_proj(enc_out)
        outputs, alignments = [], []
        for i in range(u):
            h, c = self.cell(torch.cat([emb[:, i], context], dim=-1), (h, c))
            context, att = self.attention(h, enc_out, proj_keys, enc_mask)
            outputs.append(torch.cat([h, context], dim=-1))
            alignments.append(att)
        logits = self.out(torch.stack(outputs, dim=1))
        # <sos> is only ever fed in, never predicted
        logits[..., self.sos_id] = -1e9  # expect: AMP007
        return logits, torch.stack(alignments, dim=1)


class JointCTCAttentionASR(nn.Module):
    def __init__(self, cfg: TrainConfig):
        super().__init__()
        self.encoder = Listener(cfg)
        self.decoder = Speller(cfg)
        self.ctc_head = nn.Linear(cfg.enc_hidden, cfg.vocab_size)
        self.eou_head = nn.Linear(cfg.enc_hidden, 1)

    def forward(self, feats, feat_lens, prev_tokens) -> Dict[str, torch.Tensor]:
        enc_out, enc_lens = self.encoder(feats, feat_lens)
        enc_mask = torch.arange(enc_out.size(1), device=enc_out.device)[None, :] < enc_lens.to(enc_out.device)[:, None]
        dec_logits, alignments = self.decoder(enc_out, enc_mask, prev_tokens)
        return {
            "enc_lens": enc_lens,
            "ctc_logits": self.ctc_head(enc_out),
            "eou_logits": self.eou_head(enc_out).squeeze(-1),
            "dec_logits": dec_logits,
            "alignments": alignments,
        }


class ASRTrainer:
    def __init__(self, cfg: TrainConfig, model: nn.Module, device: torch.device):
        self.cfg = cfg
        self.device = device
        self.model = model.to(device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), eps=1e-8,
                                           weight_decay=cfg.weight_decay)
        self.scaler = torch.amp.GradScaler("cuda", init_scale=cfg.init_loss_scale)
        self.eou_criterion = nn.BCELoss()
        # homoscedastic task weighting (Kendall et al., 2018): one log-variance per loss term
        self.log_vars = nn.Parameter(torch.zeros(3, device=device)) if cfg.learn_task_weights else None
        self.weight_optimizer = torch.optim.Adam([self.log_vars], lr=1e-3) if self.log_vars is not None else None
        self.num_updates = 0
        self.best_valid = float("inf")

    @staticmethod
    def _eou_targets(enc_lens, max_len, device):
        # 1.0 on the last valid encoder frame of every utterance
        target = torch.zeros(enc_lens.size(0), max_len, device=device)
        target[torch.arange(enc_lens.size(0), device=device), enc_lens.to(device) - 1] = 1.0
        return target

    def _compute_loss(self, batch) -> Tuple[torch.Tensor, Dict[str, float]]:
        feats, feat_lens, tokens, token_lens = (t.to(self.device, non_blocking=True) for t in batch)
        prev_tokens, target_tokens = tokens[:, :-1], tokens[:, 1:]
        with torch.autocast("cuda", dtype=torch.float16):
            out = self.model(feats, feat_lens, prev_tokens)
            att_loss = F.cross_entropy(out["dec_logits"].transpose(1, 2), target_tokens, ignore_index=self.cfg.pad_id,
                                       label_smoothing=self.cfg.label_smoothing)
            eou_prob = torch.sigmoid(out["eou_logits"])
            eou_target = self._eou_targets(out["enc_lens"], eou_prob.size(1), self.device)
            eou_loss = self.eou_criterion(eou_prob, eou_target)  # expect: AMP003
        # CTC targets: the transcript without <eos>
        ctc_log_probs = out["ctc_logits"].log_softmax(dim=-1).transpose(0, 1)
        ctc_targets = target_tokens.masked_fill(target_tokens == self.cfg.eos_id, self.cfg.pad_id)
        ctc_loss = F.ctc_loss(ctc_log_probs, ctc_targets, out["enc_lens"], token_lens - 1, blank=self.cfg.blank_id, zero_infinity=True)  # expect: AMP002

        if self.log_vars is not None:
            terms = torch.stack([att_loss.float(), ctc_loss.float(), eou_loss.float()])
            loss = (torch.exp(-self.log_vars) * terms + self.log_vars).sum()
        else:
            loss = (1.0 - self.cfg.ctc_weight) * att_loss + self.cfg.ctc_weight * ctc_loss + self.cfg.eou_weight * eou_loss
        stats = {"loss": loss.item(), "att": att_loss.item(), "ctc": ctc_loss.item(), "eou": eou_loss.item(),
                 "ntokens": int((target_tokens != self.cfg.pad_id).sum())}
        return loss, stats

    def backward(self, loss):
        self.scaler.scale(loss / self.cfg.accum_steps).backward()

    def optimizer_step(self):
        grad_norm = clip_grad_norm_(self.model.parameters(), self.cfg.clip_norm)  # expect: AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.weight_optimizer is not None:
            self.weight_optimizer.step()  # expect: AMP006
            self.weight_optimizer.zero_grad(set_to_none=True)
        self.optimizer.zero_grad(set_to_none=True)
        self.num_updates += 1
        return grad_norm

    def train_step(self, batch, update: bool = True):
        self.model.train()
        loss, stats = self._compute_loss(batch)
        self.backward(loss)
        if update:
            stats["grad_norm"] = float(self.optimizer_step())
            stats["loss_scale"] = self.scaler.get_scale()
        return stats

    @torch.no_grad()
    def validate(self, loader) -> float:
        self.model.eval()
        total, ntok = 0.0, 0
        for batch in loader:
            _, stats = self._compute_loss(batch)
            total += stats["att"] * stats["ntokens"]
            ntok += stats["ntokens"]
        return total / max(ntok, 1)

    def save_checkpoint(self, path, epoch, valid_loss):
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "scaler": self.scaler.state_dict(), "cfg": asdict(self.cfg), "epoch": epoch,
                    "valid_loss": valid_loss, "num_updates": self.num_updates}, path)

    def fit(self, train_loader, valid_loader, save_dir):
        for epoch in range(1, self.cfg.epochs + 1):
            t0 = time.time()
            for i, batch in enumerate(train_loader):
                update = (i + 1) % self.cfg.accum_steps == 0
                stats = self.train_step(batch, update=update)
                if update and self.num_updates % 100 == 0:
                    logger.info("ep %d | upd %d | loss %.3f | att %.3f | ctc %.3f | gnorm %.2f | scale %.0f", epoch,
                                self.num_updates, stats["loss"], stats["att"], stats["ctc"], stats["grad_norm"],
                                stats["loss_scale"])
            valid_loss = self.validate(valid_loader)
            logger.info("epoch %d done in %.0fs | valid att loss %.3f", epoch, time.time() - t0, valid_loss)
            self.save_checkpoint(os.path.join(save_dir, "checkpoint_last.pt"), epoch, valid_loss)
            if valid_loss < self.best_valid:
                self.best_valid = valid_loss
                self.save_checkpoint(os.path.join(save_dir, "checkpoint_best.pt"), epoch, valid_loss)


def pretrain_decoder_lm(model, text_loader, cfg: TrainConfig, device, steps: int = 20000):
    """Warm up the speller as a language model on text-only data (all-zero acoustic context)."""
    optimizer = torch.optim.AdamW(model.decoder.parameters(), lr=cfg.lr)
    scaler = torch.amp.GradScaler("cuda")
    model.decoder.train()
    for step, tokens in enumerate(text_loader):
        if step >= steps:
            break
        tokens = tokens.to(device)
        enc_out = torch.zeros(tokens.size(0), 1, cfg.enc_hidden, device=device)
        enc_mask = torch.ones(tokens.size(0), 1, dtype=torch.bool, device=device)
        with torch.autocast("cuda", dtype=torch.float16):
            logits, _ = model.decoder(enc_out, enc_mask, tokens[:, :-1])
            loss = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], ignore_index=cfg.pad_id)
        loss = scaler.scale(loss)
        loss.backward()
        optimizer.step()  # expect: AMP006
        optimizer.zero_grad(set_to_none=True)
        if step % 500 == 0:
            logger.info("lm step %d | loss %.3f", step, loss.item() / scaler.get_scale())


def finetune_endpointer(model, loader, device, steps: int = 2000, lr: float = 1e-4, scaler=torch.cuda.amp.GradScaler()):  # expect: AMP009
    """Train only the end-of-utterance head on top of the frozen encoder."""
    model.encoder.requires_grad_(False)
    optimizer = torch.optim.Adam(model.eou_head.parameters(), lr=lr)
    eou_loss = nn.BCEWithLogitsLoss(pos_weight=torch.tensor(4.0, device=device))
    for step, (feats, feat_lens, eou_targets) in enumerate(loader):
        if step >= steps:
            break
        with torch.autocast("cuda", dtype=torch.float16):
            with torch.no_grad():
                enc_out, _ = model.encoder(feats.to(device), feat_lens.to(device))
            logits = model.eou_head(enc_out).squeeze(-1)
            loss = eou_loss(logits, eou_targets.to(device))
            scaler.scale(loss).backward()  # expect: AMP008
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)


@torch.inference_mode()
def greedy_ctc_decode(model, loader, tokenizer, device, blank_id=3):
    model.eval()
    hyps, refs = [], []
    for feats, feat_lens, tokens, token_lens in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            enc_out, enc_lens = model.encoder(feats.to(device), feat_lens.to(device))
            best = model.ctc_head(enc_out).argmax(dim=-1)
        for b in range(best.size(0)):
            ids = torch.unique_consecutive(best[b, : enc_lens[b]]).tolist()
            hyps.append(tokenizer.decode([i for i in ids if i != blank_id]))
            refs.append(tokenizer.decode(tokens[b, 1 : token_lens[b]].tolist()))
    return word_error_rate(hyps, refs)


def measure_cpu_rtf(model, feats, feat_lens, frame_shift_s=0.01, n_runs=10):
    """Real-time factor of the encoder on CPU with bf16 autocast."""
    model = model.cpu().eval()
    with torch.no_grad(), torch.cpu.amp.autocast(dtype=torch.bfloat16):  # expect: AMP009
        model.encoder(feats, feat_lens)
        start = time.perf_counter()
        for _ in range(n_runs):
            model.encoder(feats, feat_lens)
        elapsed = (time.perf_counter() - start) / n_runs
    return elapsed / (feat_lens.sum().item() * frame_shift_s)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", required=True)
    parser.add_argument("--valid", required=True)
    parser.add_argument("--text", default=None, help="optional text corpus for decoder LM warm-up")
    parser.add_argument("--spm", required=True)
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--batch-frames", type=int, default=40000)
    parser.add_argument("--learn-task-weights", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s | %(levelname)s | %(message)s")

    os.makedirs(args.save_dir, exist_ok=True)
    device = torch.device("cuda")
    tokenizer = SentencePieceTokenizer(args.spm)
    cfg = TrainConfig(vocab_size=tokenizer.vocab_size, epochs=args.epochs, learn_task_weights=args.learn_task_weights)
    model = JointCTCAttentionASR(cfg)

    if args.text:
        text_loader = build_loader(TextDataset(args.text, tokenizer), batch_size=128, shuffle=True)
        pretrain_decoder_lm(model.to(device), text_loader, cfg, device)

    train_loader = build_loader(SpeechDataset(args.train, tokenizer), max_frames=args.batch_frames, shuffle=True)
    valid_loader = build_loader(SpeechDataset(args.valid, tokenizer), max_frames=args.batch_frames, shuffle=False)
    trainer = ASRTrainer(cfg, model, device)
    trainer.fit(train_loader, valid_loader, args.save_dir)
    wer = greedy_ctc_decode(model, valid_loader, tokenizer, device, blank_id=cfg.blank_id)
    logger.info("greedy CTC WER on %s: %.2f%%", args.valid, 100 * wer)


if __name__ == "__main__":
    main()
