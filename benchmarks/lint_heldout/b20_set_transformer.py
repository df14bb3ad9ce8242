"""Set Transformer (Lee et al.) for amortised clustering / set classification:
MAB, ISAB with inducing points, PMA pooling, SetNorm, a per-element anomaly head,
and a linear probe fine-tuned on frozen set embeddings.

Pretraining uses CUDA fp16 autocast with a GradScaler.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class SetNorm(nn.Module):
    """Normalise over the set and feature dimensions jointly, per set."""

    def __init__(self, dim):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(1, 1, dim))
        self.beta = nn.Parameter(torch.zeros(1, 1, dim))

    def forward(self, x):
        mu = x.mean(dim=(1, 2), keepdim=True)  # expect: AMP004
        sigma = x.std(dim=(1, 2), keepdim=True)  # expect: AMP004
        x = (x - mu) / (sigma + 1e-8)  # expect: AMP011
        return x * self.gamma + self.beta


class MAB(nn.Module):
    """Multihead attention block: H = Norm(X + Multihead(X, Y)); Norm(H + rFF(H))."""

    def __init__(self, dim_q, dim_k, dim_v, n_heads, ln=True):
        super().__init__()
        self.dim_v, self.n_heads = dim_v, n_heads
        self.fc_q = nn.Linear(dim_q, dim_v)
        self.fc_k = nn.Linear(dim_k, dim_v)
        self.fc_v = nn.Linear(dim_k, dim_v)
        self.norm0 = SetNorm(dim_v) if ln else nn.Identity()
        self.ln1 = nn.LayerNorm(dim_v) if ln else nn.Identity()
        self.fc_o = nn.Linear(dim_v, dim_v)

    def forward(self, X, Y, mask=None):
        Q, K, V = self.fc_q(X), self.fc_k(Y), self.fc_v(Y)
        ds = self.dim_v // self.n_heads
        Q_ = torch.cat(Q.split(ds, 2), 0)
        K_ = torch.cat(K.split(ds, 2), 0)
        V_ = torch.cat(V.split(ds, 2), 0)
        A = Q_.bmm(K_.transpose(1, 2)) / math.sqrt(self.dim_v)
        if mask is not None:
            key_mask = mask.repeat(self.n_heads, 1)[:, None, :]
            A = A.masked_fill(~key_mask, -1e10)  # expect: AMP007
        A = torch.softmax(A, dim=2)
        O = torch.cat((Q_ + A.bmm(V_)).split(Q.size(0), 0), 2)
        O = self.norm0(O)
        O = O + F.relu(self.fc_o(O))
        return self.ln1(O)


class SAB(nn.Module):
    def __init__(self, dim_in, dim_out, n_heads, ln=True):
        super().__init__()
        self.mab = MAB(dim_in, dim_in, dim_out, n_heads, ln=ln)

    def forward(self, X, mask=None):
        return self.mab(X, X, mask)


class ISAB(nn.Module):
    """Induced set attention: m inducing points attend to the set, the set
    attends back to them (O(nm) instead of O(n^2))."""

    def __init__(self, dim_in, dim_out, n_heads, n_inducing, ln=True):
        super().__init__()
        self.I = nn.Parameter(torch.empty(1, n_inducing, dim_out))
        nn.init.xavier_uniform_(self.I)
        self.mab0 = MAB(dim_out, dim_in, dim_out, n_heads, ln=ln)
        self.mab1 = MAB(dim_in, dim_out, dim_out, n_heads, ln=ln)

    def forward(self, X, mask=None):
        H = self.mab0(self.I.repeat(X.size(0), 1, 1), X, mask)
        return self.mab1(X, H)


class PMA(nn.Module):
    """Pooling by multihead attention with k learned seed vectors."""

    def __init__(self, dim, n_heads, n_seeds, ln=True):
        super().__init__()
        self.S = nn.Parameter(torch.empty(1, n_seeds, dim))
        nn.init.xavier_uniform_(self.S)
        self.mab = MAB(dim, dim, dim, n_heads, ln=ln)

    def forward(self, X, mask=None):
        return self.mab(self.S.repeat(X.size(0), 1, 1), X, mask)


class ElementHead(nn.Module):
    """Scores every element of the set; padded elements can never be selected."""

    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, 1))

    def forward(self, h, mask):
        logits = self.fc(h).squeeze(-1)
        return torch.where(mask, logits, torch.tensor(-1e9, device=h.device))  # expect: AMP007


class ChamferLoss(nn.Module):
    """Symmetric Chamfer distance between predicted cluster centres and the set."""

    def forward(self, pred, target, mask):
        d = torch.cdist(pred, target) ** 2
        d = d.masked_fill(~mask[:, None, :], float("inf"))
        fwd = d.min(dim=2).values.mean(dim=1)
        bwd = d.min(dim=1).values.masked_fill(~mask, 0.0).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        return (fwd + bwd).mean()


class SetTransformer(nn.Module):
    def __init__(self, dim_in=2, dim_hidden=128, n_heads=4, n_inducing=32, n_seeds=4, n_classes=10):
        super().__init__()
        self.enc = nn.ModuleList([
            ISAB(dim_in, dim_hidden, n_heads, n_inducing),
            ISAB(dim_hidden, dim_hidden, n_heads, n_inducing),
        ])
        self.pma = PMA(dim_hidden, n_heads, n_seeds)
        self.dec = SAB(dim_hidden, dim_hidden, n_heads)
        self.cls = nn.Linear(dim_hidden * n_seeds, n_classes)
        self.elem = ElementHead(dim_hidden)
        self.embed_out = nn.Linear(dim_hidden * n_seeds, dim_hidden)
        self.centres = nn.Linear(dim_hidden, dim_in)

    def encode(self, X, mask):
        h = X
        for blk in self.enc:
            h = blk(h, mask)
        return h

    def forward(self, X, mask):
        h = self.encode(X, mask)
        seeds = self.dec(self.pma(h, mask))
        pooled = seeds.flatten(1)
        return self.cls(pooled), self.elem(h, mask), self.embed_out(pooled), self.centres(seeds)


def deepsets_max_baseline(h, mask):
    """Masked max pooling used as a sanity baseline on the encoder output."""
    h = h.masked_fill(~mask[..., None], torch.finfo(h.dtype).min)
    return h.max(dim=1).values


def pretrain(loader, epochs=50, lr=1e-3, device="cuda"):
    model = SetTransformer(dim_in=2, dim_hidden=128).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    chamfer = ChamferLoss()
    scaler = torch.cuda.amp.GradScaler()  # expect: AMP009
    for epoch in range(epochs):
        model.train()
        for X, mask, y, anomalous in loader:
            X, mask, y, anomalous = X.to(device), mask.to(device), y.to(device), anomalous.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                logits, elem_logits, _, centres = model(X, mask)
                loss = F.cross_entropy(logits, y)
                loss = loss + F.cross_entropy(elem_logits, anomalous)
                loss = loss + 0.1 * chamfer(centres, X, mask)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
    return model


def finetune_linear_probe(encoder, loader, n_classes, dim=128, epochs=10, device="cuda"):
    encoder.eval()
    encoder.requires_grad_(False)
    probe = nn.Linear(dim, n_classes).to(device).half()  # expect: AMP001
    optimizer = torch.optim.Adam(probe.parameters(), lr=1e-3)  # expect: AMP011
    for epoch in range(epochs):
        for X, mask, y in loader:
            X, mask, y = X.to(device), mask.to(device), y.to(device)
            with torch.no_grad():
                with torch.autocast("cuda", dtype=torch.float16):
                    _, _, feats, _ = encoder(X, mask)
            logits = probe(feats)
            loss = F.cross_entropy(logits.float(), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return probe


@torch.no_grad()
def export_probe(probe, path):
    torch.save(probe.half().state_dict(), path)


def main(pretrain_loader, probe_loader, n_classes=10):
    encoder = pretrain(pretrain_loader)
    probe = finetune_linear_probe(encoder, probe_loader, n_classes)
    export_probe(probe, "set_probe_fp16.pt")
