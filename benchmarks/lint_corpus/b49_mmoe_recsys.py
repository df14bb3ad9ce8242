"""Multi-gate Mixture-of-Experts (MMoE) for joint CTR / CVR prediction.

Sparse id features go through per-field embeddings, dense features are
concatenated, a shared bottom feeds the experts and each task has its own
softmax gate and tower.
"""
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

SPARSE_FIELDS = {"user_id": 200_000, "item_id": 500_000, "cate_id": 5_000, "shop_id": 80_000, "hour": 24}
TASKS = ("ctr", "cvr")


class MMoEOutput(NamedTuple):
    ctr_logit: torch.Tensor
    cvr_logit: torch.Tensor
    shared: torch.Tensor
    gate_importance: torch.Tensor


class Tower(nn.Module):
    def __init__(self, d_in, d_hidden=64):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.gain = nn.Parameter(torch.ones(d_hidden))
        self.out = nn.Linear(d_hidden, 1)

    def _rms_scale(self, h):
        rms = torch.sqrt((h * h).mean(dim=-1, keepdim=True) + 1e-8)  # expect: AMP004, AMP011
        return h / rms * self.gain

    def forward(self, x):
        h = self._rms_scale(self.fc1(x))
        return self.out(F.relu(h)).squeeze(-1), h


class MMoE(nn.Module):
    def __init__(self, emb_dim=16, d_dense=13, d_shared=256, n_experts=6, d_expert=128):
        super().__init__()
        self.embeddings = nn.ModuleDict({k: nn.Embedding(n, emb_dim) for k, n in SPARSE_FIELDS.items()})
        d_in = emb_dim * len(SPARSE_FIELDS) + d_dense
        self.shared_bottom = nn.Sequential(nn.Linear(d_in, d_shared), nn.ReLU(), nn.Linear(d_shared, d_shared))
        self.experts = nn.ModuleList(
            [nn.Sequential(nn.Linear(d_shared, d_expert), nn.ReLU()) for _ in range(n_experts)]
        )
        self.gates = nn.ModuleDict({t: nn.Linear(d_shared, n_experts) for t in TASKS})
        self.towers = nn.ModuleDict({t: Tower(d_expert) for t in TASKS})

    def forward(self, sparse, dense):
        emb = torch.cat([self.embeddings[k](sparse[k]) for k in SPARSE_FIELDS] + [dense], dim=-1)
        shared = self.shared_bottom(emb)
        expert_out = torch.stack([expert(shared) for expert in self.experts], dim=1)
        logits, importance = {}, 0.0
        for name, tower in self.towers.items():
            gate = torch.softmax(self.gates[name](shared), dim=-1)
            importance = importance + gate.mean(dim=0)
            mixed = torch.einsum("be,bed->bd", gate.to(expert_out.dtype), expert_out)
            logits[name], hidden = tower(mixed)
            logits[name + "_repr"] = F.normalize(hidden, dim=-1)
        return MMoEOutput(logits["ctr"], logits["cvr"], shared, importance)


def load_balance_loss(importance):
    return importance.float().var() / (importance.float().mean() ** 2 + 1e-10)


@torch.no_grad()
def evaluate_auc(model, loader, device):
    from sklearn.metrics import roc_auc_score

    model.eval()
    scores, labels = {t: [] for t in TASKS}, {t: [] for t in TASKS}
    for sparse, dense, y_click, y_conv in loader:
        sparse = {k: v.to(device) for k, v in sparse.items()}
        out = model(sparse, dense.to(device))
        scores["ctr"].append(torch.sigmoid(out.ctr_logit.float()).cpu())
        scores["cvr"].append(torch.sigmoid(out.cvr_logit.float()).cpu())
        labels["ctr"].append(y_click)
        labels["cvr"].append(y_conv)
    model.train()
    return {t: roc_auc_score(torch.cat(labels[t]).numpy(), torch.cat(scores[t]).numpy()) for t in TASKS}


def train(cfg, train_loader, val_loader):
    device = torch.device("cuda")
    model = MMoE(n_experts=cfg["n_experts"]).to(device)
    dense_params = [p for n, p in model.named_parameters() if not n.startswith("embeddings")]
    optimizer = torch.optim.Adam(
        [{"params": model.embeddings.parameters(), "lr": cfg["emb_lr"]}, {"params": dense_params}], lr=cfg["lr"]
    )
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 12)
    for epoch in range(cfg["epochs"]):
        for it, (sparse, dense, y_click, y_conv) in enumerate(train_loader):
            sparse = {k: v.to(device, non_blocking=True) for k, v in sparse.items()}
            dense, y_click, y_conv = dense.to(device), y_click.to(device).float(), y_conv.to(device).float()
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(sparse, dense)
                spread = out.shared.var(dim=0)  # expect: AMP004
                decorrelation = -torch.log(spread + 1e-4).mean()
                balance = load_balance_loss(out.gate_importance)
            ctr_loss = F.binary_cross_entropy_with_logits(out.ctr_logit, y_click)  # expect: AMP002
            clicked = y_click > 0
            cvr_loss = F.binary_cross_entropy_with_logits(out.cvr_logit[clicked].float(), y_conv[clicked])
            loss = ctr_loss + cfg["cvr_weight"] * cvr_loss + cfg["aux_weight"] * (decorrelation + balance)
            optimizer.zero_grad(set_to_none=True)
            loss = scaler.scale(loss)
            loss.backward()
            optimizer.step()  # expect: AMP006
            if it % cfg["log_every"] == 0:
                print(f"epoch {epoch} it {it} ctr {ctr_loss.item():.4f} cvr {cvr_loss.item():.4f}")
        print(f"epoch {epoch}: auc {evaluate_auc(model, val_loader, device)}")
    return model


DEFAULT_CFG = {
    "n_experts": 6,
    "lr": 1e-3,
    "emb_lr": 5e-3,
    "epochs": 3,
    "cvr_weight": 1.0,
    "aux_weight": 0.01,
    "log_every": 200,
}


if __name__ == "__main__":
    from ali_ccp import build_loaders  # project-local AliCCP reader

    tr, va = build_loaders(batch_size=4096)
    train(DEFAULT_CFG, tr, va)
