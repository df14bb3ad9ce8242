"""Speaker verification: x-vector / ECAPA-lite embeddings with additive angular margin."""
import argparse
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from data.voxceleb import VoxCelebSegments, collate_segments


class LearnableFilterbank(nn.Module):
    """Strided 1-D conv filterbank on raw audio followed by log compression."""

    def __init__(self, n_filters=80, win_length=400, hop_length=160):
        super().__init__()
        self.filters = nn.Conv1d(1, n_filters, win_length, stride=hop_length, bias=False)

    def forward(self, wave):
        spec = self.filters(wave.unsqueeze(1))
        spec = torch.log(spec.abs() + 1e-8)  # expect: AMP011
        # per-utterance cepstral mean normalisation
        return spec - spec.mean(dim=-1, keepdim=True)


class TDNNBlock(nn.Module):
    def __init__(self, c_in, c_out, kernel_size, dilation):
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel_size, dilation=dilation, padding=dilation * (kernel_size - 1) // 2)
        self.bn = nn.BatchNorm1d(c_out)

    def forward(self, x):
        return self.bn(F.relu(self.conv(x)))


class StatsPool(nn.Module):
    def forward(self, x):
        mean = x.mean(dim=-1)  # expect: AMP004
        var = x.var(dim=-1, unbiased=False)  # expect: AMP004
        std = torch.sqrt(var + 1e-10)  # expect: AMP011
        return torch.cat([mean, std], dim=1)


class AttentiveStatsPool(nn.Module):
    def __init__(self, channels, bottleneck=128):
        super().__init__()
        self.attention = nn.Sequential(
            nn.Conv1d(channels, bottleneck, 1), nn.Tanh(), nn.Conv1d(bottleneck, channels, 1)
        )

    def forward(self, x):
        w = torch.softmax(self.attention(x), dim=-1)
        mu = torch.sum(x * w, dim=-1)
        sq = torch.sum((x ** 2) * w, dim=-1)
        sg = torch.sqrt((sq - mu ** 2).clamp(min=1e-5))
        return torch.cat([mu, sg], dim=1)


class XVector(nn.Module):
    def __init__(self, n_mels=80, channels=512, emb_dim=192, attentive_pool=True):
        super().__init__()
        self.frontend = LearnableFilterbank(n_mels)
        self.frame = nn.Sequential(
            TDNNBlock(n_mels, channels, 5, 1),
            TDNNBlock(channels, channels, 3, 2),
            TDNNBlock(channels, channels, 3, 3),
            TDNNBlock(channels, channels, 1, 1),
        )
        self.expand = nn.Conv1d(channels, 1500, 1)
        self.pool = AttentiveStatsPool(1500) if attentive_pool else StatsPool()
        self.embed = nn.Linear(3000, emb_dim)

    def forward(self, wave):
        h = self.frame(self.frontend(wave))
        h = self.expand(h)
        return self.embed(self.pool(h))


class AAMSoftmaxLoss(nn.Module):
    def __init__(self, emb_dim, n_classes, margin=0.2, scale=30.0):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_classes, emb_dim))
        nn.init.xavier_normal_(self.weight)
        self.s = scale
        self.cos_m, self.sin_m = math.cos(margin), math.sin(margin)
        self.th = math.cos(math.pi - margin)
        self.mm = math.sin(math.pi - margin) * margin

    def forward(self, emb, label):
        cosine = F.linear(F.normalize(emb), F.normalize(self.weight))
        sine = torch.sqrt((1.0 - cosine * cosine).clamp(0, 1))
        phi = cosine * self.cos_m - sine * self.sin_m
        phi = torch.where(cosine - self.th > 0, phi, cosine - self.mm)
        one_hot = F.one_hot(label, cosine.size(1)).float()
        logits = (one_hot * phi + (1.0 - one_hot) * cosine) * self.s
        acc = (logits.argmax(dim=1) == label).float().mean()
        return F.cross_entropy(logits, label), acc


def train_one_epoch(model, criterion, loader, optimizer, scheduler, scaler, epoch, args):
    model.train()
    params = list(model.parameters()) + list(criterion.parameters())
    for step, (wave, spk) in enumerate(loader):
        wave, spk = wave.cuda(non_blocking=True), spk.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            emb = model(wave)
            loss, acc = criterion(emb, spk)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        if step % args.log_every == 0:
            print(f"epoch {epoch} step {step} loss {loss.item():.3f} acc {acc.item():.3f} "
                  f"scale {scaler.get_scale():.0f}")


@torch.inference_mode()
def extract_embeddings(model, wav_list, device):
    model.eval()
    embs = {}
    for utt_id, wave in wav_list:
        with torch.autocast("cuda", dtype=torch.float16):
            e = model(wave.to(device)[None])
        embs[utt_id] = F.normalize(e.float(), dim=-1)[0].cpu()
    return embs


def score_trials(embs, trials):
    scores, labels = [], []
    for enroll, test, target in trials:
        scores.append(float((embs[enroll] * embs[test]).sum()))
        labels.append(int(target))
    return scores, labels


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--train-list", default="lists/vox2_dev.txt")
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=2e-5)
    p.add_argument("--max-grad-norm", type=float, default=5.0)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--plain-pool", action="store_true")
    p.add_argument("--out", default="exp/xvector")
    args = p.parse_args()

    data = VoxCelebSegments(args.train_list, seg_seconds=2.0)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, num_workers=8,
                        collate_fn=collate_segments, drop_last=True, pin_memory=True)
    model = XVector(attentive_pool=not args.plain_pool).cuda()
    criterion = AAMSoftmaxLoss(192, data.num_speakers).cuda()
    optimizer = torch.optim.Adam(
        list(model.parameters()) + list(criterion.parameters()), lr=args.lr, weight_decay=args.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.lr, total_steps=args.epochs * len(loader), pct_start=0.15
    )
    scaler = torch.amp.GradScaler("cuda")
    os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        train_one_epoch(model, criterion, loader, optimizer, scheduler, scaler, epoch, args)
        torch.save({"model": model.state_dict(), "criterion": criterion.state_dict(),
                    "scaler": scaler.state_dict()}, os.path.join(args.out, f"epoch{epoch:03d}.pt"))


if __name__ == "__main__":
    main()
