"""VQGAN-style tokenizer training: VQ autoencoder + PatchGAN, two optimizers, two loss scalers."""
import math
import os
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F


def Normalize(c):
    return nn.GroupNorm(32, c, eps=1e-6, affine=True)


def nonlinearity(x):
    return x * torch.sigmoid(x)


class ResnetBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.norm1, self.conv1 = Normalize(cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2, self.conv2 = Normalize(cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.nin_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x):
        h = self.conv1(nonlinearity(self.norm1(x)))
        h = self.conv2(nonlinearity(self.norm2(h)))
        return self.nin_shortcut(x) + h


class AttnBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.norm = Normalize(c)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(c, c, 1) for _ in range(4))

    def forward(self, x):
        h = self.norm(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        b, c, hh, ww = q.shape
        w_ = torch.bmm(q.reshape(b, c, -1).permute(0, 2, 1), k.reshape(b, c, -1)) * (int(c) ** -0.5)
        w_ = F.softmax(w_, dim=2)
        h = torch.bmm(v.reshape(b, c, -1), w_.permute(0, 2, 1)).reshape(b, c, hh, ww)
        return x + self.proj_out(h)


def build_encoder(ch, ch_mult, z_channels):
    layers = [nn.Conv2d(3, ch, 3, padding=1)]
    cin = ch
    for i, m in enumerate(ch_mult):
        layers.append(ResnetBlock(cin, ch * m))
        cin = ch * m
        if i != len(ch_mult) - 1:
            layers.append(nn.Conv2d(cin, cin, 3, stride=2, padding=1))
    layers += [ResnetBlock(cin, cin), AttnBlock(cin), ResnetBlock(cin, cin), Normalize(cin), nn.SiLU()]
    layers.append(nn.Conv2d(cin, z_channels, 3, padding=1))
    return nn.Sequential(*layers)


def build_decoder(ch, ch_mult, z_channels):
    cin = ch * ch_mult[-1]
    layers = [nn.Conv2d(z_channels, cin, 3, padding=1), ResnetBlock(cin, cin), AttnBlock(cin), ResnetBlock(cin, cin)]
    for i, m in reversed(list(enumerate(ch_mult))):
        layers.append(ResnetBlock(cin, ch * m))
        cin = ch * m
        if i != 0:
            layers += [nn.Upsample(scale_factor=2.0, mode="nearest"), nn.Conv2d(cin, cin, 3, padding=1)]
    layers += [Normalize(cin), nn.SiLU(), nn.Conv2d(cin, 3, 3, padding=1)]
    return nn.Sequential(*layers)


class VectorQuantizer(nn.Module):
    def __init__(self, n_e, e_dim, beta=0.25):
        super().__init__()
        self.n_e, self.e_dim, self.beta = n_e, e_dim, beta
        self.embedding = nn.Embedding(n_e, e_dim)
        self.embedding.weight.data.uniform_(-1.0 / n_e, 1.0 / n_e)

    def forward(self, z):
        z = z.permute(0, 2, 3, 1).contiguous()
        z_flattened = z.view(-1, self.e_dim)
        d = (torch.sum(z_flattened ** 2, dim=1, keepdim=True) + torch.sum(self.embedding.weight ** 2, dim=1)
             - 2 * torch.matmul(z_flattened, self.embedding.weight.t()))
        min_encoding_indices = torch.argmin(d, dim=1).unsqueeze(1)
        min_encodings = torch.zeros(min_encoding_indices.shape[0], self.n_e, device=z.device, dtype=z.dtype)
        min_encodings.scatter_(1, min_encoding_indices, 1)
        z_q = torch.matmul(min_encodings, self.embedding.weight).view(z.shape)
        loss = torch.mean((z_q.detach() - z) ** 2) + self.beta * torch.mean((z_q - z.detach()) ** 2)
        z_q = z + (z_q - z).detach()
        e_mean = torch.mean(min_encodings, dim=0)  # expect: AMP004
        perplexity = torch.exp(-torch.sum(e_mean * torch.log(e_mean + 1e-10)))  # expect: AMP011
        return z_q.permute(0, 3, 1, 2).contiguous(), loss, (perplexity, min_encodings, min_encoding_indices)


class GumbelQuantizer(nn.Module):
    def __init__(self, num_hiddens, n_embed, embedding_dim, kl_weight=5e-4, temp_init=1.0):
        super().__init__()
        self.n_embed = n_embed
        self.temperature = temp_init
        self.kl_weight = kl_weight
        self.proj = nn.Conv2d(num_hiddens, n_embed, 1)
        self.embed = nn.Embedding(n_embed, embedding_dim)

    def forward(self, z):
        logits = self.proj(z)
        u = torch.rand(logits.shape, device=logits.device, dtype=logits.dtype)
        gumbels = -torch.log(-torch.log(u + 1e-10) + 1e-10)  # expect: AMP011
        soft_one_hot = F.softmax((logits + gumbels) / self.temperature, dim=1)
        z_q = torch.einsum("bnhw,nd->bdhw", soft_one_hot, self.embed.weight)
        qy = F.softmax(logits, dim=1)
        diff = self.kl_weight * torch.sum(qy * torch.log(qy * self.n_embed + 1e-10), dim=1).mean()
        ind = soft_one_hot.argmax(dim=1)
        return z_q, diff, (None, None, ind)


class VQModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.encoder = build_encoder(cfg.ch, cfg.ch_mult, cfg.z_channels)
        self.decoder = build_decoder(cfg.ch, cfg.ch_mult, cfg.embed_dim)
        gumbel = cfg.quantizer == "gumbel"
        self.quant_conv = nn.Identity() if gumbel else nn.Conv2d(cfg.z_channels, cfg.embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(cfg.embed_dim, cfg.embed_dim, 1)
        self.quantize = (GumbelQuantizer(cfg.z_channels, cfg.n_embed, cfg.embed_dim) if gumbel
                         else VectorQuantizer(cfg.n_embed, cfg.embed_dim, beta=0.25))

    def encode(self, x):
        h = self.quant_conv(self.encoder(x))
        return self.quantize(h)

    def decode(self, quant):
        return self.decoder(self.post_quant_conv(quant))

    def forward(self, x):
        quant, diff, info = self.encode(x)
        return self.decode(quant), diff, info

    def get_last_layer(self):
        return self.decoder[-1].weight


class NLayerDiscriminator(nn.Module):
    def __init__(self, input_nc=3, ndf=64, n_layers=3):
        super().__init__()
        sequence = [nn.Conv2d(input_nc, ndf, 4, 2, 1), nn.LeakyReLU(0.2, True)]
        nf_mult = 1
        for n in range(1, n_layers + 1):
            nf_prev, nf_mult = nf_mult, min(2 ** n, 8)
            stride = 2 if n < n_layers else 1
            sequence += [nn.Conv2d(ndf * nf_prev, ndf * nf_mult, 4, stride, 1, bias=False),
                         nn.BatchNorm2d(ndf * nf_mult), nn.LeakyReLU(0.2, True)]
        sequence.append(nn.Conv2d(ndf * nf_mult, 1, 4, 1, 1))
        self.main = nn.Sequential(*sequence)

    def forward(self, x):
        return self.main(x)


def hinge_d_loss(logits_real, logits_fake):
    loss_real = torch.mean(F.relu(1.0 - logits_real))
    loss_fake = torch.mean(F.relu(1.0 + logits_fake))
    return 0.5 * (loss_real + loss_fake)


def adopt_weight(weight, global_step, threshold=0, value=0.0):
    return value if global_step < threshold else weight


def calculate_adaptive_weight(nll_loss, g_loss, last_layer, disc_weight=0.8):
    nll_grads = torch.autograd.grad(nll_loss, last_layer, retain_graph=True)[0]
    g_grads = torch.autograd.grad(g_loss, last_layer, retain_graph=True)[0]
    d_weight = torch.norm(nll_grads) / (torch.norm(g_grads) + 1e-4)
    return torch.clamp(d_weight, 0.0, 1e4).detach() * disc_weight


def build_models(cfg):
    return VQModel(cfg), NLayerDiscriminator(n_layers=cfg.disc_layers)


def save_checkpoint(vq, disc, step, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    torch.save({"vq": {k: v.half() for k, v in vq.state_dict().items()}, "disc": disc.state_dict(), "step": step},
               os.path.join(out_dir, f"vq_{step:07d}.pt"))


def train(cfg, loader):
    vq, disc = build_models(cfg)
    vq.cuda()
    disc.cuda()
    opt_g = torch.optim.Adam(vq.parameters(), lr=cfg.lr, betas=(0.5, 0.9))
    opt_d = torch.optim.Adam(disc.parameters(), lr=cfg.lr, betas=(0.5, 0.9))
    scaler_g = torch.amp.GradScaler("cuda")
    scaler_d = torch.amp.GradScaler("cuda")
    best_rec = 1e9
    step = 0
    for epoch in range(cfg.epochs):
        for images in loader:
            images = images.cuda(non_blocking=True)
            disc_factor = adopt_weight(cfg.disc_factor, step, threshold=cfg.disc_start)

            # ---- autoencoder / generator update ----
            with torch.autocast("cuda", dtype=torch.float16):
                recon, qloss, (perplexity, _, _) = vq(images)
                rec_loss = F.l1_loss(recon, images)
                logits_fake = disc(recon)
                g_loss = -torch.mean(logits_fake)  # expect: AMP004
                if disc_factor > 0:
                    d_weight = calculate_adaptive_weight(rec_loss, g_loss, vq.get_last_layer())
                else:
                    d_weight = torch.tensor(0.0, device=images.device)
                loss = rec_loss + cfg.codebook_weight * qloss + d_weight * disc_factor * g_loss
            opt_g.zero_grad(set_to_none=True)
            scaler_g.scale(loss).backward()
            torch.nn.utils.clip_grad_norm_(vq.parameters(), cfg.clip)  # expect: AMP005
            scaler_g.step(opt_g)
            scaler_g.update()

            # ---- discriminator update ----
            if disc_factor > 0:
                with torch.autocast("cuda", dtype=torch.float16):
                    logits_real = disc(images.detach())
                    logits_fake = disc(recon.detach())
                d_loss = disc_factor * hinge_d_loss(logits_real, logits_fake)  # expect: AMP002
                opt_d.zero_grad(set_to_none=True)
                scaler_d.scale(d_loss).backward()
                scaler_d.unscale_(opt_d)
                torch.nn.utils.clip_grad_norm_(disc.parameters(), cfg.clip)
                scaler_d.step(opt_d)
                scaler_d.update()

            if step % cfg.log_every == 0:
                print(f"step {step} rec {rec_loss.item():.4f} q {float(qloss):.4f} ppl {float(perplexity or 0):.1f}")
                best_rec = min(best_rec, rec_loss.item())
            if step % cfg.save_every == 0:
                save_checkpoint(vq, disc, step, cfg.out_dir)
            step += 1
    return vq, disc, best_rec


@torch.no_grad()
def reconstruct_samples(vq, images):
    vq.eval()
    recon, _, (_, encodings, _) = vq(images.cuda())
    usage = encodings.float().mean(0) if encodings is not None else None
    vq.train()
    return recon.clamp(-1, 1), usage


default_cfg = SimpleNamespace(ch=128, ch_mult=(1, 1, 2, 2, 4), z_channels=256, embed_dim=256, n_embed=1024,
                              quantizer="vq", disc_layers=3, lr=4.5e-6 * 12, disc_factor=1.0, disc_start=250001,
                              codebook_weight=1.0, clip=1.0, epochs=100, log_every=100, save_every=5000,
                              out_dir="checkpoints")
