"""Glow-style normalizing flow (affine couplings + invertible 1x1 convs,
multi-scale) for CIFAR-10 / CelebA-64 density estimation, reported in bits/dim."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

LOG_2PI = math.log(2 * math.pi)


def preprocess(x, n_bits=8):
    n_bins = 2 ** n_bits
    x = torch.floor(x * 255 / 2 ** (8 - n_bits))
    x = x / n_bins - 0.5
    return x + torch.rand_like(x) / n_bins


def squeeze2d(x):
    b, c, h, w = x.shape
    x = x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return x.reshape(b, c * 4, h // 2, w // 2)


def unsqueeze2d(x):
    b, c, h, w = x.shape
    x = x.view(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
    return x.reshape(b, c // 4, h * 2, w * 2)


def standard_normal_logprob(z):
    return -0.5 * (LOG_2PI + z.pow(2)).flatten(1).sum(-1)


class ActNormHidden(nn.Module):
    """ActNorm with data-dependent init, used inside the coupling networks."""

    def __init__(self, channels):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(1, channels, 1, 1))
        self.scale = nn.Parameter(torch.ones(1, channels, 1, 1))
        self.register_buffer("initialized", torch.tensor(0, dtype=torch.uint8))

    def initialize(self, x):
        with torch.no_grad():
            mean = x.mean(dim=(0, 2, 3), keepdim=True)  # expect: AMP004
            std = x.std(dim=(0, 2, 3), keepdim=True)  # expect: AMP004
            self.bias.data.copy_(-mean)
            self.scale.data.copy_(1.0 / (std + 1e-8))  # expect: AMP011
            self.initialized.fill_(1)

    def forward(self, x):
        if self.initialized.item() == 0:
            self.initialize(x)
        return (x + self.bias) * self.scale


class CouplingNN(nn.Module):
    def __init__(self, in_ch, hidden, out_ch):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(in_ch, hidden, 3, padding=1),
            ActNormHidden(hidden),
            nn.ReLU(inplace=True),
            nn.Conv2d(hidden, hidden, 1),
            ActNormHidden(hidden),
            nn.ReLU(inplace=True),
            nn.Conv2d(hidden, out_ch, 3, padding=1),
        )
        nn.init.zeros_(self.net[-1].weight)
        nn.init.zeros_(self.net[-1].bias)

    def forward(self, x):
        return self.net(x)


class AffineCoupling(nn.Module):
    def __init__(self, channels, hidden):
        super().__init__()
        self.nn = CouplingNN(channels // 2, hidden, channels)

    def forward(self, x):
        x_a, x_b = x.chunk(2, dim=1)
        h = self.nn(x_a)
        shift = h[:, 0::2]
        scale = torch.sigmoid(h[:, 1::2] + 2.0)
        z_b = (x_b + shift) * scale
        logdet = torch.log(scale + 1e-10).flatten(1).sum(-1)  # expect: AMP011
        return torch.cat([x_a, z_b], dim=1), logdet

    def inverse(self, z):
        z_a, z_b = z.chunk(2, dim=1)
        h = self.nn(z_a)
        shift = h[:, 0::2]
        scale = torch.sigmoid(h[:, 1::2] + 2.0)
        return torch.cat([z_a, z_b / scale - shift], dim=1)


class InvConv1x1(nn.Module):
    def __init__(self, channels):
        super().__init__()
        w = torch.linalg.qr(torch.randn(channels, channels))[0]
        self.weight = nn.Parameter(w)

    def forward(self, x):
        logdet = x.size(2) * x.size(3) * torch.slogdet(self.weight)[1]
        return F.conv2d(x, self.weight[:, :, None, None]), logdet

    def inverse(self, z):
        return F.conv2d(z, torch.inverse(self.weight)[:, :, None, None])


class FlowStep(nn.Module):
    def __init__(self, channels, hidden):
        super().__init__()
        self.invconv = InvConv1x1(channels)
        self.coupling = AffineCoupling(channels, hidden)

    def forward(self, x):
        x, ld1 = self.invconv(x)
        x, ld2 = self.coupling(x)
        return x, ld1 + ld2

    def inverse(self, z):
        return self.invconv.inverse(self.coupling.inverse(z))


class Glow(nn.Module):
    def __init__(self, in_ch=3, hidden=512, levels=3, depth=16):
        super().__init__()
        self.n_levels, self.depth = levels, depth
        steps, ch = [], in_ch
        for _ in range(levels):
            ch *= 4
            steps.extend(FlowStep(ch, hidden) for _ in range(depth))
            ch //= 2
        self.steps = nn.ModuleList(steps)

    def forward(self, x):
        logdet = torch.zeros(x.size(0), device=x.device)
        log_pz = torch.zeros(x.size(0), device=x.device)
        for i in range(self.n_levels):
            x = squeeze2d(x)
            for step in self.steps[i * self.depth:(i + 1) * self.depth]:
                x, ld = step(x)
                logdet = logdet + ld
            if i < self.n_levels - 1:
                x, z = x.chunk(2, dim=1)
                log_pz = log_pz + standard_normal_logprob(z)
        return log_pz + standard_normal_logprob(x), logdet

    def inverse(self, zs):
        x = zs[-1]
        for i in reversed(range(self.n_levels)):
            if i < self.n_levels - 1:
                x = torch.cat([x, zs[i]], dim=1)
            for step in reversed(self.steps[i * self.depth:(i + 1) * self.depth]):
                x = step.inverse(x)
            x = unsqueeze2d(x)
        return x


def bits_per_dim(log_pz, logdet, n_dims, n_bits):
    nll = -(log_pz + logdet) + n_dims * math.log(2 ** n_bits)
    return (nll / (n_dims * math.log(2.0))).mean()


@torch.no_grad()
def sample(model, shapes, temperature=0.7, device="cuda"):
    model.eval()
    zs = [torch.randn(s, device=device) * temperature for s in shapes]
    return model.inverse(zs).clamp(-0.5, 0.5) + 0.5


def train(args, loader, init_batch):
    model = Glow(hidden=args.hidden, levels=args.levels, depth=args.depth).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 10)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        model(preprocess(init_batch.cuda(), args.n_bits))
    for step, (x, _) in enumerate(loader):
        x = preprocess(x.cuda(non_blocking=True), args.n_bits)
        for group in optimizer.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / args.warmup)
        with torch.autocast("cuda", dtype=torch.float16):
            log_pz, logdet = model(x)
            loss = bits_per_dim(log_pz, logdet, x[0].numel(), args.n_bits)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        optimizer.step()  # expect: AMP006
        if step % 100 == 0:
            print(f"step {step} bpd {loss.item():.3f}")
    return model


def finetune(model, loader, steps, lr, n_bits=5):
    optimizer = torch.optim.Adamax(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cuda")
    data = iter(loader)
    for step in range(steps):
        x = preprocess(next(data)[0].cuda(non_blocking=True), n_bits)
        with torch.autocast("cuda", dtype=torch.float16):
            log_pz, logdet = model(x)
            loss = bits_per_dim(log_pz, logdet, x[0].numel(), n_bits)
            scaler.scale(loss).backward()  # expect: AMP008
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 50.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return model
