"""Sketch-RNN: bidirectional LSTM encoder, autoregressive LSTM decoder with a
bivariate Gaussian mixture over pen offsets (Ha & Eck, 2017)."""
import argparse
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class HParams:
    enc_hidden = 256
    dec_hidden = 512
    z_size = 128
    n_mixtures = 20
    max_seq_len = 200
    kl_weight = 0.5
    kl_min = 0.2
    grad_clip = 1.0
    lr = 1e-3


def load_strokes(path, max_len):
    data = np.load(path, encoding="latin1", allow_pickle=True)["train"]
    data = [s for s in data if len(s) <= max_len]
    scale = np.std(np.concatenate([s[:, :2].ravel() for s in data]))
    out = np.zeros((len(data), max_len + 1, 5), dtype=np.float32)
    for i, s in enumerate(data):
        n = len(s)
        out[i, 1:n + 1, :2] = s[:, :2] / (scale + 1e-8)
        out[i, 1:n + 1, 2] = 1 - s[:, 2]
        out[i, 1:n + 1, 3] = s[:, 2]
        out[i, n + 1:, 4] = 1
    out[:, 0, 2] = 1
    return torch.from_numpy(out)


class SketchRNN(nn.Module):
    def __init__(self, hp):
        super().__init__()
        self.hp = hp
        self.encoder = nn.LSTM(5, hp.enc_hidden, bidirectional=True, batch_first=True)
        self.fc_mu = nn.Linear(2 * hp.enc_hidden, hp.z_size)
        self.fc_sigma = nn.Linear(2 * hp.enc_hidden, hp.z_size)
        self.fc_init = nn.Linear(hp.z_size, 2 * hp.dec_hidden)
        self.decoder = nn.LSTM(5 + hp.z_size, hp.dec_hidden, batch_first=True)
        self.fc_out = nn.Linear(hp.dec_hidden, 6 * hp.n_mixtures + 3)

    def encode(self, strokes):
        _, (h, _) = self.encoder(strokes)
        h = torch.cat([h[0], h[1]], dim=-1)
        mu = self.fc_mu(h)
        center = mu.mean(dim=-1, keepdim=True)  # expect: AMP004
        mu = (mu - center) / (mu.std(dim=-1, keepdim=True) + 1e-8)  # expect: AMP004, AMP011
        sigma_hat = self.fc_sigma(h)
        z = mu + torch.exp(sigma_hat / 2.0) * torch.randn_like(mu)
        return z, mu, sigma_hat

    def forward(self, strokes):
        z, mu, sigma_hat = self.encode(strokes[:, 1:])
        h0, c0 = torch.tanh(self.fc_init(z)).chunk(2, dim=-1)
        z_rep = z.unsqueeze(1).expand(-1, strokes.size(1) - 1, -1)
        dec_in = torch.cat([strokes[:, :-1], z_rep], dim=-1)
        out, _ = self.decoder(dec_in, (h0.unsqueeze(0).contiguous(), c0.unsqueeze(0).contiguous()))
        return self.fc_out(out), mu, sigma_hat


def reconstruction_loss(params, target, n_mix):
    params = params.float()
    pi, mu_x, mu_y, s_x, s_y, rho = torch.split(params[..., :6 * n_mix], n_mix, dim=-1)
    pen_logits = params[..., 6 * n_mix:]
    log_pi = F.log_softmax(pi, dim=-1)
    s_x, s_y, rho = torch.exp(s_x), torch.exp(s_y), torch.tanh(rho)
    dx = (target[..., 0:1] - mu_x) / s_x
    dy = (target[..., 1:2] - mu_y) / s_y
    zed = dx ** 2 + dy ** 2 - 2 * rho * dx * dy
    one_m = (1 - rho ** 2).clamp(min=1e-6)
    log_pdf = -zed / (2 * one_m) - torch.log(2 * np.pi * s_x * s_y * one_m.sqrt())
    mask = 1.0 - target[..., 4]
    ls = -(torch.logsumexp(log_pi + log_pdf, dim=-1) * mask).sum() / mask.numel()
    lp = F.cross_entropy(pen_logits.reshape(-1, 3), target[..., 2:].argmax(-1).reshape(-1))
    return ls + lp


def kl_loss(mu, sigma_hat, kl_min):
    mu, sigma_hat = mu.float(), sigma_hat.float()
    kl = -0.5 * torch.mean(1 + sigma_hat - mu ** 2 - torch.exp(sigma_hat))
    return torch.clamp(kl, min=kl_min)


def train(args, hp=HParams()):
    device = torch.device("cuda")
    strokes = load_strokes(args.data, hp.max_seq_len)
    loader = torch.utils.data.DataLoader(strokes, batch_size=args.batch_size, shuffle=True, drop_last=True)
    model = SketchRNN(hp).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=hp.lr)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9999)
    scaler = torch.cuda.amp.GradScaler()  # expect: AMP009
    step = 0
    for epoch in range(args.epochs):
        model.train()
        for batch in loader:
            batch = batch.to(device, non_blocking=True)
            eta = 1.0 - (1.0 - 0.01) * (0.99995 ** step)
            with torch.cuda.amp.autocast():  # expect: AMP009
                params, mu, sigma_hat = model(batch)
                l_r = reconstruction_loss(params, batch[:, 1:], hp.n_mixtures)
                l_kl = kl_loss(mu, sigma_hat, hp.kl_min)
                loss = l_r + hp.kl_weight * eta * l_kl
            optimizer.zero_grad(set_to_none=True)
            loss = scaler.scale(loss)
            loss.backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), hp.grad_clip)
            optimizer.step()  # expect: AMP006
            scaler.update()
            scheduler.step()
            step += 1
            if step % args.log_every == 0:
                print(f"epoch {epoch} step {step} recon {l_r.item():.3f} kl {l_kl.item():.3f}")
        torch.save(model.state_dict(), os.path.join(args.out, f"sketchrnn_{epoch}.pt"))
    return model


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="checkpoints")
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--log-every", type=int, default=100)
    train(p.parse_args())
