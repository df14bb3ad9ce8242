"""Conv-TasNet: a fully-convolutional time-domain audio separation network.

Luo & Mesgarani, "Conv-TasNet: Surpassing Ideal Time-Frequency Magnitude
Masking for Speech Separation", 2019.  Training uses utterance-level PIT on
SI-SNR.  Mixed precision follows the torch.amp recipe (older releases of this
script used torch.cuda.amp.autocast).
"""
import argparse
import copy
import math
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

EPS = 1e-8


def _permutations(n):
    if n == 1:
        return [[0]]
    out = []
    for p in _permutations(n - 1):
        for i in range(n):
            out.append(p[:i] + [n - 1] + p[i:])
    return out


def overlap_and_add(signal, frame_step):
    """Reconstructs a signal from a framed representation [..., frames, frame_length]."""
    outer_dimensions = signal.size()[:-2]
    frames, frame_length = signal.size()[-2:]
    subframe_length = math.gcd(frame_length, frame_step)
    subframe_step = frame_step // subframe_length
    subframes_per_frame = frame_length // subframe_length
    output_size = frame_step * (frames - 1) + frame_length
    output_subframes = output_size // subframe_length

    subframe_signal = signal.view(*outer_dimensions, -1, subframe_length)
    frame = torch.arange(0, output_subframes, device=signal.device).unfold(0, subframes_per_frame, subframe_step)
    frame = frame.contiguous().view(-1)
    result = signal.new_zeros(*outer_dimensions, output_subframes, subframe_length)
    result.index_add_(-2, frame, subframe_signal)
    return result.view(*outer_dimensions, -1)


class Wsj0MixSegments(torch.utils.data.Dataset):
    """Pre-resampled 8 kHz wsj0-2mix utterances stored as ``{mix, s1, s2}.npy`` triplets."""

    def __init__(self, root, segment=32000):
        self.root, self.segment = root, segment
        self.ids = sorted(f[:-8] for f in os.listdir(root) if f.endswith(".mix.npy"))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        base = os.path.join(self.root, self.ids[i])
        mix = np.load(base + ".mix.npy").astype(np.float32)
        src = np.stack([np.load(base + ".s1.npy"), np.load(base + ".s2.npy")]).astype(np.float32)
        if 0 < self.segment < mix.shape[-1]:
            start = np.random.randint(0, mix.shape[-1] - self.segment)
            mix, src = mix[start:start + self.segment], src[:, start:start + self.segment]
        return torch.from_numpy(mix), torch.from_numpy(src)


def pad_collate(batch):
    lengths = torch.tensor([m.shape[-1] for m, _ in batch])
    T = int(lengths.max())
    mixtures = torch.stack([F.pad(m, (0, T - m.shape[-1])) for m, _ in batch])
    sources = torch.stack([F.pad(s, (0, T - s.shape[-1])) for _, s in batch])
    return mixtures, lengths, sources


class Encoder(nn.Module):
    def __init__(self, L, N):
        super().__init__()
        self.L, self.N = L, N
        self.conv1d_U = nn.Conv1d(1, N, kernel_size=L, stride=L // 2, bias=False)

    def forward(self, mixture):
        mixture = torch.unsqueeze(mixture, 1)  # [M, 1, T]
        return F.relu(self.conv1d_U(mixture))  # [M, N, K]


class Decoder(nn.Module):
    def __init__(self, N, L):
        super().__init__()
        self.N, self.L = N, L
        self.basis_signals = nn.Linear(N, L, bias=False)

    def forward(self, mixture_w, est_mask):
        source_w = torch.unsqueeze(mixture_w, 1) * est_mask  # [M, C, N, K]
        source_w = torch.transpose(source_w, 2, 3)  # [M, C, K, N]
        est_source = self.basis_signals(source_w)  # [M, C, K, L]
        return overlap_and_add(est_source, self.L // 2)  # [M, C, T]


class ChannelwiseLayerNorm(nn.Module):
    """Channel-wise layer normalisation (cLN)."""

    def __init__(self, channel_size):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(1, channel_size, 1))
        self.beta = nn.Parameter(torch.zeros(1, channel_size, 1))

    def forward(self, y):
        mean = torch.mean(y, dim=1, keepdim=True)  # expect: AMP004
        var = torch.var(y, dim=1, keepdim=True, unbiased=False)  # expect: AMP004
        return self.gamma * (y - mean) / torch.pow(var + 1e-8, 0.5) + self.beta  # expect: AMP011


class GlobalLayerNorm(nn.Module):
    """Global layer normalisation (gLN)."""

    def __init__(self, channel_size):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(1, channel_size, 1))
        self.beta = nn.Parameter(torch.zeros(1, channel_size, 1))

    def forward(self, y):
        orig_dtype = y.dtype
        y = y.float()
        mean = y.mean(dim=(1, 2), keepdim=True)
        var = (y - mean).pow(2).mean(dim=(1, 2), keepdim=True)
        out = self.gamma * (y - mean) / torch.pow(var + EPS, 0.5) + self.beta
        return out.to(orig_dtype)


def chose_norm(norm_type, channel_size):
    if norm_type == "gLN":
        return GlobalLayerNorm(channel_size)
    return nn.BatchNorm1d(channel_size)


class DepthwiseSeparableConv(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, padding, dilation, norm_type="gLN"):
        super().__init__()
        depthwise = nn.Conv1d(in_channels, in_channels, kernel_size, padding=padding, dilation=dilation, groups=in_channels, bias=False)
        pointwise = nn.Conv1d(in_channels, out_channels, 1, bias=False)
        self.net = nn.Sequential(depthwise, nn.PReLU(), chose_norm(norm_type, in_channels), pointwise)

    def forward(self, x):
        return self.net(x)


class TemporalBlock(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, padding, dilation, norm_type="gLN"):
        super().__init__()
        conv1x1 = nn.Conv1d(in_channels, out_channels, 1, bias=False)
        dsconv = DepthwiseSeparableConv(out_channels, in_channels, kernel_size, padding, dilation, norm_type)
        self.net = nn.Sequential(conv1x1, nn.PReLU(), chose_norm(norm_type, out_channels), dsconv)

    def forward(self, x):
        return self.net(x) + x


class TemporalConvNet(nn.Module):
    def __init__(self, N, B, H, P, X, R, C, norm_type="gLN", mask_nonlinear="relu"):
        super().__init__()
        self.C = C
        self.mask_nonlinear = mask_nonlinear
        layer_norm = ChannelwiseLayerNorm(N)
        bottleneck_conv1x1 = nn.Conv1d(N, B, 1, bias=False)
        repeats = []
        for _ in range(R):
            blocks = []
            for x in range(X):
                dilation = 2 ** x
                blocks.append(TemporalBlock(B, H, P, (P - 1) * dilation // 2, dilation, norm_type))
            repeats.append(nn.Sequential(*blocks))
        mask_conv1x1 = nn.Conv1d(B, C * N, 1, bias=False)
        self.network = nn.Sequential(layer_norm, bottleneck_conv1x1, nn.Sequential(*repeats), mask_conv1x1)

    def forward(self, mixture_w):
        M, N, K = mixture_w.size()
        score = self.network(mixture_w).view(M, self.C, N, K)
        if self.mask_nonlinear == "softmax":
            return F.softmax(score, dim=1)
        return F.relu(score)


class ConvTasNet(nn.Module):
    def __init__(self, N=256, L=20, B=256, H=512, P=3, X=8, R=4, C=2, norm_type="gLN", mask_nonlinear="relu"):
        super().__init__()
        self.N, self.L, self.C = N, L, C
        self.encoder = Encoder(L, N)
        self.separator = TemporalConvNet(N, B, H, P, X, R, C, norm_type, mask_nonlinear)
        self.decoder = Decoder(N, L)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_normal_(p)

    def forward(self, mixture):
        mixture_w = self.encoder(mixture)
        est_mask = self.separator(mixture_w)
        est_source = self.decoder(mixture_w, est_mask)
        return F.pad(est_source, (0, mixture.size(-1) - est_source.size(-1)))


def get_mask(source, source_lengths):
    B, _, T = source.size()
    mask = source.new_ones((B, 1, T))
    for i in range(B):
        mask[i, :, source_lengths[i]:] = 0
    return mask


def cal_si_snr_with_pit(source, estimate_source, source_lengths):
    """SI-SNR of every (estimate, reference) pair and the best permutation."""
    B, C, T = source.size()
    mask = get_mask(source, source_lengths)
    estimate_source = estimate_source * mask

    num_samples = source_lengths.view(-1, 1, 1).float()
    mean_target = torch.sum(source, dim=2, keepdim=True) / num_samples
    mean_estimate = torch.sum(estimate_source, dim=2, keepdim=True) / num_samples
    zero_mean_target = (source - mean_target) * mask
    zero_mean_estimate = (estimate_source - mean_estimate) * mask

    s_target = torch.unsqueeze(zero_mean_target, dim=1)  # [B, 1, C, T]
    s_estimate = torch.unsqueeze(zero_mean_estimate, dim=2)  # [B, C, 1, T]
    pair_wise_dot = torch.sum(s_estimate * s_target, dim=3, keepdim=True)
    s_target_energy = torch.sum(s_target ** 2, dim=3, keepdim=True) + EPS
    pair_wise_proj = pair_wise_dot * s_target / s_target_energy
    e_noise = s_estimate - pair_wise_proj
    pair_wise_si_snr = torch.sum(pair_wise_proj ** 2, dim=3) / (torch.sum(e_noise ** 2, dim=3) + EPS)
    pair_wise_si_snr = 10 * torch.log10(pair_wise_si_snr + EPS)  # [B, C, C]

    perms = _permutations(C)
    idx = torch.arange(C, device=source.device)
    snr_set = torch.stack([pair_wise_si_snr[:, idx, torch.tensor(p, device=source.device)].sum(dim=1) for p in perms], dim=1) / C
    max_snr, max_idx = torch.max(snr_set, dim=1)
    return max_snr, [perms[i] for i in max_idx.tolist()]


def cal_loss(source, estimate_source, source_lengths):
    max_snr, perms = cal_si_snr_with_pit(source, estimate_source, source_lengths)
    loss = 0 - torch.mean(max_snr)
    return loss, max_snr, perms


class Solver:
    def __init__(self, args, tr_loader, cv_loader):
        self.args = args
        self.tr_loader, self.cv_loader = tr_loader, cv_loader
        self.device = torch.device("cuda")
        self.model = ConvTasNet(args.N, args.L, args.B, args.H, args.P, args.X, args.R, args.C, norm_type=args.norm_type, mask_nonlinear=args.mask_nonlinear).to(self.device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=args.lr, weight_decay=args.l2)
        self.scaler = torch.amp.GradScaler("cuda", enabled=args.use_amp)
        self.prev_val_loss = float("inf")
        self.best_val_loss = float("inf")
        self.val_no_impv = 0
        self.halving = False

    def _run_one_epoch(self, epoch, cross_valid=False):
        total_loss = 0.0
        data_loader = self.cv_loader if cross_valid else self.tr_loader
        for i, (padded_mixture, mixture_lengths, padded_source) in enumerate(data_loader):
            padded_mixture = padded_mixture.to(self.device, non_blocking=True)
            mixture_lengths = mixture_lengths.to(self.device)
            padded_source = padded_source.to(self.device, non_blocking=True)
            with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=self.args.use_amp):
                estimate_source = self.model(padded_mixture)
                loss, max_snr, _ = cal_loss(padded_source, estimate_source, mixture_lengths)
            if not cross_valid:
                self.optimizer.zero_grad(set_to_none=True)
                self.scaler.scale(loss).backward()
                self.scaler.unscale_(self.optimizer)
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.max_norm)
                self.scaler.step(self.optimizer)
                self.scaler.update()
            total_loss += loss.item()
            if i % self.args.print_freq == 0:
                print(f"Epoch {epoch + 1} | Iter {i + 1} | Average Loss {total_loss / (i + 1):.3f} | Current Loss {loss.item():.6f}", flush=True)
        return total_loss / (i + 1)

    def train(self):
        for epoch in range(self.args.epochs):
            self.model.train()
            tr_avg_loss = self._run_one_epoch(epoch)
            self.model.eval()
            with torch.no_grad():
                val_loss = self._run_one_epoch(epoch, cross_valid=True)
            if self.args.half_lr and val_loss >= self.prev_val_loss:
                self.val_no_impv += 1
                self.halving = self.val_no_impv >= 3
            else:
                self.val_no_impv = 0
            if self.halving:
                for group in self.optimizer.param_groups:
                    group["lr"] /= 2.0
                self.halving = False
            self.prev_val_loss = val_loss
            if val_loss < self.best_val_loss:
                self.best_val_loss = val_loss
                torch.save(self.serialize(epoch, tr_avg_loss, val_loss), os.path.join(self.args.save_folder, "final.pth.tar"))
            print(f"epoch {epoch + 1}: train {tr_avg_loss:.3f} valid {val_loss:.3f}")

    def serialize(self, epoch, tr_loss, cv_loss):
        a = self.args
        model_args = dict(N=a.N, L=a.L, B=a.B, H=a.H, P=a.P, X=a.X, R=a.R, C=a.C, norm_type=a.norm_type, mask_nonlinear=a.mask_nonlinear)
        return {"model_args": model_args, "state_dict": self.model.state_dict(), "optim_dict": self.optimizer.state_dict(), "epoch": epoch, "tr_loss": tr_loss, "cv_loss": cv_loss}


def export_release(model_path, out_path):
    """Drop optimizer state and store fp16 weights for the release archive."""
    package = torch.load(model_path, map_location="cpu")
    model = ConvTasNet(**package["model_args"])
    model.load_state_dict(package["state_dict"])
    model.eval()
    torch.save({"model_args": package["model_args"], "state_dict": copy.deepcopy(model).half().state_dict()}, out_path)


@torch.inference_mode()
def inference_separate(model, mixture, device="cuda"):
    model = model.to(device).half().eval()
    est = model(mixture.to(device).half()).float()
    peak = est.abs().amax(dim=-1, keepdim=True).clamp(min=1e-4)
    return (0.9 * est / peak).cpu().numpy()


def main():
    p = argparse.ArgumentParser("Conv-TasNet training")
    p.add_argument("--train_dir", required=True)
    p.add_argument("--valid_dir", required=True)
    for name, default in (("N", 256), ("L", 20), ("B", 256), ("H", 512), ("P", 3), ("X", 8), ("R", 4), ("C", 2)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--norm_type", default="gLN", choices=["gLN", "BN"])
    p.add_argument("--mask_nonlinear", default="relu")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--half_lr", type=int, default=1)
    p.add_argument("--max_norm", type=float, default=5.0)
    for name, typ, default in (("lr", float, 1e-3), ("l2", float, 0.0), ("use_amp", int, 1), ("batch_size", int, 3), ("print_freq", int, 200)):
        p.add_argument(f"--{name}", type=typ, default=default)
    p.add_argument("--save_folder", default="exp/temp")
    args = p.parse_args()
    os.makedirs(args.save_folder, exist_ok=True)

    tr_loader = torch.utils.data.DataLoader(Wsj0MixSegments(args.train_dir, segment=32000), batch_size=args.batch_size, shuffle=True, num_workers=4, collate_fn=pad_collate, drop_last=True)
    cv_loader = torch.utils.data.DataLoader(Wsj0MixSegments(args.valid_dir, segment=-1), batch_size=1, num_workers=0, collate_fn=pad_collate)
    Solver(args, tr_loader, cv_loader).train()


if __name__ == "__main__":
    main()
