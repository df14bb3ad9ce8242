"""CRNN scene-text recognizer (VGG-style CNN + BiLSTM + CTC) and its trainer.

Mixed precision: CUDA fp16 autocast with a GradScaler. The Trainer builds the model
itself and keeps it (optionally wrapped by torch.compile) in ``self.model``.
"""
import argparse
import copy
import string
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

ALPHABET = string.digits + string.ascii_letters + string.punctuation + " "


@dataclass
class OCRConfig:
    img_h: int = 32
    channels: tuple = (64, 128, 256, 256, 512, 512)
    pools: tuple = ((2, 2), (2, 2), None, (2, 1), None, (2, 1))
    hidden: int = 256
    attn_pool: bool = True
    lr: float = 1e-3
    weight_decay: float = 1e-4
    max_grad_norm: float = 5.0
    len_loss_weight: float = 0.1
    entropy_weight: float = 0.01
    epochs: int = 30
    compile: bool = True
    num_classes: int = len(ALPHABET) + 1  # + CTC blank at index 0


def encode_text(texts):
    flat, lengths = [], []
    for t in texts:
        ids = [ALPHABET.index(c) + 1 for c in t if c in ALPHABET]
        flat.extend(ids)
        lengths.append(len(ids))
    return torch.tensor(flat, dtype=torch.long), torch.tensor(lengths, dtype=torch.long)


def greedy_decode(log_probs):
    best = log_probs.argmax(-1).cpu()
    out = []
    for row in best:
        chars, prev = [], 0
        for idx in row.tolist():
            if idx != prev and idx != 0:
                chars.append(ALPHABET[idx - 1])
            prev = idx
        out.append("".join(chars))
    return out


def conv_stage(c_in, c_out, pool):
    layers = [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)]
    if pool is not None:
        layers.append(nn.MaxPool2d(pool))
    return layers


class HeightAttentionPool(nn.Module):
    """Collapses the height axis with learned per-column attention weights."""

    def __init__(self, channels):
        super().__init__()
        self.score = nn.Conv2d(channels, 1, kernel_size=1)

    def forward(self, f):
        w = torch.sigmoid(self.score(f))
        # both sums run in fp32 under CUDA autocast, so this eps meets an fp32 tensor
        pooled = (f * w).sum(dim=2) / (w.sum(dim=2) + 1e-8)
        entropy = -(w * torch.log(w + 1e-8)).sum(dim=2).mean()  # expect: AMP011
        return pooled, entropy


class CRNN(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        layers, c_prev = [], 1
        for c, pool in zip(cfg.channels, cfg.pools):
            layers += conv_stage(c_prev, c, pool)
            c_prev = c
        layers.append(nn.Conv2d(c_prev, cfg.hidden, kernel_size=1))
        self.cnn = nn.Sequential(*layers)
        self.height_pool = HeightAttentionPool(cfg.hidden) if cfg.attn_pool else None
        self.rnn = nn.LSTM(cfg.hidden, cfg.hidden, num_layers=2, bidirectional=True, batch_first=True)
        self.proj = nn.Linear(2 * cfg.hidden, cfg.hidden)
        self.classifier = nn.Linear(cfg.hidden, cfg.num_classes)
        self.length_head = nn.Sequential(nn.Linear(cfg.hidden, 64), nn.ReLU(), nn.Linear(64, 1))

    def encode(self, images):
        f = self.cnn(images)
        if self.height_pool is not None:
            seq, entropy = self.height_pool(f)
        else:
            seq, entropy = f.mean(dim=2), None  # expect: AMP004
        return seq.transpose(1, 2), entropy

    def forward(self, images):
        seq, entropy = self.encode(images)
        out, _ = self.rnn(seq)
        feats = self.proj(out)
        logits = self.classifier(F.gelu(feats))
        length_pred = self.length_head(feats.mean(dim=1)).squeeze(-1)  # expect: AMP004
        return logits, length_pred, entropy


def clip_gradients(model, max_norm):
    params = [p for p in model.parameters() if p.grad is not None]
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


class Trainer:
    def __init__(self, cfg, device="cuda"):
        self.cfg = cfg
        self.device = device
        model = CRNN(cfg).to(device)
        self.raw_model = model
        self.model = torch.compile(model) if cfg.compile else model
        self.ctc = nn.CTCLoss(blank=0, zero_infinity=True)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.scaler = torch.amp.GradScaler("cuda")
        self.step = 0
        self.best_acc = -1e9

    def train_step(self, images, texts):
        targets, target_lengths = encode_text(texts)
        images = images.to(self.device, non_blocking=True).half()  # expect: AMP001
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits, length_pred, entropy = self.model(images)
            len_loss = F.smooth_l1_loss(length_pred, target_lengths.to(self.device).float())
        log_probs = logits.log_softmax(2).permute(1, 0, 2)
        input_lengths = torch.full((logits.size(0),), logits.size(1), dtype=torch.long)
        ctc_loss = self.ctc(log_probs, targets, input_lengths, target_lengths)  # expect: AMP002
        loss = ctc_loss + self.cfg.len_loss_weight * len_loss
        if entropy is not None:
            loss = loss + self.cfg.entropy_weight * entropy
        self.scaler.scale(loss).backward()
        grad_norm = clip_gradients(self.raw_model, self.cfg.max_grad_norm)  # expect: AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.step += 1
        return loss.item(), grad_norm.item()

    @torch.no_grad()
    def evaluate(self, loader):
        self.model.eval()
        correct, total, margins = 0, 0, []
        for images, texts in loader:
            images = images.to(self.device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits, _, _ = self.model(images)
            top2 = logits.topk(2, dim=-1).values
            margins.append((top2[..., 0] - top2[..., 1]).mean().item())
            preds = greedy_decode(logits.float().log_softmax(-1))
            correct += sum(p == t for p, t in zip(preds, texts))
            total += len(texts)
        self.model.train()
        return correct / max(total, 1), sum(margins) / max(len(margins), 1)

    def export_fp16(self, path):
        # serving copy: cast a deepcopy and save it
        serving = copy.deepcopy(self.raw_model).half().eval()
        torch.save(serving.state_dict(), path)

    def fit(self, train_loader, val_loader, out_dir):
        for epoch in range(self.cfg.epochs):
            running = 0.0
            for i, (images, texts) in enumerate(train_loader):
                loss, gnorm = self.train_step(images, texts)
                running += loss
                if i % 100 == 0:
                    print(f"epoch {epoch} it {i} loss {running / (i + 1):.4f} |g| {gnorm:.2f}")
            acc, margin = self.evaluate(val_loader)
            print(f"epoch {epoch}: word acc {acc:.4f}, mean logit margin {margin:.3f}")
            if acc > self.best_acc:
                self.best_acc = acc
                torch.save({"model": self.raw_model.state_dict(), "cfg": self.cfg}, f"{out_dir}/best.pt")
        self.export_fp16(f"{out_dir}/crnn_fp16.pt")


def collate(batch):
    images, texts = zip(*batch)
    return torch.stack(images), list(texts)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", required=True)
    parser.add_argument("--val", required=True)
    parser.add_argument("--out", default="runs/crnn")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--no-attn-pool", action="store_true")
    parser.add_argument("--batch-size", type=int, default=128)
    args = parser.parse_args()

    cfg = OCRConfig(compile=not args.no_compile, attn_pool=not args.no_attn_pool)
    train_set = torch.load(args.train)
    val_set = torch.load(args.val)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                              num_workers=8, collate_fn=collate, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=256, num_workers=4, collate_fn=collate)
    Trainer(cfg).fit(train_loader, val_loader, args.out)


if __name__ == "__main__":
    main()
