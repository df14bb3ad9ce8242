"""E(n)-equivariant graph network (EGNN) for molecular property regression on
dense, padded molecule batches, with a coordinate-denoising pretraining stage.

Fine-tuning uses CUDA fp16 autocast with a GradScaler.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


def remove_mean(x, node_mask):
    """Centre coordinates on the molecule's centre of mass (translation invariance)."""
    n = node_mask.sum(dim=1, keepdim=True).clamp(min=1)
    mean = (x * node_mask).sum(dim=1, keepdim=True) / n
    return (x - mean) * node_mask


class GaussianSmearing(nn.Module):
    def __init__(self, start=0.0, stop=5.0, n_rbf=32):
        super().__init__()
        offsets = torch.linspace(start, stop, n_rbf)
        self.register_buffer("offsets", offsets)
        self.coeff = -0.5 / float(offsets[1] - offsets[0]) ** 2

    def forward(self, dist):
        return torch.exp(self.coeff * (dist[..., None] - self.offsets) ** 2)


class GraphNorm(nn.Module):
    """GraphNorm (Cai et al.): per-graph mean removal with a learned shift."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.mean_scale = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, h):
        mean = h.mean(dim=1, keepdim=True)  # expect: AMP004
        centered = h - self.mean_scale * mean
        var = centered.pow(2).mean(dim=1, keepdim=True)
        return self.weight * centered / torch.sqrt(var + self.eps) + self.bias


class EdgeAttention(nn.Module):
    """Softmax attention over neighbours with standardised logits."""

    def __init__(self, hidden):
        super().__init__()
        self.att_mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 1))

    def forward(self, m, adj):
        logits = self.att_mlp(m).squeeze(-1)
        mu, sd = logits.mean(), logits.std()  # expect: AMP004
        logits = (logits - mu) / (sd + 1e-8)  # expect: AMP011
        logits[~adj] = -1e9  # expect: AMP007
        return torch.softmax(logits, dim=-1)


class EquivariantConv(nn.Module):
    """One E_GCL layer: messages from invariant features and squared distances,
    coordinate updates along relative position vectors."""

    def __init__(self, hidden, n_rbf=32, coords_range=15.0):
        super().__init__()
        self.edge_mlp = nn.Sequential(
            nn.Linear(2 * hidden + 1 + n_rbf, hidden), nn.SiLU(),
            nn.Linear(hidden, hidden), nn.SiLU(),
        )
        self.node_mlp = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.coord_mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 1, bias=False))
        self.attention = EdgeAttention(hidden)
        self.norm = GraphNorm(hidden)
        self.rbf = GaussianSmearing(n_rbf=n_rbf)
        self.coords_range = coords_range

    def coord2radial(self, x):
        coord_diff = x[:, :, None, :] - x[:, None, :, :]
        radial = (coord_diff ** 2).sum(dim=-1, keepdim=True)
        norm = torch.sqrt(radial).detach() + 1e-8
        return radial, coord_diff / norm

    def forward(self, h, x, adj, node_mask):
        B, N, C = h.shape
        radial, unit = self.coord2radial(x)
        rbf = self.rbf(radial.squeeze(-1).sqrt())
        pair = torch.cat([
            h[:, :, None, :].expand(B, N, N, C),
            h[:, None, :, :].expand(B, N, N, C),
            radial, rbf,
        ], dim=-1)
        m = self.edge_mlp(pair)
        att = self.attention(m, adj)
        m = m * att[..., None] * adj[..., None]
        agg = m.sum(dim=2) / 100.0
        h = h + self.norm(self.node_mlp(torch.cat([h, agg], dim=-1)))
        trans = unit * torch.tanh(self.coord_mlp(m)) * self.coords_range
        x = x + trans.sum(dim=2) / N * node_mask
        return h, x


class EGNN(nn.Module):
    def __init__(self, n_atom_types=10, hidden=128, n_layers=6, n_targets=1):
        super().__init__()
        self.embedding = nn.Linear(n_atom_types, hidden)
        self.layers = nn.ModuleList([EquivariantConv(hidden) for _ in range(n_layers)])
        self.energy_head = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 1))
        self.prop_head = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 2 * n_targets))

    def forward(self, one_hot, x, adj, node_mask):
        h = self.embedding(one_hot)
        x = remove_mean(x, node_mask)
        for layer in self.layers:
            h, x = layer(h, x, adj, node_mask)
            h = h * node_mask
        atom_e = self.energy_head(h).squeeze(-1)
        energy = (atom_e * node_mask.squeeze(-1)).sum(dim=1)
        graph = (h * node_mask).sum(dim=1) / node_mask.sum(dim=1).clamp(min=1)
        mu, raw_var = self.prop_head(graph).chunk(2, dim=-1)
        return energy, mu, F.softplus(raw_var), x


def gaussian_nll(mu, var, target):
    return 0.5 * (torch.log(var + 1e-8) + (target - mu) ** 2 / (var + 1e-8)).mean()


def pretrain_denoise(model, loader, optimizer, sigma=0.2, device="cuda"):
    """Denoising pretraining: predict clean coordinates from perturbed ones."""
    model.train()
    for one_hot, x, adj, node_mask in loader:
        one_hot, x = one_hot.to(device), x.to(device)
        adj, node_mask = adj.to(device), node_mask.to(device)
        noisy = x + sigma * torch.randn_like(x) * node_mask
        with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
            _, _, _, x_out = model(one_hot, noisy, adj, node_mask)
            loss = F.mse_loss(x_out * node_mask, remove_mean(x, node_mask))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def finetune(model, loader, epochs=300, lr=5e-4, max_norm=10.0, device="cuda"):
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-12)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, epochs)
    scaler = torch.amp.GradScaler("cuda")
    best_mae = 1e9
    for epoch in range(epochs):
        model.train()
        for one_hot, x, adj, node_mask, y_energy, y_prop in loader:
            one_hot, x = one_hot.to(device), x.to(device)
            adj, node_mask = adj.to(device), node_mask.to(device)
            y_energy, y_prop = y_energy.to(device), y_prop.to(device)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                energy, mu, var, _ = model(one_hot, x, adj, node_mask)
                loss = F.l1_loss(energy, y_energy) + gaussian_nll(mu, var, y_prop)
            scaler.scale(loss).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
        scheduler.step()
        mae = validate(model, loader, device)
        if mae < best_mae:
            best_mae = mae
            torch.save({"model": model.state_dict(), "epoch": epoch}, "egnn_best.pt")
    return best_mae


@torch.no_grad()
def validate(model, loader, device="cuda"):
    model.eval()
    err, n = 0.0, 0
    for one_hot, x, adj, node_mask, y_energy, _ in loader:
        energy, _, _, _ = model(one_hot.to(device), x.to(device), adj.to(device), node_mask.to(device))
        err += (energy - y_energy.to(device)).abs().sum().item()
        n += energy.numel()
    model.train()
    return err / max(n, 1)


def main(train_loader, pretrain_loader):
    model = EGNN().cuda()
    pre_opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    pretrain_denoise(model, pretrain_loader, pre_opt)
    return finetune(model, train_loader)
