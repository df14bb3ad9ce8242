"""Two-stream video action recognition (RGB + optical flow), divided space-time attention.

Decoding dominates the input pipeline, so the dataset hands out clips already
normalised and stored as fp16 (half the shared-memory traffic between workers);
the training step turns them back into fp32 before augmentation and autocast.
"""

import argparse
import copy
import math
import os
import time

import decord
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_map
from torch.utils.data import DataLoader, Dataset

FRAME_DTYPE = torch.float16
MEAN16 = np.array([0.45, 0.45, 0.45], dtype=np.float16)
STD16 = np.array([0.225, 0.225, 0.225], dtype=np.float16)


class VideoClipDataset(Dataset):
    def __init__(self, root, annotations, num_frames=16, stride=4, size=224, flow_root=None):
        self.root = root
        self.items = [line.split() for line in open(annotations)]
        self.num_frames, self.stride, self.size = num_frames, stride, size
        self.flow_root = flow_root

    def __len__(self):
        return len(self.items)

    def _indices(self, n):
        span = self.num_frames * self.stride
        start = np.random.randint(0, max(1, n - span))
        return np.clip(np.arange(start, start + span, self.stride), 0, n - 1)

    def __getitem__(self, i):
        rel, label = self.items[i]
        vr = decord.VideoReader(os.path.join(self.root, rel), width=self.size, height=self.size, num_threads=1)
        idx = self._indices(len(vr))
        frames = vr.get_batch(idx).asnumpy().astype(np.float16) / np.float16(255.0)
        frames = (frames - MEAN16) / STD16
        clip = torch.from_numpy(np.ascontiguousarray(frames.transpose(3, 0, 1, 2)))  # C T H W, fp16
        flow = np.load(os.path.join(self.flow_root, rel + ".npy"))[idx].astype(np.float32) / 20.0
        return {"frames": clip, "flow": torch.from_numpy(flow).permute(3, 0, 1, 2), "label": int(label)}


class CUDAPrefetcher:
    """Overlaps host-to-device copies with compute on a side stream."""

    def __init__(self, loader, device, half=False):
        self.loader, self.device, self.half = loader, device, half
        self.stream = torch.cuda.Stream()

    def __iter__(self):
        self.it = iter(self.loader)
        self._preload()
        while self.next is not None:
            torch.cuda.current_stream().wait_stream(self.stream)
            batch = self.next
            self._preload()
            yield batch

    def _preload(self):
        try:
            batch = next(self.it)
        except StopIteration:
            self.next = None
            return
        with torch.cuda.stream(self.stream):
            batch = tree_map(lambda t: t.to(self.device, non_blocking=True), batch)
            self.next = tree_map(lambda t: t.half() if self.half and t.is_floating_point() else t, batch)


class PatchEmbed3d(nn.Module):
    def __init__(self, in_ch, dim, patch=16, tubelet=2):
        super().__init__()
        self.proj = nn.Conv3d(in_ch, dim, (tubelet, patch, patch), (tubelet, patch, patch))

    def forward(self, x):
        x = self.proj(x)  # B D T' H' W'
        b, d, t, h, w = x.shape
        return x.permute(0, 2, 3, 4, 1).reshape(b, t, h * w, d)


class DividedBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm_t, self.norm_s, self.norm_mlp = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv_t, self.qkv_s = nn.Linear(dim, 3 * dim), nn.Linear(dim, 3 * dim)
        self.out_t, self.out_s = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def _attend(self, x, qkv, out, mask=None):
        n, l, d = x.shape
        q, k, v = qkv(x).view(n, l, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        if mask is not None:
            scores = scores.masked_fill(~mask[:, None, None, :], -1e9)  # expect: AMP007
        return out((scores.softmax(-1) @ v).transpose(1, 2).reshape(n, l, d))

    def forward(self, x, frame_mask):
        b, t, s, d = x.shape
        xt = x.permute(0, 2, 1, 3).reshape(b * s, t, d)
        tmask = frame_mask.repeat_interleave(s, dim=0)
        xt = xt + self._attend(self.norm_t(xt), self.qkv_t, self.out_t, tmask)
        x = xt.reshape(b, s, t, d).permute(0, 2, 1, 3)
        xs = x.reshape(b * t, s, d)
        xs = xs + self._attend(self.norm_s(xs), self.qkv_s, self.out_s)
        x = xs.reshape(b, t, s, d)
        return x + self.mlp(self.norm_mlp(x))


class TwoStreamTimeSformer(nn.Module):
    def __init__(self, num_classes, dim=384, depth=8, heads=6):
        super().__init__()
        self.rgb_embed = PatchEmbed3d(3, dim)
        self.flow_embed = PatchEmbed3d(2, dim)
        self.blocks = nn.ModuleList(DividedBlock(dim, heads) for _ in range(depth))
        self.pool = nn.Linear(dim, 1)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, inputs, frame_mask=None):
        x = self.rgb_embed(inputs["rgb"]) + self.flow_embed(inputs["flow"])
        if frame_mask is None:
            frame_mask = torch.ones(x.shape[0], x.shape[1], dtype=torch.bool, device=x.device)
        for blk in self.blocks:
            x = blk(x, frame_mask)
        tokens = x.flatten(1, 2)
        weights = self.pool(tokens).float().softmax(dim=1)
        pooled = (weights * tokens.float()).sum(dim=1)
        return self.head(self.norm(pooled))


class ModelEma:
    def __init__(self, model, decay=0.9998):
        self.module = copy.deepcopy(model).eval()
        self.module.requires_grad_(False)
        self.decay = decay

    @torch.no_grad()
    def update(self, model):
        for e, m in zip(self.module.state_dict().values(), model.state_dict().values()):
            if e.dtype.is_floating_point:
                e.mul_(self.decay).add_(m.detach(), alpha=1.0 - self.decay)


def mixup(frames, flow, labels, num_classes, alpha=0.8):
    lam = float(np.random.beta(alpha, alpha))
    perm = torch.randperm(frames.size(0), device=frames.device)
    targets = F.one_hot(labels, num_classes).float()
    return (lam * frames + (1 - lam) * frames[perm], lam * flow + (1 - lam) * flow[perm],
            lam * targets + (1 - lam) * targets[perm])


def train_step(model, batch, optimizer, scaler, ema, args):
    frames = batch["frames"].float()
    flow = batch["flow"].to(frames.device, dtype=FRAME_DTYPE)  # expect: AMP001
    frames, flow, targets = mixup(frames, flow, batch["label"], args.num_classes)
    with torch.autocast("cuda", dtype=torch.float16):
        logits = model({"rgb": frames, "flow": flow})
        loss = torch.sum(-targets * F.log_softmax(logits.float(), dim=-1), dim=-1).mean()
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
    scaler.step(optimizer)
    scaler.update()
    ema.update(model)
    return loss.detach()


def finetune_long_clips(model, loader, optimizer, scaler, device, epochs=2):
    """Second stage on 64-frame clips with a lower learning rate."""
    model.train()
    for _ in range(epochs):
        for batch in CUDAPrefetcher(loader, device):
            inputs = {"rgb": batch["frames"], "flow": batch["flow"]}
            inputs = tree_map(lambda t: t.half(), inputs)  # expect: AMP001
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(inputs), batch["label"])
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()


def validate(model, loader, device):
    model.eval()
    correct = total = 0
    with torch.inference_mode():
        for batch in loader:
            inputs = {"rgb": batch["frames"].to(device, dtype=FRAME_DTYPE),
                      "flow": batch["flow"].to(device, dtype=FRAME_DTYPE)}
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(inputs)
            correct += (logits.argmax(-1).cpu() == batch["label"]).sum().item()
            total += len(batch["label"])
    return correct / max(total, 1)


def predict_clip(model, clip, flow):
    """Single-clip prediction for the demo server: model and inputs in fp16."""
    model.eval()
    inputs = {"rgb": clip.half()[None], "flow": flow.half()[None]}
    return model.half()(inputs).float().softmax(-1)[0]


def benchmark_clips_per_second(model, device, batch_size=8, frames=16, iters=30):
    m = copy.deepcopy(model).half().eval()
    inputs = {"rgb": torch.randn(batch_size, 3, frames, 224, 224, device=device, dtype=FRAME_DTYPE),
              "flow": torch.randn(batch_size, 2, frames, 224, 224, device=device, dtype=FRAME_DTYPE)}
    with torch.inference_mode():
        for _ in range(5):
            m(inputs)
        torch.cuda.synchronize()
        t0 = time.time()
        for _ in range(iters):
            m(inputs)
        torch.cuda.synchronize()
    return batch_size * iters / (time.time() - t0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--flow-root", required=True)
    p.add_argument("--num-classes", type=int, default=400)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--out", default="out/video")
    args = p.parse_args()
    device = torch.device("cuda")
    train_set = VideoClipDataset(args.root, os.path.join(args.root, "train.txt"), flow_root=args.flow_root)
    val_set = VideoClipDataset(args.root, os.path.join(args.root, "val.txt"), flow_root=args.flow_root)
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=12, pin_memory=True,
                        drop_last=True, persistent_workers=True, prefetch_factor=4)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, num_workers=8)

    model = TwoStreamTimeSformer(args.num_classes).to(device)
    ema = ModelEma(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    scaler = torch.amp.GradScaler("cuda")
    print(f"{benchmark_clips_per_second(model, device):.1f} clips/s")
    for epoch in range(args.epochs):
        model.train()
        for it, batch in enumerate(CUDAPrefetcher(loader, device)):
            loss = train_step(model, batch, optimizer, scaler, ema, args)
            if it % 50 == 0:
                print(f"epoch {epoch} it {it} loss {loss.item():.4f}")
        acc = validate(ema.module, val_loader, device)
        print(f"epoch {epoch} ema top1 {acc:.4f}")
        torch.save({"epoch": epoch, "model": model.state_dict(), "ema": copy.deepcopy(ema.module).half(),
                    "optimizer": optimizer.state_dict()}, os.path.join(args.out, "last.pt"))
    long_loader = DataLoader(VideoClipDataset(args.root, os.path.join(args.root, "train.txt"), num_frames=64,
                                              stride=2, flow_root=args.flow_root), batch_size=4, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr / 10, weight_decay=0.05)
    finetune_long_clips(model, long_loader, optimizer, scaler, device)


if __name__ == "__main__":
    main()
