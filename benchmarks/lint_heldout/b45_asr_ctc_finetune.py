"""Fine-tune a pretrained conformer-lite CTC model on a new read-speech corpus.

    python b45_asr_ctc_finetune.py --pretrained ckpt/base_960h.pt --manifest data/train.jsonl
"""
import argparse
import copy
import json
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset

VOCAB = ["<blank>", " ", "'"] + list("abcdefghijklmnopqrstuvwxyz")
CHAR2ID = {c: i for i, c in enumerate(VOCAB)}


class ManifestDataset(Dataset):
    def __init__(self, manifest):
        with open(manifest) as f:
            self.items = [json.loads(line) for line in f]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        item = self.items[idx]
        feats = torch.load(item["feats_path"])  # (T, n_mels) log-mel, fp32
        target = torch.tensor([CHAR2ID[c] for c in item["text"].lower() if c in CHAR2ID])
        return feats, target


def collate(batch):
    feats, targets = zip(*batch)
    feat_lens = torch.tensor([f.size(0) for f in feats])
    target_lens = torch.tensor([t.size(0) for t in targets])
    return pad_sequence(feats, batch_first=True), feat_lens, torch.cat(targets), target_lens


class SpecAugment(nn.Module):
    def __init__(self, freq_mask=27, time_mask=40, n_masks=2):
        super().__init__()
        self.freq_mask, self.time_mask, self.n_masks = freq_mask, time_mask, n_masks

    def forward(self, x):
        if not self.training:
            return x
        B, T, Fdim = x.shape
        for _ in range(self.n_masks):
            f0 = torch.randint(0, Fdim - self.freq_mask, (1,)).item()
            t0 = torch.randint(0, max(1, T - self.time_mask), (1,)).item()
            x = x.clone()
            x[:, :, f0:f0 + self.freq_mask] = 0.0
            x[:, t0:t0 + self.time_mask, :] = 0.0
        return x


class MultiHeadSelfAttention(nn.Module):
    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__()
        self.n_heads, self.d_head = n_heads, d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, pad_mask):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, self.d_head).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.d_head)
        scores = scores.masked_fill(pad_mask[:, None, None, :], -1e9)  # expect: AMP007
        attn = self.drop(scores.softmax(dim=-1))
        return self.proj((attn @ v).transpose(1, 2).reshape(B, T, C))


class ConformerBlockLite(nn.Module):
    def __init__(self, d_model, n_heads, kernel_size=15):
        super().__init__()
        self.ff1 = nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, 4 * d_model), nn.SiLU(), nn.Linear(4 * d_model, d_model))
        self.attn_norm = nn.LayerNorm(d_model)
        self.attn = MultiHeadSelfAttention(d_model, n_heads)
        self.conv_norm = nn.LayerNorm(d_model)
        self.dwconv = nn.Conv1d(d_model, d_model, kernel_size, padding=kernel_size // 2, groups=d_model)
        self.ff2 = nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, 4 * d_model), nn.SiLU(), nn.Linear(4 * d_model, d_model))
        self.out_norm = nn.LayerNorm(d_model)

    def forward(self, x, pad_mask):
        x = x + 0.5 * self.ff1(x)
        x = x + self.attn(self.attn_norm(x), pad_mask)
        x = x + F.silu(self.dwconv(self.conv_norm(x).transpose(1, 2))).transpose(1, 2)
        return self.out_norm(x + 0.5 * self.ff2(x))


class ASRModel(nn.Module):
    def __init__(self, n_mels=80, d_model=256, n_layers=8, n_heads=4, vocab_size=len(VOCAB)):
        super().__init__()
        self.spec_aug = SpecAugment()
        self.subsample = nn.Sequential(
            nn.Conv1d(n_mels, d_model, 3, stride=2, padding=1), nn.GELU(),
            nn.Conv1d(d_model, d_model, 3, stride=2, padding=1),
        )
        self.blocks = nn.ModuleList([ConformerBlockLite(d_model, n_heads) for _ in range(n_layers)])
        self.ctc_head = nn.Linear(d_model, vocab_size)

    def forward(self, feats, feat_lens):
        x = self.subsample(self.spec_aug(feats).transpose(1, 2))  # (B, D, T/4)
        # per-utterance feature normalisation over time, as in the original recipe
        x = x - x.mean(dim=-1, keepdim=True)  # expect: AMP004
        x = x / (x.std(dim=-1, keepdim=True) + 1e-8)  # expect: AMP004, AMP011
        x = F.gelu(x).transpose(1, 2)
        out_lens = torch.div(feat_lens - 1, 4, rounding_mode="floor") + 1
        pad_mask = torch.arange(x.size(1), device=x.device)[None, :] >= out_lens[:, None]
        for block in self.blocks:
            x = block(x, pad_mask)
        return self.ctc_head(x), out_lens


def load_pretrained(path, vocab_size):
    ckpt = torch.load(path, map_location="cpu")
    model = ASRModel(**ckpt["hparams"])
    model.load_state_dict(ckpt["model"])
    if model.ctc_head.out_features != vocab_size:
        model.ctc_head = nn.Linear(model.ctc_head.in_features, vocab_size)
    # the released checkpoint is fp16; keep the weights in the dtype they were trained in
    return model.half()  # expect: AMP001


def build_optimizer(model, args, steps_per_epoch):
    no_decay = ("bias", "norm")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)], "weight_decay": 1e-3},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, total_steps=args.epochs * steps_per_epoch)
    scaler = torch.cuda.amp.GradScaler(growth_interval=1000)  # expect: AMP009
    return optimizer, scheduler, scaler


def optimizer_step(model, optimizer, scheduler, scaler, max_norm):
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # expect: AMP005
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def save_checkpoint(path, model, optimizer, scheduler, scaler, epoch):
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict(), "epoch": epoch}, path)


def export_for_serving(model, path):
    served = copy.deepcopy(model).half().eval()
    torch.save({"hparams": {"vocab_size": len(VOCAB)}, "model": served.state_dict()}, path)


@torch.inference_mode()
def greedy_decode(model, loader, device):
    model.eval()
    hyps = []
    for feats, feat_lens, _, _ in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logits, out_lens = model(feats.to(device), feat_lens.to(device))
        for seq, n in zip(logits.argmax(-1).cpu(), out_lens.cpu()):
            ids = torch.unique_consecutive(seq[:n])
            hyps.append("".join(VOCAB[i] for i in ids.tolist() if i != 0))
    model.train()
    return hyps


def train(args):
    device = torch.device("cuda")
    loader = DataLoader(ManifestDataset(args.manifest), batch_size=args.batch_size, shuffle=True,
                        collate_fn=collate, num_workers=6, drop_last=True)
    model = load_pretrained(args.pretrained, len(VOCAB)).to(device)
    optimizer, scheduler, scaler = build_optimizer(model, args, len(loader) // args.accum_steps)
    start_epoch = 0
    if args.resume and os.path.exists(args.resume):
        ckpt = torch.load(args.resume, map_location=device)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1

    model.train()
    for epoch in range(start_epoch, args.epochs):
        for step, (feats, feat_lens, targets, target_lens) in enumerate(loader):
            feats, feat_lens = feats.to(device, non_blocking=True), feat_lens.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                logits, out_lens = model(feats, feat_lens)
            log_probs = logits.log_softmax(-1).transpose(0, 1)
            loss = F.ctc_loss(log_probs, targets, out_lens, target_lens, blank=0, zero_infinity=True)  # expect: AMP002
            scaler.scale(loss / args.accum_steps).backward()
            if (step + 1) % args.accum_steps == 0:
                grad_norm = optimizer_step(model, optimizer, scheduler, scaler, args.max_norm)
                if step % 100 == 0:
                    print(f"epoch {epoch} step {step} ctc {loss.item():.3f} |g| {grad_norm:.2f}")
        save_checkpoint(os.path.join(args.out_dir, "last.pt"), model, optimizer, scheduler, scaler, epoch)
    export_for_serving(model, os.path.join(args.out_dir, "model_fp16.pt"))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--pretrained", required=True)
    p.add_argument("--manifest", required=True)
    p.add_argument("--out-dir", dest="out_dir", default="exp/asr_ft")
    p.add_argument("--resume", default="")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", dest="batch_size", type=int, default=32)
    p.add_argument("--accum-steps", dest="accum_steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--max-norm", dest="max_norm", type=float, default=5.0)
    train(p.parse_args())
