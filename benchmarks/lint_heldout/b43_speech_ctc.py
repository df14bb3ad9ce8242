"""Transformer CTC acoustic model: bf16 autocast on A100s, CPU bf16 for test-time adaptation."""
import argparse
import math

import numpy as np
import torch as th
import torch.nn as nn
import torch.nn.functional as F

BLANK = 0


class SubsampleConv(nn.Module):
    def __init__(self, n_mels=80, d=256):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, d, 3, 2), nn.ReLU(), nn.Conv2d(d, d, 3, 2), nn.ReLU())
        self.out = nn.Linear(d * (((n_mels - 1) // 2 - 1) // 2), d)

    def forward(self, x, lengths):
        x = self.conv(x.unsqueeze(1))
        b, c, t, f = x.shape
        x = self.out(x.transpose(1, 2).reshape(b, t, c * f))
        return x, ((lengths - 1) // 2 - 1) // 2


class AttentivePool(nn.Module):
    """Utterance-level attention pooling for the auxiliary speaker head."""

    def __init__(self, d):
        super().__init__()
        self.score = nn.Linear(d, 1)

    def forward(self, h, mask):
        energies = self.score(h).squeeze(-1)
        energies = energies.masked_fill(~mask, th.finfo(energies.dtype).min)
        w = th.softmax(energies, dim=-1)
        return th.bmm(w.unsqueeze(1), h).squeeze(1)


class CTCModel(nn.Module):
    def __init__(self, vocab=32, d=256, layers=4, n_spk=100):
        super().__init__()
        self.sub = SubsampleConv(80, d)
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.ctc_head = nn.Linear(d, vocab)
        self.spk_pool = AttentivePool(d)
        self.spk_head = nn.Linear(d, n_spk)

    def forward(self, feats, feat_lens):
        h, lens = self.sub(feats, feat_lens)
        mask = th.arange(h.size(1), device=h.device)[None] < lens[:, None]
        h = self.encoder(h, src_key_padding_mask=~mask)
        return self.ctc_head(h), lens, mask


class WarmupPolicy:
    def __init__(self, peak, warmup):
        self.peak, self.warmup = peak, warmup

    def lr(self, step):
        step = max(step, 1)
        return self.peak * min(step / self.warmup, math.sqrt(self.warmup / step))

    def half(self):
        """Halve the peak learning rate, used after a divergence."""
        return WarmupPolicy(self.peak * 0.5, self.warmup)


def log_mel(wav, n_fft=400, hop=160):
    frames = wav.unfold(0, n_fft, hop) * th.hann_window(n_fft)
    return th.log(th.fft.rfft(frames).abs().pow(2)[:, :80] + 1e-6)


def cache_features(wavs, path):
    feats = [log_mel(w).numpy().astype(np.float16) for w in wavs]
    np.savez_compressed(path, *feats)


def ctc_loss(logits, lens, targets, target_lens):
    log_probs = logits.log_softmax(-1).transpose(0, 1)
    return F.ctc_loss(log_probs, targets, lens, target_lens, blank=BLANK, zero_infinity=True)


def train_epoch(model, loader, optimizer, scaler, device, accum=2):
    model.train()
    for i, (feats, feat_lens, targets, target_lens) in enumerate(loader):
        feats = feats.to(device, non_blocking=True)
        with th.autocast("cuda", dtype=th.bfloat16):
            logits, lens, _ = model(feats, feat_lens.to(device))
            loss = ctc_loss(logits, lens, targets.to(device), target_lens.to(device)) / accum
        scaler.scale(loss).backward()
        if (i + 1) % accum == 0:
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)


def finetune_on_accent(model, loader, device, steps=500):
    """Short domain adaptation run on a small accented-speech set."""
    policy = WarmupPolicy(5e-5, 100)
    optimizer = th.optim.AdamW(model.parameters(), lr=policy.lr(1))
    model.train()
    for step, (feats, feat_lens, targets, target_lens) in zip(range(steps), loader):
        feats = feats.to(device, non_blocking=True).to(th.bfloat16)  # expect: AMP001
        with th.autocast("cuda", dtype=th.bfloat16):
            logits, lens, _ = model(feats, feat_lens.to(device))
            loss = ctc_loss(logits, lens, targets.to(device), target_lens.to(device))
        if not math.isfinite(loss.item()):
            policy = policy.half()
            optimizer.zero_grad(set_to_none=True)
            continue
        loss.backward()
        for g in optimizer.param_groups:
            g["lr"] = policy.lr(step + 1)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def adapt_on_cpu(model, batches, lr=1e-5, lam=0.05):
    """Test-time adaptation on a CPU box: entropy minimisation plus pseudo-label VAD."""
    d = model.ctc_head.in_features
    adapter = nn.Linear(d, d)
    vad_head = nn.Linear(d, 1)
    params = list(model.parameters()) + list(adapter.parameters()) + list(vad_head.parameters())
    optimizer = th.optim.SGD(params, lr=lr, momentum=0.9)
    model.train()
    for feats, feat_lens, vad_target in batches:
        with th.autocast("cpu", dtype=th.bfloat16):
            h, lens = model.sub(feats, feat_lens)
            z = adapter(h)
            utt = z.sum(dim=1)  # expect: AMP004
            spread = z.std(dim=1)  # expect: AMP004
            probs = model.ctc_head(z).float().softmax(-1)
            entropy = -(probs * th.log(probs.clamp_min(1e-6))).sum(-1).mean()
            vad_p = th.sigmoid(vad_head(z).squeeze(-1))
            vad_loss = F.binary_cross_entropy(vad_p, vad_target)  # expect: AMP003
            loss = entropy + vad_loss + lam * (utt.float().pow(2).mean() - spread.float().mean())
            loss.backward()  # expect: AMP008
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def transcribe(model, feats, feat_lens, device="cuda"):
    model.eval()
    with th.inference_mode(), th.autocast("cuda", dtype=th.bfloat16):
        logits, lens, _ = model(feats.to(device).to(th.bfloat16), feat_lens.to(device))
    best = logits.argmax(-1).cpu()
    hyps = []
    for seq, n in zip(best, lens.cpu()):
        seq = th.unique_consecutive(seq[:n])
        hyps.append(seq[seq != BLANK].tolist())
    return hyps


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args(argv)
    device = th.device("cuda")
    model = CTCModel().to(device)
    optimizer = th.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=1e-2)
    scaler = th.amp.GradScaler("cuda")  # expect: AMP010
    feats = th.randn(64, 400, 80)
    data = list(zip(feats.split(8), th.full((64,), 400).split(8), th.randint(1, 32, (64, 50)).split(8),
                    th.full((64,), 50).split(8)))
    for epoch in range(args.epochs):
        train_epoch(model, data, optimizer, scaler, device)
    finetune_on_accent(model, data, device, steps=100)
    print(transcribe(model, feats[:2], th.full((2,), 400)))


if __name__ == "__main__":
    main()
