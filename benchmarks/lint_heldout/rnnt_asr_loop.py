"""RNN-T ASR training loop (torchaudio), DDP, optional AMP."""
import argparse
import os

import torch
import torch.distributed as dist
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP

from rnnt_model import build_emformer_rnnt
from rnnt_data import librispeech_loader


def train(args):
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    model = DDP(build_emformer_rnnt().cuda(), device_ids=[rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=8e-4, betas=(0.9, 0.98), eps=1e-9)
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
    loss_fn = torchaudio.transforms.RNNTLoss(reduction="sum", clamp=1.0)
    loader = librispeech_loader(args.data, rank)
    for epoch in range(args.epochs):
        model.train()
        for feats, feat_lens, tokens, token_lens in loader:
            feats, feat_lens = feats.cuda(), feat_lens.cuda()
            tokens, token_lens = tokens.cuda(), token_lens.cuda()
            with torch.cuda.amp.autocast(enabled=args.amp):  # expect: AMP009
                logits, src_lens, _, _ = model(feats, feat_lens, tokens[:, :-1], token_lens)
            loss = loss_fn(logits, tokens[:, 1:].int(), src_lens.int(), (token_lens - 1).int())  # expect: AMP002
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss / feats.size(0)).backward()
            if args.clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
        if rank == 0:
            torch.save(model.module.state_dict(), os.path.join(args.out, f"epoch{epoch}.pt"))


def train_fixed(args, model, loader, optimizer):
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
    loss_fn = torchaudio.transforms.RNNTLoss(reduction="sum", clamp=1.0)
    for feats, feat_lens, tokens, token_lens in loader:
        with torch.autocast("cuda", enabled=args.amp):
            logits, src_lens, _, _ = model(feats.cuda(), feat_lens.cuda(), tokens[:, :-1].cuda(), token_lens.cuda())
        loss = loss_fn(logits.float(), tokens[:, 1:].int().cuda(), src_lens.int(), (token_lens - 1).int().cuda())
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss / feats.size(0)).backward()
        if args.clip > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        scaler.step(optimizer)
        scaler.update()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="exp")
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--clip", type=float, default=10.0)
    p.add_argument("--amp", action="store_true")
    train(p.parse_args())
