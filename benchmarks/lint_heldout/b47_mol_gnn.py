"""Dense SchNet-style GNN for molecular property prediction (QM9 regression, Tox21).

Runs on CPU nodes with bf16 autocast (AMX); no loss scaling is needed for bf16.
Older versions of this script used torch.cpu.amp.autocast; see get_cpu_autocast().
"""
import argparse
import copy
import functools
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def get_cpu_autocast(dtype=torch.bfloat16):
    try:
        return functools.partial(torch.amp.autocast, "cpu", dtype=dtype)
    except AttributeError:
        return functools.partial(torch.cpu.amp.autocast, dtype=dtype)


def gaussian_rbf(dist, n_rbf=50, cutoff=5.0):
    centers = torch.linspace(0.0, cutoff, n_rbf, device=dist.device, dtype=dist.dtype)
    gamma = 10.0 / cutoff
    return torch.exp(-gamma * (dist[..., None] - centers) ** 2)


class DenseInteraction(nn.Module):
    def __init__(self, hidden, n_rbf):
        super().__init__()
        self.filter = nn.Sequential(nn.Linear(n_rbf, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.lin_in = nn.Linear(hidden, hidden, bias=False)
        self.lin_out = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, h, rbf, env):
        msg = self.filter(rbf) * self.lin_in(h)[:, None, :, :]
        agg = torch.einsum("bijh,bij->bih", msg, env.to(msg.dtype))
        return h + self.lin_out(self.norm(agg))


class MolNet(nn.Module):
    def __init__(self, num_tasks, hidden=128, layers=4, n_rbf=50, cutoff=5.0, pool="sum"):
        super().__init__()
        self.embedding = nn.Embedding(100, hidden, padding_idx=0)
        self.layers = nn.ModuleList([DenseInteraction(hidden, n_rbf) for _ in range(layers)])
        self.readout = nn.Sequential(nn.Linear(hidden, hidden // 2), nn.SiLU(), nn.Linear(hidden // 2, num_tasks))
        self.n_rbf, self.cutoff, self.pool = n_rbf, cutoff, pool

    def forward(self, z, pos, node_mask):
        dist = (pos[:, :, None, :] - pos[:, None, :, :]).float().norm(dim=-1)
        eye = torch.eye(z.shape[1], dtype=torch.bool, device=z.device)
        adj = node_mask[:, :, None] & node_mask[:, None, :] & (dist < self.cutoff) & ~eye
        env = 0.5 * (torch.cos(dist * math.pi / self.cutoff) + 1.0) * adj
        rbf = gaussian_rbf(dist, self.n_rbf, self.cutoff)
        h = self.embedding(z)
        for layer in self.layers:
            h = layer(h, rbf, env)
        node_out = self.readout(h).masked_fill(~node_mask[..., None], 0.0)
        if self.pool == "sum":
            return node_out.sum(dim=1)  # expect: AMP004
        n_atoms = node_mask.sum(dim=1, keepdim=True).clamp(min=1)
        return node_out.sum(dim=1, dtype=torch.float32) / n_atoms


def target_statistics(dataset):
    y = np.stack([np.asarray(d["y"], dtype=np.float64) for d in dataset])
    return torch.from_numpy(y.mean(0)).float(), torch.from_numpy(y.std(0) + 1e-8).float()


def train_epoch(model, loader, optimizer, ema_model, y_mean, y_std, args):
    model.train()
    use_amp = args.precision == "bf16"
    for step, batch in enumerate(loader):
        z, pos, node_mask = batch["z"], batch["pos"], batch["node_mask"]
        y = (batch["y"] - y_mean) / y_std
        if use_amp:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                pred = model(z, pos, node_mask)
                loss = F.l1_loss(pred.float(), y)
        else:
            pred = model(z, pos, node_mask)
            loss = F.l1_loss(pred, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        ema_model.update_parameters(model)
        if step % 200 == 0:
            print(f"step {step} l1 {loss.item():.4f} grad {grad_norm:.3f}")


def finetune_tox21(model, loader, args):
    """Multi-label toxicity (12 binary tasks, missing labels masked out)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * 0.3, weight_decay=1e-5)
    model.train()
    for batch in loader:
        pos = batch["pos"].to(torch.bfloat16)  # expect: AMP001
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(batch["z"], pos, batch["node_mask"])
            probs = torch.sigmoid(logits)
            loss = F.binary_cross_entropy(probs, batch["y"], weight=batch["label_mask"])  # expect: AMP003
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def finetune_tox21_logits(model, loader, args):
    """Same task, numerically safe: BCE with logits in fp32 and a per-task positive weight."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * 0.3, weight_decay=1e-5)
    pos_weight = torch.as_tensor(args.pos_weight, dtype=torch.float32)
    model.train()
    for batch in loader:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(batch["z"], batch["pos"], batch["node_mask"])
            raw = F.binary_cross_entropy_with_logits(logits.float(), batch["y"], pos_weight=pos_weight,
                                                     reduction="none")
            loss = (raw * batch["label_mask"]).sum() / batch["label_mask"].sum().clamp(min=1.0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def overfit_single_batch(model, batch, steps=200, lr=1e-3):
    """Debug helper: the loss must go to ~0 on one batch, else the pipeline is broken."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for it in range(steps):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pred = model(batch["z"], batch["pos"], batch["node_mask"])
            loss = F.mse_loss(pred.float(), batch["y"])
            loss.backward()  # expect: AMP008
        optimizer.step()
        if it % 50 == 0:
            print(f"overfit {it}: {loss.item():.5f}")
    return loss.item()


@torch.no_grad()
def evaluate(model, loader, y_mean, y_std):
    model.eval()
    amp_ctx = get_cpu_autocast()
    abs_err, n = 0.0, 0
    for batch in loader:
        with amp_ctx():
            pred = model(batch["z"], batch["pos"], batch["node_mask"])
        pred = pred.float() * y_std + y_mean
        abs_err += (pred - batch["y"]).abs().sum().item()
        n += batch["y"].numel()
    model.train()
    return abs_err / max(1, n)


def export_for_inference(model, path):
    torch.save(copy.deepcopy(model).to(torch.bfloat16).state_dict(), path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    parser.add_argument("--task", choices=["qm9", "tox21"], default="qm9")
    parser.add_argument("--pool", choices=["sum", "mean"], default="sum")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--clip", type=float, default=10.0)
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--pos-weight", type=float, nargs="*", default=[1.0] * 12)
    args = parser.parse_args()
    torch.set_num_threads(16)
    train_set, loaders = build_qm9(args)  # noqa: F821  (project helper)
    model = MolNet(num_tasks=12, pool=args.pool)
    if args.task == "tox21":
        finetune_tox21_logits(model, loaders["tox21"], args)
        return
    y_mean, y_std = target_statistics(train_set)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, eps=1e-8, weight_decay=0.0)
    ema_model = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.999))
    overfit_single_batch(copy.deepcopy(model), next(iter(loaders["train"])))
    best_mae = math.inf
    for _ in range(args.epochs):
        train_epoch(model, loaders["train"], optimizer, ema_model, y_mean, y_std, args)
        mae = evaluate(ema_model.module, loaders["valid"], y_mean, y_std)
        if mae < best_mae:
            best_mae = mae
            export_for_inference(ema_model.module, "molnet_best_bf16.pt")
    finetune_tox21(model, loaders["tox21"], args)


if __name__ == "__main__":
    main()
