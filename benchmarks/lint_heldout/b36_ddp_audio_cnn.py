"""Audio event classification from raw waveforms, DistributedDataParallel + torchrun.

    torchrun --nproc_per_node=8 b36_ddp_audio_cnn.py --data /data/audioset --amp

A learnable filterbank front end feeds a ConvNeXt-style 1-D CNN with squeeze-excite and an
auxiliary head in the middle. fp16 autocast with a GradScaler; gradient accumulation skips
the all-reduce with model.no_sync() on all but the last micro-batch.
"""
import argparse
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from datasets_audio import WaveformDataset  # project-local


class LearnableFilterbank(nn.Module):
    def __init__(self, n_filters=80, kernel=401, stride=160):
        super().__init__()
        self.filters = nn.Conv1d(1, n_filters, kernel, stride=stride, padding=kernel // 2, bias=False)

    def forward(self, wav):
        h = self.filters(wav.unsqueeze(1))
        return torch.log(h.abs() + 1e-8)  # expect: AMP011


class WSConv1d(nn.Conv1d):
    """Weight-standardised conv for the stem (no norm layer after it)."""

    def forward(self, x):
        w = self.weight
        w = (w - w.mean(dim=(1, 2), keepdim=True)) / (w.std(dim=(1, 2), keepdim=True) + 1e-5)
        return F.conv1d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)


class ChannelNorm(nn.Module):
    """LayerNorm over the channel axis of (B, C, T), as in ConvNeXt's channels_first LN."""

    def __init__(self, channels, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.eps = eps

    def forward(self, x):
        u = x.mean(1, keepdim=True)  # expect: AMP004
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight[:, None] * x + self.bias[:, None]


class SqueezeExcite(nn.Module):
    def __init__(self, channels, reduction=4):
        super().__init__()
        self.fc1 = nn.Conv1d(channels, channels // reduction, 1)
        self.fc2 = nn.Conv1d(channels // reduction, channels, 1)

    def forward(self, x):
        s = x.mean(dim=-1, keepdim=True)  # expect: AMP004
        s = torch.sigmoid(self.fc2(F.relu(self.fc1(s))))
        return x * s


class ConvBlock(nn.Module):
    def __init__(self, channels, kernel=7, expansion=4, drop_path=0.0):
        super().__init__()
        self.dwconv = nn.Conv1d(channels, channels, kernel, padding=kernel // 2, groups=channels)
        self.norm = ChannelNorm(channels)
        self.pw1 = nn.Conv1d(channels, expansion * channels, 1)
        self.pw2 = nn.Conv1d(expansion * channels, channels, 1)
        self.se = SqueezeExcite(channels)
        self.drop_path = drop_path

    def forward(self, x):
        h = self.norm(self.dwconv(x))
        h = self.pw2(F.gelu(self.pw1(h)))
        h = self.se(h)
        if self.training and self.drop_path > 0:
            keep = torch.rand(x.size(0), 1, 1, device=x.device) >= self.drop_path
            h = h * keep / (1 - self.drop_path)
        return x + h


class AudioNet(nn.Module):
    def __init__(self, n_classes=527, n_filters=80, width=256, depth=8):
        super().__init__()
        self.frontend = LearnableFilterbank(n_filters)
        self.stem = WSConv1d(n_filters, width, 3, padding=1)
        self.blocks = nn.ModuleList([ConvBlock(width, drop_path=0.1 * i / depth) for i in range(depth)])
        self.head = nn.Linear(width, n_classes)
        self.aux_head = nn.Linear(width, n_classes)

    def forward(self, wav):
        x = self.stem(self.frontend(wav))
        aux = None
        for i, blk in enumerate(self.blocks):
            x = blk(x)
            if i == len(self.blocks) // 2 - 1:
                aux = self.aux_head(x.amax(dim=-1))
        pooled = F.adaptive_avg_pool1d(x, 1).squeeze(-1)
        return self.head(pooled), aux


def evaluate(model, loader, device):
    model.eval()
    correct = total = 0
    loss_sum = torch.zeros((), device=device)
    with torch.no_grad():
        for wav, target in loader:
            wav, target = wav.to(device, non_blocking=True), target.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits, _ = model(wav)
            loss_sum += F.cross_entropy(logits.float(), target, reduction="sum")
            correct += (logits.argmax(-1) == target).sum().item()
            total += target.numel()
    model.train()
    stats = torch.tensor([loss_sum.item(), correct, total], device=device, dtype=torch.float64)
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main(args):
    dist.init_process_group("nccl")
    rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)

    train_set = WaveformDataset(args.data, split="train", seconds=10)
    val_set = WaveformDataset(args.data, split="eval", seconds=10)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, args.batch_size, sampler=DistributedSampler(val_set, shuffle=False), num_workers=4)

    model = AudioNet(n_classes=args.n_classes).to(device)
    model = DDP(model, device_ids=[local_rank])
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs * len(loader) // args.accum_steps)
    scaler = torch.cuda.amp.GradScaler() if args.amp else None  # expect: AMP009

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        optimizer.zero_grad(set_to_none=True)
        for it, (wav, target) in enumerate(loader):
            wav, target = wav.to(device, non_blocking=True), target.to(device, non_blocking=True)
            last = (it + 1) % args.accum_steps == 0
            sync_ctx = nullcontext() if last else model.no_sync()
            with sync_ctx:
                with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                    logits, aux_logits = model(wav)
                    loss = criterion(logits, target)
                aux_loss = F.cross_entropy(aux_logits, target)  # expect: AMP002
                loss = (loss + args.aux_weight * aux_loss) / args.accum_steps
                if scaler is not None:
                    scaler.scale(loss).backward()
                else:
                    loss.backward()
            if not last:
                continue
            if scaler is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)  # expect: AMP005
                scaler.step(optimizer)
                scaler.update()
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            if rank == 0 and (it + 1) % (50 * args.accum_steps) == 0:
                print(f"epoch {epoch} it {it + 1} loss {loss.item() * args.accum_steps:.4f} {time.time() - t0:.1f}s")
        val_loss, val_acc = evaluate(model, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} val_loss {val_loss:.4f} val_acc {val_acc:.4f}")
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/audio")
    p.add_argument("--n_classes", type=int, default=527)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--accum_steps", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--aux_weight", type=float, default=0.3)
    p.add_argument("--clip_grad_norm", type=float, default=5.0)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    main(p.parse_args())
