"""Jukebox-style hierarchical VQ-VAE for raw audio (Dhariwal et al., 2020), after
openai/jukebox/vqvae: dilated Conv1D encoders, EMA codebooks with random restarts,
spectral loss, three levels of temporal downsampling.
"""
import argparse

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class ResConv1DBlock(nn.Module):
    def __init__(self, n_in, n_state, dilation=1, res_scale=1.0):
        super().__init__()
        self.model = nn.Sequential(
            nn.ReLU(), nn.Conv1d(n_in, n_state, 3, 1, dilation, dilation),
            nn.ReLU(), nn.Conv1d(n_state, n_in, 1, 1, 0),
        )
        self.res_scale = res_scale

    def forward(self, x):
        return x + self.res_scale * self.model(x)


class Encoder(nn.Module):
    def __init__(self, input_emb_width, output_emb_width, down_t, stride_t, width=32, depth=4, dilation_growth_rate=3):
        super().__init__()
        blocks = []
        for i in range(down_t):
            blocks.append(nn.Conv1d(input_emb_width if i == 0 else width, width, stride_t * 2, stride_t, stride_t // 2))
            blocks += [ResConv1DBlock(width, width, dilation_growth_rate ** d) for d in range(depth)]
        self.blocks = nn.Sequential(*blocks)
        self.proj = nn.Conv1d(width, output_emb_width, 3, 1, 1)

    def forward(self, x):
        return self.proj(self.blocks(x))


class Decoder(nn.Module):
    def __init__(self, output_emb_width, input_emb_width, down_t, stride_t, width=32, depth=4, dilation_growth_rate=3):
        super().__init__()
        blocks = [nn.Conv1d(output_emb_width, width, 3, 1, 1)]
        for i in range(down_t):
            blocks += [ResConv1DBlock(width, width, dilation_growth_rate ** d) for d in reversed(range(depth))]
            blocks.append(nn.ConvTranspose1d(width, width, stride_t * 2, stride_t, stride_t // 2))
        self.blocks = nn.Sequential(*blocks)
        self.out = nn.Conv1d(width, input_emb_width, 3, 1, 1)

    def forward(self, x):
        return self.out(self.blocks(x))


class BottleneckBlock(nn.Module):
    def __init__(self, k_bins, emb_width, mu=0.99):
        super().__init__()
        self.k_bins, self.emb_width, self.mu = k_bins, emb_width, mu
        self.threshold = 1.0
        self.init = False
        self.register_buffer("k", torch.zeros(k_bins, emb_width))
        self.register_buffer("k_sum", torch.zeros(k_bins, emb_width))
        self.register_buffer("k_elem", torch.ones(k_bins))

    def _tile(self, x):
        d, ew = x.shape
        if d < self.k_bins:
            n_repeats = (self.k_bins + d - 1) // d
            std = 0.01 / np.sqrt(ew)
            x = x.repeat(n_repeats, 1)
            x = x + torch.randn_like(x) * std
        return x

    @torch.no_grad()
    def init_k(self, x):
        y = self._tile(x)
        self.k.copy_(y[torch.randperm(y.shape[0], device=x.device)][: self.k_bins])
        self.k_sum.copy_(self.k)
        self.k_elem.fill_(1.0)
        self.init = True

    @torch.no_grad()
    def update_k(self, x, x_l):
        mu, k_bins = self.mu, self.k_bins
        x_l_onehot = torch.zeros(k_bins, x.shape[0], device=x.device)
        x_l_onehot.scatter_(0, x_l.view(1, x.shape[0]), 1)
        _k_sum = torch.matmul(x_l_onehot, x)
        _k_elem = x_l_onehot.sum(dim=-1)
        y = self._tile(x)
        _k_rand = y[torch.randperm(y.shape[0], device=x.device)][:k_bins]
        old_k = self.k.clone()
        self.k_sum.mul_(mu).add_((1.0 - mu) * _k_sum)
        self.k_elem.mul_(mu).add_((1.0 - mu) * _k_elem)
        usage = (self.k_elem.view(k_bins, 1) >= self.threshold).float()
        self.k.copy_(usage * (self.k_sum / self.k_elem.view(k_bins, 1)) + (1 - usage) * _k_rand)
        _k_prob = _k_elem / torch.sum(_k_elem)
        entropy = -torch.sum(_k_prob * torch.log(_k_prob + 1e-8))
        used_curr = (_k_elem >= self.threshold).sum()
        dk = torch.norm(self.k - old_k) / np.sqrt(np.prod(old_k.shape))
        return dict(entropy=entropy, used_curr=used_curr, usage=usage.sum(), dk=dk)

    def preprocess(self, x):
        x = x.permute(0, 2, 1).contiguous().view(-1, x.shape[1])
        prenorm = torch.norm(x - torch.mean(x)) / np.sqrt(np.prod(x.shape))  # expect: AMP004
        return x, prenorm

    def quantise(self, x):
        k_w = self.k.t()
        distance = torch.sum(x ** 2, dim=-1, keepdim=True) - 2 * torch.matmul(x, k_w) + torch.sum(k_w ** 2, dim=0, keepdim=True)
        min_distance, x_l = torch.min(distance, dim=-1)
        fit = torch.mean(min_distance)
        return x_l, fit

    def forward(self, x):
        n, _, t = x.shape
        x, prenorm = self.preprocess(x)
        if self.training and not self.init:
            self.init_k(x)
        x_l, fit = self.quantise(x)
        x_d = F.embedding(x_l, self.k)
        metrics = self.update_k(x, x_l) if self.training else {}
        commit_loss = torch.norm(x_d.detach() - x) ** 2 / np.prod(x.shape)
        x_d = x + (x_d - x).detach()
        x_d = x_d.view(n, t, -1).permute(0, 2, 1).contiguous()
        metrics.update(fit=fit, pn=prenorm)
        return x_l.view(n, t), x_d, commit_loss, metrics


class VQVAE(nn.Module):
    def __init__(self, levels=3, downs_t=(3, 2, 2), strides_t=(2, 2, 2), emb_width=64, l_bins=2048):
        super().__init__()
        self.levels = levels
        down = lambda lvl: downs_t[: lvl + 1]
        self.encoders = nn.ModuleList(Encoder(1, emb_width, sum(down(lvl)), strides_t[lvl]) for lvl in range(levels))
        self.decoders = nn.ModuleList(Decoder(emb_width, 1, sum(down(lvl)), strides_t[lvl]) for lvl in range(levels))
        self.bottlenecks = nn.ModuleList(BottleneckBlock(l_bins, emb_width) for _ in range(levels))

    def forward(self, x):
        outs, commit, metrics = [], 0.0, []
        for level in range(self.levels):
            x_enc = self.encoders[level](x)
            _, x_q, commit_l, m = self.bottlenecks[level](x_enc)
            outs.append(self.decoders[level](x_q))
            commit = commit + commit_l
            metrics.append(m)
        return torch.stack(outs, dim=0), commit / self.levels, metrics


def spectral_loss(x_in, x_out, n_fft=1024, hop=256):
    window = torch.hann_window(n_fft, device=x_in.device)
    spec_in = torch.stft(x_in.float().reshape(-1, x_in.shape[-1]), n_fft, hop, window=window, return_complex=True).abs()
    spec_out = torch.stft(x_out.float().reshape(-1, x_out.shape[-1]), n_fft, hop, window=window, return_complex=True).abs()
    return torch.norm(spec_in - spec_out) / torch.norm(spec_in).clamp(min=1e-3)


def train(model, loader, optimizer, scaler, args):
    model.train()
    for step, x in enumerate(loader):
        x = x.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            x_out, commit_loss, metrics = model(x)
        x_rep = x.unsqueeze(0).expand_as(x_out)
        recons_loss = F.mse_loss(x_out, x_rep)  # expect: AMP002
        spec = spectral_loss(x_rep, x_out)
        loss = recons_loss + args.spectral * spec + args.commit * commit_loss
        optimizer.zero_grad(set_to_none=True)
        if args.amp:
            scaler.scale(loss).backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
        if step % args.log_every == 0:
            usage = [m["used_curr"].item() for m in metrics]
            print(f"step {step} recons {recons_loss.item():.5f} spec {spec.item():.4f} gn {grad_norm:.2f} used {usage}")


@torch.no_grad()
def sample_reconstruction(model, x, level=0):
    model.eval()
    with torch.autocast("cuda", dtype=torch.float16):
        x_out, _, _ = model(x.cuda())
    rms = x_out[level].pow(2).mean().sqrt()
    return x_out[level].float().cpu(), rms.item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--amp", action="store_true")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--clip", type=float, default=100.0)
    p.add_argument("--spectral", type=float, default=0.0)
    p.add_argument("--commit", type=float, default=0.02)
    p.add_argument("--log-every", dest="log_every", type=int, default=100)
    args = p.parse_args()
    model = VQVAE().cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999), weight_decay=0.0)
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
    loader = []  # 3 s mono clips at 22 kHz, (B, 1, T)
    train(model, loader, optimizer, scaler, args)


if __name__ == "__main__":
    main()
