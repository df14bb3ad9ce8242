"""Conformer-CTC speech recogniser.

Trained with fp16 autocast and a GradScaler; shipped as a half-precision ONNX graph
and a TorchScript module for on-device decoding.
"""

import argparse
import copy
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.utils.data import DataLoader


class GlobalCMVN(nn.Module):
    """Global mean/variance normalisation of log-mel features."""

    def __init__(self, mean, istd):
        super().__init__()
        self.register_buffer("mean", mean.float())
        self.register_buffer("istd", istd.float())

    def half(self):
        # the statistics span 1e-3 .. 1e4: they stay fp32 whatever the model runs in
        return self

    def forward(self, x):
        return ((x.float() - self.mean) * self.istd).to(x.dtype)


class Conv2dSubsampling(nn.Module):
    def __init__(self, n_mels, d_model):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, d_model, 3, 2), nn.ReLU(), nn.Conv2d(d_model, d_model, 3, 2), nn.ReLU())
        self.out = nn.Linear(d_model * (((n_mels - 1) // 2 - 1) // 2), d_model)

    def forward(self, x, lens):
        x = self.conv(x.unsqueeze(1))
        b, c, t, f = x.shape
        x = self.out(x.transpose(1, 2).reshape(b, t, c * f))
        return x, ((lens - 1) // 2 - 1) // 2


class MultiHeadSelfAttention(nn.Module):
    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__()
        self.h = n_heads
        self.scale = (d_model // n_heads) ** -0.5
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, pad_mask):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.h, c // self.h).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) * self.scale
        scores = scores.masked_fill(pad_mask[:, None, None, :], -1e9)  # expect: AMP007
        attn = self.drop(scores.softmax(dim=-1))
        return self.proj((attn @ v).transpose(1, 2).reshape(b, t, c))


class ConvModule(nn.Module):
    def __init__(self, d_model, kernel_size=31):
        super().__init__()
        self.pw1 = nn.Conv1d(d_model, 2 * d_model, 1)
        self.dw = nn.Conv1d(d_model, d_model, kernel_size, padding=kernel_size // 2, groups=d_model)
        self.bn = nn.BatchNorm1d(d_model)
        self.pw2 = nn.Conv1d(d_model, d_model, 1)

    def forward(self, x):
        x = F.glu(self.pw1(x.transpose(1, 2)), dim=1)
        x = self.pw2(F.silu(self.bn(self.dw(x))))
        return x.transpose(1, 2)


class ConformerBlock(nn.Module):
    def __init__(self, d_model, n_heads, ff_mult=4, dropout=0.1):
        super().__init__()
        self.ff1 = nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, ff_mult * d_model), nn.SiLU(),
                                 nn.Dropout(dropout), nn.Linear(ff_mult * d_model, d_model))
        self.ff2 = copy.deepcopy(self.ff1)
        self.norm_att = nn.LayerNorm(d_model)
        self.att = MultiHeadSelfAttention(d_model, n_heads, dropout)
        self.norm_conv = nn.LayerNorm(d_model)
        self.conv = ConvModule(d_model)
        self.norm_out = nn.LayerNorm(d_model)

    def forward(self, x, pad_mask):
        x = x + 0.5 * self.ff1(x)
        x = x + self.att(self.norm_att(x), pad_mask)
        x = x + self.conv(self.norm_conv(x))
        x = x + 0.5 * self.ff2(x)
        return self.norm_out(x)


class ConformerEncoder(nn.Module):
    def __init__(self, n_mels=80, d_model=256, n_heads=4, n_layers=12):
        super().__init__()
        self.subsample = Conv2dSubsampling(n_mels, d_model)
        self.layers = nn.ModuleList(ConformerBlock(d_model, n_heads) for _ in range(n_layers))

    def forward(self, feats, lens):
        x, lens = self.subsample(feats, lens)
        pad_mask = torch.arange(x.size(1), device=x.device)[None, :] >= lens[:, None]
        for layer in self.layers:
            x = layer(x, pad_mask)
        return x, lens


class ConformerCTC(nn.Module):
    def __init__(self, vocab_size, n_mels=80, d_model=256, n_heads=4, n_layers=12):
        super().__init__()
        self.encoder = ConformerEncoder(n_mels, d_model, n_heads, n_layers)
        self.decoder = nn.Sequential(nn.Dropout(0.1), nn.Linear(d_model, vocab_size))

    def forward(self, feats, lens):
        enc, enc_lens = self.encoder(feats, lens)
        return self.decoder(enc), enc_lens


def ctc_loss(logits, enc_lens, tokens, token_lens):
    log_probs = logits.float().log_softmax(dim=-1).transpose(0, 1)
    return F.ctc_loss(log_probs, tokens, enc_lens, token_lens, blank=0, zero_infinity=True)


def train_one_epoch(model, cmvn, loader, optimizer, scheduler, scaler, device, epoch, args):
    model.train()
    spec_aug = nn.Sequential(torchaudio.transforms.FrequencyMasking(27), torchaudio.transforms.TimeMasking(40))
    for it, (feats, feat_lens, tokens, token_lens) in enumerate(loader):
        feats = spec_aug(cmvn(feats.to(device, non_blocking=True)).transpose(1, 2)).transpose(1, 2)
        if args.amp:
            feats = feats.type("torch.cuda.HalfTensor")  # expect: AMP001
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            logits, enc_lens = model(feats, feat_lens.to(device))
            loss = ctc_loss(logits, enc_lens, tokens.to(device), token_lens.to(device))
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        if it % 100 == 0:
            print(f"epoch {epoch} it {it} loss {loss.item():.3f} gnorm {grad_norm:.2f} scale {scaler.get_scale():.0f}")


def greedy_decode(logits, lens, blank=0):
    hyps = []
    for seq, n in zip(logits.argmax(-1).cpu(), lens.cpu()):
        out, prev = [], blank
        for s in seq[:n].tolist():
            if s != prev and s != blank:
                out.append(s)
            prev = s
        hyps.append(out)
    return hyps


def evaluate_wer(model, cmvn, loader, device):
    model.eval()
    errors = words = 0
    with torch.inference_mode():
        for feats, feat_lens, tokens, token_lens in loader:
            with torch.autocast("cuda", dtype=torch.float16):
                logits, enc_lens = model(cmvn(feats.to(device)), feat_lens.to(device))
            for hyp, ref, n in zip(greedy_decode(logits, enc_lens), tokens, token_lens):
                errors += torchaudio.functional.edit_distance(hyp, ref[:n].tolist())
                words += int(n)
    return errors / max(1, words)


def finetune_decoder(model, cmvn, loader, vocab_size, epochs, device):
    """Adapt to a new tokenizer: fresh CTC head, frozen fp16 encoder."""
    model.encoder.requires_grad_(False)
    model.encoder.eval()
    model.encoder.half()
    model.decoder = nn.Sequential(nn.Dropout(0.1), nn.Linear(model.decoder[1].in_features, vocab_size)).to(device)
    model.decoder.to(torch.float16)  # expect: AMP001
    optimizer = torch.optim.AdamW(model.decoder.parameters(), lr=1e-3, eps=1e-6)
    for _ in range(epochs):
        for feats, feat_lens, tokens, token_lens in loader:
            with torch.no_grad():
                enc, enc_lens = model.encoder(cmvn(feats.to(device)).half(), feat_lens.to(device))
            logits = model.decoder(enc)
            loss = ctc_loss(logits, enc_lens, tokens.to(device), token_lens.to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()


def export_onnx(model, path, n_mels=80, opset=17):
    model_fp16 = copy.deepcopy(model).half().eval()
    dummy = torch.randn(1, 400, n_mels, dtype=torch.float16)
    lens = torch.tensor([400])
    torch.onnx.export(model_fp16, (dummy, lens), path, opset_version=opset,
                      input_names=["feats", "lens"], output_names=["logits", "out_lens"],
                      dynamic_axes={"feats": {0: "B", 1: "T"}, "lens": {0: "B"}, "logits": {0: "B", 1: "T'"}})


def export_torchscript(model, path, n_mels=80):
    scripted_model = copy.deepcopy(model).eval()
    scripted_model.half()
    traced = torch.jit.trace(scripted_model, (torch.randn(1, 400, n_mels).half(), torch.tensor([400])))
    traced.save(path)


def benchmark_rtf(model, device, seconds=10.0, iters=20):
    """Real-time factor of the half-precision encoder on this device."""
    with torch.inference_mode():
        m = copy.deepcopy(model).to(device).half().eval()
        x = torch.randn(1, int(seconds * 100), 80, device=device).half()
        lens = torch.tensor([x.size(1)], device=device)
        for _ in range(3):
            m(x, lens)
        torch.cuda.synchronize()
        t0 = time.time()
        for _ in range(iters):
            m(x, lens)
        torch.cuda.synchronize()
    return (time.time() - t0) / iters / seconds


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--train-manifest", required=True)
    p.add_argument("--dev-manifest", required=True)
    p.add_argument("--cmvn", required=True)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=5.0)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--new-vocab-size", type=int, default=0)
    p.add_argument("--out", default="exp/conformer_ctc")
    args = p.parse_args()
    from asr_data import build_loader  # project-local manifest loader
    device = torch.device("cuda")
    os.makedirs(args.out, exist_ok=True)

    model = ConformerCTC(args.vocab_size).to(device)
    stats = torch.load(args.cmvn, map_location="cpu")
    cmvn = GlobalCMVN(stats["mean"], stats["istd"]).half().to(device)
    train_loader = build_loader(args.train_manifest, shuffle=True)
    dev_loader = build_loader(args.dev_manifest, shuffle=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=1e-3)
    total = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total, pct_start=0.1)
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)

    best = math.inf
    for epoch in range(args.epochs):
        train_one_epoch(model, cmvn, train_loader, optimizer, scheduler, scaler, device, epoch, args)
        wer = evaluate_wer(model, cmvn, dev_loader, device)
        print(f"epoch {epoch} dev WER {wer:.4f}")
        if wer < best:
            best = wer
            torch.save({"model": model.state_dict(),
                        "model_fp16": {k: v.half() for k, v in model.state_dict().items()},
                        "epoch": epoch, "wer": wer}, os.path.join(args.out, "best.pt"))

    if args.new_vocab_size:
        new_loader = build_loader(args.train_manifest, shuffle=True, vocab_size=args.new_vocab_size)
        finetune_decoder(model, cmvn, new_loader, args.new_vocab_size, epochs=5, device=device)
    print(f"RTF (fp16): {benchmark_rtf(model, device):.4f}")
    export_onnx(model, os.path.join(args.out, "model_fp16.onnx"))
    export_torchscript(model, os.path.join(args.out, "model_fp16.ts"))


if __name__ == "__main__":
    main()
