"""Train a Graves-style handwriting synthesis network (LSTM + soft window + MDN).

usage: python b31_train_handwriting_mdn.py --data data/iam_strokes.npz --amp
"""
import argparse
import copy
import math
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/iam_strokes.npz")
    p.add_argument("--out", default="runs/hw")
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--hidden", type=int, default=400)
    p.add_argument("--mixtures", type=int, default=20)
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--clip", type=float, default=10.0)
    p.add_argument("--eos-weight", type=float, default=1.0)
    p.add_argument("--amp", action="store_true")
    return p.parse_args()


class StrokeDataset(Dataset):
    def __init__(self, path, max_len=700):
        blob = np.load(path, allow_pickle=True)
        self.strokes = blob["strokes"]
        self.texts = blob["texts"]
        cat = np.concatenate([s[:, :2] for s in self.strokes])
        self.mean, self.std = cat.mean(0), cat.std(0) + 1e-8
        self.max_len = max_len

    def __len__(self):
        return len(self.strokes)

    def __getitem__(self, i):
        s = self.strokes[i][: self.max_len].astype(np.float32).copy()
        s[:, :2] = (s[:, :2] - self.mean) / self.std
        return torch.from_numpy(s), torch.as_tensor(self.texts[i], dtype=torch.long)


def collate(batch):
    strokes, texts = zip(*batch)
    T = max(s.size(0) for s in strokes)
    U = max(t.size(0) for t in texts)
    x = torch.zeros(len(batch), T, 3)
    c = torch.zeros(len(batch), U, dtype=torch.long)
    smask = torch.zeros(len(batch), T)
    cmask = torch.zeros(len(batch), U)
    for i, (s, t) in enumerate(batch):
        x[i, : s.size(0)], smask[i, : s.size(0)] = s, 1.0
        c[i, : t.size(0)], cmask[i, : t.size(0)] = t, 1.0
    return x, c, smask, cmask


class SoftWindow(nn.Module):
    def __init__(self, hidden, k, vocab):
        super().__init__()
        self.params = nn.Linear(hidden, 3 * k)
        self.vocab = vocab

    def forward(self, h, chars, cmask, kappa_prev):
        a, b, k = torch.exp(self.params(h)).chunk(3, dim=-1)
        kappa = kappa_prev + k / 25.0
        u = torch.arange(chars.size(1), device=h.device, dtype=h.dtype)
        phi = (a.unsqueeze(-1) * torch.exp(-b.unsqueeze(-1) * (kappa.unsqueeze(-1) - u) ** 2)).sum(1)
        phi = phi * cmask
        onehot = F.one_hot(chars, self.vocab).to(phi.dtype)
        return torch.bmm(phi.unsqueeze(1), onehot).squeeze(1), kappa


class HandwritingSynthesis(nn.Module):
    def __init__(self, vocab=80, hidden=400, mixtures=20, window=10):
        super().__init__()
        self.vocab, self.hidden, self.M = vocab, hidden, mixtures
        self.cell1 = nn.LSTMCell(3 + vocab, hidden)
        self.window = SoftWindow(hidden, window, vocab)
        self.lstm2 = nn.LSTM(3 + vocab + hidden, hidden, batch_first=True)
        self.skip_proj = nn.Linear(hidden, hidden)
        self.mdn = nn.Linear(2 * hidden, 6 * mixtures + 1)

    def forward(self, strokes, chars, cmask):
        B, T, _ = strokes.shape
        h = strokes.new_zeros(B, self.hidden)
        c = strokes.new_zeros(B, self.hidden)
        w = strokes.new_zeros(B, self.vocab)
        kappa = strokes.new_zeros(B, self.window.params.out_features // 3)
        hs, ws = [], []
        for t in range(T):
            h, c = self.cell1(torch.cat([strokes[:, t], w], -1), (h, c))
            w, kappa = self.window(h, chars, cmask, kappa)
            hs.append(h)
            ws.append(w)
        h1, w1 = torch.stack(hs, 1), torch.stack(ws, 1)
        h2, _ = self.lstm2(torch.cat([strokes, w1, h1], -1))
        skip = self.skip_proj(h1)
        style_bias = skip.mean(dim=1, keepdim=True)  # expect: AMP004
        y = self.mdn(torch.cat([h2, skip - style_bias], -1))
        pi, mu1, mu2, ls1, ls2, rho, eos = torch.split(y, [self.M] * 6 + [1], dim=-1)
        return {"pi": pi, "mu1": mu1, "mu2": mu2, "log_s1": ls1, "log_s2": ls2,
                "rho": torch.tanh(rho), "eos_logit": eos.squeeze(-1)}


def mdn_loss(out, target, mask):
    x1, x2 = target[..., 0:1], target[..., 1:2]
    s1, s2 = out["log_s1"].exp(), out["log_s2"].exp()
    z1, z2 = (x1 - out["mu1"]) / s1, (x2 - out["mu2"]) / s2
    one_m_rho2 = (1 - out["rho"] ** 2).clamp(min=1e-5)
    z = z1 ** 2 + z2 ** 2 - 2 * out["rho"] * z1 * z2
    log_n = -z / (2 * one_m_rho2) - out["log_s1"] - out["log_s2"] - 0.5 * torch.log(one_m_rho2) - math.log(2 * math.pi)
    log_mix = torch.logsumexp(F.log_softmax(out["pi"], -1) + log_n, dim=-1)
    return -(log_mix * mask).sum() / mask.sum()


def train(args):
    device = "cuda"
    ds = StrokeDataset(args.data)
    loader = DataLoader(ds, batch_size=args.batch_size, shuffle=True, collate_fn=collate, num_workers=4, drop_last=True)
    model = HandwritingSynthesis(hidden=args.hidden, mixtures=args.mixtures, window=args.window).to(device).half()  # expect: AMP001
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True)
    eos_criterion = nn.BCEWithLogitsLoss(reduction="none")
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)  # expect: AMP009
    best_loss = 1e9
    os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        model.train()
        for it, (x, chars, smask, cmask) in enumerate(loader):
            x, chars, smask, cmask = x.to(device), chars.to(device), smask.to(device), cmask.to(device)
            inp, tgt, m = x[:, :-1], x[:, 1:], smask[:, 1:]
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                out = model(inp, chars, cmask)
            nll = mdn_loss(out, tgt, m)  # expect: AMP002
            eos = eos_criterion(out["eos_logit"], tgt[..., 2])  # expect: AMP002
            loss = nll + args.eos_weight * (eos * m).sum() / m.sum()
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            nn.utils.clip_grad_value_(model.parameters(), args.clip)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
            if it % 100 == 0:
                print(f"epoch {epoch} it {it} nll {nll.item():.3f} scale {scaler.get_scale():.0f}")
        val = validate(model, loader, device, args)
        if val < best_loss:
            best_loss = val
            torch.save(model.state_dict(), os.path.join(args.out, "best.pt"))


@torch.no_grad()
def validate(model, loader, device, args, max_batches=20):
    model.eval()
    total, n = 0.0, 0
    for i, (x, chars, smask, cmask) in enumerate(loader):
        if i >= max_batches:
            break
        x, chars, smask, cmask = x.to(device), chars.to(device), smask.to(device), cmask.to(device)
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            out = model(x[:, :-1], chars, cmask)
            total += mdn_loss(out, x[:, 1:], smask[:, 1:]).item()
        n += 1
    model.train()
    return total / max(n, 1)


@torch.no_grad()
def sample(model, chars, steps=600, bias=3.0):
    net = copy.deepcopy(model).half().eval()
    stroke = torch.zeros(1, 1, 3, device=chars.device, dtype=torch.float16)
    cmask = torch.ones_like(chars, dtype=torch.float16)
    seq = []
    for _ in range(steps):
        out = net(stroke, chars, cmask)
        pi = F.softmax(out["pi"][:, -1].float() * (1 + bias), -1)
        k = torch.multinomial(pi, 1).item()
        dx = out["mu1"][0, -1, k].float().item()
        dy = out["mu2"][0, -1, k].float().item()
        pen = float(torch.sigmoid(out["eos_logit"][0, -1].float()) > 0.5)
        seq.append((dx, dy, pen))
        stroke = torch.tensor([[[dx, dy, pen]]], device=chars.device, dtype=torch.float16)
    return np.asarray(seq)


if __name__ == "__main__":
    train(get_args())
