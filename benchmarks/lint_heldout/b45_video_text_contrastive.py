"""Video-text contrastive pre-training on pre-extracted frame features (CLIP4Clip-style meanP).

    torchrun --nproc_per_node=8 b45_video_text_contrastive.py --train shards/train --epochs 10
"""
import argparse
import math
import os
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.distributed.nn
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class FrameCaptionShards(Dataset):
    """Each shard holds frame features (N, T, 768) fp32, token ids (N, L) and pad masks (N, L)."""

    def __init__(self, root):
        self.shards = sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".pt"))
        self.index = [(s, i) for s in self.shards for i in range(torch.load(s, mmap=True)["frames"].shape[0])]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, idx):
        shard, i = self.index[idx]
        data = torch.load(shard, mmap=True)
        return data["frames"][i], data["tokens"][i], data["pad_mask"][i]


def masked_max_pool(x, valid):
    """Max over the valid positions of x (B, L, D); valid is (B, L) bool."""
    return x.masked_fill(~valid.unsqueeze(-1), -1e9).max(dim=1).values  # expect: AMP007


class VideoTextModel(nn.Module):
    def __init__(self, frame_dim=768, vocab=49408, width=512, embed_dim=512, layers=6, max_len=77):
        super().__init__()
        self.frame_proj = nn.Linear(frame_dim, width)
        self.token_emb = nn.Embedding(vocab, width)
        self.pos_emb = nn.Parameter(torch.zeros(1, max_len, width))
        layer = nn.TransformerEncoderLayer(width, 8, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.text_encoder = nn.TransformerEncoder(layer, layers)
        self.video_head = nn.Linear(width, embed_dim, bias=False)
        self.text_head = nn.Linear(width, embed_dim, bias=False)

    def forward(self, frames, tokens, pad_mask):
        v = self.frame_proj(frames)  # (B, T, width)
        v = v.mean(dim=1)  # expect: AMP004
        t = self.token_emb(tokens) + self.pos_emb[:, : tokens.size(1)]
        t = self.text_encoder(t, src_key_padding_mask=pad_mask)
        t = masked_max_pool(t, ~pad_mask)
        return self.video_head(v), self.text_head(t)


class ClipLoss(nn.Module):
    """Symmetric InfoNCE with a learnable temperature, gathered across ranks."""

    def __init__(self, init_temp=0.07):
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / init_temp)))

    def forward(self, video_emb, text_emb):
        video_emb = F.normalize(video_emb, dim=-1)
        text_emb = F.normalize(text_emb, dim=-1)
        if dist.is_initialized():
            all_text = torch.cat(torch.distributed.nn.all_gather(text_emb), dim=0)
            offset = dist.get_rank() * video_emb.size(0)
        else:
            all_text, offset = text_emb, 0
        logits = self.logit_scale.exp() * video_emb @ all_text.t()
        labels = torch.arange(video_emb.size(0), device=video_emb.device) + offset
        v2t = F.cross_entropy(logits, labels)
        t2v = F.cross_entropy(logits[:, offset:offset + video_emb.size(0)].t(), labels - offset)
        return (v2t + t2v) / 2


def build_optimizers(model, criterion, args):
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "emb" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "emb" in n]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.2}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    temp_optimizer = torch.optim.SGD(criterion.parameters(), lr=args.temp_lr)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)  # expect: AMP009
    return optimizer, temp_optimizer, scaler


def cosine_schedule(optimizer, warmup, total):
    def lr_lambda(step):
        if step < warmup:
            return step / max(1, warmup)
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)


def train_one_epoch(model, criterion, loader, optimizer, temp_optimizer, scaler, scheduler, args, epoch):
    model.train()
    for i, (frames, tokens, pad_mask) in enumerate(loader):
        frames = frames.cuda(non_blocking=True)
        tokens, pad_mask = tokens.cuda(non_blocking=True), pad_mask.cuda(non_blocking=True)
        last_micro = (i + 1) % args.accum_steps == 0
        sync_ctx = model.no_sync() if (isinstance(model, DDP) and not last_micro) else nullcontext()
        with sync_ctx:
            with torch.autocast("cuda", dtype=torch.float16):
                video_emb, text_emb = model(frames, tokens, pad_mask)
                loss = criterion(video_emb, text_emb) / args.accum_steps
                scaler.scale(loss).backward()  # expect: AMP008
        if not last_micro:
            continue
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        temp_optimizer.step()  # expect: AMP006
        optimizer.zero_grad(set_to_none=True)
        temp_optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        with torch.no_grad():
            criterion.logit_scale.clamp_(0, math.log(100))
        if (i // args.accum_steps) % 50 == 0 and (not dist.is_initialized() or dist.get_rank() == 0):
            print(f"ep {epoch} it {i} loss {loss.item() * args.accum_steps:.4f} |g| {grad_norm:.2f} "
                  f"T {1 / criterion.logit_scale.exp().item():.4f}")


@torch.no_grad()
def evaluate_retrieval(model, loader):
    model.eval()
    videos, texts = [], []
    for frames, tokens, pad_mask in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            v, t = model(frames.cuda(), tokens.cuda(), pad_mask.cuda())
        videos.append(F.normalize(v.float(), dim=-1))
        texts.append(F.normalize(t.float(), dim=-1))
    sims = torch.cat(videos) @ torch.cat(texts).t()
    ranks = (sims.argsort(dim=1, descending=True) == torch.arange(sims.size(0), device=sims.device)[:, None]).nonzero()[:, 1]
    model.train()
    return {f"R@{k}": (ranks < k).float().mean().item() * 100 for k in (1, 5, 10)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--val", default="")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", dest="batch_size", type=int, default=256)
    p.add_argument("--accum-steps", dest="accum_steps", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--temp-lr", dest="temp_lr", type=float, default=1e-3)
    p.add_argument("--max-grad-norm", dest="max_grad_norm", type=float, default=1.0)
    p.add_argument("--amp", action="store_true", default=True)
    p.add_argument("--compile", action="store_true")
    args = p.parse_args()

    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    model = VideoTextModel().cuda()
    criterion = ClipLoss().cuda()
    optimizer, temp_optimizer, scaler = build_optimizers(model, criterion, args)
    if args.compile:
        model = torch.compile(model)
    model = DDP(model, device_ids=[local_rank])
    train_set = FrameCaptionShards(args.train)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=DistributedSampler(train_set),
                        num_workers=8, pin_memory=True, drop_last=True)
    steps = args.epochs * len(loader) // args.accum_steps
    scheduler = cosine_schedule(optimizer, warmup=steps // 50, total=steps)
    for epoch in range(args.epochs):
        loader.sampler.set_epoch(epoch)
        train_one_epoch(model, criterion, loader, optimizer, temp_optimizer, scaler, scheduler, args, epoch)
        if dist.get_rank() == 0:
            torch.save({"model": model.module.state_dict(), "loss": criterion.state_dict(), "epoch": epoch,
                        "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()}, "video_text_last.pt")
            if args.val:
                print(evaluate_retrieval(model.module, DataLoader(FrameCaptionShards(args.val), batch_size=512)))


if __name__ == "__main__":
    main()
