"""Industrial anomaly detection with a convolutional autoencoder and a patch-statistics score."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Autoencoder(nn.Module):
    def __init__(self, ch=64):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, ch, 4, 2, 1), nn.ReLU(), nn.Conv2d(ch, 2 * ch, 4, 2, 1), nn.ReLU())
        self.dec = nn.Sequential(nn.ConvTranspose2d(2 * ch, ch, 4, 2, 1), nn.ReLU(), nn.ConvTranspose2d(ch, 3, 4, 2, 1))

    def forward(self, x):
        return torch.sigmoid(self.dec(self.enc(x)))


def ssim_map(x, y, window=11, c1=0.01 ** 2, c2=0.03 ** 2):
    mu_x = F.avg_pool2d(x, window, 1, window // 2)
    mu_y = F.avg_pool2d(y, window, 1, window // 2)
    sigma_x = F.avg_pool2d(x * x, window, 1, window // 2) - mu_x ** 2
    sigma_y = F.avg_pool2d(y * y, window, 1, window // 2) - mu_y ** 2
    sigma_xy = F.avg_pool2d(x * y, window, 1, window // 2) - mu_x * mu_y
    return ((2 * mu_x * mu_y + c1) * (2 * sigma_xy + c2)) / ((mu_x ** 2 + mu_y ** 2 + c1) * (sigma_x + sigma_y + c2))


def train(model, loader, epochs=100, lr=2e-4):
    model = model.cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=1e-5)
    scaler = torch.amp.GradScaler("cuda")
    bce = nn.BCELoss()
    for _ in range(epochs):
        for x in loader:
            x = x.cuda()
            with torch.autocast("cuda", dtype=torch.float16):
                recon = model(x)
                loss = bce(recon, x) + (1 - ssim_map(recon, x).mean())  # expect: AMP003
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()


def train_fixed(model, loader, epochs=100, lr=2e-4):
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cuda")
    for _ in range(epochs):
        for x in loader:
            x = x.cuda()
            with torch.autocast("cuda", dtype=torch.float16):
                recon = model(x)
            loss = F.binary_cross_entropy(recon.float(), x) + (1 - ssim_map(recon.float(), x).mean())
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()


@torch.no_grad()
def anomaly_scores(model, loader):
    model.eval()
    scores = []
    for x in loader:
        x = x.cuda().half()
        recon = model.half()(x)
        err = (recon - x).pow(2).mean(dim=1)
        scores.append(err.flatten(1).amax(1).float().cpu())
    return torch.cat(scores)


def patch_statistics(features):
    feats = features.half()
    mean = feats.mean(dim=0)  # expect: AMP004
    cov = torch.einsum("nc,nd->cd", feats - mean, feats - mean) / (feats.size(0) - 1)
    return mean.float(), cov.float() + 0.01 * torch.eye(cov.size(0), device=cov.device)
