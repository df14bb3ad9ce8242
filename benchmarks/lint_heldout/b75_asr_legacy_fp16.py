"""Training script for the streaming ASR encoder (CTC head).

Precision flags, kept for compatibility with the old launch scripts:

    --fp16        mixed precision: fp16 autocast + dynamic loss scaling
    --pure-fp16   weights, activations and optimizer all in fp16 (small-memory cards)
    --amp         used by the finetune stage only
"""
import argparse
import logging
import os
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from asr.data import SpeechDataset, collate_speech
from asr.model import ConformerCTC
from asr.text import GreedyDecoder, word_error_rate

logger = logging.getLogger("asr.train")


def get_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--manifest", required=True)
    p.add_argument("--val-manifest", required=True)
    p.add_argument("--vocab", required=True)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--accum-steps", type=int, default=4)
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--pure-fp16", action="store_true")
    p.add_argument("--amp", action="store_true")
    p.add_argument("--clip", type=float, default=5.0)
    p.add_argument("--mode", choices=["train", "lowmem", "accum", "trainer", "finetune"], default="train")
    p.add_argument("--init", default=None, help="checkpoint to finetune from")
    p.add_argument("--save-dir", default="exp/asr")
    return p.parse_args(argv)


def build_model(args, vocab_size):
    return ConformerCTC(n_mels=80, d_model=256, n_layers=12, n_heads=4, vocab_size=vocab_size)


def build_loaders(args):
    train_set = SpeechDataset(args.manifest, args.vocab, augment=True)
    val_set = SpeechDataset(args.val_manifest, args.vocab, augment=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=6,
                              collate_fn=collate_speech, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, shuffle=False, num_workers=4,
                            collate_fn=collate_speech)
    return train_set, train_loader, val_loader


def ctc_loss(log_probs, targets, input_lengths, target_lengths):
    # CTC wants (T, N, C)
    return F.ctc_loss(log_probs.transpose(0, 1), targets, input_lengths, target_lengths,
                      blank=0, zero_infinity=True)


@torch.no_grad()
def validate(model, loader, decoder, device):
    model.eval()
    hyps, refs = [], []
    for feats, feat_lens, targets, target_lens in loader:
        feats = feats.to(device).half() if next(model.parameters()).dtype == torch.float16 else feats.to(device)
        log_probs, out_lens = model(feats, feat_lens.to(device))
        hyps.extend(decoder.decode(log_probs.float().cpu(), out_lens.cpu()))
        refs.extend(decoder.targets_to_text(targets, target_lens))
    model.train()
    return word_error_rate(hyps, refs)


def train(args):
    device = torch.device("cuda")
    train_set, train_loader, val_loader = build_loaders(args)
    decoder = GreedyDecoder(train_set.vocab)
    model = build_model(args, len(train_set.vocab)).to(device)
    if args.fp16:
        model = model.half()  # expect: AMP001
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=1e-5)
    scaler = torch.amp.GradScaler("cuda", enabled=args.fp16)

    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for step, (feats, feat_lens, targets, target_lens) in enumerate(train_loader):
            feats, feat_lens = feats.to(device), feat_lens.to(device)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
                log_probs, out_lens = model(feats, feat_lens)
                loss = ctc_loss(log_probs, targets, out_lens, target_lens)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            scaler.step(optimizer)
            scaler.update()
        wer = validate(model, val_loader, decoder, device)
        logger.info("epoch %d wer %.3f (%.0fs)", epoch, wer, time.time() - t0)
        torch.save({"model": model.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch},
                   os.path.join(args.save_dir, f"epoch{epoch}.pt"))


def train_lowmem(args):
    """Everything in fp16, for 8GB cards. Converges slower; use --fp16 when memory allows."""
    device = torch.device("cuda")
    train_set, train_loader, val_loader = build_loaders(args)
    decoder = GreedyDecoder(train_set.vocab)
    model = build_model(args, len(train_set.vocab)).to(device)
    if args.pure_fp16:
        model = model.half()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    for epoch in range(args.epochs):
        model.train()
        for feats, feat_lens, targets, target_lens in train_loader:
            feats = feats.to(device)
            feats = feats.half() if args.pure_fp16 else feats
            log_probs, out_lens = model(feats, feat_lens.to(device))
            loss = ctc_loss(log_probs.float(), targets, out_lens, target_lens)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
        logger.info("epoch %d wer %.3f", epoch, validate(model, val_loader, decoder, device))


def train_accum(args):
    """Large effective batch via gradient accumulation."""
    device = torch.device("cuda")
    train_set, train_loader, _ = build_loaders(args)
    model = build_model(args, len(train_set.vocab)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True)
    scaler = torch.amp.GradScaler("cuda", enabled=args.fp16)

    model.train()
    for epoch in range(args.epochs):
        for step, (feats, feat_lens, targets, target_lens) in enumerate(train_loader):
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
                log_probs, out_lens = model(feats.to(device), feat_lens.to(device))
                loss = ctc_loss(log_probs, targets, out_lens, target_lens) / args.accum_steps
            loss = scaler.scale(loss)
            loss.backward()
            if (step + 1) % args.accum_steps == 0:
                optimizer.step()  # expect: AMP006
                optimizer.zero_grad(set_to_none=True)
            if step % 100 == 0:
                logger.info("epoch %d step %d loss %.4f", epoch, step, loss.item() / scaler.get_scale())


class Trainer:
    """Small object-style trainer used by the sweep launcher."""

    def __init__(self, model, train_loader, val_loader, vocab, lr=1e-3, clip=5.0, device="cuda"):
        self.device = torch.device(device)
        self.model = model.to(self.device).half()  # expect: AMP001
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)  # expect: AMP011
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.decoder = GreedyDecoder(vocab)
        self.clip = clip
        self.history = []

    def _step(self, feats, feat_lens, targets, target_lens):
        feats = feats.to(self.device, non_blocking=True)
        log_probs, out_lens = self.model(feats, feat_lens.to(self.device))
        loss = ctc_loss(log_probs.float(), targets, out_lens, target_lens)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        return loss.item()

    def fit(self, epochs):
        for epoch in range(epochs):
            self.model.train()
            losses = [self._step(*batch) for batch in self.train_loader]
            wer = validate(self.model, self.val_loader, self.decoder, self.device)
            self.history.append({"epoch": epoch, "loss": sum(losses) / len(losses), "wer": wer})
            logger.info("%s", self.history[-1])
        return self.history


def finetune(args, model, loader):
    """Adapt a pretrained encoder to a new domain (few thousand utterances)."""
    device = torch.device("cuda")
    model.to(device).train()
    # keep the subsampling frontend fixed while the encoder adapts
    for p in model.frontend.parameters():
        p.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    for epoch in range(args.epochs):
        for feats, feat_lens, targets, target_lens in loader:
            with torch.cuda.amp.autocast(enabled=args.amp, dtype=torch.float16):  # expect: AMP009 AMP010
                log_probs, out_lens = model(feats.to(device), feat_lens.to(device))
                loss = ctc_loss(log_probs, targets, out_lens, target_lens)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(params, args.clip)
            optimizer.step()
        logger.info("finetune epoch %d loss %.4f", epoch, loss.item())
    return model


def main(argv=None):
    args = get_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    os.makedirs(args.save_dir, exist_ok=True)
    if args.mode == "train":
        train(args)
    elif args.mode == "lowmem":
        train_lowmem(args)
    elif args.mode == "accum":
        train_accum(args)
    elif args.mode == "trainer":
        train_set, train_loader, val_loader = build_loaders(args)
        model = build_model(args, len(train_set.vocab))
        Trainer(model, train_loader, val_loader, train_set.vocab, lr=args.lr, clip=args.clip).fit(args.epochs)
    elif args.mode == "finetune":
        train_set, train_loader, _ = build_loaders(args)
        model = build_model(args, len(train_set.vocab))
        model.load_state_dict(torch.load(args.init, map_location="cpu")["model"])
        finetune(args, model, train_loader)


if __name__ == "__main__":
    main()
