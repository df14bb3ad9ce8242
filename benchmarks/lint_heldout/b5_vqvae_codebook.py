"""VQ-VAE on 128x128 images with an EMA codebook and commitment loss; fp16 autocast, scaler passed in."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class ResBlock(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.net = nn.Sequential(nn.ReLU(), nn.Conv2d(ch, ch, 3, padding=1), nn.ReLU(), nn.Conv2d(ch, ch, 1))

    def forward(self, x):
        return x + self.net(x)


class VectorQuantizerEMA(nn.Module):
    def __init__(self, num_codes=512, dim=64, beta=0.25, decay=0.99, eps=1e-5):
        super().__init__()
        self.beta, self.decay, self.eps = beta, decay, eps
        self.codebook = nn.Embedding(num_codes, dim)
        self.codebook.weight.data.normal_()
        self.register_buffer("ema_count", torch.zeros(num_codes))
        self.register_buffer("ema_weight", self.codebook.weight.data.clone())

    def forward(self, z):
        b, c, h, w = z.shape
        flat = z.permute(0, 2, 3, 1).reshape(-1, c)
        dist = (flat.pow(2).sum(1, keepdim=True)
                - 2 * flat @ self.codebook.weight.t()
                + self.codebook.weight.pow(2).sum(1))
        idx = dist.argmin(1)
        onehot = F.one_hot(idx, self.codebook.num_embeddings).float()
        zq = self.codebook(idx).view(b, h, w, c).permute(0, 3, 1, 2)
        if self.training:
            self._ema_update(flat, onehot)
        commit = self.beta * F.mse_loss(z, zq.detach())
        avg = onehot.mean(0)
        perplexity = torch.exp(-torch.sum(avg * torch.log(avg + 1e-10)))
        zq = z + (zq - z).detach()
        return zq, commit, perplexity

    @torch.no_grad()
    def _ema_update(self, flat, onehot):
        self.ema_count.mul_(self.decay).add_(onehot.sum(0), alpha=1 - self.decay)
        n = self.ema_count.sum()
        count = (self.ema_count + self.eps) / (n + self.codebook.num_embeddings * self.eps) * n
        self.ema_weight.mul_(self.decay).add_(onehot.t() @ flat.float(), alpha=1 - self.decay)
        self.codebook.weight.data.copy_(self.ema_weight / count.unsqueeze(1))


class VQVAE(nn.Module):
    def __init__(self, ch=128, dim=64):
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Conv2d(3, ch // 2, 4, 2, 1), nn.ReLU(), nn.Conv2d(ch // 2, ch, 4, 2, 1),
            ResBlock(ch), ResBlock(ch), nn.Conv2d(ch, dim, 1))
        self.vq = VectorQuantizerEMA(dim=dim)
        self.decoder = nn.Sequential(
            nn.Conv2d(dim, ch, 3, padding=1), ResBlock(ch), ResBlock(ch),
            nn.ConvTranspose2d(ch, ch // 2, 4, 2, 1), nn.ReLU(), nn.ConvTranspose2d(ch // 2, 3, 4, 2, 1))

    def forward(self, x):
        zq, commit, ppl = self.vq(self.encoder(x))
        return self.decoder(zq), commit, ppl


def prepare(batch, device):
    x = batch[0].to(device, non_blocking=True)
    return x.half()  # expect: AMP001


def train_epoch(model: VQVAE, loader, optimizer, scaler, data_variance, device="cuda", var_weight=1e-3):
    model.train()
    for batch in loader:
        x = prepare(batch, device)
        with torch.autocast("cuda", dtype=torch.float16):
            z_e = model.encoder(x)
            z_e = z_e / (z_e.abs().amax(dim=1, keepdim=True) + 1e-8)  # expect: AMP011
            latent_pen = (z_e.var(dim=(0, 2, 3)) - 1.0).abs().sum()  # expect: AMP004
            zq, commit, ppl = model.vq(z_e)
            x_hat = model.decoder(zq)
        recon = F.mse_loss(x_hat, x) / data_variance  # expect: AMP002
        loss = recon + commit + var_weight * latent_pen
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
    return ppl.item()


@torch.no_grad()
def reconstruct(model, x):
    model.eval()
    with torch.autocast("cuda", dtype=torch.float16):
        x_hat, _, _ = model(x.cuda().half())
        err = (x_hat.float() - x.cuda()).pow(2).mean()
    return x_hat.float().clamp(-1, 1), err.item()


def main(loader, epochs=100):
    device = "cuda"
    model = VQVAE().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-4, amsgrad=False)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 14)
    data_variance = torch.stack([b[0].float().var() for b, _ in zip(loader, range(50))]).mean().item()
    for epoch in range(epochs):
        ppl = train_epoch(model, loader, optimizer, scaler, data_variance, device)
        print(f"epoch {epoch} perplexity {ppl:.1f}")
        torch.save({"model": model.state_dict(), "scaler": scaler.state_dict()}, "vqvae.pt")
