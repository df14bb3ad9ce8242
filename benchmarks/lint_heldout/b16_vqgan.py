"""VQGAN first stage (taming-transformers f16, 1024 codes) with a PatchGAN and perceptual loss.

Plain PyTorch trainer (no Lightning): two optimizers, a shared GradScaler, adaptive GAN weight.
"""
import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torchvision.models import vgg16


def Normalize(ch):
    return nn.GroupNorm(32, ch, eps=1e-6, affine=True)


def swish(x):
    return x * torch.sigmoid(x)


class ResnetBlock(nn.Module):
    def __init__(self, in_ch, out_ch=None, dropout=0.0):
        super().__init__()
        out_ch = out_ch or in_ch
        self.norm1, self.conv1 = Normalize(in_ch), nn.Conv2d(in_ch, out_ch, 3, 1, 1)
        self.norm2, self.conv2 = Normalize(out_ch), nn.Conv2d(out_ch, out_ch, 3, 1, 1)
        self.dropout = nn.Dropout(dropout)
        self.nin_shortcut = nn.Conv2d(in_ch, out_ch, 1) if in_ch != out_ch else nn.Identity()

    def forward(self, x):
        h = self.conv1(swish(self.norm1(x)))
        h = self.conv2(self.dropout(swish(self.norm2(h))))
        return self.nin_shortcut(x) + h


class AttnBlock(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.norm = Normalize(ch)
        self.q, self.k, self.v = nn.Conv2d(ch, ch, 1), nn.Conv2d(ch, ch, 1), nn.Conv2d(ch, ch, 1)
        self.proj_out = nn.Conv2d(ch, ch, 1)

    def forward(self, x):
        h_ = self.norm(x)
        q, k, v = self.q(h_), self.k(h_), self.v(h_)
        b, c, h, w = q.shape
        w_ = torch.bmm(q.reshape(b, c, h * w).permute(0, 2, 1), k.reshape(b, c, h * w)) * (int(c) ** -0.5)
        w_ = F.softmax(w_, dim=2)
        h_ = torch.bmm(v.reshape(b, c, h * w), w_.permute(0, 2, 1)).reshape(b, c, h, w)
        return x + self.proj_out(h_)


class Encoder(nn.Module):
    def __init__(self, ch=128, ch_mult=(1, 1, 2, 2, 4), z_channels=256):
        super().__init__()
        self.conv_in = nn.Conv2d(3, ch, 3, 1, 1)
        blocks, in_ch = [], ch
        for i, m in enumerate(ch_mult):
            blocks += [ResnetBlock(in_ch, ch * m), ResnetBlock(ch * m)]
            in_ch = ch * m
            if i != len(ch_mult) - 1:
                blocks.append(nn.Conv2d(in_ch, in_ch, 3, 2, 1))
        blocks += [ResnetBlock(in_ch), AttnBlock(in_ch), ResnetBlock(in_ch)]
        self.blocks = nn.Sequential(*blocks)
        self.norm_out = Normalize(in_ch)
        self.conv_out = nn.Conv2d(in_ch, z_channels, 3, 1, 1)

    def forward(self, x):
        return self.conv_out(swish(self.norm_out(self.blocks(self.conv_in(x)))))


class Decoder(nn.Module):
    def __init__(self, ch=128, ch_mult=(1, 1, 2, 2, 4), z_channels=256):
        super().__init__()
        in_ch = ch * ch_mult[-1]
        self.conv_in = nn.Conv2d(z_channels, in_ch, 3, 1, 1)
        blocks = [ResnetBlock(in_ch), AttnBlock(in_ch), ResnetBlock(in_ch)]
        for i, m in reversed(list(enumerate(ch_mult))):
            blocks += [ResnetBlock(in_ch, ch * m), ResnetBlock(ch * m), ResnetBlock(ch * m)]
            in_ch = ch * m
            if i != 0:
                blocks += [nn.Upsample(scale_factor=2.0, mode="nearest"), nn.Conv2d(in_ch, in_ch, 3, 1, 1)]
        self.blocks = nn.Sequential(*blocks)
        self.norm_out = Normalize(in_ch)
        self.conv_out = nn.Conv2d(in_ch, 3, 3, 1, 1)

    def forward(self, z):
        return self.conv_out(swish(self.norm_out(self.blocks(self.conv_in(z)))))


class VectorQuantizer(nn.Module):
    def __init__(self, n_e, e_dim, beta=0.25):
        super().__init__()
        self.n_e, self.e_dim, self.beta = n_e, e_dim, beta
        self.embedding = nn.Embedding(n_e, e_dim)
        self.embedding.weight.data.uniform_(-1.0 / n_e, 1.0 / n_e)

    def forward(self, z):
        z = z.permute(0, 2, 3, 1).contiguous()
        z_flat = z.view(-1, self.e_dim)
        d = (z_flat ** 2).sum(dim=1, keepdim=True) + (self.embedding.weight ** 2).sum(dim=1) - 2 * torch.matmul(z_flat, self.embedding.weight.t())
        min_encoding_indices = torch.argmin(d, dim=1)
        z_q = self.embedding(min_encoding_indices).view(z.shape)
        loss = torch.mean((z_q.detach() - z) ** 2) + self.beta * torch.mean((z_q - z.detach()) ** 2)
        z_q = z + (z_q - z).detach()
        min_encodings = torch.zeros(min_encoding_indices.shape[0], self.n_e, device=z.device).to(z)
        min_encodings.scatter_(1, min_encoding_indices[:, None], 1)
        e_mean = torch.mean(min_encodings, dim=0)  # expect: AMP004
        perplexity = torch.exp(-torch.sum(e_mean * torch.log(e_mean + 1e-10)))  # expect: AMP011
        return z_q.permute(0, 3, 1, 2).contiguous(), loss, perplexity


class VQModel(nn.Module):
    def __init__(self, n_embed=1024, embed_dim=256, z_channels=256):
        super().__init__()
        self.encoder, self.decoder = Encoder(z_channels=z_channels), Decoder(z_channels=z_channels)
        self.quantize = VectorQuantizer(n_embed, embed_dim)
        self.quant_conv = nn.Conv2d(z_channels, embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(embed_dim, z_channels, 1)

    def forward(self, x):
        quant, qloss, perplexity = self.quantize(self.quant_conv(self.encoder(x)))
        return self.decoder(self.post_quant_conv(quant)), qloss, perplexity

    def get_last_layer(self):
        return self.decoder.conv_out.weight


class NLayerDiscriminator(nn.Module):
    def __init__(self, in_ch=3, ndf=64, n_layers=3):
        super().__init__()
        seq = [nn.Conv2d(in_ch, ndf, 4, 2, 1), nn.LeakyReLU(0.2, True)]
        mult = 1
        for n in range(1, n_layers + 1):
            prev, mult = mult, min(2 ** n, 8)
            seq += [nn.Conv2d(ndf * prev, ndf * mult, 4, 2 if n < n_layers else 1, 1, bias=False), nn.BatchNorm2d(ndf * mult), nn.LeakyReLU(0.2, True)]
        seq += [nn.Conv2d(ndf * mult, 1, 4, 1, 1)]
        self.main = nn.Sequential(*seq)

    def forward(self, x):
        return self.main(x)


def normalize_tensor(x, eps=1e-10):
    return x / (torch.sqrt(torch.sum(x ** 2, dim=1, keepdim=True)) + eps)


class PerceptualLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = vgg16(weights="IMAGENET1K_V1").features[:23].eval().requires_grad_(False)
        self.taps = {3, 8, 15, 22}
        self.register_buffer("shift", torch.tensor([-0.030, -0.088, -0.188]).view(1, 3, 1, 1))
        self.register_buffer("scale", torch.tensor([0.458, 0.448, 0.450]).view(1, 3, 1, 1))

    def forward(self, x, y):
        x, y = (x - self.shift) / self.scale, (y - self.shift) / self.scale
        total = 0.0
        for i, layer in enumerate(self.net):
            x, y = layer(x), layer(y)
            if i in self.taps:
                total = total + F.mse_loss(normalize_tensor(x), normalize_tensor(y), reduction="none").sum(1).mean((1, 2), keepdim=True)
        return total.view(-1, 1, 1, 1)


def hinge_d_loss(logits_real, logits_fake):
    loss_real = torch.mean(F.relu(1.0 - logits_real))  # expect: AMP004
    loss_fake = torch.mean(F.relu(1.0 + logits_fake))  # expect: AMP004
    return 0.5 * (loss_real + loss_fake)


def vanilla_d_loss(logits_real, logits_fake):
    return 0.5 * (torch.mean(F.softplus(-logits_real)) + torch.mean(F.softplus(logits_fake)))


class VQLPIPSWithDiscriminator(nn.Module):
    def __init__(self, disc_start, codebook_weight=1.0, perceptual_weight=1.0, disc_weight=0.8, disc_loss="hinge"):
        super().__init__()
        self.codebook_weight, self.perceptual_weight, self.disc_weight = codebook_weight, perceptual_weight, disc_weight
        self.perceptual_loss = PerceptualLoss()
        self.discriminator = NLayerDiscriminator()
        self.disc_start, self.disc_loss_type = disc_start, disc_loss

    def calculate_adaptive_weight(self, nll_loss, g_loss, last_layer):
        nll_grads = torch.autograd.grad(nll_loss, last_layer, retain_graph=True)[0]
        g_grads = torch.autograd.grad(g_loss, last_layer, retain_graph=True)[0]
        d_weight = torch.norm(nll_grads) / (torch.norm(g_grads) + 1e-4)
        return torch.clamp(d_weight, 0.0, 1e4).detach() * self.disc_weight

    def forward(self, codebook_loss, inputs, reconstructions, optimizer_idx, global_step, last_layer=None):
        disc_factor = 1.0 if global_step >= self.disc_start else 0.0
        if optimizer_idx == 0:
            rec_loss = torch.abs(inputs.float() - reconstructions.float())
            p_loss = self.perceptual_loss(inputs.float(), reconstructions.float())
            nll_loss = torch.mean(rec_loss + self.perceptual_weight * p_loss)
            logits_fake = self.discriminator(reconstructions)
            g_loss = -torch.mean(logits_fake)  # expect: AMP004
            d_weight = self.calculate_adaptive_weight(nll_loss, g_loss, last_layer) if disc_factor > 0 else torch.tensor(0.0)
            loss = nll_loss + d_weight * disc_factor * g_loss + self.codebook_weight * codebook_loss.mean()
            return loss, {"nll": nll_loss.item(), "g": g_loss.item(), "d_weight": float(d_weight)}
        logits_real = self.discriminator(inputs.detach())
        logits_fake = self.discriminator(reconstructions.detach())
        if self.disc_loss_type == "hinge":
            d_loss = disc_factor * hinge_d_loss(logits_real, logits_fake)
        else:
            d_loss = disc_factor * vanilla_d_loss(logits_real, logits_fake)
        return d_loss, {"d": d_loss.item()}


class VQGANTrainer:
    def __init__(self, cfg, device):
        self.cfg, self.device = cfg, device
        self.model = VQModel(cfg["n_embed"], cfg["embed_dim"]).to(device)
        self.loss = VQLPIPSWithDiscriminator(cfg["disc_start"], disc_weight=cfg["disc_weight"]).to(device)
        lr = cfg["base_lr"] * cfg["batch_size"]
        self.opt_ae = torch.optim.Adam(self.model.parameters(), lr=lr, betas=(0.5, 0.9))
        self.opt_disc = torch.optim.Adam(self.loss.discriminator.parameters(), lr=lr, betas=(0.5, 0.9))
        try:
            self.scaler = torch.amp.GradScaler("cuda", enabled=cfg["amp"])
        except (AttributeError, TypeError):
            self.scaler = torch.cuda.amp.GradScaler(enabled=cfg["amp"])
        self.global_step = 0

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def step(self, optimizer, params):
        if self.cfg["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(params, self.cfg["grad_clip"])  # expect: AMP005
        self.scaler.step(optimizer)
        optimizer.zero_grad(set_to_none=True)

    def train_step(self, x):
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.cfg["amp"]):
            xrec, qloss, perplexity = self.model(x)
            aeloss, log_ae = self.loss(qloss, x, xrec, 0, self.global_step, last_layer=self.model.get_last_layer())
        self.backward(aeloss)
        self.step(self.opt_ae, self.model.parameters())
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.cfg["amp"]):
            discloss, log_d = self.loss(None, x, xrec.detach().float(), 1, self.global_step)
        self.backward(discloss)
        self.step(self.opt_disc, self.loss.discriminator.parameters())
        self.scaler.update()
        self.global_step += 1
        return {**log_ae, **log_d, "perplexity": perplexity.item()}

    @torch.no_grad()
    def evaluate(self, loader):
        self.model.eval()
        errs, ppls = [], []
        for x in loader:
            x = x.to(self.device)
            with torch.autocast("cuda", dtype=torch.float16, enabled=self.cfg["amp"]):
                xrec, _, perplexity = self.model(x)
            errs.append(torch.abs(x - xrec.float()).mean().item())
            ppls.append(perplexity.item())
        self.model.train()
        return sum(errs) / len(errs), sum(ppls) / len(ppls)

    def fit(self, train_loader, val_loader):
        for epoch in range(self.cfg["epochs"]):
            for x in train_loader:
                logs = self.train_step(x.to(self.device, non_blocking=True))
                if self.global_step % 100 == 0:
                    print(f"ep {epoch} step {self.global_step} " + " ".join(f"{k} {v:.4f}" for k, v in logs.items()))
            rec, ppl = self.evaluate(val_loader)
            print(f"epoch {epoch} val rec {rec:.4f} perplexity {ppl:.1f}")
            torch.save({"model": self.model.state_dict(), "loss": self.loss.state_dict(), "opt_ae": self.opt_ae.state_dict(), "opt_disc": self.opt_disc.state_dict(), "scaler": self.scaler.state_dict(), "step": self.global_step}, os.path.join(self.cfg["ckpt_dir"], "last.ckpt"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", default="configs/imagenet_vqgan.yaml")
    args = parser.parse_args()
    with open(args.base) as f:
        cfg = yaml.safe_load(f)
    os.makedirs(cfg["ckpt_dir"], exist_ok=True)
    from vq_data import build_loaders  # project-local ImageNet crops in [-1, 1]

    train_loader, val_loader = build_loaders(cfg)
    VQGANTrainer(cfg, torch.device("cuda")).fit(train_loader, val_loader)


if __name__ == "__main__":
    main()
