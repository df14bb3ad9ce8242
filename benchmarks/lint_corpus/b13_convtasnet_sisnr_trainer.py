"""Conv-TasNet speech separation trainer (WSJ0-2mix / Libri2Mix) with SI-SNR + PIT.

Adapted from a research repo: encoder / TCN separator / decoder in one file, a trainer
class with split backward/step methods, and a small CLI at the bottom.
"""
import argparse
import itertools
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.cuda.amp import GradScaler, autocast
from torch.utils.data import DataLoader

EPS = 1e-8


class GlobalLayerNorm(nn.Module):
    """gLN from the Conv-TasNet paper: normalise over channels and time."""

    def __init__(self, channels):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(1, channels, 1))
        self.beta = nn.Parameter(torch.zeros(1, channels, 1))

    def forward(self, x):
        mean = x.mean(dim=(1, 2), keepdim=True)  # expect: AMP004
        var = x.var(dim=(1, 2), keepdim=True, unbiased=False)  # expect: AMP004
        x = (x - mean) / torch.sqrt(var + 1e-8)  # expect: AMP011
        return self.gamma * x + self.beta


class TemporalBlock(nn.Module):
    def __init__(self, in_ch, hid_ch, kernel_size, dilation):
        super().__init__()
        self.conv1x1 = nn.Conv1d(in_ch, hid_ch, 1)
        self.norm1 = GlobalLayerNorm(hid_ch)
        self.prelu1 = nn.PReLU()
        pad = (kernel_size - 1) * dilation // 2
        self.dwconv = nn.Conv1d(hid_ch, hid_ch, kernel_size, padding=pad, dilation=dilation, groups=hid_ch)
        self.norm2 = GlobalLayerNorm(hid_ch)
        self.prelu2 = nn.PReLU()
        self.res_out = nn.Conv1d(hid_ch, in_ch, 1)

    def forward(self, x):
        y = self.prelu1(self.norm1(self.conv1x1(x)))
        y = self.prelu2(self.norm2(self.dwconv(y)))
        return x + self.res_out(y)


class ConvTasNet(nn.Module):
    def __init__(self, n_src=2, N=512, L=16, B=128, H=512, P=3, X=8, R=3):
        super().__init__()
        self.n_src = n_src
        self.encoder = nn.Conv1d(1, N, L, stride=L // 2, bias=False)
        self.bottleneck = nn.Conv1d(N, B, 1)
        blocks = [TemporalBlock(B, H, P, 2 ** x) for _ in range(R) for x in range(X)]
        self.tcn = nn.Sequential(*blocks)
        self.mask_conv = nn.Conv1d(B, n_src * N, 1)
        self.decoder = nn.ConvTranspose1d(N, 1, L, stride=L // 2, bias=False)

    def forward(self, mix):
        w = F.relu(self.encoder(mix.unsqueeze(1)))
        masks = torch.sigmoid(self.mask_conv(self.tcn(self.bottleneck(w))))
        masks = masks.view(mix.size(0), self.n_src, -1, w.size(-1))
        est = self.decoder((masks * w.unsqueeze(1)).flatten(0, 1))
        return est.view(mix.size(0), self.n_src, -1)[..., : mix.size(-1)]


def si_snr(est, ref):
    est = est.float()
    ref = ref.float()
    est = est - est.mean(dim=-1, keepdim=True)
    ref = ref - ref.mean(dim=-1, keepdim=True)
    proj = (est * ref).sum(-1, keepdim=True) * ref / (ref.pow(2).sum(-1, keepdim=True) + EPS)
    noise = est - proj
    return 10 * torch.log10(proj.pow(2).sum(-1) / (noise.pow(2).sum(-1) + EPS) + EPS)


def pit_si_snr_loss(est, ref):
    n_src = est.size(1)
    perms = list(itertools.permutations(range(n_src)))
    scores = torch.stack(
        [torch.stack([si_snr(est[:, i], ref[:, j]) for i, j in enumerate(p)], -1).mean(-1) for p in perms],
        dim=-1,
    )
    best, _ = scores.max(dim=-1)
    return -best.mean()


def pretrain_autoencoder(model, loader, steps=2000, lr=1e-3):
    """Warm-start encoder/decoder as a plain autoencoder on the mixtures."""
    params = list(model.encoder.parameters()) + list(model.decoder.parameters())
    opt = torch.optim.Adam(params, lr=lr)
    model.cuda().train()
    for step, (mix, _) in enumerate(loader):
        if step == steps:
            break
        mix = mix.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
            w = F.relu(model.encoder(mix.unsqueeze(1)))
            rec = model.decoder(w).squeeze(1)[..., : mix.size(-1)]
            loss = F.l1_loss(rec, mix)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


class SeparationTrainer:
    def __init__(self, model, train_loader, valid_loader, args):
        self.model = model.cuda()
        self.train_loader = train_loader
        self.valid_loader = valid_loader
        self.args = args
        self.optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
        self.scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(self.optimizer, factor=0.5, patience=3)
        self.scaler = GradScaler(enabled=args.amp)  # expect: AMP009
        self.best_val = float("inf")
        self.step = 0

    def _forward(self, mix, sources):
        with autocast(enabled=self.args.amp):  # expect: AMP009
            est = self.model(mix)
            loss = pit_si_snr_loss(est, sources)
        return loss

    def _backward(self, loss):
        self.scaler.scale(loss / self.args.accum_steps).backward()

    def _optimizer_step(self):
        grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.args.clip)  # expect: AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def train_epoch(self, epoch):
        self.model.train()
        running, t0 = 0.0, time.time()
        for i, (mix, sources) in enumerate(self.train_loader):
            mix, sources = mix.cuda(non_blocking=True), sources.cuda(non_blocking=True)
            loss = self._forward(mix, sources)
            self._backward(loss)
            if (i + 1) % self.args.accum_steps == 0:
                gn = self._optimizer_step()
                self.step += 1
                if self.step % self.args.log_every == 0:
                    print(f"ep {epoch} step {self.step} loss {loss.item():.3f} gn {gn:.2f} "
                          f"scale {self.scaler.get_scale():.0f} {time.time() - t0:.1f}s")
            running += loss.item()
        return running / max(1, len(self.train_loader))

    @torch.no_grad()
    def validate(self):
        self.model.eval()
        total, n = 0.0, 0
        for mix, sources in self.valid_loader:
            mix, sources = mix.cuda(), sources.cuda()
            with autocast(enabled=self.args.amp):  # expect: AMP009
                est = self.model(mix)
            total += -pit_si_snr_loss(est, sources).item() * mix.size(0)
            n += mix.size(0)
        self.model.train()
        return total / n

    def save(self, path, epoch, val_sisnr):
        torch.save(
            {
                "epoch": epoch,
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict(),
                "val_sisnr": val_sisnr,
            },
            path,
        )

    def fit(self):
        for epoch in range(self.args.epochs):
            tr = self.train_epoch(epoch)
            val = self.validate()
            self.scheduler.step(-val)
            print(f"epoch {epoch}: train loss {tr:.3f} | valid SI-SNR {val:.2f} dB")
            if -val < self.best_val:
                self.best_val = -val
                self.save(os.path.join(self.args.out_dir, "best.pt"), epoch, val)
            self.save(os.path.join(self.args.out_dir, "last.pt"), epoch, val)


class RandomMixtures(torch.utils.data.Dataset):
    """Stand-in dataset: random 4 s mixtures of two sources at 8 kHz."""

    def __init__(self, n, seconds=4.0, sr=8000, n_src=2):
        self.n, self.len, self.n_src = n, int(seconds * sr), n_src

    def __len__(self):
        return self.n

    def __getitem__(self, idx):
        g = torch.Generator().manual_seed(idx)
        sources = torch.randn(self.n_src, self.len, generator=g) * 0.1
        return sources.sum(0), sources


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=5.0)
    p.add_argument("--accum-steps", type=int, default=1)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--out-dir", default="exp/convtasnet")
    return p.parse_args()


def main():
    args = parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    train_loader = DataLoader(RandomMixtures(20000), batch_size=args.batch_size, shuffle=True,
                              num_workers=4, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(RandomMixtures(3000), batch_size=args.batch_size)
    model = pretrain_autoencoder(ConvTasNet(), train_loader)
    trainer = SeparationTrainer(model, train_loader, valid_loader, args)
    trainer.fit()


if __name__ == "__main__":
    main()
