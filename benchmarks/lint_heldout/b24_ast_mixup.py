"""Audio Spectrogram Transformer (AST) fine-tuning on AudioSet-style multi-label clips:
learnable log-mel front end, overlapping patch embedding, mixup, statistics pooling."""
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

AUDIOSET_MEAN, AUDIOSET_STD = -4.2677393, 4.5689974


def mel_matrix(n_freqs, n_mels, sr=16000, fmin=0.0, fmax=8000.0):
    def hz_to_mel(f):
        return 2595.0 * np.log10(1.0 + f / 700.0)

    mels = np.linspace(hz_to_mel(fmin), hz_to_mel(fmax), n_mels + 2)
    hz = 700.0 * (10 ** (mels / 2595.0) - 1.0)
    freqs = np.linspace(0, sr / 2, n_freqs)
    fb = np.zeros((n_mels, n_freqs), dtype=np.float32)
    for m in range(n_mels):
        lo, c, hi = hz[m], hz[m + 1], hz[m + 2]
        fb[m] = np.clip(np.minimum((freqs - lo) / (c - lo), (hi - freqs) / (hi - c)), 0, None)
    return torch.from_numpy(fb)


class LearnableLogMel(nn.Module):
    def __init__(self, n_fft=400, hop=160, n_mels=128):
        super().__init__()
        self.n_fft, self.hop = n_fft, hop
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)
        self.filterbank = nn.Linear(n_fft // 2 + 1, n_mels, bias=False)
        with torch.no_grad():
            self.filterbank.weight.copy_(mel_matrix(n_fft // 2 + 1, n_mels))

    def forward(self, wav):
        spec = torch.stft(wav, self.n_fft, self.hop, window=self.window, return_complex=True)
        power = spec.abs().pow(2).transpose(1, 2)
        mel = self.filterbank(power).clamp_min(0.0)
        return torch.log(mel + 1e-10)  # expect: AMP011


def spec_augment(x, freq_mask=48, time_mask=192):
    b, t, f = x.shape
    f0 = torch.randint(0, f - freq_mask, (b, 1, 1), device=x.device)
    fw = torch.randint(0, freq_mask, (b, 1, 1), device=x.device)
    t0 = torch.randint(0, max(1, t - time_mask), (b, 1, 1), device=x.device)
    tw = torch.randint(0, time_mask, (b, 1, 1), device=x.device)
    fr = torch.arange(f, device=x.device)[None, None, :]
    tr = torch.arange(t, device=x.device)[None, :, None]
    mask = ((fr >= f0) & (fr < f0 + fw)) | ((tr >= t0) & (tr < t0 + tw))
    return x.masked_fill(mask, 0.0)


class PatchEmbed(nn.Module):
    def __init__(self, n_mels=128, frames=1024, patch=16, stride=10, dim=768):
        super().__init__()
        self.proj = nn.Conv2d(1, dim, patch, stride=stride)
        self.grid = ((n_mels - patch) // stride + 1, (frames - patch) // stride + 1)

    def forward(self, x):
        x = x.transpose(1, 2).unsqueeze(1)
        return self.proj(x).flatten(2).transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, dim, heads=12, attn_drop=0.0):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.attn_drop = nn.Dropout(attn_drop)

    def forward(self, x, key_mask=None):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        scores = (q @ k.transpose(-2, -1)) * self.scale
        if key_mask is not None:
            scores.masked_fill_(~key_mask[:, None, None, :], -1e5)  # expect: AMP007
        attn = self.attn_drop(scores.softmax(dim=-1))
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))


class Block(nn.Module):
    def __init__(self, dim, heads, mlp_ratio=4.0, drop=0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(drop), nn.Linear(hidden, dim))

    def forward(self, x, key_mask=None):
        x = x + self.attn(self.norm1(x), key_mask)
        return x + self.mlp(self.norm2(x))


class ASTModel(nn.Module):
    def __init__(self, num_classes=527, n_mels=128, frames=1024, dim=768, depth=12, heads=12):
        super().__init__()
        self.frontend = LearnableLogMel(n_mels=n_mels)
        self.patch_embed = PatchEmbed(n_mels, frames, dim=dim)
        num_patches = self.patch_embed.grid[0] * self.patch_embed.grid[1]
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.dist_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, num_patches + 2, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pre_head = nn.Linear(dim, dim)
        self.head = nn.Linear(3 * dim, num_classes)

    def forward_features(self, wav, key_mask=None):
        x = (self.frontend(wav) - AUDIOSET_MEAN) / (AUDIOSET_STD * 2)
        if self.training:
            x = spec_augment(x)
        x = self.patch_embed(x)
        b = x.shape[0]
        x = torch.cat([self.cls_token.expand(b, -1, -1), self.dist_token.expand(b, -1, -1), x], dim=1)
        x = x + self.pos_embed
        for blk in self.blocks:
            x = blk(x, key_mask)
        return self.norm(x)

    def forward(self, wav, key_mask=None):
        x = self.forward_features(wav, key_mask)
        cls = (x[:, 0] + x[:, 1]) / 2
        h = F.gelu(self.pre_head(x[:, 2:]))
        mu = h.mean(dim=1)  # expect: AMP004
        sd = h.std(dim=1)  # expect: AMP004
        return self.head(torch.cat([cls, mu, sd], dim=-1))


def mixup_batch(wav, target, alpha=10.0):
    lam = float(np.random.beta(alpha, alpha))
    index = torch.randperm(wav.size(0), device=wav.device)
    return lam * wav + (1.0 - lam) * wav[index], target, target[index], lam


def mixup_criterion(criterion, pred, y_a, y_b, lam):
    return lam * criterion(pred, y_a) + (1.0 - lam) * criterion(pred, y_b)


def finetune(train_loader, epochs=30, lr=1e-5, device="cuda", mixup_prob=0.5):
    model = ASTModel().to(device)
    criterion = nn.BCEWithLogitsLoss()
    head_names = ("pre_head", "head")
    base = [p for n, p in model.named_parameters() if not n.startswith(head_names)]
    head = [p for n, p in model.named_parameters() if n.startswith(head_names)]
    optimizer = torch.optim.Adam(
        [{"params": base, "lr": lr}, {"params": head, "lr": lr * 100}], weight_decay=5e-7, betas=(0.95, 0.999)
    )
    scaler = torch.amp.GradScaler("cuda")
    for epoch in range(epochs):
        model.train()
        for step, (wav, key_mask, target) in enumerate(train_loader):
            wav, key_mask, target = wav.to(device), key_mask.to(device), target.to(device)
            if np.random.rand() < mixup_prob:
                wav, y_a, y_b, lam = mixup_batch(wav, target)
            else:
                y_a, y_b, lam = target, target, 1.0
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(wav, key_mask)
            loss = mixup_criterion(criterion, logits, y_a, y_b, lam)  # expect: AMP002
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            if step % 100 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}")
    return model


def linear_probe(backbone, train_loader, num_classes=50, epochs=20, device="cuda"):
    backbone.eval()
    head = nn.Linear(768, num_classes).to(device)
    opt = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(epochs):
        for wav, key_mask, target in train_loader:
            wav, key_mask, target = wav.to(device), key_mask.to(device), target.to(device)
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
                feats = backbone.forward_features(wav, key_mask)[:, :2].mean(dim=1)
            with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
                loss = F.cross_entropy(head(feats), target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        print(f"probe epoch {epoch}: loss {loss.item():.4f}")
    return head


@torch.no_grad()
def evaluate(model, loader, device="cuda"):
    model.eval()
    scores, labels = [], []
    for wav, key_mask, target in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(wav.to(device), key_mask.to(device))
        scores.append(torch.sigmoid(logits.float()).cpu())
        labels.append(target)
    scores, labels = torch.cat(scores), torch.cat(labels)
    order = scores.argsort(0, descending=True)
    hits = torch.gather(labels, 0, order)
    precision = hits.cumsum(0) / torch.arange(1, len(hits) + 1)[:, None]
    ap = (precision * hits).sum(0) / hits.sum(0).clamp_min(1)
    return ap.mean().item()
