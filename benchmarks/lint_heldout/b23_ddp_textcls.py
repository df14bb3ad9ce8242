"""Distributed fine-tuning of a small transformer text classifier with a SupCon auxiliary loss.

    torchrun --nproc_per_node=8 b23_ddp_textcls.py --data data/tok.pt --amp
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="ckpt")
    p.add_argument("--vocab", type=int, default=30522)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--num-classes", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--wd", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--supcon-weight", type=float, default=0.1)
    p.add_argument("--amp", action="store_true", help="fp16 autocast with loss scaling")
    p.add_argument("--pure-fp16", action="store_true", help="keep the weights themselves in fp16")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class MHSA(nn.Module):
    def __init__(self, dim, heads, dropout=0.1):
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, key_mask):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        scores = torch.where(key_mask[:, None, None, :], scores, torch.tensor(-1e9, device=scores.device))  # expect: AMP007
        attn = self.drop(scores.softmax(dim=-1))
        return self.out((attn @ v).transpose(1, 2).reshape(B, T, C))


class EncoderLayer(nn.Module):
    def __init__(self, dim, heads, dropout=0.1):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = MHSA(dim, heads, dropout)
        self.ln2 = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(dropout), nn.Linear(4 * dim, dim))

    def forward(self, x, key_mask):
        x = x + self.attn(self.ln1(x), key_mask)
        return x + self.ff(self.ln2(x))


class AttentionPool(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.score = nn.Linear(dim, 1)

    def forward(self, h, mask):
        w = self.score(h).squeeze(-1)
        w = w.masked_fill(~mask, torch.finfo(w.dtype).min).softmax(dim=-1)
        return torch.einsum("bt,btd->bd", w, h)


class Projector(nn.Module):
    """Projection head for the supervised-contrastive term; batch-centred outputs."""

    def __init__(self, dim, out_dim=128):
        super().__init__()
        self.fc1 = nn.Linear(dim, dim)
        self.fc2 = nn.Linear(dim, out_dim)

    def forward(self, x):
        z = self.fc2(F.gelu(self.fc1(x)))
        return z - z.mean(dim=0, keepdim=True)  # expect: AMP004


class TextClassifier(nn.Module):
    def __init__(self, vocab, dim, depth, heads, num_classes, max_len=512):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim, padding_idx=0)
        self.pos = nn.Parameter(torch.zeros(1, max_len, dim))
        self.layers = nn.ModuleList([EncoderLayer(dim, heads) for _ in range(depth)])
        self.ln_f = nn.LayerNorm(dim)
        self.pool = AttentionPool(dim)
        self.head = nn.Linear(dim, num_classes)
        self.projector = Projector(dim)

    def forward(self, ids, mask):
        x = self.tok(ids) + self.pos[:, : ids.size(1)]
        for layer in self.layers:
            x = layer(x, mask)
        pooled = self.pool(self.ln_f(x), mask)
        return self.head(pooled), self.projector(pooled)


def supcon_loss(z, labels, temperature=0.1):
    z = F.normalize(z.float(), dim=-1)
    sim = torch.matmul(z, z.t()).float() / temperature
    eye = torch.eye(z.size(0), dtype=torch.bool, device=z.device)
    sim = sim.masked_fill(eye, -1e9)
    pos = (labels[:, None] == labels[None, :]) & ~eye
    log_prob = sim - torch.logsumexp(sim, dim=1, keepdim=True)
    mean_log_pos = (log_prob * pos).sum(1) / pos.sum(1).clamp(min=1)
    return -mean_log_pos.mean()


@torch.no_grad()
def evaluate(model, loader, device, amp):
    model.eval()
    correct = torch.zeros(2, device=device)
    for ids, mask, labels in loader:
        ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
        with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
            logits, _ = model(ids, mask)
        correct[0] += (logits.argmax(-1) == labels).sum()
        correct[1] += labels.numel()
    dist.all_reduce(correct)
    model.train()
    return (correct[0] / correct[1]).item()


def main():
    args = get_args()
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + dist.get_rank())
    is_main = dist.get_rank() == 0

    data = torch.load(args.data)
    train_ds = TensorDataset(data["train_ids"], data["train_mask"].bool(), data["train_labels"])
    val_ds = TensorDataset(data["val_ids"], data["val_mask"].bool(), data["val_labels"])
    sampler = DistributedSampler(train_ds, shuffle=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=256, sampler=DistributedSampler(val_ds, shuffle=False))

    model = TextClassifier(args.vocab, args.dim, args.depth, args.heads, args.num_classes).to(device)
    if args.pure_fp16:
        model = model.half()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "pos" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "pos" in n]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)  # expect: AMP011
    model = DDP(model, device_ids=[local_rank])
    scaler = torch.cuda.amp.GradScaler() if args.amp else None  # expect: AMP009
    total_steps = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, s / 500) * max(0.0, 1 - s / total_steps))

    best_acc = -1e9
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for step, (ids, mask, labels) in enumerate(loader):
            ids, mask, labels = ids.to(device, non_blocking=True), mask.to(device), labels.to(device)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                logits, proj = model(ids, mask)
                loss = F.cross_entropy(logits, labels) + args.supcon_weight * supcon_loss(proj, labels)
            optimizer.zero_grad(set_to_none=True)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()  # expect: AMP006
            sched.step()
            if is_main and step % 100 == 0:
                print(f"epoch {epoch} step {step}/{len(loader)} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e}")
        acc = evaluate(model, val_loader, device, args.amp)
        if is_main:
            print(f"epoch {epoch}: val acc {acc:.4f} ({time.time() - tic:.0f}s)")
            if acc > best_acc:
                best_acc = acc
                os.makedirs(args.out, exist_ok=True)
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
