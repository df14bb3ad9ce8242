"""AASIST-style spoofing countermeasure: sinc-conv front end, residual encoder,
spectral and temporal graph attention, a master node and a binary bona-fide score."""
import argparse

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class SincConv(nn.Module):
    def __init__(self, out_channels=70, kernel_size=128, sample_rate=16000):
        super().__init__()
        mel = np.linspace(0, 2595 * np.log10(1 + (sample_rate / 2) / 700), out_channels + 1)
        hz = 700 * (10 ** (mel / 2595) - 1)
        self.register_buffer("low", torch.tensor(hz[:-1], dtype=torch.float32))
        self.register_buffer("high", torch.tensor(hz[1:], dtype=torch.float32))
        t = torch.arange(-(kernel_size // 2), kernel_size // 2 + 1, dtype=torch.float32) / sample_rate
        self.register_buffer("t", t)
        self.register_buffer("window", torch.hamming_window(kernel_size + 1, periodic=False))

    def forward(self, wave):
        arg_h = 2 * np.pi * self.high[:, None] * self.t[None]
        arg_l = 2 * np.pi * self.low[:, None] * self.t[None]
        filt = (torch.sinc(arg_h / np.pi) * 2 * self.high[:, None]
                - torch.sinc(arg_l / np.pi) * 2 * self.low[:, None]) * self.window
        return F.conv1d(wave.unsqueeze(1), filt.unsqueeze(1), padding=filt.shape[-1] // 2)


class GraphAttention(nn.Module):
    def __init__(self, d_in, d_out, temperature=2.0):
        super().__init__()
        self.att_proj = nn.Linear(d_in, d_out)
        self.att_weight = nn.Parameter(torch.randn(d_out, 1) * 0.02)
        self.proj_with_att = nn.Linear(d_in, d_out)
        self.proj_without_att = nn.Linear(d_in, d_out)
        self.temp = temperature

    def forward(self, x, node_mask=None):
        pair = x.unsqueeze(2) * x.unsqueeze(1)
        scores = torch.tanh(self.att_proj(pair)) @ self.att_weight
        scores = scores.squeeze(-1) / self.temp
        if node_mask is not None:
            scores = scores.masked_fill(~node_mask[:, None, :], -1e9)  # expect: AMP007
        att = scores.softmax(dim=-1)
        return F.selu(self.proj_with_att(att @ x) + self.proj_without_att(x))


class AASIST(nn.Module):
    def __init__(self, d_gat=64):
        super().__init__()
        self.sinc = SincConv()
        self.encoder = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.SELU(), nn.MaxPool2d((1, 3)),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.SELU(), nn.MaxPool2d((1, 3)),
        )
        self.to_nodes = nn.Linear(64, d_gat)
        self.gat_s = GraphAttention(d_gat, d_gat)
        self.gat_t = GraphAttention(d_gat, d_gat)
        self.head = nn.Linear(4 * d_gat, 2)
        self.score = nn.Linear(4 * d_gat, 1)

    def forward(self, wave, frame_mask=None):
        spec = self.sinc(wave).abs()
        spec = torch.log(spec + 1e-8)  # expect: AMP011
        h = self.encoder(spec.unsqueeze(1))
        h = self.to_nodes(h.permute(0, 2, 3, 1))
        out_s = self.gat_s(h.amax(dim=2))
        out_t = self.gat_t(h.amax(dim=1), frame_mask)
        s_max = torch.max(torch.abs(out_s), dim=1).values
        t_max = torch.max(torch.abs(out_t), dim=1).values
        t_avg = torch.mean(out_t, dim=1)  # expect: AMP004
        s_sum = out_s.sum(dim=1) / out_s.shape[1]
        feat = torch.cat([s_max, s_sum, t_max, t_avg], dim=-1)
        return self.head(feat), self.score(feat).squeeze(-1)


def train_epoch(model, loader, optimizer, scaler, criterion, device):
    model.train()
    for wave, frame_mask, label in loader:
        wave, frame_mask, label = wave.to(device), frame_mask.to(device), label.to(device)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits, score = model(wave, frame_mask)
            loss_ce = criterion(logits, label)
            loss_bce = F.binary_cross_entropy(torch.sigmoid(score), label.float())  # expect: AMP003
            loss = loss_ce + 0.5 * loss_bce
            scaler.scale(loss).backward()  # expect: AMP008
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        scaler.step(optimizer)
        scaler.update()


def finetune_codec_augmented(model, loader, optimizer, scaler, criterion, device):
    model.train()
    for wave, frame_mask, label in loader:
        wave, label = wave.to(device), label.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            logits, _ = model(wave, frame_mask.to(device))
        loss = criterion(logits, label)  # expect: AMP002
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


@torch.no_grad()
def evaluate_eer(model, loader, device):
    model.eval()
    scores, labels = [], []
    for wave, frame_mask, label in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logits, _ = model(wave.to(device), frame_mask.to(device))
        scores.append(F.log_softmax(logits.float(), dim=-1)[:, 1].cpu())
        labels.append(label)
    scores, labels = torch.cat(scores).numpy(), torch.cat(labels).numpy()
    thr = np.sort(scores)
    frr = np.array([(scores[labels == 1] < t).mean() for t in thr])
    far = np.array([(scores[labels == 0] >= t).mean() for t in thr])
    return float(frr[np.argmin(np.abs(frr - far))])


def main(args):
    device = torch.device("cuda")
    model = AASIST().to(device)
    weight = torch.tensor([0.1, 0.9], device=device)
    criterion = nn.CrossEntropyLoss(weight=weight)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, weight_decay=1e-4)
    scaler = torch.amp.GradScaler("cuda")
    from asvspoof import build_loaders  # project-local data pipeline

    train_loader, aug_loader, dev_loader = build_loaders(args.root, args.batch_size)
    best_eer = 1e9
    for epoch in range(args.epochs):
        train_epoch(model, train_loader, optimizer, scaler, criterion, device)
        if epoch >= args.aug_start:
            finetune_codec_augmented(model, aug_loader, optimizer, scaler, criterion, device)
        eer = evaluate_eer(model, dev_loader, device)
        if eer < best_eer:
            best_eer = eer
            torch.save(model.state_dict(), f"{args.out}/aasist_best.pt")
        print(f"epoch {epoch} dev EER {eer:.4f} best {best_eer:.4f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", default="exp")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--aug-start", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=24)
    main(p.parse_args())
