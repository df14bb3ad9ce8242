"""PixelCNN++ (Salimans et al., 2017) on CIFAR-10.

Single-resolution variant: up/down passes of gated resnets over down- and down-right
shifted convolutions, weight-normalised layers with data-dependent initialisation on the
first training batch, discretized logistic mixture likelihood, Polyak averaging, fp16 AMP.
"""
import argparse
import copy
import os
from functools import partial

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.utils.data import DataLoader


def concat_elu(x):
    return F.elu(torch.cat([x, -x], dim=1))


def log_sum_exp(x):
    axis = x.dim() - 1
    m, _ = torch.max(x, dim=axis)
    m2, _ = torch.max(x, dim=axis, keepdim=True)
    return m + torch.log(torch.sum(torch.exp(x - m2), dim=axis))


def log_prob_from_logits(x):
    axis = x.dim() - 1
    m, _ = torch.max(x, dim=axis, keepdim=True)
    return x - m - torch.log(torch.sum(torch.exp(x - m), dim=axis, keepdim=True))


class WNConv2d(nn.Module):
    """Weight-normalised conv whose g and b are set from the first batch it sees."""

    def __init__(self, cin, cout, kernel_size, stride=1, init_scale=1.0):
        super().__init__()
        self.v = nn.Parameter(torch.randn(cout, cin, *kernel_size) * 0.05)
        self.g = nn.Parameter(torch.ones(cout))
        self.b = nn.Parameter(torch.zeros(cout))
        self.stride, self.init_scale = stride, init_scale
        self.register_buffer("initialized", torch.tensor(0, dtype=torch.uint8))

    def _direction(self):
        norm = self.v.flatten(1).norm(dim=1).view(-1, 1, 1, 1)
        return self.v / (norm + 1e-8)

    @torch.no_grad()
    def _data_init(self, x):
        t = F.conv2d(x, self._direction(), None, self.stride)
        m_init = t.mean(dim=(0, 2, 3))  # expect: AMP004
        v_init = t.var(dim=(0, 2, 3))  # expect: AMP004
        scale_init = self.init_scale / torch.sqrt(v_init + 1e-10)  # expect: AMP011
        self.g.data.copy_(scale_init)
        self.b.data.copy_(-m_init * scale_init)
        self.initialized.fill_(1)

    def forward(self, x):
        if self.training and not self.initialized:
            self._data_init(x)
        weight = self.g.view(-1, 1, 1, 1) * self._direction()
        return F.conv2d(x, weight, self.b, self.stride)


def nin(cin, cout):
    return WNConv2d(cin, cout, (1, 1))


def down_shift(x):
    return F.pad(x[:, :, :-1, :], (0, 0, 1, 0))


def right_shift(x):
    return F.pad(x[:, :, :, :-1], (1, 0, 0, 0))


class ShiftedConv2d(nn.Module):
    """mode="down": sees rows above; mode="downright": sees rows above and columns to the left."""

    def __init__(self, cin, cout, filter_size=(2, 3), mode="down", shift_output=False):
        super().__init__()
        self.conv = WNConv2d(cin, cout, filter_size)
        fh, fw = filter_size
        if mode == "down":
            self.pad = ((fw - 1) // 2, (fw - 1) // 2, fh - 1, 0)
            self.shift = down_shift
        else:
            self.pad = (fw - 1, 0, fh - 1, 0)
            self.shift = right_shift
        self.shift_output = shift_output

    def forward(self, x):
        x = self.conv(F.pad(x, self.pad))
        return self.shift(x) if self.shift_output else x


class GatedResnet(nn.Module):
    def __init__(self, nf, conv_cls, skip_connection=0):
        super().__init__()
        self.conv_input = conv_cls(2 * nf, nf)
        self.nin_skip = nin(2 * skip_connection * nf, nf) if skip_connection else None
        self.dropout = nn.Dropout2d(0.5)
        self.conv_out = conv_cls(2 * nf, 2 * nf)

    def forward(self, og_x, a=None):
        x = self.conv_input(concat_elu(og_x))
        if a is not None:
            x = x + self.nin_skip(concat_elu(a))
        x = self.conv_out(self.dropout(concat_elu(x)))
        a, b = torch.chunk(x, 2, dim=1)
        return og_x + a * torch.sigmoid(b)


class PixelCNNpp(nn.Module):
    def __init__(self, nr_resnet=5, nr_filters=160, nr_logistic_mix=10, input_channels=3):
        super().__init__()
        down = partial(ShiftedConv2d, filter_size=(2, 3), mode="down")
        downright = partial(ShiftedConv2d, filter_size=(2, 2), mode="downright")
        self.u_init = ShiftedConv2d(input_channels + 1, nr_filters, (2, 3), "down", shift_output=True)
        self.ul_init = nn.ModuleList([
            ShiftedConv2d(input_channels + 1, nr_filters, (1, 3), "down", shift_output=True),
            ShiftedConv2d(input_channels + 1, nr_filters, (2, 1), "downright", shift_output=True),
        ])
        self.up_u = nn.ModuleList([GatedResnet(nr_filters, down) for _ in range(nr_resnet)])
        self.up_ul = nn.ModuleList([GatedResnet(nr_filters, downright, 1) for _ in range(nr_resnet)])
        self.down_u = nn.ModuleList([GatedResnet(nr_filters, down, 1) for _ in range(nr_resnet)])
        self.down_ul = nn.ModuleList([GatedResnet(nr_filters, downright, 2) for _ in range(nr_resnet)])
        num_mix = 3 if input_channels == 1 else 10
        self.nin_out = nin(nr_filters, num_mix * nr_logistic_mix)

    def forward(self, x):
        b, _, h, w = x.shape
        x = torch.cat((x, torch.ones(b, 1, h, w, device=x.device)), 1)
        u_list = [self.u_init(x)]
        ul_list = [self.ul_init[0](x) + self.ul_init[1](x)]
        for up_u, up_ul in zip(self.up_u, self.up_ul):
            u_list.append(up_u(u_list[-1]))
            ul_list.append(up_ul(ul_list[-1], a=u_list[-1]))
        u, ul = u_list.pop(), ul_list.pop()
        for down_u, down_ul in zip(self.down_u, self.down_ul):
            u = down_u(u, a=u_list.pop())
            ul = down_ul(ul, a=torch.cat((u, ul_list.pop()), 1))
        return self.nin_out(F.elu(ul))


def discretized_mix_logistic_loss(x, l):
    """Negative log-likelihood for data in [-1, 1] under a mixture of discretized logistics."""
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
    means = torch.cat((means[:, :, :, 0, :].unsqueeze(3), m2, m3), dim=3)
    centered_x = x - means
    inv_stdv = torch.exp(-log_scales)
    plus_in = inv_stdv * (centered_x + 1.0 / 255.0)
    min_in = inv_stdv * (centered_x - 1.0 / 255.0)
    cdf_delta = torch.sigmoid(plus_in) - torch.sigmoid(min_in)
    log_cdf_plus = plus_in - F.softplus(plus_in)
    log_one_minus_cdf_min = -F.softplus(min_in)
    mid_in = inv_stdv * centered_x
    log_pdf_mid = mid_in - log_scales - 2.0 * F.softplus(mid_in)
    inner_inner_cond = (cdf_delta > 1e-5).float()
    inner_inner_out = (inner_inner_cond * torch.log(torch.clamp(cdf_delta, min=1e-12))
                       + (1.0 - inner_inner_cond) * (log_pdf_mid - np.log(127.5)))
    inner_cond = (x > 0.999).float()
    inner_out = inner_cond * log_one_minus_cdf_min + (1.0 - inner_cond) * inner_inner_out
    cond = (x < -0.999).float()
    log_probs = cond * log_cdf_plus + (1.0 - cond) * inner_out
    log_probs = torch.sum(log_probs, dim=3) + log_prob_from_logits(logit_probs)
    return -torch.sum(log_sum_exp(log_probs))


@torch.no_grad()
def sample(model, n, image_shape, nr_mix):
    model.eval()
    data = torch.zeros(n, *image_shape, device="cuda")
    for i in range(image_shape[1]):
        for j in range(image_shape[2]):
            l = model(data).permute(0, 2, 3, 1)
            logit_probs, rest = l[:, i, j, :nr_mix], l[:, i, j, nr_mix:].view(n, 3, 3 * nr_mix)
            gumbel = -torch.log(-torch.log(torch.empty_like(logit_probs).uniform_(1e-5, 1.0 - 1e-5)))
            sel = F.one_hot((logit_probs + gumbel).argmax(dim=1), nr_mix).float().unsqueeze(1)
            means = (rest[:, :, :nr_mix] * sel).sum(dim=2)
            log_scales = torch.clamp((rest[:, :, nr_mix:2 * nr_mix] * sel).sum(dim=2), min=-7.0)
            coeffs = torch.tanh((rest[:, :, 2 * nr_mix:] * sel).sum(dim=2))
            u = torch.empty_like(means).uniform_(1e-5, 1.0 - 1e-5)
            x = means + torch.exp(log_scales) * (torch.log(u) - torch.log(1.0 - u))
            x0 = x[:, 0].clamp(-1, 1)
            x1 = (x[:, 1] + coeffs[:, 0] * x0).clamp(-1, 1)
            x2 = (x[:, 2] + coeffs[:, 1] * x0 + coeffs[:, 2] * x1).clamp(-1, 1)
            data[:, :, i, j] = torch.stack([x0, x1, x2], dim=1)
    model.train()
    return data


@torch.no_grad()
def polyak_update(ema_model, model, decay):
    for pe, p in zip(ema_model.parameters(), model.parameters()):
        pe.mul_(decay).add_(p, alpha=1.0 - decay)


@torch.no_grad()
def test(model, loader):
    model.eval()
    total, count = 0.0, 0
    for x, _ in loader:
        x = x.cuda(non_blocking=True)
        total += discretized_mix_logistic_loss(x, model(x)).item()
        count += x.numel()
    model.train()
    return total / (count * np.log(2.0))


def train(args):
    rescale = T.Lambda(lambda x: (x - 0.5) * 2.0)
    tf = T.Compose([T.ToTensor(), rescale])
    train_loader = DataLoader(torchvision.datasets.CIFAR10(args.data_dir, train=True, download=True, transform=tf),
                              batch_size=args.batch_size, shuffle=True, num_workers=4, drop_last=True, pin_memory=True)
    test_loader = DataLoader(torchvision.datasets.CIFAR10(args.data_dir, train=False, transform=tf),
                             batch_size=args.batch_size, num_workers=4)

    model = PixelCNNpp(args.nr_resnet, args.nr_filters, args.nr_logistic_mix).cuda()
    ema = copy.deepcopy(model).requires_grad_(False)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=args.lr_decay)
    scaler = torch.cuda.amp.GradScaler()  # expect: AMP009

    for epoch in range(args.max_epochs):
        model.train()
        running = 0.0
        for step, (x, _) in enumerate(train_loader):
            x = x.cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                output = model(x)
                loss = discretized_mix_logistic_loss(x, output)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            scaler.step(optimizer)
            scaler.update()
            polyak_update(ema, model, args.polyak_decay)
            running += loss.item()
            if (step + 1) % args.print_every == 0:
                bpd = running / (args.print_every * np.log(2.0) * np.prod(x.shape))
                print(f"epoch {epoch} step {step + 1} train bpd {bpd:.4f}")
                running = 0.0
        scheduler.step()
        print(f"epoch {epoch} test bpd {test(ema, test_loader):.4f}")
        if (epoch + 1) % args.save_interval == 0:
            torch.save({"model": model.state_dict(), "ema": ema.state_dict()},
                       os.path.join(args.save_dir, f"pcnn_{epoch}.pth"))
            samples = sample(ema, 25, (3, 32, 32), args.nr_logistic_mix)
            torchvision.utils.save_image(samples * 0.5 + 0.5, os.path.join(args.save_dir, f"sample_{epoch}.png"), nrow=5)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_dir", default="data")
    parser.add_argument("--save_dir", default="models")
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--nr_resnet", type=int, default=5)
    parser.add_argument("--nr_filters", type=int, default=160)
    parser.add_argument("--nr_logistic_mix", type=int, default=10)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--lr_decay", type=float, default=0.999995)
    parser.add_argument("--grad_clip", type=float, default=100.0)
    parser.add_argument("--polyak_decay", type=float, default=0.9995)
    parser.add_argument("--max_epochs", type=int, default=5000)
    parser.add_argument("--print_every", type=int, default=100)
    parser.add_argument("--save_interval", type=int, default=10)
    train(parser.parse_args())
