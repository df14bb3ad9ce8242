"""
Contrastive video-text retrieval on pre-extracted CLIP frame features (CLIP4Clip-style
mean pooling), with a cross-batch memory bank of caption embeddings.

    torchrun --nproc_per_node=8 b62_video_text_retrieval.py --train-csv msrvtt_9k.csv --frames 12
"""
import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from data.msrvtt import FrameFeatureDataset


class GatherLayer(torch.autograd.Function):
    """all_gather that keeps the gradient of the local slice."""

    @staticmethod
    def forward(ctx, x):
        out = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        all_grads = torch.stack(grads)
        dist.all_reduce(all_grads)
        return all_grads[dist.get_rank()]


def gather_with_grad(x):
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return x
    return torch.cat(GatherLayer.apply(x), dim=0)


@torch.no_grad()
def concat_all_gather(x):
    if not dist.is_initialized():
        return x
    out = [torch.ones_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x)
    return torch.cat(out, dim=0)


class TextEncoder(nn.Module):
    def __init__(self, vocab_size, width, layers, heads, max_len=77):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, width)
        self.pos = nn.Parameter(torch.zeros(max_len, width))
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.1, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers)
        self.ln = nn.LayerNorm(width)

    def forward(self, tokens, mask):
        x = self.tok(tokens) + self.pos[: tokens.size(1)]
        return self.ln(self.blocks(x, src_key_padding_mask=~mask))


class VideoTextModel(nn.Module):
    def __init__(self, feat_dim, embed_dim, vocab_size, width=512, layers=6, heads=8):
        super().__init__()
        self.frame_proj = nn.Linear(feat_dim, embed_dim)
        self.text = TextEncoder(vocab_size, width, layers, heads)
        self.text_proj = nn.Linear(width, embed_dim)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def encode_video(self, frames):
        x = self.frame_proj(frames)
        v = x.mean(dim=1)  # expect: AMP004
        return F.normalize(v, dim=-1)

    def encode_text(self, tokens, mask):
        h = self.text_proj(self.text(tokens, mask))
        m = mask.unsqueeze(-1).to(h.dtype)
        t = (h * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
        return F.normalize(t, dim=-1)

    def forward(self, frames, tokens, mask):
        return self.encode_video(frames), self.encode_text(tokens, mask)


class MemoryBank:
    """FIFO queue of past caption embeddings (and their video ids) used as extra negatives."""

    def __init__(self, size, dim, device):
        self.feats = F.normalize(torch.randn(size, dim, device=device), dim=1)
        self.ids = torch.full((size,), -1, dtype=torch.long, device=device)
        self.ptr, self.size = 0, size

    @torch.no_grad()
    def enqueue(self, feats, ids):
        feats, ids = concat_all_gather(feats.float()), concat_all_gather(ids)
        idx = (torch.arange(feats.size(0), device=feats.device) + self.ptr) % self.size
        self.feats[idx] = feats
        self.ids[idx] = ids
        self.ptr = (self.ptr + feats.size(0)) % self.size


def cosine_with_warmup(warmup, total):
    def fn(step):
        if step < warmup:
            return step / max(1, warmup)
        return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
    return fn


def train_one_epoch(model, loader, optimizer, scheduler, scaler, bank, args, epoch, device):
    model.train()
    raw = model.module if isinstance(model, DDP) else model
    rank = dist.get_rank() if dist.is_initialized() else 0
    for i, batch in enumerate(loader):
        frames = batch["frames"].to(device, non_blocking=True)
        tokens = batch["tokens"].to(device, non_blocking=True)
        mask = batch["mask"].to(device, non_blocking=True)
        vid = batch["video_id"].to(device, non_blocking=True)

        with torch.autocast("cuda", dtype=torch.float16):
            v, t = model(frames, tokens, mask)
            all_v, all_t = gather_with_grad(v), gather_with_grad(t)
            scale = raw.logit_scale.exp()
            labels = torch.arange(v.size(0), device=device) + rank * v.size(0)
            loss = (F.cross_entropy(scale * v @ all_t.t(), labels) +
                    F.cross_entropy(scale * t @ all_v.t(), labels)) / 2
            # extra negatives from the memory bank, minus captions of the same video
            sim_bank = v @ bank.feats.t()
            sim_bank = sim_bank.masked_fill(bank.ids[None, :] == vid[:, None], -1e9)  # expect: AMP007
            pos = (v * t).sum(dim=-1, keepdim=True)
            logits_bank = torch.cat([pos, sim_bank], dim=1) / args.bank_tau
            zeros = torch.zeros(v.size(0), dtype=torch.long, device=device)
            loss = loss + args.bank_weight * F.cross_entropy(logits_bank, zeros)
            # hardest in-batch negative, ranked with a BPR-style term
            sim = v @ t.t()
            eye = torch.eye(sim.size(0), dtype=torch.bool, device=device)
            hard = sim.masked_fill(eye, float("-inf")).amax(dim=1)
            loss_rank = -torch.log(torch.sigmoid(sim.diagonal() - hard) + 1e-8)  # expect: AMP011
            loss = loss + args.rank_weight * loss_rank.mean()

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        with torch.no_grad():
            raw.logit_scale.clamp_(0, math.log(100))
        bank.enqueue(t.detach(), vid)
        if i % args.log_interval == 0 and rank == 0:
            print(f"epoch {epoch} it {i}/{len(loader)} loss {loss.item():.4f} grad {grad_norm:.2f} "
                  f"temp {1 / raw.logit_scale.exp().item():.4f} scale {scaler.get_scale():.0f}")


def t2v_ranks(sim, caption_video):
    """Rank of the ground-truth video for every caption (sim: captions x videos)."""
    sim = sim.float()
    gt = sim.gather(1, caption_video[:, None])
    return (sim > gt).sum(dim=1)


def v2t_ranks(sim, caption_video):
    """Best rank over each video's captions (sim: videos x captions)."""
    sim = sim.float()
    own = caption_video[None, :] == torch.arange(sim.size(0), device=sim.device)[:, None]
    best_pos = sim.masked_fill(~own, -1e9).amax(dim=1, keepdim=True)
    return (sim.masked_fill(own, -1e9) > best_pos).sum(dim=1)


def recall(ranks, ks=(1, 5, 10)):
    out = {f"R@{k}": (ranks < k).float().mean().item() * 100 for k in ks}
    out["MdR"] = ranks.float().median().item() + 1
    return out


@torch.no_grad()
def evaluate(model, video_loader, text_loader, device, dsl=False):
    model.eval()
    raw = model.module if isinstance(model, DDP) else model
    vids, txts, cap_vid = [], [], []
    for batch in video_loader:
        with torch.autocast("cuda", dtype=torch.float16):
            vids.append(raw.encode_video(batch["frames"].to(device)).float())
    for batch in text_loader:
        with torch.autocast("cuda", dtype=torch.float16):
            t = raw.encode_text(batch["tokens"].to(device), batch["mask"].to(device))
        txts.append(t.float())
        cap_vid.append(batch["video_index"].to(device))
    v, t, cap_vid = torch.cat(vids), torch.cat(txts), torch.cat(cap_vid)
    sim = t @ v.t()
    if dsl:  # dual-softmax re-ranking
        sim = sim * F.softmax(sim * 100, dim=0)
    model.train()
    return {"t2v": recall(t2v_ranks(sim, cap_vid)), "v2t": recall(v2t_ranks(sim.t(), cap_vid))}


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-csv", default="msrvtt_9k.csv")
    p.add_argument("--val-csv", default="msrvtt_1k_test.csv")
    p.add_argument("--features", default="features/clip_vit_b32")
    p.add_argument("--out-dir", default="runs/retrieval")
    p.add_argument("--frames", type=int, default=12)
    p.add_argument("--feat-dim", type=int, default=512)
    p.add_argument("--embed-dim", type=int, default=512)
    p.add_argument("--vocab-size", type=int, default=49408)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.2)
    p.add_argument("--bank-size", type=int, default=4096)
    p.add_argument("--bank-tau", type=float, default=0.05)
    p.add_argument("--bank-weight", type=float, default=0.5)
    p.add_argument("--rank-weight", type=float, default=0.1)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--log-interval", type=int, default=50)
    p.add_argument("--dsl", action="store_true")
    return p.parse_args()


def main():
    args = get_args()
    distributed = int(os.environ.get("WORLD_SIZE", 1)) > 1
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if distributed:
        dist.init_process_group("nccl")
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    rank = dist.get_rank() if distributed else 0

    train_set = FrameFeatureDataset(args.train_csv, args.features, n_frames=args.frames, split="train")
    sampler = DistributedSampler(train_set) if distributed else None
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, shuffle=sampler is None,
                        num_workers=8, pin_memory=True, drop_last=True)
    val_set = FrameFeatureDataset(args.val_csv, args.features, n_frames=args.frames, split="test")
    video_loader = DataLoader(val_set.videos(), batch_size=256, num_workers=4)
    text_loader = DataLoader(val_set.captions(), batch_size=256, num_workers=4)

    model = VideoTextModel(args.feat_dim, args.embed_dim, args.vocab_size).to(device)
    if distributed:
        model = DDP(model, device_ids=[local_rank])
    named = list(model.named_parameters())
    no_wd = [p for n, p in named if p.ndim < 2 or "logit_scale" in n]
    wd = [p for n, p in named if not (p.ndim < 2 or "logit_scale" in n)]
    optimizer = torch.optim.AdamW([{"params": no_wd, "weight_decay": 0.0},
                                   {"params": wd, "weight_decay": args.weight_decay}],
                                  lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    total = args.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup(int(0.1 * total), total))
    scaler = torch.amp.GradScaler("cuda")
    bank = MemoryBank(args.bank_size, args.embed_dim, device)

    best_r1 = 0.0
    os.makedirs(args.out_dir, exist_ok=True)
    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        train_one_epoch(model, loader, optimizer, scheduler, scaler, bank, args, epoch, device)
        if rank == 0:
            metrics = evaluate(model, video_loader, text_loader, device, dsl=args.dsl)
            print(f"epoch {epoch}: {metrics}")
            raw = model.module if distributed else model
            ckpt = {"model": raw.state_dict(), "optimizer": optimizer.state_dict(),
                    "scaler": scaler.state_dict(), "epoch": epoch, "metrics": metrics}
            torch.save(ckpt, os.path.join(args.out_dir, "last.pth"))
            if metrics["t2v"]["R@1"] > best_r1:
                best_r1 = metrics["t2v"]["R@1"]
                torch.save(ckpt, os.path.join(args.out_dir, "best.pth"))
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
