"""CTC fine-tuning of a conformer encoder; the loop is split into small helpers."""
import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import clip_grad_norm_

from asr.model import ConformerCTC
from asr.data import build_loaders
from asr.decode import greedy_decode, wer

AMP_DTYPE = torch.float16


def forward_logits(model: nn.Module, feats: torch.Tensor, feat_lens: torch.Tensor):
    with torch.autocast("cuda", dtype=AMP_DTYPE):
        logits, out_lens = model(feats, feat_lens)
    return logits, out_lens


def ctc_objective(logits, out_lens, targets, target_lens, blank=0):
    log_probs = logits.log_softmax(-1).transpose(0, 1)
    return F.ctc_loss(log_probs, targets, out_lens, target_lens, blank=blank, zero_infinity=True)


def backward_and_step(loss, model, optimizer, scaler, max_norm):
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


def train_epoch(model, loader, optimizer, scaler, args):
    model.train()
    for feats, feat_lens, targets, target_lens in loader:
        feats, feat_lens = feats.cuda(non_blocking=True), feat_lens.cuda()
        targets, target_lens = targets.cuda(), target_lens.cuda()
        with torch.autocast("cuda", dtype=AMP_DTYPE):
            logits, out_lens = model(feats, feat_lens)
        log_probs = F.log_softmax(logits, dim=-1).transpose(0, 1)
        loss = F.ctc_loss(log_probs, targets, out_lens, target_lens, zero_infinity=True)  # expect: AMP002
        backward_and_step(loss, model, optimizer, scaler, args.max_norm)


def train_epoch_with_helpers(model, loader, optimizer, scaler, args):
    model.train()
    for feats, feat_lens, targets, target_lens in loader:
        logits, out_lens = forward_logits(model, feats.cuda(), feat_lens.cuda())
        loss = ctc_objective(logits.float(), out_lens, targets.cuda(), target_lens.cuda())
        backward_and_step(loss, model, optimizer, scaler, args.max_norm)


def consistency_step(model, loader, optimizer, scaler):
    """Unlabelled batches: make the two augmented views agree."""
    for view_a, view_b, lens in loader:
        with torch.autocast("cuda", dtype=AMP_DTYPE):
            pa, _ = model(view_a.cuda(), lens.cuda())
            pb, _ = model(view_b.cuda(), lens.cuda())
            loss = F.kl_div(pa.log_softmax(-1), pb.softmax(-1).detach(), reduction="batchmean")
            scaler.scale(loss).backward()  # expect: AMP008
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()


@torch.no_grad()
def evaluate(model, loader, vocab):
    model.eval()
    hyps, refs = [], []
    for feats, feat_lens, targets, target_lens in loader:
        logits, out_lens = forward_logits(model, feats.cuda(), feat_lens.cuda())
        hyps += greedy_decode(logits, out_lens, vocab)
        refs += [vocab.decode(t[:l]) for t, l in zip(targets, target_lens)]
    model.train()
    return wer(hyps, refs)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-norm", type=float, default=5.0)
    parser.add_argument("--semi", action="store_true")
    args = parser.parse_args()
    train_loader, valid_loader, unlabelled_loader, vocab = build_loaders(os.environ["DATA_ROOT"])
    model = ConformerCTC(vocab_size=len(vocab)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-3)
    scaler = torch.amp.GradScaler("cuda")
    for epoch in range(args.epochs):
        train_epoch(model, train_loader, optimizer, scaler, args)
        if args.semi:
            consistency_step(model, unlabelled_loader, optimizer, scaler)
        print(f"epoch {epoch}: WER {evaluate(model, valid_loader, vocab):.3f}")


if __name__ == "__main__":
    main()
