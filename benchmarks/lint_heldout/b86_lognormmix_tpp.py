"""Intensity-free temporal point process (LogNormMix, Shchur et al. 2020) with a Gaussian
mixture head for continuous event marks (e.g. earthquake magnitude)."""
import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def pad_sequences(seqs, device):
    lengths = torch.tensor([len(s["times"]) for s in seqs])
    max_len = int(lengths.max())
    tau = torch.zeros(len(seqs), max_len)
    marks = torch.zeros(len(seqs), max_len)
    for i, s in enumerate(seqs):
        t = torch.as_tensor(s["times"], dtype=torch.float32)
        tau[i, : len(t)] = torch.diff(t, prepend=t.new_zeros(1))
        marks[i, : len(t)] = torch.as_tensor(s["marks"], dtype=torch.float32)
    mask = torch.arange(max_len)[None, :] < lengths[:, None]
    return tau.to(device), marks.to(device), mask.to(device)


class LogNormMixTPP(nn.Module):
    def __init__(self, hidden=64, n_components=16, n_mark_components=4):
        super().__init__()
        self.k = n_components
        self.m = n_mark_components
        self.rnn = nn.GRU(2, hidden, batch_first=True)
        self.history_proj = nn.Linear(hidden, hidden)
        self.time_head = nn.Linear(2 * hidden, 3 * n_components)
        self.mark_head = nn.Linear(2 * hidden + 1, 3 * n_mark_components)
        self.register_buffer("log_tau_mean", torch.zeros(()))
        self.register_buffer("log_tau_std", torch.ones(()))

    def forward(self, tau, marks, mask):
        log_tau = (torch.log(tau.clamp(min=1e-6)) - self.log_tau_mean) / self.log_tau_std
        features = torch.stack([log_tau, marks], dim=-1)
        h, _ = self.rnn(features)
        # context for event i is the history up to i - 1
        h = F.pad(h, (0, 0, 1, 0))[:, :-1]
        hist = self.history_proj(h)
        seq_summary = hist.mean(dim=1, keepdim=True).expand_as(hist)  # expect: AMP004
        context = torch.cat([hist, seq_summary], dim=-1)

        raw_t = self.time_head(context)
        locs, log_scales, w_logits = raw_t[..., : self.k], raw_t[..., self.k : 2 * self.k], raw_t[..., 2 * self.k :]

        raw_m = self.mark_head(torch.cat([context, log_tau[..., None]], dim=-1))
        mu = raw_m[..., : self.m]
        sigma = raw_m[..., self.m : 2 * self.m].abs() + 1e-10  # expect: AMP011
        pi_logits = raw_m[..., 2 * self.m :]
        return (locs, log_scales.clamp(-5.0, 3.0), w_logits), (mu, sigma, pi_logits)

    def time_log_prob(self, tau, params):
        locs, log_scales, w_logits = (p.float() for p in params)
        log_tau = (torch.log(tau.clamp(min=1e-6)) - self.log_tau_mean) / self.log_tau_std
        log_w = F.log_softmax(w_logits, dim=-1)
        z = (log_tau[..., None] - locs) / log_scales.exp()
        comp = -0.5 * z.pow(2) - log_scales - HALF_LOG_2PI
        log_p = torch.logsumexp(log_w + comp, dim=-1)
        # change of variables from log-normalised tau back to tau
        return log_p - torch.log(tau.clamp(min=1e-6)) - torch.log(self.log_tau_std)


def mark_log_prob(marks, params):
    mu, sigma, pi_logits = (p.float() for p in params)
    log_pi = F.log_softmax(pi_logits, dim=-1)
    comp = -0.5 * ((marks[..., None] - mu) / sigma) ** 2 - torch.log(sigma) - HALF_LOG_2PI
    m = (log_pi + comp).amax(dim=-1, keepdim=True)
    return (m + torch.log(torch.exp(log_pi + comp - m).sum(dim=-1, keepdim=True))).squeeze(-1)


def train(args, train_seqs, device):
    model = LogNormMixTPP(args.hidden, args.components).to(device)
    all_tau = torch.cat([torch.diff(torch.as_tensor(s["times"]).float()) for s in train_seqs])
    log_all = torch.log(all_tau.clamp(min=1e-6))
    model.log_tau_mean.fill_(log_all.mean().item())
    model.log_tau_std.fill_(log_all.std().item())

    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-5)
    scaler = torch.amp.GradScaler("cuda")
    for epoch in range(args.epochs):
        perm = torch.randperm(len(train_seqs))
        epoch_nll = 0.0
        for start in range(0, len(perm), args.batch_size):
            batch = [train_seqs[i] for i in perm[start : start + args.batch_size]]
            tau, marks, mask = pad_sequences(batch, device)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                time_params, mark_params = model(tau, marks, mask)
                ll = model.time_log_prob(tau, time_params) + mark_log_prob(marks, mark_params)
                loss = -(ll * mask).sum() / mask.sum()
                scaler.scale(loss).backward()  # expect: AMP008
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            scaler.step(optimizer)
            scaler.update()
            epoch_nll += loss.item()
        print(f"epoch {epoch:3d}  nll/event {epoch_nll / math.ceil(len(perm) / args.batch_size):.4f}")
    return model, scaler


def finetune_mark_head(model, seqs, scaler, device, steps=500, lr=1e-4, batch_size=32):
    """Adapt only the mark mixture to a new catalogue, keeping the timing model fixed."""
    model.requires_grad_(False)
    model.mark_head.requires_grad_(True)
    optimizer = torch.optim.Adam(model.mark_head.parameters(), lr=lr)
    for step in range(steps):
        idx = torch.randint(0, len(seqs), (batch_size,))
        tau, marks, mask = pad_sequences([seqs[int(i)] for i in idx], device)
        with torch.autocast("cuda", dtype=torch.float16):
            _, mark_params = model(tau, marks, mask)
            loss = -(mark_log_prob(marks, mark_params) * mask).sum() / mask.sum()
        loss = scaler.scale(loss)
        loss.backward()
        optimizer.step()  # expect: AMP006
        optimizer.zero_grad(set_to_none=True)
    return model


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", default="data/scedc_train.pt")
    ap.add_argument("--adapt", default="data/japan_catalogue.pt")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--components", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--clip", type=float, default=5.0)
    args = ap.parse_args()
    dev = torch.device("cuda")
    tpp, grad_scaler = train(args, torch.load(args.train), dev)
    tpp = finetune_mark_head(tpp, torch.load(args.adapt), grad_scaler, dev)
    torch.save(tpp.state_dict(), "lognormmix_tpp.pt")
