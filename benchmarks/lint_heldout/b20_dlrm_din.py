"""CTR model combining DLRM (embedding bags, bottom/top MLPs, pairwise dot
interactions), a FiBiNET SENET field re-weighting layer, DIN target attention
over the user's click history and an MMoE tower for two tasks (click, purchase).

Trained with CUDA fp16 autocast and a GradScaler; an auxiliary BPR ranking loss
on sampled negatives.
"""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F


def mlp(sizes, final_act=False):
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2 or final_act:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class SENETLayer(nn.Module):
    """Squeeze-and-excitation over feature fields (FiBiNET)."""

    def __init__(self, n_fields, reduction=3):
        super().__init__()
        hidden = max(1, n_fields // reduction)
        self.excite = nn.Sequential(nn.Linear(n_fields, hidden), nn.ReLU(), nn.Linear(hidden, n_fields), nn.ReLU())

    def forward(self, emb):
        # emb: (B, F, D) straight from the embedding tables
        z = emb.mean(dim=-1)
        a = self.excite(z)
        return emb * a[..., None]


class DotInteraction(nn.Module):
    def __init__(self, n_features, self_interaction=False):
        super().__init__()
        offset = 0 if self_interaction else -1
        li, lj = torch.tril_indices(n_features, n_features, offset=offset)
        self.register_buffer("li", li, persistent=False)
        self.register_buffer("lj", lj, persistent=False)

    def forward(self, dense, sparse):
        T = torch.cat([dense[:, None, :], sparse], dim=1)
        Z = torch.bmm(T, T.transpose(1, 2))
        return torch.cat([dense, Z[:, self.li, self.lj]], dim=1)


class TargetAttention(nn.Module):
    """DIN local activation unit: attention of the candidate item over history."""

    def __init__(self, dim, hidden=64):
        super().__init__()
        self.att_mlp = nn.Sequential(nn.Linear(4 * dim, hidden), nn.PReLU(), nn.Linear(hidden, 1))
        self.hist_proj = nn.Linear(dim, dim)

    def forward(self, query, hist, hist_mask):
        # query: (B, D), hist: (B, L, D), hist_mask: (B, L) bool
        q = query[:, None, :].expand_as(hist)
        scores = self.att_mlp(torch.cat([q, hist, q - hist, q * hist], dim=-1)).squeeze(-1)
        scores = scores.masked_fill(~hist_mask, -2 ** 32 + 1)  # expect: AMP007
        weights = torch.softmax(scores, dim=-1)
        interest = torch.bmm(weights[:, None, :], hist).squeeze(1)
        mean_hist = self.hist_proj(hist).mean(dim=1)  # expect: AMP004
        return torch.cat([interest, mean_hist], dim=-1)


class MMoE(nn.Module):
    def __init__(self, dim_in, dim_expert, n_experts=4, n_tasks=2):
        super().__init__()
        self.experts = nn.ModuleList([mlp([dim_in, dim_expert, dim_expert], final_act=True) for _ in range(n_experts)])
        self.gates = nn.ModuleList([nn.Linear(dim_in, n_experts) for _ in range(n_tasks)])
        self.balance_loss = None

    def forward(self, x):
        expert_out = torch.stack([e(x) for e in self.experts], dim=1)
        outs, importance = [], 0.0
        for gate in self.gates:
            g = torch.softmax(gate(x), dim=-1)
            importance = importance + g.sum(dim=0)
            outs.append((g[..., None] * expert_out).sum(dim=1))
        # coefficient of variation of expert importance (Shazeer et al.)
        self.balance_loss = importance.var() / (importance.mean() ** 2 + 1e-10)
        return outs


class CTRModel(nn.Module):
    def __init__(self, n_dense=13, table_sizes=(100000,) * 8, dim=16, item_vocab=200000, n_experts=4):
        super().__init__()
        self.tables = nn.ModuleList([nn.EmbeddingBag(n, dim, mode="sum") for n in table_sizes])
        self.item_emb = nn.Embedding(item_vocab, dim, padding_idx=0)
        self.bottom = mlp([n_dense, 128, 64, dim], final_act=True)
        self.senet = SENETLayer(len(table_sizes) + 1)
        n_feat = len(table_sizes) + 2
        self.interact = DotInteraction(n_feat)
        self.din = TargetAttention(dim)
        d_int = dim + n_feat * (n_feat - 1) // 2 + 2 * dim
        self.mmoe = MMoE(d_int, 128, n_experts)
        self.towers = nn.ModuleList([
            nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 1)) for _ in range(2)
        ])
        self.user_proj = nn.Linear(128, dim)

    def item_logits(self, x_shared, item_ids):
        # score arbitrary items (positives or sampled negatives) against the user
        u = self.user_proj(x_shared)
        return torch.bmm(self.item_emb(item_ids), u[:, :, None]).squeeze(-1)

    def forward(self, dense, sparse_idx, sparse_off, cand, hist, hist_mask, neg_items):
        x = self.bottom(torch.log1p(dense))
        sparse = torch.stack([t(i, o) for t, i, o in zip(self.tables, sparse_idx, sparse_off)], dim=1)
        cand_e = self.item_emb(cand)
        fields = self.senet(torch.cat([sparse, cand_e[:, None]], dim=1))
        z = self.interact(x, fields)
        h = torch.cat([z, self.din(cand_e, self.item_emb(hist), hist_mask)], dim=-1)
        click_h, buy_h = self.mmoe(h)
        click = self.towers[0](click_h).squeeze(-1)
        buy = self.towers[1](buy_h).squeeze(-1)
        pos = self.item_logits(click_h, cand[:, None]).squeeze(-1)
        neg = self.item_logits(click_h, neg_items)
        return click, buy, pos, neg, self.mmoe.balance_loss


def bpr_loss(pos_logits, neg_logits):
    diff = pos_logits[:, None] - neg_logits
    return -torch.log(torch.sigmoid(diff) + 1e-10).mean()  # expect: AMP011


class Trainer:
    def __init__(self, lr=1e-3, sparse_lr=0.1, device="cuda", **model_kwargs):
        model = CTRModel(**model_kwargs)
        self.model = model.to(device)
        self.device = device
        dense_params = [p for n, p in model.named_parameters() if not n.startswith(("tables", "item_emb"))]
        sparse_params = [p for n, p in model.named_parameters() if n.startswith(("tables", "item_emb"))]
        self.opt_dense = torch.optim.Adam(dense_params, lr=lr)
        self.opt_sparse = torch.optim.Adagrad(sparse_params, lr=sparse_lr)
        self.scaler = torch.amp.GradScaler("cuda")
        self.ctr_loss = nn.BCELoss()
        self.buy_loss = nn.BCEWithLogitsLoss(pos_weight=torch.tensor(20.0, device=device))

    def _to(self, batch):
        return [b.to(self.device, non_blocking=True) if torch.is_tensor(b) else
                [t.to(self.device, non_blocking=True) for t in b] for b in batch]

    def train_epoch(self, loader, bpr_weight=0.1, balance_weight=1e-2, calib_weight=0.5):
        self.model.train()
        total = 0.0
        for step, batch in enumerate(loader):
            dense, sparse_idx, sparse_off, cand, hist, hist_mask, neg, y_click, y_buy = self._to(batch)
            with torch.autocast("cuda", dtype=torch.float16):
                click, buy, pos, negs, balance = self.model(dense, sparse_idx, sparse_off, cand, hist, hist_mask, neg)
                p_click = torch.sigmoid(click)
                loss = self.ctr_loss(p_click, y_click)  # expect: AMP003
                loss = loss + self.buy_loss(buy, y_buy) + balance_weight * balance
                calib = (p_click.mean() - y_click.mean()).abs()  # expect: AMP004
                loss = loss + calib_weight * calib
            loss = loss + bpr_weight * bpr_loss(pos, negs)  # expect: AMP002
            self.opt_dense.zero_grad(set_to_none=True)
            self.opt_sparse.zero_grad(set_to_none=True)
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt_dense)
            self.scaler.step(self.opt_sparse)
            self.scaler.update()
            total += loss.item()
        return total / max(step + 1, 1)

    @torch.no_grad()
    def evaluate_auc(self, loader):
        self.model.eval()
        scores, labels = [], []
        for batch in loader:
            dense, sparse_idx, sparse_off, cand, hist, hist_mask, neg, y_click, _ = self._to(batch)
            with torch.autocast("cuda", dtype=torch.float16):
                click, _, _, _, _ = self.model(dense, sparse_idx, sparse_off, cand, hist, hist_mask, neg)
            scores.append(torch.sigmoid(click.float()))
            labels.append(y_click)
        s, l = torch.cat(scores), torch.cat(labels)
        order = s.argsort(descending=True)
        l = l[order]
        tp = l.cumsum(0)
        fp = (1 - l).cumsum(0)
        self.model.train()
        return (tp[l == 0].sum() / (tp[-1] * fp[-1]).clamp(min=1)).item()


def export_for_serving(model, path):
    """Half-precision copy of the dense towers for the online ranking service;
    the embedding tables stay fp32 and are sharded separately."""
    served = copy.deepcopy(model).eval()
    for name in ("bottom", "senet", "din", "mmoe", "towers"):
        getattr(served, name).half()
    state = {k: v for k, v in served.state_dict().items() if not k.startswith(("tables", "item_emb"))}
    torch.save(state, path)


def main(train_loader, val_loader, epochs=3):
    trainer = Trainer(lr=1e-3, sparse_lr=0.05, table_sizes=(2 ** 20,) * 8, dim=16)
    for epoch in range(epochs):
        loss = trainer.train_epoch(train_loader)
        auc = trainer.evaluate_auc(val_loader)
        print(f"epoch {epoch}: train loss {loss:.4f}, val AUC {auc:.4f}")
    export_for_serving(trainer.model, "ctr_dense_fp16.pt")
