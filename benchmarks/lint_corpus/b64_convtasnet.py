"""Conv-TasNet: fully-convolutional time-domain audio separation.

Luo & Mesgarani, "Conv-TasNet: Surpassing Ideal Time-Frequency Magnitude Masking
for Speech Separation" (TASLP 2019). Trained on WSJ0-2mix with utterance-level
permutation invariant training (uPIT) on SI-SNR.

    python train_convtasnet.py --train-dir data/wsj0-2mix/tr --valid-dir data/wsj0-2mix/cv --amp
"""
import argparse
import itertools
import logging
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from data.wsj0mix import Wsj0MixDataset, collate_pad
from utils.checkpoint import load_checkpoint, save_checkpoint
from utils.meters import AverageMeter

logger = logging.getLogger("convtasnet")


# --------------------------------------------------------------------------- norms


class ChannelwiseLayerNorm(nn.Module):
    """cLN: normalise over the channel axis independently at every frame."""

    def __init__(self, channels):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(1, channels, 1))
        self.beta = nn.Parameter(torch.zeros(1, channels, 1))

    def forward(self, y):
        # y: [M, N, K]
        mean = torch.mean(y, dim=1, keepdim=True)  # expect: AMP004
        var = torch.var(y, dim=1, keepdim=True, unbiased=False)  # expect: AMP004
        return self.gamma * (y - mean) / torch.pow(var + 1e-8, 0.5) + self.beta  # expect: AMP011


class GlobalLayerNorm(nn.Module):
    """gLN: normalise over channels and time jointly (non-causal)."""

    def __init__(self, channels):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(1, channels, 1))
        self.beta = nn.Parameter(torch.zeros(1, channels, 1))

    def forward(self, y):
        mean = y.mean(dim=1, keepdim=True).mean(dim=2, keepdim=True)  # expect: AMP004
        var = torch.pow(y - mean, 2).mean(dim=1, keepdim=True).mean(dim=2, keepdim=True)
        return self.gamma * (y - mean) / torch.pow(var + 1e-8, 0.5) + self.beta


class CumulativeLayerNorm(nn.Module):
    """Causal cumulative layer norm: statistics over channels and all frames up to t."""

    def __init__(self, channels):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(1, channels, 1))
        self.beta = nn.Parameter(torch.zeros(1, channels, 1))

    def forward(self, y):
        # running sums over thousands of frames: accumulate in fp32
        with torch.autocast("cuda", enabled=False):
            x = y.float()
            n_chan, n_frames = x.shape[1], x.shape[2]
            cum_sum = torch.cumsum(x.sum(dim=1, keepdim=True), dim=-1)
            cum_pow_sum = torch.cumsum(x.pow(2).sum(dim=1, keepdim=True), dim=-1)
            cnt = torch.arange(n_chan, n_chan * (n_frames + 1), n_chan, dtype=x.dtype, device=x.device)
            cum_mean = cum_sum / cnt.view(1, 1, -1)
            cum_var = (cum_pow_sum / cnt.view(1, 1, -1) - cum_mean.pow(2)).clamp(min=0.0)
            out = (x - cum_mean) / torch.sqrt(cum_var + 1e-8)
        return (self.gamma * out + self.beta).to(y.dtype)


NORM_LAYERS = {
    "gLN": GlobalLayerNorm,
    "cLN": ChannelwiseLayerNorm,
    "cumLN": CumulativeLayerNorm,
    "BN": nn.BatchNorm1d,
}


def make_norm(norm_type, channels):
    if norm_type not in NORM_LAYERS:
        raise ValueError(f"unknown norm {norm_type!r}, expected one of {sorted(NORM_LAYERS)}")
    return NORM_LAYERS[norm_type](channels)


# --------------------------------------------------------------------------- blocks


class Encoder(nn.Module):
    def __init__(self, kernel_size, n_filters):
        super().__init__()
        self.conv1d_U = nn.Conv1d(1, n_filters, kernel_size, stride=kernel_size // 2, bias=False)

    def forward(self, mixture):
        # [M, T] -> [M, N, K]
        return F.relu(self.conv1d_U(mixture.unsqueeze(1)))


class Decoder(nn.Module):
    def __init__(self, kernel_size, n_filters):
        super().__init__()
        self.basis = nn.ConvTranspose1d(n_filters, 1, kernel_size, stride=kernel_size // 2, bias=False)

    def forward(self, mixture_w, est_mask):
        batch, n_src, n_filters, n_frames = est_mask.shape
        source_w = mixture_w.unsqueeze(1) * est_mask
        est = self.basis(source_w.view(batch * n_src, n_filters, n_frames))
        return est.view(batch, n_src, -1)


class Conv1DBlock(nn.Module):
    """1x1 conv -> PReLU -> norm -> dilated depthwise conv -> PReLU -> norm -> res/skip."""

    def __init__(self, bn_chan, hid_chan, skip_chan, kernel_size, dilation, norm_type="gLN"):
        super().__init__()
        padding = (kernel_size - 1) * dilation // 2
        self.shared_block = nn.Sequential(
            nn.Conv1d(bn_chan, hid_chan, 1),
            nn.PReLU(),
            make_norm(norm_type, hid_chan),
            nn.Conv1d(hid_chan, hid_chan, kernel_size, padding=padding, dilation=dilation, groups=hid_chan),
            nn.PReLU(),
            make_norm(norm_type, hid_chan),
        )
        self.res_conv = nn.Conv1d(hid_chan, bn_chan, 1)
        self.skip_conv = nn.Conv1d(hid_chan, skip_chan, 1)

    def forward(self, x):
        shared = self.shared_block(x)
        return self.res_conv(shared), self.skip_conv(shared)


class TemporalConvNet(nn.Module):
    def __init__(self, n_filters, n_src, bn_chan=128, hid_chan=512, skip_chan=128,
                 kernel_size=3, n_blocks=8, n_repeats=3, norm_type="gLN", mask_act="relu"):
        super().__init__()
        self.n_src = n_src
        self.n_filters = n_filters
        self.input_norm = ChannelwiseLayerNorm(n_filters)
        self.bottleneck = nn.Conv1d(n_filters, bn_chan, 1)
        self.tcn = nn.ModuleList()
        for _ in range(n_repeats):
            for b in range(n_blocks):
                self.tcn.append(Conv1DBlock(bn_chan, hid_chan, skip_chan, kernel_size, 2 ** b, norm_type))
        self.mask_net = nn.Sequential(nn.PReLU(), nn.Conv1d(skip_chan, n_src * n_filters, 1))
        self.mask_act = nn.ReLU() if mask_act == "relu" else nn.Sigmoid()

    def forward(self, mixture_w):
        batch, _, n_frames = mixture_w.shape
        output = self.bottleneck(self.input_norm(mixture_w))
        skip_sum = 0.0
        for block in self.tcn:
            residual, skip = block(output)
            output = output + residual
            skip_sum = skip_sum + skip
        score = self.mask_net(skip_sum)
        score = score.view(batch, self.n_src, self.n_filters, n_frames)
        return self.mask_act(score)


class ConvTasNet(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.encoder = Encoder(cfg.kernel_size, cfg.n_filters)
        self.separator = TemporalConvNet(
            cfg.n_filters, cfg.n_src, bn_chan=cfg.bn_chan, hid_chan=cfg.hid_chan,
            skip_chan=cfg.skip_chan, n_blocks=cfg.n_blocks, n_repeats=cfg.n_repeats,
            norm_type=cfg.norm_type, mask_act=cfg.mask_act,
        )
        self.decoder = Decoder(cfg.kernel_size, cfg.n_filters)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_normal_(p)

    def forward(self, mixture):
        mixture_w = self.encoder(mixture)
        est_mask = self.separator(mixture_w)
        est = self.decoder(mixture_w, est_mask)
        # transposed conv may drop a few samples at the end
        return F.pad(est, (0, mixture.size(-1) - est.size(-1)))


# --------------------------------------------------------------------------- loss / metrics


class PITSISNRLoss(nn.Module):
    """Negative SI-SNR under the best permutation of the estimated sources."""

    def __init__(self, n_src, zero_mean=True):
        super().__init__()
        self.n_src = n_src
        self.zero_mean = zero_mean
        self.register_buffer(
            "perms", torch.tensor(list(itertools.permutations(range(n_src))), dtype=torch.long), persistent=False
        )

    def pairwise_si_snr(self, est, ref):
        # est, ref: [B, C, T] -> [B, C_est, C_ref]
        if self.zero_mean:
            est = est - est.mean(dim=-1, keepdim=True)  # expect: AMP004
            ref = ref - ref.mean(dim=-1, keepdim=True)
        s_est = est.unsqueeze(2)
        s_ref = ref.unsqueeze(1)
        dot = torch.sum(s_est * s_ref, dim=-1, keepdim=True)
        ref_energy = torch.sum(s_ref ** 2, dim=-1, keepdim=True) + 1e-8
        proj = dot * s_ref / ref_energy
        noise = s_est - proj
        ratio = torch.sum(proj ** 2, dim=-1) / (torch.sum(noise ** 2, dim=-1) + 1e-8)
        return 10 * torch.log10(ratio + 1e-8)

    def forward(self, est, ref):
        pw = self.pairwise_si_snr(est, ref)  # [B, C, C]
        idx = torch.arange(self.n_src, device=pw.device)
        per_perm = pw[:, idx.unsqueeze(0).expand_as(self.perms), self.perms].mean(-1)  # [B, P]
        best, _ = per_perm.max(dim=1)
        return -best.mean()


def si_snr(est, ref):
    est = est - est.mean(dim=-1, keepdim=True)
    ref = ref - ref.mean(dim=-1, keepdim=True)
    proj = (est * ref).sum(-1, keepdim=True) * ref / (ref.pow(2).sum(-1, keepdim=True) + 1e-8)
    noise = est - proj
    return 10 * torch.log10(proj.pow(2).sum(-1) / (noise.pow(2).sum(-1) + 1e-8) + 1e-8)


# --------------------------------------------------------------------------- train / eval


def train_one_epoch(model, criterion, loader, optimizer, scaler, epoch, args):
    model.train()
    loss_meter = AverageMeter()
    start = time.time()
    for step, (mixture, sources, _) in enumerate(loader):
        mixture = mixture.cuda(non_blocking=True)
        sources = sources.cuda(non_blocking=True)

        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=args.amp):
            est_sources = model(mixture)
            loss = criterion(est_sources, sources)

        scaler.scale(loss).backward()
        if args.clip_norm > 0:
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), args.clip_norm)
        scaler.step(optimizer)
        scaler.update()

        loss_meter.update(loss.item(), mixture.size(0))
        if step % args.log_every == 0:
            logger.info(
                "epoch %d step %d/%d  loss %.3f  scale %.0f  %.1fs",
                epoch, step, len(loader), loss_meter.avg, scaler.get_scale(), time.time() - start,
            )
    return loss_meter.avg


@torch.no_grad()
def evaluate(model, criterion, loader, args):
    model.eval()
    loss_meter, sisnri_meter = AverageMeter(), AverageMeter()
    for mixture, sources, _ in loader:
        mixture = mixture.cuda(non_blocking=True)
        sources = sources.cuda(non_blocking=True)
        with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=args.amp):
            est_sources = model(mixture)
            loss = criterion(est_sources, sources)
        loss_meter.update(loss.item(), mixture.size(0))

        # SI-SNR improvement over the mixture, in fp32
        est = est_sources.float()
        mix = mixture.unsqueeze(1).expand_as(sources).float()
        improvement = si_snr(est, sources) - si_snr(mix, sources)
        sisnri_meter.update(improvement.mean().item(), mixture.size(0))
    return loss_meter.avg, sisnri_meter.avg


def build_parser():
    p = argparse.ArgumentParser(description="Conv-TasNet on WSJ0-2mix")
    p.add_argument("--train-dir", required=True)
    p.add_argument("--valid-dir", required=True)
    p.add_argument("--out-dir", default="exp/convtasnet")
    p.add_argument("--segment", type=float, default=4.0)
    p.add_argument("--sample-rate", type=int, default=8000)
    p.add_argument("--n-src", type=int, default=2)
    p.add_argument("--kernel-size", type=int, default=16)
    p.add_argument("--n-filters", type=int, default=512)
    p.add_argument("--bn-chan", type=int, default=128)
    p.add_argument("--hid-chan", type=int, default=512)
    p.add_argument("--skip-chan", type=int, default=128)
    p.add_argument("--n-blocks", type=int, default=8)
    p.add_argument("--n-repeats", type=int, default=3)
    p.add_argument("--norm-type", default="gLN", choices=sorted(NORM_LAYERS))
    p.add_argument("--mask-act", default="relu", choices=["relu", "sigmoid"])
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip-norm", type=float, default=5.0)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--resume", default=None)
    return p


def main():
    args = build_parser().parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    os.makedirs(args.out_dir, exist_ok=True)
    torch.backends.cudnn.benchmark = True

    train_set = Wsj0MixDataset(args.train_dir, segment=args.segment, sample_rate=args.sample_rate)
    valid_set = Wsj0MixDataset(args.valid_dir, segment=None, sample_rate=args.sample_rate)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                              num_workers=4, drop_last=True, collate_fn=collate_pad)
    valid_loader = DataLoader(valid_set, batch_size=1, num_workers=2, collate_fn=collate_pad)

    model = ConvTasNet(args).cuda()
    criterion = PITSISNRLoss(args.n_src).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=3)
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("Conv-TasNet with %.2fM parameters", n_params / 1e6)

    start_epoch, best_loss = 0, float("inf")
    if args.resume:
        state = load_checkpoint(args.resume, model, optimizer, scaler)
        start_epoch, best_loss = state["epoch"] + 1, state["best_loss"]

    for epoch in range(start_epoch, args.epochs):
        train_loss = train_one_epoch(model, criterion, train_loader, optimizer, scaler, epoch, args)
        valid_loss, sisnri = evaluate(model, criterion, valid_loader, args)
        scheduler.step(valid_loss)
        logger.info("epoch %d  train %.3f  valid %.3f  SI-SNRi %.2f dB", epoch, train_loss, valid_loss, sisnri)
        is_best = valid_loss < best_loss
        best_loss = min(valid_loss, best_loss)
        save_checkpoint(
            {"epoch": epoch, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "scaler": scaler.state_dict(), "best_loss": best_loss},
            os.path.join(args.out_dir, "last.pth"), is_best=is_best,
        )


if __name__ == "__main__":
    main()
