#!/usr/bin/env python3
"""Train a small transformer CTC acoustic model on cached filterbank features.

The feature cache is written by ``prepare_features.py``: one ``.pt`` shard per
1000 utterances, each a list of ``{"feats": (T, n_mels) power spectrogram,
"text": str}`` records. Characters outside the vocabulary are dropped.
"""
import argparse
import copy
import logging
import math
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

log = logging.getLogger("asr.ctc")

VOCAB = ["<blank>", " ", "'"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
CHAR_TO_ID = {c: i for i, c in enumerate(VOCAB)}
FEAT_DTYPE = torch.float16  # same precision as the on-disk feature cache
AMP_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class FeatureShards(Dataset):
    def __init__(self, root, max_frames=3000):
        self.records = []
        for shard in sorted(Path(root).glob("*.pt")):
            for rec in torch.load(shard):
                if rec["feats"].shape[0] <= max_frames:
                    self.records.append(rec)

    def __len__(self):
        return len(self.records)

    def __getitem__(self, idx):
        rec = self.records[idx]
        ids = [CHAR_TO_ID[c] for c in rec["text"].lower() if c in CHAR_TO_ID]
        return rec["feats"], torch.tensor(ids, dtype=torch.long)


def collate(batch):
    feats, labels = zip(*batch)
    feat_lens = torch.tensor([f.shape[0] for f in feats], dtype=torch.long)
    label_lens = torch.tensor([len(l) for l in labels], dtype=torch.long)
    feats = nn.utils.rnn.pad_sequence(feats, batch_first=True)
    return feats, feat_lens, torch.cat(labels), label_lens


class ConvSubsampling(nn.Module):
    """Two strided convolutions: 4x fewer frames, as in most CTC recipes."""

    def __init__(self, n_mels, d_model, channels=32):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, channels, 3, stride=2), nn.ReLU(),
            nn.Conv2d(channels, channels, 3, stride=2), nn.ReLU(),
        )
        freq = ((n_mels - 1) // 2 - 1) // 2
        self.proj = nn.Linear(channels * freq, d_model)

    def forward(self, x, lengths):
        x = self.conv(x.unsqueeze(1))
        b, c, t, f = x.shape
        x = self.proj(x.transpose(1, 2).reshape(b, t, c * f))
        lengths = ((lengths - 1) // 2 - 1) // 2
        return x, lengths


class CTCModel(nn.Module):
    def __init__(self, n_mels=80, d_model=256, n_layers=8, n_heads=4, dropout=0.1):
        super().__init__()
        self.subsample = ConvSubsampling(n_mels, d_model)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout,
                                           batch_first=True, norm_first=True)
        self.lower = nn.TransformerEncoder(layer, n_layers // 2)
        self.upper = nn.TransformerEncoder(layer, n_layers - n_layers // 2)
        self.aux_head = nn.Linear(d_model, len(VOCAB))  # intermediate CTC (InterCTC)
        self.head = nn.Linear(d_model, len(VOCAB))

    def forward(self, feats, lengths):
        x, lengths = self.subsample(feats, lengths)
        pad_mask = torch.arange(x.size(1), device=x.device)[None, :] >= lengths[:, None]
        mid = self.lower(x, src_key_padding_mask=pad_mask)
        x = self.upper(mid, src_key_padding_mask=pad_mask)
        return self.head(x), self.aux_head(mid), lengths


def cosine_with_warmup(optimizer, warmup, total):
    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def edit_distance(a, b):
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def greedy_decode(ids):
    out, last = [], 0
    for i in ids:
        if i != last and i != 0:
            out.append(VOCAB[i])
        last = i
    return "".join(out)


@torch.no_grad()
def evaluate(model, loader, device, ctx):
    model.eval()
    errors, chars = 0, 0
    for feats, feat_lens, labels, label_lens in loader:
        feats = torch.log(feats.to(device) + 1e-10)
        with ctx:
            logits, _, out_lens = model(feats, feat_lens.to(device))
        best = logits.argmax(dim=-1).cpu()
        offset = 0
        for k in range(best.shape[0]):
            ref = "".join(VOCAB[i] for i in labels[offset:offset + label_lens[k]])
            offset += int(label_lens[k])
            hyp = greedy_decode(best[k, : out_lens[k]].tolist())
            errors += edit_distance(hyp, ref)
            chars += max(1, len(ref))
    model.train()
    return errors / chars


def train(args, model, train_loader, dev_loader, device):
    use_amp = args.precision != "fp32"
    ctx = nullcontext() if not use_amp else torch.autocast(device.type, dtype=AMP_DTYPES[args.precision])
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")
    inter_ctc = nn.CTCLoss(zero_infinity=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=1e-3)
    total = args.epochs * len(train_loader)
    scheduler = cosine_with_warmup(optimizer, args.warmup, total)
    best_cer, step = float("inf"), 0
    model.train()
    for epoch in range(args.epochs):
        t0 = time.time()
        for feats, feat_lens, labels, label_lens in train_loader:
            feats = feats.to(device, dtype=FEAT_DTYPE, non_blocking=True)  # expect: AMP001
            feats = torch.log(feats + 1e-10)  # expect: AMP011
            feat_lens, labels, label_lens = feat_lens.to(device), labels.to(device), label_lens.to(device)
            with ctx:
                logits, aux_logits, out_lens = model(feats, feat_lens)
            log_probs = logits.log_softmax(dim=-1).transpose(0, 1)
            loss = F.ctc_loss(log_probs=log_probs, targets=labels, input_lengths=out_lens, target_lengths=label_lens, zero_infinity=True)  # expect: AMP002
            aux = inter_ctc(log_probs=aux_logits.log_softmax(dim=-1).transpose(0, 1), targets=labels, input_lengths=out_lens, target_lengths=label_lens)  # expect: AMP002
            loss = loss + args.inter_ctc_weight * aux
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            if step % args.log_every == 0:
                log.info("epoch %d step %d loss %.3f gnorm %.2f lr %.2e", epoch, step,
                         loss.item(), grad_norm.item(), scheduler.get_last_lr()[0])
        cer = evaluate(model, dev_loader, device, ctx)
        log.info("epoch %d done in %.0fs, dev CER %.2f%%", epoch, time.time() - t0, 100 * cer)
        if cer < best_cer:
            best_cer = cer
            torch.save({"model": model.state_dict(), "epoch": epoch, "cer": cer}, args.out / "best.pt")
    return best_cer


def export_torchscript(model, path, n_mels):
    """Half-precision TorchScript copy for the streaming server."""
    serving = copy.deepcopy(model).half().eval()
    device = next(serving.parameters()).device
    example = torch.randn(1, 400, n_mels, dtype=torch.float16, device=device)
    traced = torch.jit.trace(serving, (example, torch.tensor([400], device=device)))
    traced.save(str(path))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--train", type=Path, required=True)
    p.add_argument("--dev", type=Path, required=True)
    p.add_argument("--out", type=Path, default=Path("exp/ctc"))
    p.add_argument("--n-mels", type=int, default=80)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=4000)
    p.add_argument("--clip", type=float, default=5.0)
    p.add_argument("--inter-ctc-weight", type=float, default=0.3)
    p.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default="fp16")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--export", action="store_true")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    train_loader = DataLoader(FeatureShards(args.train), batch_size=args.batch_size, shuffle=True,
                              collate_fn=collate, num_workers=4, pin_memory=True)
    dev_loader = DataLoader(FeatureShards(args.dev), batch_size=args.batch_size, collate_fn=collate)
    model = CTCModel(n_mels=args.n_mels).to(device)
    best = train(args, model, train_loader, dev_loader, device)
    log.info("best dev CER %.2f%%", 100 * best)
    if args.export:
        export_torchscript(model, args.out / "ctc_fp16.ts", args.n_mels)


if __name__ == "__main__":
    main()
