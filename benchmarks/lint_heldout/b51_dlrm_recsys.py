"""DLRM-style CTR model (Criteo Kaggle layout) with SENET re-weighting and an
AutoInt field-attention branch next to the classic dot interaction.

    python b51_dlrm_recsys.py --data criteo_kaggle_processed.npz --epochs 1
"""
import argparse
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def create_mlp(sizes, sigmoid_layer=-1):
    layers = []
    for i in range(len(sizes) - 1):
        lin = nn.Linear(sizes[i], sizes[i + 1], bias=True)
        nn.init.normal_(lin.weight, 0.0, np.sqrt(2.0 / (sizes[i] + sizes[i + 1])))
        nn.init.normal_(lin.bias, 0.0, np.sqrt(1.0 / sizes[i + 1]))
        layers.append(lin)
        layers.append(nn.Sigmoid() if i == sigmoid_layer else nn.ReLU())
    return nn.Sequential(*layers)


class SENETLayer(nn.Module):
    """FiBiNET squeeze-excitation over embedding fields."""

    def __init__(self, num_fields, reduction=3):
        super().__init__()
        hidden = max(1, num_fields // reduction)
        self.excitation = nn.Sequential(
            nn.Linear(num_fields, hidden, bias=False), nn.ReLU(),
            nn.Linear(hidden, num_fields, bias=False), nn.ReLU(),
        )

    def forward(self, emb):
        # emb: (B, F, D) straight out of the embedding bags
        z = torch.mean(emb, dim=-1)
        a = self.excitation(z)
        return emb * a.unsqueeze(-1)


class FieldSelfAttention(nn.Module):
    """AutoInt interacting layer."""

    def __init__(self, dim, heads=2):
        super().__init__()
        self.heads, self.d = heads, dim // heads
        self.W_q = nn.Linear(dim, dim, bias=False)
        self.W_k = nn.Linear(dim, dim, bias=False)
        self.W_v = nn.Linear(dim, dim, bias=False)
        self.W_res = nn.Linear(dim, dim, bias=False)

    def forward(self, e):
        b, f, _ = e.shape
        q = self.W_q(e).view(b, f, self.heads, self.d).transpose(1, 2)
        k = self.W_k(e).view(b, f, self.heads, self.d).transpose(1, 2)
        v = self.W_v(e).view(b, f, self.heads, self.d).transpose(1, 2)
        attn = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) / self.d ** 0.5, dim=-1)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, f, -1)
        return F.relu(out + self.W_res(e))


class DLRM(nn.Module):
    def __init__(self, dense_dim, table_sizes, emb_dim=16, bot=(512, 256, 64),
                 top=(512, 256, 1), loss_threshold=0.0):
        super().__init__()
        num_fields = len(table_sizes)
        self.emb_l = nn.ModuleList(
            [nn.EmbeddingBag(n, emb_dim, mode="sum") for n in table_sizes])
        self.bot_l = create_mlp([dense_dim, *bot[:-1], emb_dim])
        self.senet = SENETLayer(num_fields)
        self.autoint = FieldSelfAttention(emb_dim)
        n_f = num_fields + 1
        li, lj = torch.tril_indices(n_f, n_f, offset=-1)
        self.register_buffer("tril_i", li, persistent=False)
        self.register_buffer("tril_j", lj, persistent=False)
        self.register_buffer("interaction_scale", torch.ones(()))
        n_int = emb_dim + n_f * (n_f - 1) // 2 + emb_dim + 1
        self.top_l = create_mlp([n_int, *top], sigmoid_layer=len(top) - 1)
        self.loss_threshold = loss_threshold

    def apply_emb(self, lS_o, lS_i):
        return [emb(idx, off) for emb, idx, off in zip(self.emb_l, lS_i, lS_o)]

    def interact_features(self, x, ly):
        b, d = x.shape
        t = torch.cat([x] + ly, dim=1).view(b, -1, d)
        z = torch.bmm(t, t.transpose(1, 2))
        if self.training:
            with torch.no_grad():
                self.interaction_scale.mul_(0.99).add_(0.01 * z.abs().mean())  # expect: AMP004
        zflat = z[:, self.tril_i, self.tril_j]
        return torch.cat([x, zflat], dim=1)

    def forward(self, dense_x, lS_o, lS_i):
        x = self.bot_l(dense_x)
        ly = self.apply_emb(lS_o, lS_i)
        emb = self.senet(torch.stack(ly, dim=1))
        # factorisation-machine term on the re-weighted embeddings
        square_of_sum = emb.sum(dim=1) ** 2
        sum_of_square = (emb * emb).sum(dim=1)
        fm = 0.5 * (square_of_sum - sum_of_square).sum(dim=1, keepdim=True)
        att = self.autoint(emb)
        att_vec = att.mean(dim=1)  # expect: AMP004
        r = self.interact_features(x, ly)
        r = r * torch.rsqrt((r * r).mean(dim=1, keepdim=True) + 1e-10)  # expect: AMP004, AMP011
        p = self.top_l(torch.cat([r, att_vec, fm], dim=1))
        if 0.0 < self.loss_threshold < 1.0:
            p = torch.clamp(p, min=self.loss_threshold, max=1.0 - self.loss_threshold)
        return p


def load_criteo(path):
    data = np.load(path)
    x_int = np.log(data["X_int"].astype(np.float32) + 1.0)
    x_cat = data["X_cat"].astype(np.int64)
    y = data["y"].astype(np.float32)
    counts = data["counts"].tolist()
    return x_int, x_cat, y, counts


def batches(x_int, x_cat, y, batch_size, shuffle=True):
    idx = np.random.permutation(len(y)) if shuffle else np.arange(len(y))
    for s in range(0, len(y) - batch_size + 1, batch_size):
        j = idx[s:s + batch_size]
        dense = torch.from_numpy(x_int[j])
        lS_i = [torch.from_numpy(x_cat[j, k]) for k in range(x_cat.shape[1])]
        lS_o = [torch.arange(batch_size) for _ in range(x_cat.shape[1])]
        yield dense, lS_o, lS_i, torch.from_numpy(y[j]).view(-1, 1)


def logloss_auc(p, y):
    p = np.clip(p, 1e-8, 1.0 - 1e-8)
    ll = -np.mean(y * np.log(p) + (1.0 - y) * np.log(1.0 - p))
    order = np.argsort(p)
    ranks = np.empty_like(order)
    ranks[order] = np.arange(1, len(p) + 1)
    n_pos = y.sum()
    auc = (ranks[y == 1].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * (len(y) - n_pos) + 1e-8)
    return ll, auc


@torch.no_grad()
def evaluate(model, data, device, batch_size=16384):
    model.eval()
    preds, labels = [], []
    for dense, lS_o, lS_i, y in batches(*data, batch_size, shuffle=False):
        with torch.amp.autocast("cuda", dtype=torch.float16):
            p = model(dense.to(device), [o.to(device) for o in lS_o], [i.to(device) for i in lS_i])
        preds.append(p.float().cpu().numpy().ravel())
        labels.append(y.numpy().ravel())
    model.train()
    return logloss_auc(np.concatenate(preds), np.concatenate(labels))


def warm_start_bottom_mlp(model, x_int, device, steps=2000, temperature=0.1):
    """SimCLR-style warm start of the bottom MLP on dense features (bf16, no scaler)."""
    opt = torch.optim.Adam(model.bot_l.parameters(), lr=1e-3)
    for _ in range(steps):
        j = np.random.randint(0, len(x_int), size=1024)
        dense = torch.from_numpy(x_int[j]).to(device)
        noisy = dense + 0.1 * torch.randn_like(dense)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            z = model.bot_l(torch.cat([dense, noisy], dim=0))
            z = z / (z.abs().amax(dim=-1, keepdim=True) + 1e-8)
            sim = z @ z.t() / temperature
            sim = sim.masked_fill(torch.eye(sim.shape[0], dtype=torch.bool, device=device), -1e4)
            target = torch.arange(sim.shape[0], device=device).roll(1024)
            loss = F.cross_entropy(sim, target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def main(args):
    device = torch.device("cuda")
    x_int, x_cat, y, counts = load_criteo(args.data)
    n_test = len(y) // 8
    train_data = (x_int[n_test:], x_cat[n_test:], y[n_test:])
    test_data = (x_int[:n_test], x_cat[:n_test], y[:n_test])
    model = DLRM(x_int.shape[1], counts, emb_dim=args.emb_dim).to(device)
    if args.warm_start:
        warm_start_bottom_mlp(model, train_data[0], device)
    loss_fn = torch.nn.BCELoss(reduction="mean")
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    scaler = torch.cuda.amp.GradScaler()  # expect: AMP009
    t0 = time.time()
    for epoch in range(args.epochs):
        for it, (dense, lS_o, lS_i, target) in enumerate(batches(*train_data, args.batch_size)):
            dense, target = dense.to(device), target.to(device)
            lS_o, lS_i = [o.to(device) for o in lS_o], [i.to(device) for i in lS_i]
            with torch.amp.autocast("cuda", dtype=torch.float16):
                p = model(dense, lS_o, lS_i)
                loss = loss_fn(p, target)  # expect: AMP003
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if it % args.print_freq == 0:
                print(f"epoch {epoch} it {it} loss {loss.item():.5f} {time.time() - t0:.1f}s")
        ll, auc = evaluate(model, test_data, device)
        print(f"epoch {epoch} test logloss {ll:.5f} auc {auc:.5f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--emb-dim", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--print-freq", type=int, default=1024)
    p.add_argument("--warm-start", action="store_true")
    main(p.parse_args())
