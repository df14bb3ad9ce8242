"""VAE-GAN (Larsen et al., 2016) on 64x64 faces.

The discriminator's intermediate feature map defines the learned reconstruction loss; its
head sees a minibatch-stddev channel (ProGAN) to discourage mode collapse. The decoder uses
pixel-wise feature normalisation.
"""
import argparse
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision import datasets, transforms
from torchvision.utils import save_image

adversarial_loss = nn.BCELoss()


@dataclass
class DiscOutput:
    prob: torch.Tensor
    feat: torch.Tensor


class PixelNorm(nn.Module):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(dim=1, keepdim=True) + 1e-8)


class MinibatchStdDev(nn.Module):
    def __init__(self, group_size=4):
        super().__init__()
        self.group_size = group_size

    def forward(self, x):
        b, c, h, w = x.shape
        g = min(self.group_size, b)
        y = x.view(g, -1, c, h, w)
        y = torch.sqrt(y.var(dim=0, unbiased=False) + 1e-8)  # expect: AMP004, AMP011
        y = y.mean(dim=(1, 2, 3), keepdim=True)  # expect: AMP004
        y = y.repeat(g, 1, h, w)
        return torch.cat([x, y], dim=1)


class Encoder(nn.Module):
    def __init__(self, channels=3, base=64, z_dim=128):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(channels, base, 5, 2, 2), nn.BatchNorm2d(base), nn.ReLU(True),
            nn.Conv2d(base, base * 2, 5, 2, 2), nn.BatchNorm2d(base * 2), nn.ReLU(True),
            nn.Conv2d(base * 2, base * 4, 5, 2, 2), nn.BatchNorm2d(base * 4), nn.ReLU(True),
            nn.Flatten(),
        )
        self.fc = nn.Linear(base * 4 * 8 * 8, 2 * z_dim)

    def forward(self, x):
        mu, logvar = self.fc(self.net(x)).chunk(2, dim=-1)
        return mu, logvar.clamp(-30.0, 20.0)


def up_block(cin, cout):
    return [nn.ConvTranspose2d(cin, cout, 4, 2, 1), PixelNorm(), nn.LeakyReLU(0.2)]


class Decoder(nn.Module):
    def __init__(self, z_dim=128, base=64, channels=3):
        super().__init__()
        self.base = base
        self.fc = nn.Linear(z_dim, base * 4 * 8 * 8)
        self.net = nn.Sequential(*up_block(base * 4, base * 2), *up_block(base * 2, base),
                                 nn.ConvTranspose2d(base, channels, 4, 2, 1), nn.Tanh())

    def forward(self, z):
        return self.net(self.fc(z).view(-1, self.base * 4, 8, 8))


class Discriminator(nn.Module):
    def __init__(self, channels=3, base=64, act="LeakyReLU"):
        super().__init__()
        act_layer = getattr(nn, act)
        self.features = nn.Sequential(
            nn.Conv2d(channels, base, 4, 2, 1), act_layer(0.2),
            nn.Conv2d(base, base * 2, 4, 2, 1), act_layer(0.2),
            nn.Conv2d(base * 2, base * 4, 4, 2, 1), act_layer(0.2),
        )
        self.feat_conv = nn.Conv2d(base * 4, base * 4, 3, 1, 1)
        self.mbstd = MinibatchStdDev()
        self.head = nn.Sequential(nn.Flatten(), nn.Linear((base * 4 + 1) * 8 * 8, 1))

    def forward(self, x):
        feat = self.feat_conv(self.features(x))
        logit = self.head(self.mbstd(feat))
        return DiscOutput(prob=torch.sigmoid(logit), feat=feat)


class VAEGAN(nn.Module):
    def __init__(self, z_dim=128, d_act="LeakyReLU"):
        super().__init__()
        self.encoder = Encoder(z_dim=z_dim)
        self.decoder = Decoder(z_dim=z_dim)
        self.discriminator = Discriminator(act=d_act)

    @staticmethod
    def reparameterize(mu, logvar):
        std = torch.exp(0.5 * logvar)
        return mu + torch.randn_like(std) * std

    def forward(self, x):
        mu, logvar = self.encoder(x)
        return self.decoder(self.reparameterize(mu, logvar)), mu, logvar


def kl_divergence(mu, logvar):
    return -0.5 * torch.mean(torch.sum(1 + logvar - mu.pow(2) - logvar.exp(), dim=1))


def train_step(model, x, opt_enc, opt_dec, opt_dis, scaler, cfg):
    # 1) discriminator: real vs. reconstructions and prior samples
    with torch.autocast("cuda", dtype=torch.float16):
        x_rec, mu, logvar = model(x)
        x_p = model.decoder(torch.randn_like(mu))
        d_real = model.discriminator(x)
        d_fake = model.discriminator(torch.cat([x_rec, x_p]).detach())
        loss_real = adversarial_loss(d_real.prob, torch.ones_like(d_real.prob))  # expect: AMP003
        loss_fake = adversarial_loss(d_fake.prob, torch.zeros_like(d_fake.prob))  # expect: AMP003
        loss_dis = loss_real + loss_fake
        opt_dis.zero_grad(set_to_none=True)
        scaler.scale(loss_dis).backward()  # expect: AMP008
    scaler.step(opt_dis)

    # 2) encoder + decoder: KL, feature-space reconstruction, non-saturating GAN term
    with torch.autocast("cuda", dtype=torch.float16):
        x_rec, mu, logvar = model(x)
        x_p = model.decoder(torch.randn_like(mu))
        d_fake = model.discriminator(torch.cat([x_rec, x_p]))
        feat_real = model.discriminator(x).feat.detach()
        loss_llike = F.mse_loss(d_fake.feat[: x.size(0)], feat_real)
        loss_kl = kl_divergence(mu, logvar)
        loss_gan = -torch.log(d_fake.prob + 1e-8).mean()  # expect: AMP011
        loss_ge = cfg.beta * loss_kl + cfg.gamma * loss_llike + loss_gan
    opt_enc.zero_grad(set_to_none=True)
    opt_dec.zero_grad(set_to_none=True)
    scaler.scale(loss_ge).backward()
    scaler.step(opt_dec)
    opt_enc.step()  # expect: AMP006
    scaler.update()
    return {"dis": loss_dis.item(), "kl": loss_kl.item(), "llike": loss_llike.item(), "gan": loss_gan.item()}


@torch.no_grad()
def sample_grid(model, n, z_dim, device):
    model.eval()
    imgs = model.decoder(torch.randn(n, z_dim, device=device))
    model.train()
    return (imgs.clamp(-1, 1) + 1) / 2


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/celeba")
    p.add_argument("--z-dim", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--beta", type=float, default=1.0)
    p.add_argument("--gamma", type=float, default=1e-6)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--d-act", default="LeakyReLU")
    cfg = p.parse_args()
    device = torch.device("cuda")
    tf = transforms.Compose([transforms.CenterCrop(148), transforms.Resize(64), transforms.ToTensor(),
                             transforms.Normalize((0.5,) * 3, (0.5,) * 3)])
    loader = torch.utils.data.DataLoader(datasets.ImageFolder(cfg.data, tf), batch_size=64, shuffle=True,
                                         num_workers=8, drop_last=True)
    model = VAEGAN(z_dim=cfg.z_dim, d_act=cfg.d_act)
    model.to(device)
    opt_enc = torch.optim.RMSprop(model.encoder.parameters(), lr=cfg.lr)
    opt_dec = torch.optim.RMSprop(model.decoder.parameters(), lr=cfg.lr)
    opt_dis = torch.optim.RMSprop(model.discriminator.parameters(), lr=cfg.lr * 0.1)
    scaler = torch.amp.GradScaler("cuda")
    for epoch in range(cfg.epochs):
        for it, (x, _) in enumerate(loader):
            logs = train_step(model, x.to(device, non_blocking=True), opt_enc, opt_dec, opt_dis, scaler, cfg)
            if it % 200 == 0:
                print(epoch, it, {k: round(v, 4) for k, v in logs.items()})
        save_image(sample_grid(model, 64, cfg.z_dim, device), f"samples_{epoch:03d}.png", nrow=8)
        torch.save(model.state_dict(), "vaegan.pt")


if __name__ == "__main__":
    main()
