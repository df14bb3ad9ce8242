"""PixelCNN++ with a causal self-attention block: weight-normalised shifted convolutions,
gated resnets, discretized logistic mixture likelihood, fp16 training."""
import copy
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def concat_elu(x):
    return F.elu(torch.cat([x, -x], dim=1))


def down_shift(x):
    return F.pad(x, (0, 0, 1, 0))[:, :, :-1, :]


def right_shift(x):
    return F.pad(x, (1, 0, 0, 0))[:, :, :, :-1]


class WNConv2d(nn.Module):
    """Weight-normalised convolution with the data-dependent initialisation of PixelCNN++."""

    def __init__(self, c_in, c_out, kernel_size, pad=(0, 0, 0, 0), init_scale=0.1):
        super().__init__()
        self.v = nn.Parameter(torch.randn(c_out, c_in, *kernel_size) * 0.05)
        self.g = nn.Parameter(torch.ones(c_out))
        self.b = nn.Parameter(torch.zeros(c_out))
        self.pad = pad
        self.init_scale = init_scale
        self.register_buffer("initialized", torch.tensor(False))

    def weight(self):
        v_norm = self.v / (self.v.norm(dim=(1, 2, 3), keepdim=True) + 1e-12)
        return v_norm * self.g.view(-1, 1, 1, 1)

    @torch.no_grad()
    def data_init(self, x):
        v_norm = self.v / self.v.norm(dim=(1, 2, 3), keepdim=True)
        t = F.conv2d(F.pad(x, self.pad), v_norm)
        m_init = t.mean(dim=(0, 2, 3))  # expect: AMP004
        v_init = t.var(dim=(0, 2, 3))  # expect: AMP004
        scale_init = self.init_scale / torch.sqrt(v_init + 1e-10)  # expect: AMP011
        self.g.copy_(scale_init)
        self.b.copy_(-m_init * scale_init)
        self.initialized.fill_(True)

    def forward(self, x):
        if self.training and not bool(self.initialized):
            self.data_init(x)
        return F.conv2d(F.pad(x, self.pad), self.weight(), self.b)


def down_conv(c_in, c_out, k=(2, 3)):
    return WNConv2d(c_in, c_out, k, pad=((k[1] - 1) // 2, (k[1] - 1) // 2, k[0] - 1, 0))


def down_right_conv(c_in, c_out, k=(2, 2)):
    return WNConv2d(c_in, c_out, k, pad=(k[1] - 1, 0, k[0] - 1, 0))


class GatedResNet(nn.Module):
    def __init__(self, ch, conv_fn, n_skip=0, dropout=0.5):
        super().__init__()
        self.conv_input = conv_fn(2 * ch, ch)
        self.nin_skip = nn.Conv2d(2 * n_skip * ch, ch, 1) if n_skip else None
        self.dropout = nn.Dropout2d(dropout)
        self.conv_out = conv_fn(2 * ch, 2 * ch)

    def forward(self, og_x, a=None):
        x = self.conv_input(concat_elu(og_x))
        if a is not None:
            x = x + self.nin_skip(concat_elu(a))
        x = self.conv_out(self.dropout(concat_elu(x)))
        a, b = torch.chunk(x, 2, dim=1)
        return og_x + a * torch.sigmoid(b)


class CausalAttention(nn.Module):
    """PixelSNAIL-style attention over strictly earlier pixels in raster order."""

    def __init__(self, ch, key_ch=16, value_ch=64):
        super().__init__()
        self.query = nn.Conv2d(ch, key_ch, 1)
        self.key = nn.Conv2d(ch, key_ch, 1)
        self.value = nn.Conv2d(ch, value_ch, 1)
        self.proj = nn.Conv2d(value_ch, ch, 1)

    def forward(self, x):
        b, _, h, w = x.shape
        q = self.query(x).flatten(2).transpose(1, 2)
        k = self.key(x).flatten(2)
        v = self.value(x).flatten(2).transpose(1, 2)
        scores = torch.bmm(q, k) / math.sqrt(q.size(-1))
        causal = torch.ones(h * w, h * w, dtype=torch.bool, device=x.device).tril(-1)
        scores = scores.masked_fill(~causal, -1e10)  # expect: AMP007
        start = causal.any(dim=-1, keepdim=True)
        attn = torch.softmax(scores, dim=-1) * start
        out = torch.bmm(attn, v).transpose(1, 2).reshape(b, -1, h, w)
        return x + self.proj(out)


class PixelCNNpp(nn.Module):
    def __init__(self, ch=80, nr_resnet=3, nr_mix=10, in_ch=3):
        super().__init__()
        self.u_init = down_conv(in_ch + 1, ch, (2, 3))
        self.ul_init = nn.ModuleList([down_conv(in_ch + 1, ch, (1, 3)), down_right_conv(in_ch + 1, ch, (2, 1))])
        self.up_u = nn.ModuleList([nn.ModuleList([GatedResNet(ch, down_conv) for _ in range(nr_resnet)])
                                   for _ in range(3)])
        self.up_ul = nn.ModuleList([nn.ModuleList([GatedResNet(ch, down_right_conv, 1) for _ in range(nr_resnet)])
                                    for _ in range(3)])
        self.downsize_u = nn.ModuleList([nn.Conv2d(ch, ch, 3, stride=2, padding=1) for _ in range(2)])
        self.downsize_ul = nn.ModuleList([nn.Conv2d(ch, ch, 3, stride=2, padding=1) for _ in range(2)])
        self.attention = CausalAttention(ch)
        down_nr = (nr_resnet, nr_resnet + 1, nr_resnet + 1)
        self.down_u = nn.ModuleList([nn.ModuleList([GatedResNet(ch, down_conv, 1) for _ in range(n)])
                                     for n in down_nr])
        self.down_ul = nn.ModuleList([nn.ModuleList([GatedResNet(ch, down_right_conv, 2) for _ in range(n)])
                                      for n in down_nr])
        self.upsize_u = nn.ModuleList([nn.ConvTranspose2d(ch, ch, 4, stride=2, padding=1) for _ in range(2)])
        self.upsize_ul = nn.ModuleList([nn.ConvTranspose2d(ch, ch, 4, stride=2, padding=1) for _ in range(2)])
        self.nin_out = nn.Conv2d(ch, 10 * nr_mix, 1)

    def forward(self, x):
        x = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
        u_list = [down_shift(self.u_init(x))]
        ul_list = [down_shift(self.ul_init[0](x)) + right_shift(self.ul_init[1](x))]
        for i in range(3):
            for u_block, ul_block in zip(self.up_u[i], self.up_ul[i]):
                u_list.append(u_block(u_list[-1]))
                ul_list.append(ul_block(ul_list[-1], a=u_list[-1]))
            if i < 2:
                u_list.append(self.downsize_u[i](u_list[-1]))
                ul_list.append(self.downsize_ul[i](ul_list[-1]))
        u, ul = u_list.pop(), self.attention(ul_list.pop())
        for i in range(3):
            for u_block, ul_block in zip(self.down_u[i], self.down_ul[i]):
                u = u_block(u, a=u_list.pop())
                ul = ul_block(ul, a=torch.cat([u, ul_list.pop()], dim=1))
            if i < 2:
                u, ul = self.upsize_u[i](u), self.upsize_ul[i](ul)
        return self.nin_out(F.elu(ul))


def log_sum_exp(x):
    m, _ = torch.max(x, dim=-1)
    m2, _ = torch.max(x, dim=-1, keepdim=True)
    return m + torch.log(torch.sum(torch.exp(x - m2), dim=-1))


def log_prob_from_logits(x):
    m, _ = torch.max(x, dim=-1, keepdim=True)
    return x - m - torch.log(torch.sum(torch.exp(x - m), dim=-1, keepdim=True))


def discretized_mix_logistic_loss(x, l):
    x, l = x.permute(0, 2, 3, 1), l.permute(0, 2, 3, 1)
    xs, ls = [int(y) for y in x.size()], [int(y) for y in l.size()]
    nr_mix = ls[-1] // 10
    logit_probs = l[:, :, :, :nr_mix]
    l = l[:, :, :, nr_mix:].contiguous().view(xs + [nr_mix * 3])
    means = l[:, :, :, :, :nr_mix]
    log_scales = torch.clamp(l[:, :, :, :, nr_mix:2 * nr_mix], min=-7.0)
    coeffs = torch.tanh(l[:, :, :, :, 2 * nr_mix:3 * nr_mix])
    x = x.contiguous().unsqueeze(-1) + torch.zeros(xs + [nr_mix], device=x.device)
    m2 = (means[:, :, :, 1, :] + coeffs[:, :, :, 0, :] * x[:, :, :, 0, :]).view(xs[0], xs[1], xs[2], 1, nr_mix)
    m3 = (means[:, :, :, 2, :] + coeffs[:, :, :, 1, :] * x[:, :, :, 0, :]
          + coeffs[:, :, :, 2, :] * x[:, :, :, 1, :]).view(xs[0], xs[1], xs[2], 1, nr_mix)
    means = torch.cat((means[:, :, :, 0:1, :], m2, m3), dim=3)
    centered_x = x - means
    inv_stdv = torch.exp(-log_scales)
    cdf_plus = torch.sigmoid(inv_stdv * (centered_x + 1.0 / 255.0))
    cdf_min = torch.sigmoid(inv_stdv * (centered_x - 1.0 / 255.0))
    cdf_delta = cdf_plus - cdf_min
    log_cdf_plus = inv_stdv * (centered_x + 1.0 / 255.0) - F.softplus(inv_stdv * (centered_x + 1.0 / 255.0))
    log_one_minus_cdf_min = -F.softplus(inv_stdv * (centered_x - 1.0 / 255.0))
    mid_in = inv_stdv * centered_x
    log_pdf_mid = mid_in - log_scales - 2.0 * F.softplus(mid_in)
    inner = torch.where(cdf_delta > 1e-5, torch.log(torch.clamp(cdf_delta, min=1e-12)),
                        log_pdf_mid - np.log(127.5))
    inner = torch.where(x > 0.999, log_one_minus_cdf_min, inner)
    log_probs = torch.where(x < -0.999, log_cdf_plus, inner)
    log_probs = torch.sum(log_probs, dim=3) + log_prob_from_logits(logit_probs)
    return -torch.sum(log_sum_exp(log_probs))


def export_half(model, path):
    torch.save(copy.deepcopy(model).half().state_dict(), path)


def train(model, loader, epochs, lr=2e-4, device="cuda", grad_clip=1.0):
    model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.95, 0.9995))
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.999995)
    scaler = torch.cuda.amp.GradScaler()  # expect: AMP009
    for epoch in range(epochs):
        model.train()
        bits = []
        for x, _ in loader:
            x = x.to(device, non_blocking=True) * 2.0 - 1.0
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(x)
                loss = discretized_mix_logistic_loss(x, out)
                bpd = loss / (math.log(2.0) * x.numel())
                scaler.scale(bpd).backward()  # expect: AMP008
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            bits.append(bpd.item())
        print(f"epoch {epoch}: {sum(bits) / len(bits):.4f} bits/dim")
        export_half(model, f"pixelcnnpp_e{epoch}_fp16.pt")
