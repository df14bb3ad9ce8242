"""Train a CNN + Transformer text-line recogniser with CTC.

    python b32_ocr_ctc_train.py configs/ocr_latin.yaml

Lines are resized to height 32 and padded to the widest image of the batch;
an auxiliary head classifies the script of the line.
"""
import argparse
import copy
import math
import os
import time

import editdistance
import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.utils.data import DataLoader

from ocrdata import Charset, CTCCollate, LineImageDataset


class ConvFeatureExtractor(nn.Module):
    def __init__(self, in_ch=1, channels=(64, 128, 256, 256, 512, 512), out_dim=512):
        super().__init__()
        layers, ch = [], in_ch
        for i, c in enumerate(channels):
            layers += [nn.Conv2d(ch, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(inplace=True)]
            if i in (0, 1):
                layers.append(nn.MaxPool2d(2, 2))
            elif i in (3, 5):
                layers.append(nn.MaxPool2d((2, 1), (2, 1)))
            ch = c
        self.body = nn.Sequential(*layers)
        self.proj = nn.Conv2d(ch, out_dim, 1)

    def forward(self, x):
        return self.proj(self.body(x))


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).type_as(x) * self.weight


class MaskedSelfAttention(nn.Module):
    def __init__(self, dim, heads, dropout=0.1):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, pad_mask):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        scores = scores.masked_fill(pad_mask[:, None, None, :], -1e9)  # expect: AMP007
        attn = self.drop(scores.softmax(dim=-1))
        return self.proj(torch.matmul(attn, v).transpose(1, 2).reshape(b, t, c))


class EncoderLayer(nn.Module):
    def __init__(self, dim, heads, ff_mult=4, dropout=0.1):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.attn = MaskedSelfAttention(dim, heads, dropout)
        self.ff = nn.Sequential(nn.Linear(dim, ff_mult * dim), nn.GELU(), nn.Dropout(dropout), nn.Linear(ff_mult * dim, dim))

    def forward(self, x, pad_mask):
        x = x + self.attn(self.norm1(x), pad_mask)
        return x + self.ff(self.norm2(x))


class LineRecognizer(nn.Module):
    def __init__(self, num_classes, num_scripts, dim=512, depth=4, heads=8, max_len=1024):
        super().__init__()
        self.cnn = ConvFeatureExtractor(out_dim=dim)
        self.pos = nn.Parameter(torch.zeros(1, max_len, dim))
        self.layers = nn.ModuleList([EncoderLayer(dim, heads) for _ in range(depth)])
        self.pool_gate = nn.Linear(dim, 1)
        self.classifier = nn.Linear(dim, num_classes)
        self.script_head = nn.Linear(dim, num_scripts)

    def forward(self, images, widths):
        feat = self.cnn(images)
        feat = feat.mean(dim=2)  # expect: AMP004
        seq = feat.transpose(1, 2)
        t = seq.shape[1]
        lengths = torch.div(widths, 4, rounding_mode="floor").clamp(max=t)
        pad_mask = torch.arange(t, device=seq.device)[None, :] >= lengths[:, None]
        seq = seq + self.pos[:, :t]
        for layer in self.layers:
            seq = layer(seq, pad_mask)
        gate = torch.sigmoid(self.pool_gate(seq)).masked_fill(pad_mask[..., None], 0.0)
        pooled = (gate * seq).sum(dim=1) / (gate.sum(dim=1) + 1e-8)
        return {"logits": self.classifier(seq), "script_logits": self.script_head(pooled), "lengths": lengths}


def greedy_decode(logits, lengths, charset):
    best = logits.argmax(-1).cpu()
    texts = []
    for seq, n in zip(best, lengths.tolist()):
        prev, chars = 0, []
        for idx in seq[:n].tolist():
            if idx != prev and idx != 0:
                chars.append(charset.itos[idx])
            prev = idx
        texts.append("".join(chars))
    return texts


@torch.no_grad()
def evaluate(model, loader, charset, device):
    model.eval()
    errors, total = 0, 0
    for images, widths, _, _, _, texts in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(images.to(device), widths.to(device))
        preds = greedy_decode(out["logits"].float(), out["lengths"], charset)
        errors += sum(editdistance.eval(p, t) for p, t in zip(preds, texts))
        total += sum(len(t) for t in texts)
    model.train()
    return errors / max(total, 1)


def export_onnx(model, path, height=32, width=512):
    m = copy.deepcopy(model).eval().half()
    dummy = (torch.zeros(1, 1, height, width, device="cuda").half(), torch.tensor([width], device="cuda"))
    torch.onnx.export(m, dummy, path, input_names=["image", "width"], dynamic_axes={"image": {3: "w"}}, opset_version=17)


def train(cfg):
    device = torch.device("cuda")
    charset = Charset.from_file(cfg["charset"])
    model = LineRecognizer(len(charset), cfg["num_scripts"], dim=cfg["dim"], depth=cfg["depth"])
    model.to(device)
    if cfg.get("compile"):
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg["max_steps"])
    scaler = torch.cuda.amp.GradScaler(enabled=cfg["amp"])  # expect: AMP009
    collate = CTCCollate(charset, height=32)
    train_loader = DataLoader(LineImageDataset(cfg["train"], augment=True), batch_size=cfg["batch_size"],
                              shuffle=True, collate_fn=collate, num_workers=8, drop_last=True)
    val_loader = DataLoader(LineImageDataset(cfg["val"]), batch_size=64, collate_fn=collate, num_workers=4)
    step, best_cer = 0, 1.0
    while step < cfg["max_steps"]:
        for images, widths, targets, target_lengths, scripts, _ in train_loader:
            images, widths = images.to(device, non_blocking=True), widths.to(device)
            targets, target_lengths, scripts = targets.to(device), target_lengths.to(device), scripts.to(device)
            with torch.autocast("cuda", dtype=torch.float16, enabled=cfg["amp"]):
                out = model(images, widths)
                script_loss = F.cross_entropy(out["script_logits"], scripts)
            log_probs = out["logits"].log_softmax(2).transpose(0, 1)
            ctc = F.ctc_loss(log_probs, targets, out["lengths"], target_lengths, blank=0, zero_infinity=True)  # expect: AMP002
            loss = ctc + cfg["script_weight"] * script_loss
            loss = scaler.scale(loss)
            loss.backward()
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
            optimizer.step()  # expect: AMP006
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step += 1
            if step % cfg["log_every"] == 0:
                print(f"step {step} ctc {ctc.item():.4f} grad_norm {grad_norm:.2f} scale {scaler.get_scale():.0f}")
            if step % cfg["eval_every"] == 0:
                cer = evaluate(model, val_loader, charset, device)
                print(f"step {step} val CER {cer:.4f}")
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                         "scaler": scaler.state_dict(), "step": step, "cer": cer}
                torch.save(state, os.path.join(cfg["out_dir"], "last.pt"))
                if cer < best_cer:
                    best_cer = cer
                    torch.save(state, os.path.join(cfg["out_dir"], "best.pt"))
            if step >= cfg["max_steps"]:
                break
    if cfg.get("export_onnx"):
        export_onnx(model, os.path.join(cfg["out_dir"], "model.onnx"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    args = parser.parse_args()
    with open(args.config) as f:
        config = yaml.safe_load(f)
    os.makedirs(config["out_dir"], exist_ok=True)
    train(config)
