"""ECAPA-TDNN speaker verification (VoxCeleb2 dev): SE-Res2Net blocks, attentive
statistics pooling with global context, AAM-softmax head. fp16 autocast + GradScaler.
"""
import argparse
import math
from collections import namedtuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

SpeakerOutput = namedtuple("SpeakerOutput", ["logits", "embedding"])


def mel_filterbank(n_mels, n_fft, sr, fmin=20.0, fmax=7600.0):
    def hz_to_mel(f):
        return 2595.0 * math.log10(1.0 + f / 700.0)

    mels = torch.linspace(hz_to_mel(fmin), hz_to_mel(fmax), n_mels + 2)
    hz = 700.0 * (10 ** (mels / 2595.0) - 1.0)
    bins = torch.linspace(0, sr / 2, n_fft // 2 + 1)
    lo, mid, hi = hz[:-2, None], hz[1:-1, None], hz[2:, None]
    up = (bins[None] - lo) / (mid - lo)
    down = (hi - bins[None]) / (hi - mid)
    return torch.clamp(torch.minimum(up, down), min=0.0)


class FbankFrontend(nn.Module):
    """Log-mel features, always computed in fp32 (STFT is not autocast-friendly)."""

    def __init__(self, n_mels=80, n_fft=512, win_length=400, hop=160, sr=16000):
        super().__init__()
        self.n_fft, self.win_length, self.hop = n_fft, win_length, hop
        self.register_buffer("window", torch.hamming_window(win_length))
        self.register_buffer("mel_fb", mel_filterbank(n_mels, n_fft, sr))

    def forward(self, wav):
        with torch.autocast("cuda", enabled=False):
            wav = wav.float()
            wav = torch.cat([wav[:, :1], wav[:, 1:] - 0.97 * wav[:, :-1]], dim=1)
            spec = torch.stft(wav, self.n_fft, self.hop, self.win_length, self.window, return_complex=True)
            mel = torch.matmul(self.mel_fb, spec.abs().pow(2))
            logmel = torch.log(mel + 1e-6)
            return logmel - logmel.mean(dim=-1, keepdim=True)


class SpecAugment(nn.Module):
    def __init__(self, freq_width=(0, 8), time_width=(0, 10)):
        super().__init__()
        self.freq_width, self.time_width = freq_width, time_width

    def _mask(self, x, dim, width):
        b, L = x.shape[0], x.shape[dim]
        w = torch.randint(width[0], width[1], (b, 1), device=x.device)
        pos = torch.randint(0, max(1, L - w.max().item()), (b, 1), device=x.device)
        ar = torch.arange(L, device=x.device)[None]
        mask = (pos <= ar) & (ar < pos + w)
        mask = mask[:, :, None] if dim == 1 else mask[:, None, :]
        return x.masked_fill(mask, 0.0)

    def forward(self, x):
        return self._mask(self._mask(x, 1, self.freq_width), 2, self.time_width)


class SEModule(nn.Module):
    def __init__(self, channels, bottleneck=128):
        super().__init__()
        self.se = nn.Sequential(
            nn.AdaptiveAvgPool1d(1), nn.Conv1d(channels, bottleneck, 1), nn.ReLU(),
            nn.Conv1d(bottleneck, channels, 1), nn.Sigmoid(),
        )

    def forward(self, x):
        return x * self.se(x)


class Bottle2neck(nn.Module):
    def __init__(self, inplanes, planes, kernel_size, dilation, scale=8):
        super().__init__()
        width = planes // scale
        self.width, self.nums = width, scale - 1
        self.conv1 = nn.Conv1d(inplanes, width * scale, 1)
        self.bn1 = nn.BatchNorm1d(width * scale)
        pad = math.floor(kernel_size / 2) * dilation
        self.convs = nn.ModuleList(nn.Conv1d(width, width, kernel_size, dilation=dilation, padding=pad) for _ in range(self.nums))
        self.bns = nn.ModuleList(nn.BatchNorm1d(width) for _ in range(self.nums))
        self.conv3 = nn.Conv1d(width * scale, planes, 1)
        self.bn3 = nn.BatchNorm1d(planes)
        self.se = SEModule(planes)

    def forward(self, x):
        out = self.bn1(F.relu(self.conv1(x)))
        spx = torch.split(out, self.width, 1)
        for i in range(self.nums):
            sp = spx[i] if i == 0 else sp + spx[i]
            sp = self.bns[i](F.relu(self.convs[i](sp)))
            out = sp if i == 0 else torch.cat((out, sp), 1)
        out = torch.cat((out, spx[self.nums]), 1)
        out = self.se(self.bn3(F.relu(self.conv3(out))))
        return out + x


class GlobalContextMixin:
    """Appends utterance-level mean/std to every frame (ECAPA's context-dependent pooling)."""

    def _global_context(self, x):
        t = x.size(-1)
        ctx_mean = x.mean(dim=2, keepdim=True)  # expect: AMP004
        ctx_std = torch.sqrt(x.var(dim=2, keepdim=True) + 1e-10)  # expect: AMP004, AMP011
        return torch.cat((x, ctx_mean.repeat(1, 1, t), ctx_std.repeat(1, 1, t)), dim=1)


class AttentiveStatsPool(GlobalContextMixin, nn.Module):
    def __init__(self, channels, attn_dim=256, global_context=True):
        super().__init__()
        self.global_context = global_context
        in_ch = channels * 3 if global_context else channels
        self.attention = nn.Sequential(
            nn.Conv1d(in_ch, attn_dim, 1), nn.ReLU(), nn.BatchNorm1d(attn_dim), nn.Tanh(),
            nn.Conv1d(attn_dim, channels, 1),
        )

    def forward(self, x):
        global_x = self._global_context(x) if self.global_context else x
        w = torch.softmax(self.attention(global_x), dim=2)
        mu = torch.sum(x * w, dim=2)
        sg = torch.sqrt((torch.sum((x ** 2) * w, dim=2) - mu ** 2).clamp(min=1e-4))
        return torch.cat((mu, sg), dim=1)


class ECAPA_TDNN(nn.Module):
    def __init__(self, C=1024, n_mels=80, emb_dim=192):
        super().__init__()
        self.frontend = FbankFrontend(n_mels=n_mels)
        self.specaug = SpecAugment()
        self.conv1 = nn.Conv1d(n_mels, C, 5, 1, 2)
        self.bn1 = nn.BatchNorm1d(C)
        self.layers = nn.ModuleList(Bottle2neck(C, C, 3, d) for d in (2, 3, 4))
        self.layer4 = nn.Conv1d(3 * C, 1536, 1)
        self.pooling = AttentiveStatsPool(1536)
        self.bn5 = nn.BatchNorm1d(3072)
        self.fc6 = nn.Linear(3072, emb_dim)
        self.bn6 = nn.BatchNorm1d(emb_dim)

    def forward(self, wav, aug=False):
        x = self.frontend(wav)
        if aug:
            x = self.specaug(x)
        x = self.bn1(F.relu(self.conv1(x)))
        feats, acc = [], x
        for layer in self.layers:
            y = layer(acc)
            feats.append(y)
            acc = acc + y
        x = F.relu(self.layer4(torch.cat(feats, dim=1)))
        return self.bn6(self.fc6(self.bn5(self.pooling(x))))


class AAMSoftmaxHead(nn.Module):
    def __init__(self, emb_dim, n_class, margin=0.2, scale=30.0):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_class, emb_dim))
        nn.init.xavier_normal_(self.weight, gain=1)
        self.s = scale
        self.cos_m, self.sin_m = math.cos(margin), math.sin(margin)
        self.th = math.cos(math.pi - margin)
        self.mm = math.sin(math.pi - margin) * margin

    def forward(self, emb, label):
        cosine = F.linear(F.normalize(emb), F.normalize(self.weight))
        sine = torch.sqrt(1.0 - cosine * cosine + 1e-12)  # expect: AMP011
        phi = cosine * self.cos_m - sine * self.sin_m
        phi = torch.where((cosine - self.th) > 0, phi, cosine - self.mm)
        one_hot = torch.zeros_like(cosine).scatter_(1, label.view(-1, 1), 1.0)
        return self.s * (one_hot * phi + (1.0 - one_hot) * cosine)


class SpeakerNet(nn.Module):
    def __init__(self, n_class, C=1024, emb_dim=192):
        super().__init__()
        self.encoder = ECAPA_TDNN(C=C, emb_dim=emb_dim)
        self.head = AAMSoftmaxHead(emb_dim, n_class)

    def forward(self, wav, label, aug=True):
        emb = self.encoder(wav, aug=aug)
        return SpeakerOutput(self.head(emb, label), emb)


def accuracy(output, target, topk=(1,)):
    maxk = max(topk)
    _, pred = output.topk(maxk, 1, True, True)
    correct = pred.t().eq(target.view(1, -1).expand_as(pred.t()))
    return [correct[:k].reshape(-1).float().sum(0) * (100.0 / target.size(0)) for k in topk]


def train_network(model, loader, optimizer, scheduler, scaler, epoch):
    model.train()
    scheduler.step(epoch - 1)
    top1, total_loss = 0.0, 0.0
    for num, (wav, labels) in enumerate(loader, start=1):
        wav, labels = wav.cuda(non_blocking=True), labels.cuda(non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(wav, labels, aug=True)
        loss = F.cross_entropy(out.logits, labels)  # expect: AMP002
        prec = accuracy(out.logits.detach(), labels)[0]
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        top1 += prec.item()
        total_loss += loss.item()
    return total_loss / num, top1 / num


@torch.no_grad()
def eval_network(model, trials, wavs):
    model.eval()
    embs = {}
    for key, wav in wavs.items():
        emb = model.encoder(wav.cuda()[None], aug=False)
        embs[key] = F.normalize(emb, p=2, dim=1)
    scores, labels = [], []
    for enroll, test, lab in trials:
        e1, e2 = embs[enroll], embs[test]
        scores.append(((e1 * e2).sum() / (e1.norm() * e2.norm() + 1e-8)).item())
        labels.append(int(lab))
    scores, labels = np.array(scores), np.array(labels)
    thr = np.sort(scores)
    fnr = np.array([(scores[labels == 1] < t).mean() for t in thr])
    fpr = np.array([(scores[labels == 0] >= t).mean() for t in thr])
    return 100.0 * fnr[np.nanargmin(np.abs(fnr - fpr))]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n_class", type=int, default=5994)
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args()
    model = SpeakerNet(args.n_class).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=2e-5)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.97)
    scaler = torch.amp.GradScaler("cuda")
    wavs = torch.randn(64, 32240)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(wavs, torch.randint(0, args.n_class, (64,))), batch_size=16, shuffle=True
    )
    for epoch in range(1, args.epochs + 1):
        loss, acc = train_network(model, loader, optimizer, scheduler, scaler, epoch)
        print(f"epoch {epoch}: loss {loss:.3f} acc {acc:.2f}%")
        if epoch % 10 == 0:
            eer = eval_network(model, [("a", "b", 1), ("a", "c", 0)], {k: wavs[i] for i, k in enumerate("abc")})
            print(f"EER {eer:.2f}%")


if __name__ == "__main__":
    main()
