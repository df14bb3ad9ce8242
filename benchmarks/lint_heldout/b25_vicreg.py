"""VICReg pretraining (with an auxiliary NT-Xent term) of a small ResNet, plus an
online linear probe on the detached backbone features."""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


class BasicBlock(nn.Module):
    def __init__(self, c_in, c_out, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18Small(nn.Module):
    def __init__(self, widths=(64, 128, 256, 512)):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU(inplace=True))
        layers, c = [], widths[0]
        for i, w in enumerate(widths):
            layers += [BasicBlock(c, w, stride=1 if i == 0 else 2), BasicBlock(w, w)]
            c = w
        self.layers = nn.Sequential(*layers)
        self.out_dim = c

    def forward(self, x):
        x = self.layers(self.stem(x))
        return torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)


class VICRegModel(nn.Module):
    def __init__(self, proj_dims=(2048, 2048, 2048)):
        super().__init__()
        self.backbone = ResNet18Small()
        dims = [self.backbone.out_dim, *proj_dims]
        layers = []
        for i in range(len(dims) - 2):
            layers += [nn.Linear(dims[i], dims[i + 1]), nn.BatchNorm1d(dims[i + 1]), nn.ReLU(inplace=True)]
        layers.append(nn.Linear(dims[-2], dims[-1], bias=False))
        self.projector = nn.Sequential(*layers)

    def forward(self, x):
        return self.projector(self.backbone(x))


def off_diagonal(x):
    n, m = x.shape
    assert n == m
    return x.flatten()[:-1].view(n - 1, n + 1)[:, 1:].flatten()


def variance_covariance(z, gamma=1.0):
    """Hinge on the per-dimension std and squared off-diagonal covariance."""
    z = z - z.mean(dim=0)  # expect: AMP004
    var = z.var(dim=0)  # expect: AMP004
    std = torch.sqrt(var + 1e-10)  # expect: AMP011
    std_term = F.relu(gamma - std).float().mean()
    cov = (z.T @ z) / (z.size(0) - 1)
    cov_term = off_diagonal(cov).pow(2).sum() / z.size(1)
    return std_term, cov_term


def nt_xent(z_a, z_b, temperature=0.2):
    n = z_a.size(0)
    z = F.normalize(torch.cat([z_a, z_b], dim=0), dim=1)
    sim = z @ z.T / temperature
    self_mask = torch.eye(2 * n, dtype=torch.bool, device=z.device)
    sim = sim.masked_fill(self_mask, -1e9)  # expect: AMP007
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]).to(z.device)
    return F.cross_entropy(sim, targets)


def train(model, probe, loader, optimizer, probe_opt, scaler, args):
    model.train()
    probe.train()
    for epoch in range(args.epochs):
        for step, ((x_a, x_b), labels) in enumerate(loader):
            x_a, x_b = x_a.cuda(non_blocking=True), x_b.cuda(non_blocking=True)
            labels = labels.cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                h_a = model.backbone(x_a)
                h_b = model.backbone(x_b)
                z_a = model.projector(h_a)
                z_b = model.projector(h_b)
                inv = F.mse_loss(z_a, z_b)
                std_a, cov_a = variance_covariance(z_a)
                std_b, cov_b = variance_covariance(z_b)
                ssl_loss = (args.sim_coeff * inv
                            + args.std_coeff * (std_a + std_b) / 2
                            + args.cov_coeff * (cov_a + cov_b))
                ssl_loss = ssl_loss + args.nce_weight * nt_xent(z_a, z_b, args.temperature)
                probe_logits = probe(h_a.detach())
            probe_loss = F.cross_entropy(probe_logits, labels)  # expect: AMP002
            loss = ssl_loss + probe_loss
            optimizer.zero_grad(set_to_none=True)
            probe_opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if args.clip_value > 0:
                torch.nn.utils.clip_grad_value_(model.parameters(), args.clip_value)  # expect: AMP005
            scaler.step(optimizer)
            scaler.step(probe_opt)
            scaler.update()
            if step % 50 == 0:
                acc = (probe_logits.argmax(dim=1) == labels).float().mean()
                print(f"ep {epoch} it {step} ssl {ssl_loss.item():.3f} probe acc {acc.item():.3f}")


@torch.no_grad()
def knn_eval(model, bank_loader, query_loader, k=20):
    model.eval()
    feats, labels = [], []
    for x, y in bank_loader:
        with torch.autocast("cuda", dtype=torch.float16):
            f = model.backbone(x.cuda())
        feats.append(F.normalize(f.float(), dim=1))
        labels.append(y.cuda())
    feats, labels = torch.cat(feats), torch.cat(labels)
    correct, total = 0, 0
    for x, y in query_loader:
        q = F.normalize(model.backbone(x.cuda()).float(), dim=1)
        idx = (q @ feats.T).topk(k, dim=1).indices
        pred = labels[idx].mode(dim=1).values
        correct += (pred == y.cuda()).sum().item()
        total += y.numel()
    model.train()
    return correct / max(total, 1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--lr", type=float, default=0.3)
    parser.add_argument("--sim-coeff", type=float, default=25.0)
    parser.add_argument("--std-coeff", type=float, default=25.0)
    parser.add_argument("--cov-coeff", type=float, default=1.0)
    parser.add_argument("--nce-weight", type=float, default=0.1)
    parser.add_argument("--temperature", type=float, default=0.2)
    parser.add_argument("--clip-value", type=float, default=3.0)
    args = parser.parse_args()

    model = VICRegModel().cuda()
    probe = nn.Linear(model.backbone.out_dim, 100).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-6)
    probe_opt = torch.optim.AdamW(probe.parameters(), lr=1e-3, eps=1e-8)
    scaler = torch.cuda.amp.GradScaler(init_scale=2.0 ** 14)  # expect: AMP009
    loader = torch.load("cifar100_two_views.pt")
    train(model, probe, loader, optimizer, probe_opt, scaler, args)
    print("knn acc", knn_eval(model, loader, loader))
    torch.save(model.backbone.state_dict(), "vicreg_backbone.pt")


if __name__ == "__main__":
    main()
