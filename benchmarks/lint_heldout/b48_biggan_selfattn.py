"""BigGAN-style class-conditional GAN at 64x64 (Brock et al., 2019), after ajbrock/BigGAN-PyTorch:
own spectral norm, class-conditional BatchNorm, SAGAN self-attention, hinge loss, G EMA,
plus an optional mode-seeking regulariser (Mao et al., 2019).
"""
import argparse
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F


class SN:
    def _init_sn(self, num_outputs):
        self.register_buffer("u", F.normalize(torch.randn(num_outputs), dim=0))

    def W_(self):
        W = self.weight.view(self.weight.size(0), -1)
        with torch.no_grad():
            v = F.normalize(torch.mv(W.t(), self.u), dim=0, eps=1e-12)
            u = F.normalize(torch.mv(W, v), dim=0, eps=1e-12)
            if self.training:
                self.u.copy_(u)
        sigma = (u * torch.mv(W, v)).sum()
        return self.weight / sigma


class SNConv2d(nn.Conv2d, SN):
    def __init__(self, *args, **kwargs):
        nn.Conv2d.__init__(self, *args, **kwargs)
        self._init_sn(self.out_channels)

    def forward(self, x):
        return F.conv2d(x, self.W_(), self.bias, self.stride, self.padding)


class SNLinear(nn.Linear, SN):
    def __init__(self, *args, **kwargs):
        nn.Linear.__init__(self, *args, **kwargs)
        self._init_sn(self.out_features)

    def forward(self, x):
        return F.linear(x, self.W_(), self.bias)


class ccbn(nn.Module):
    """Class-conditional BatchNorm; statistics are taken in fp32 as in BigGAN-PyTorch's manual_bn."""

    def __init__(self, output_size, input_size, eps=1e-5, momentum=0.1):
        super().__init__()
        self.gain, self.bias = SNLinear(input_size, output_size), SNLinear(input_size, output_size)
        self.eps, self.momentum = eps, momentum
        self.register_buffer("stored_mean", torch.zeros(output_size))
        self.register_buffer("stored_var", torch.ones(output_size))

    def forward(self, x, y):
        gain = (1 + self.gain(y)).view(y.size(0), -1, 1, 1)
        bias = self.bias(y).view(y.size(0), -1, 1, 1)
        if not self.training:
            out = F.batch_norm(x, self.stored_mean, self.stored_var, None, None, False, 0.0, self.eps)
            return out * gain + bias
        float_x = x.float()
        m = torch.mean(float_x, [0, 2, 3], keepdim=True)
        m2 = torch.mean(float_x ** 2, [0, 2, 3], keepdim=True)
        var = (m2 - m ** 2).to(x.dtype)
        m = m.to(x.dtype)
        with torch.no_grad():
            self.stored_mean.lerp_(m.flatten().float(), self.momentum)
            self.stored_var.lerp_(var.flatten().float(), self.momentum)
        return (x - m) * torch.rsqrt(var + self.eps) * gain + bias


class SelfAttention(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.ch = ch
        self.theta = SNConv2d(ch, ch // 8, 1, bias=False)
        self.phi = SNConv2d(ch, ch // 8, 1, bias=False)
        self.g = SNConv2d(ch, ch // 2, 1, bias=False)
        self.o = SNConv2d(ch // 2, ch, 1, bias=False)
        self.gamma = nn.Parameter(torch.tensor(0.0))

    def forward(self, x):
        n, _, h, w = x.shape
        theta = self.theta(x).view(n, self.ch // 8, h * w)
        phi = F.max_pool2d(self.phi(x), 2).view(n, self.ch // 8, h * w // 4)
        g = F.max_pool2d(self.g(x), 2).view(n, self.ch // 2, h * w // 4)
        beta = F.softmax(torch.bmm(theta.transpose(1, 2), phi), -1)
        o = self.o(torch.bmm(g, beta.transpose(1, 2)).view(n, self.ch // 2, h, w))
        return x + self.gamma * o


class GBlock(nn.Module):
    def __init__(self, in_ch, out_ch, cond_dim):
        super().__init__()
        self.bn1, self.bn2 = ccbn(in_ch, cond_dim), ccbn(out_ch, cond_dim)
        self.conv1 = SNConv2d(in_ch, out_ch, 3, padding=1)
        self.conv2 = SNConv2d(out_ch, out_ch, 3, padding=1)
        self.conv_sc = SNConv2d(in_ch, out_ch, 1)

    def forward(self, x, y):
        h = F.interpolate(F.relu(self.bn1(x, y)), scale_factor=2)
        h = self.conv2(F.relu(self.bn2(self.conv1(h), y)))
        return h + self.conv_sc(F.interpolate(x, scale_factor=2))


class Generator(nn.Module):
    def __init__(self, z_dim=120, shared_dim=128, ch=64, n_classes=1000):
        super().__init__()
        chs = [16 * ch, 8 * ch, 4 * ch, 2 * ch, ch]
        self.z_chunk = z_dim // len(chs)
        self.shared = nn.Embedding(n_classes, shared_dim)
        self.linear = SNLinear(self.z_chunk, chs[0] * 4 * 4)
        cond = shared_dim + self.z_chunk
        self.blocks = nn.ModuleList(GBlock(chs[i], chs[i + 1], cond) for i in range(len(chs) - 1))
        self.attn = SelfAttention(chs[-2])
        self.output_layer = nn.Sequential(nn.BatchNorm2d(ch), nn.ReLU(), SNConv2d(ch, 3, 3, padding=1))

    def forward(self, z, y):
        zs = torch.split(z, self.z_chunk, 1)
        y = self.shared(y)
        ys = [torch.cat([y, item], 1) for item in zs[1:]]
        h = self.linear(zs[0]).view(z.size(0), -1, 4, 4)
        for i, block in enumerate(self.blocks):
            h = block(h, ys[i])
            if i == len(self.blocks) - 2:
                h = self.attn(h)
        return torch.tanh(self.output_layer(h))


class Discriminator(nn.Module):
    def __init__(self, ch=64):
        super().__init__()
        chs = [3, ch, 2 * ch, 4 * ch, 8 * ch, 16 * ch]
        self.blocks = nn.ModuleList(
            nn.Sequential(SNConv2d(chs[i], chs[i + 1], 3, padding=1), nn.ReLU(),
                          SNConv2d(chs[i + 1], chs[i + 1], 3, padding=1), nn.AvgPool2d(2))
            for i in range(len(chs) - 1))
        self.attn = SelfAttention(2 * ch)
        self.linear = SNLinear(16 * ch, 1)

    def forward(self, x):
        h = x
        for i, block in enumerate(self.blocks):
            h = block(h)
            if i == 1:
                h = self.attn(h)
        h = torch.sum(F.relu(h), [2, 3])
        return self.linear(h)


def loss_hinge_dis(dis_fake, dis_real):
    loss_real = torch.mean(F.relu(1.0 - dis_real))  # expect: AMP004
    loss_fake = torch.mean(F.relu(1.0 + dis_fake))  # expect: AMP004
    return loss_real, loss_fake


def loss_hinge_gen(dis_fake):
    return -torch.mean(dis_fake)  # expect: AMP004


def train(args):
    device = torch.device("cuda")
    G, D = Generator(n_classes=args.n_classes).to(device), Discriminator().to(device)
    G_ema = copy.deepcopy(G).eval().requires_grad_(False)
    opt_g = torch.optim.Adam(G.parameters(), lr=args.g_lr, betas=(0.0, 0.999), eps=1e-6)
    opt_d = torch.optim.Adam(D.parameters(), lr=args.d_lr, betas=(0.0, 0.999), eps=1e-6)
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
    loader = []  # ImageNet 64x64 (x, y) batches
    for it, (x, y) in enumerate(loader):
        x, y = x.to(device), y.to(device)
        z = torch.randn(x.size(0), 120, device=device)
        y_fake = torch.randint(0, args.n_classes, (x.size(0),), device=device)
        with torch.cuda.amp.autocast(enabled=args.amp):  # expect: AMP009
            with torch.no_grad():
                fake = G(z, y_fake)
            d_real, d_fake = D(x), D(fake)
            loss_real, loss_fake = loss_hinge_dis(d_fake, d_real)
            d_loss = loss_real + loss_fake
        opt_d.zero_grad(set_to_none=True)
        scaler.scale(d_loss).backward()
        scaler.step(opt_d)

        opt_g.zero_grad(set_to_none=True)
        with torch.cuda.amp.autocast(enabled=args.amp):  # expect: AMP009
            fake = G(z, y_fake)
            g_loss = loss_hinge_gen(D(fake))
            if args.ms_weight > 0:
                z2 = torch.randn_like(z)
                fake2 = G(z2, y_fake)
                lz = torch.mean(torch.abs(fake2 - fake)) / torch.mean(torch.abs(z2 - z))  # expect: AMP004
                g_loss = g_loss + args.ms_weight / (lz + 1e-5)
        scaler.scale(g_loss).backward()
        opt_g.step()  # expect: AMP006
        scaler.update()

        with torch.no_grad():
            for p_ema, p in zip(G_ema.parameters(), G.parameters()):
                p_ema.lerp_(p, 1.0 - args.ema_decay)
        if it % 500 == 0:
            print(f"it {it} D {d_loss.item():.3f} G {g_loss.item():.3f} scale {scaler.get_scale():.0f}")


@torch.no_grad()
def sample_sheet(G_ema, n_classes, device, per_class=8, truncation=0.5):
    y = torch.arange(n_classes, device=device).repeat_interleave(per_class)
    z = torch.randn(y.numel(), 120, device=device).clamp_(-2 * truncation, 2 * truncation)
    imgs = G_ema(z, y)
    return (imgs + 1) / 2, imgs.mean().item()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--amp", action="store_true")
    p.add_argument("--n-classes", dest="n_classes", type=int, default=1000)
    p.add_argument("--g-lr", dest="g_lr", type=float, default=1e-4)
    p.add_argument("--d-lr", dest="d_lr", type=float, default=4e-4)
    p.add_argument("--ema-decay", dest="ema_decay", type=float, default=0.9999)
    p.add_argument("--ms-weight", dest="ms_weight", type=float, default=0.0)
    train(p.parse_args())
