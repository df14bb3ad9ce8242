"""CTR model training with SAM, plus an LBFGS refinement of the output layer.

Stage 1 trains the whole network with sharpness-aware minimisation (bf16 autocast on
A100/H100, no loss scaling needed).  Stage 2 freezes the body and refits the head with
full-batch LBFGS on cached features; stage 3 fits a temperature on the validation set.

Older checkpoints were produced with ``torch.cuda.amp.autocast`` + GradScaler; they load
fine, only the optimizer state is dropped.
"""
import argparse
import logging
import math

import numpy as np
import torch as th
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch import nn

from ctr.data import build_loaders

logger = logging.getLogger("ctr")


class CTRModel(nn.Module):
    def __init__(self, field_dims, embed_dim=16, hidden=(400, 400, 400), dropout=0.1):
        super().__init__()
        self.embedding = nn.Embedding(sum(field_dims), embed_dim)
        self.register_buffer("offsets", th.tensor([0, *np.cumsum(field_dims)[:-1]]), persistent=False)
        layers, d = [], len(field_dims) * embed_dim
        for h in hidden:
            layers += [nn.Linear(d, h), nn.LayerNorm(h), nn.ReLU(), nn.Dropout(dropout)]
            d = h
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(d, 1)

    def features(self, x):
        e = self.embedding(x + self.offsets)
        return self.body(e.flatten(1))

    def forward(self, x):
        return self.head(self.features(x)).squeeze(1)


class SAM(th.optim.Optimizer):
    def __init__(self, params, base_optimizer, rho=0.05, adaptive=False, **kwargs):
        defaults = dict(rho=rho, adaptive=adaptive, **kwargs)
        super().__init__(params, defaults)
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @th.no_grad()
    def first_step(self, zero_grad=False):
        grad_norm = self._grad_norm()
        for group in self.param_groups:
            scale = group["rho"] / (grad_norm + 1e-12)
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p]["old_p"] = p.data.clone()
                e_w = (th.pow(p, 2) if group["adaptive"] else 1.0) * p.grad * scale.to(p)
                p.add_(e_w)
        if zero_grad:
            self.zero_grad()

    @th.no_grad()
    def second_step(self, zero_grad=False):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                p.data = self.state[p]["old_p"]
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()

    @th.no_grad()
    def step(self, closure=None):
        assert closure is not None, "SAM requires a closure"
        closure = th.enable_grad()(closure)
        self.first_step(zero_grad=True)
        closure()
        self.second_step()

    def _grad_norm(self):
        device = self.param_groups[0]["params"][0].device
        norms = [
            ((th.abs(p) if group["adaptive"] else 1.0) * p.grad).norm(p=2).to(device)
            for group in self.param_groups for p in group["params"] if p.grad is not None
        ]
        return th.norm(th.stack(norms), p=2)


def ctr_loss(logits, labels, pos_weight=1.0):
    """Weighted log-loss on calibrated probabilities (matches the offline metric)."""
    probs = th.sigmoid(logits)
    weight = th.where(labels > 0, th.full_like(labels, pos_weight), th.ones_like(labels))
    return F.binary_cross_entropy(probs, labels, weight=weight)  # expect: AMP003


def train_sam(model, loader, cfg, device):
    """SAM through the closure API."""
    criterion = nn.BCEWithLogitsLoss(pos_weight=th.tensor(cfg.pos_weight, device=device))
    optimizer = SAM(model.parameters(), th.optim.AdamW, rho=cfg.rho, lr=cfg.lr, weight_decay=cfg.wd)
    model.train()
    for epoch in range(cfg.epochs):
        for step, (x, y) in enumerate(loader):
            x, y = x.to(device), y.to(device).float()

            def closure():
                with th.autocast("cuda", dtype=th.bfloat16):
                    second = criterion(model(x), y)
                second.backward()
                return second

            with th.autocast("cuda", dtype=th.bfloat16):
                loss = criterion(model(x), y)
            loss.backward()
            optimizer.step(closure)
            optimizer.zero_grad(set_to_none=True)
            if step % cfg.log_every == 0:
                logger.info("sam epoch %d step %d loss %.5f", epoch, step, loss.item())
    return model


def train_sam_explicit(model, loader, cfg, device):
    """Same as ``train_sam`` but with the two steps spelled out (needed for BN handling)."""
    optimizer = SAM(model.parameters(), th.optim.SGD, rho=cfg.rho, adaptive=True,
                    lr=cfg.lr, momentum=0.9, weight_decay=cfg.wd)
    model.train()
    for epoch in range(cfg.epochs):
        for step, (x, y) in enumerate(loader):
            x, y = x.to(device), y.to(device).float()
            with th.autocast("cuda", dtype=th.bfloat16):
                loss = ctr_loss(model(x), y, cfg.pos_weight)
            loss.backward()
            optimizer.first_step(zero_grad=True)

            # second forward-backward at the perturbed point
            with th.autocast("cuda", dtype=th.bfloat16):
                perturbed = ctr_loss(model(x), y, cfg.pos_weight)
                perturbed.backward()  # expect: AMP008
            optimizer.second_step(zero_grad=True)
            if step % cfg.log_every == 0:
                logger.info("sam2 epoch %d step %d loss %.5f/%.5f", epoch, step, loss.item(), perturbed.item())
    return model


@th.no_grad()
def collect_features(model, loader, device):
    model.eval()
    feats, labels = [], []
    for x, y in loader:
        feats.append(model.features(x.to(device)).float())
        labels.append(y.to(device).float())
    return th.cat(feats), th.cat(labels)


def refine_head_lbfgs(model, loader, cfg, device):
    """Full-batch LBFGS on the output layer with the body frozen."""
    feats, labels = collect_features(model, loader, device)
    head = model.head
    head.train()
    optimizer = th.optim.LBFGS(head.parameters(), lr=1.0, max_iter=20, history_size=10,
                                  line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        with th.autocast("cuda", dtype=th.float16):  # expect: AMP010
            logits = head(feats).squeeze(1)
            loss = F.binary_cross_entropy_with_logits(logits, labels) + cfg.l2 * head.weight.pow(2).sum()
        loss.backward()
        return loss

    for r in range(cfg.lbfgs_rounds):
        loss = optimizer.step(closure)
        logger.info("lbfgs round %d loss %.6f", r, loss.item())
    return head


def fit_temperature(model, loader, device, max_iter=50):
    """Temperature scaling in fp32 on the validation logits."""
    logits, labels = predict(model, loader, device)
    log_t = th.zeros(1, device=device, requires_grad=True)
    optimizer = th.optim.LBFGS([log_t], lr=0.1, max_iter=max_iter)

    def closure():
        optimizer.zero_grad()
        loss = F.binary_cross_entropy(th.sigmoid(logits / log_t.exp()), labels)
        loss.backward()
        return loss

    optimizer.step(closure)
    return log_t.exp().item()


@th.no_grad()
def predict(model, loader, device):
    model.eval()
    outs, ys = [], []
    for x, y in loader:
        with th.autocast("cuda", dtype=th.bfloat16):
            logits = model(x.to(device))
        outs.append(logits.float())
        ys.append(y.to(device).float())
    return th.cat(outs), th.cat(ys)


@th.no_grad()
def predict_cpu(model, loader):
    """Offline scoring on the CPU boxes."""
    model.eval()
    scores = []
    with th.cpu.amp.autocast(dtype=th.bfloat16):  # expect: AMP009
        for x, _ in loader:
            scores.append(th.sigmoid(model(x)).float().numpy())
    return np.concatenate(scores)


@th.no_grad()
def evaluate(model, loader, device, pos_weight=1.0, temperature=1.0):
    logits, labels = predict(model, loader, device)
    logloss = ctr_loss(logits / temperature, labels, pos_weight).item()
    auc = roc_auc_score(labels.cpu().numpy(), logits.cpu().numpy())
    return {"logloss": logloss, "auc": auc}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--wd", type=float, default=1e-5)
    parser.add_argument("--rho", type=float, default=0.05)
    parser.add_argument("--pos-weight", type=float, default=1.0)
    parser.add_argument("--l2", type=float, default=1e-4)
    parser.add_argument("--lbfgs-rounds", type=int, default=5)
    parser.add_argument("--explicit-sam", action="store_true")
    parser.add_argument("--log-every", type=int, default=200)
    cfg = parser.parse_args()
    logging.basicConfig(level=logging.INFO)

    device = th.device("cuda")
    train_loader, val_loader, field_dims = build_loaders(cfg.data)
    model = CTRModel(field_dims).to(device)
    if cfg.explicit_sam:
        train_sam_explicit(model, train_loader, cfg, device)
    else:
        train_sam(model, train_loader, cfg, device)
    logger.info("after SAM: %s", evaluate(model, val_loader, device, cfg.pos_weight))
    refine_head_lbfgs(model, train_loader, cfg, device)
    t = fit_temperature(model, val_loader, device)
    logger.info("after LBFGS (T=%.3f): %s", t, evaluate(model, val_loader, device, cfg.pos_weight, t))
    th.save({"model": model.state_dict(), "temperature": t}, "ctr_final.pt")


if __name__ == "__main__":
    main()
