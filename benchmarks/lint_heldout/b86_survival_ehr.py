"""Discrete-time survival model on longitudinal EHR visits (CPU training, bf16 autocast).

Loss = per-interval hazard likelihood + Cox partial likelihood + a pairwise ranking
term (DeepHit-style) on the continuous risk score.
"""
import argparse
import logging

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

log = logging.getLogger("survival")


class VisitEncoder(nn.Module):
    def __init__(self, n_codes, n_static, d=128, n_bins=20):
        super().__init__()
        self.visit_proj = nn.Linear(n_codes, d)
        self.static_proj = nn.Linear(n_static, d)
        self.mlp = nn.Sequential(nn.Linear(2 * d, d), nn.SiLU(), nn.Dropout(0.1), nn.Linear(d, d), nn.SiLU())
        self.risk_head = nn.Linear(d, 1)
        self.hazard_head = nn.Linear(d, n_bins)

    def forward(self, codes, visit_mask, static):
        v = self.visit_proj(codes)
        v = v.masked_fill(~visit_mask[..., None], 0.0)
        n_visits = visit_mask.sum(dim=1, keepdim=True).clamp(min=1)
        patient = v.sum(dim=1) / n_visits  # expect: AMP004
        h = self.mlp(torch.cat([patient, self.static_proj(static)], dim=-1))
        return self.risk_head(h).squeeze(-1), self.hazard_head(h)


def cox_ph_loss(risk, durations, events):
    """Breslow partial likelihood; ties are broken by sort order."""
    risk = risk.float()
    order = torch.argsort(durations, descending=True)
    risk, events = risk[order], events[order].float()
    log_cum_hazard = torch.logcumsumexp(risk, dim=0)
    return -((risk - log_cum_hazard) * events).sum() / events.sum().clamp(min=1.0)


def concordance_ranking_loss(risk, durations, events, sigma=0.1):
    # pairs (i, j) with an observed event for i before j's time
    diff_t = durations[:, None] < durations[None, :]
    acceptable = diff_t & events[:, None].bool()
    diff_r = risk[None, :] - risk[:, None]
    per_pair = torch.exp(diff_r / sigma) * acceptable
    return per_pair.sum() / acceptable.sum().clamp(min=1)


def make_hazard_targets(bin_idx, events, n_bins):
    """Per-interval labels and the at-risk mask for the discrete-time likelihood."""
    grid = torch.arange(n_bins)[None, :]
    at_risk = (grid <= bin_idx[:, None]).float()
    target = ((grid == bin_idx[:, None]) & events[:, None].bool()).float()
    return target, at_risk


def concordance_index(risk, durations, events):
    risk, durations, events = risk.numpy(), durations.numpy(), events.numpy()
    num, den = 0.0, 0.0
    for i in np.nonzero(events)[0]:
        later = durations > durations[i]
        den += later.sum()
        num += (risk[i] > risk[later]).sum() + 0.5 * (risk[i] == risk[later]).sum()
    return num / max(den, 1.0)


def train(args, train_ds, valid_ds):
    torch.manual_seed(args.seed)
    model = VisitEncoder(args.n_codes, args.n_static, d=args.hidden, n_bins=args.n_bins)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=1e-4)
    loader = torch.utils.data.DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, drop_last=True)

    for epoch in range(args.epochs):
        model.train()
        running = 0.0
        for codes, visit_mask, static, durations, bin_idx, events in loader:
            hazard_targets, at_risk = make_hazard_targets(bin_idx, events, args.n_bins)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                risk, hazard_logits = model(codes, visit_mask, static)
                hazard = torch.sigmoid(hazard_logits)
                nll_hazard = F.binary_cross_entropy(hazard, hazard_targets, weight=at_risk)  # expect: AMP003
            cox = cox_ph_loss(risk, durations, events)
            rank = concordance_ranking_loss(risk, durations, events, sigma=args.sigma)  # expect: AMP002
            loss = nll_hazard + args.alpha * cox + args.beta * rank
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            running += loss.item()
        c_index, val_nll = evaluate(model, valid_ds, args)
        log.info("epoch %d  loss %.4f  val c-index %.4f  val hazard nll %.4f", epoch, running / len(loader), c_index, val_nll)
    return model


@torch.no_grad()
def evaluate(model, ds, args):
    model.eval()
    codes, visit_mask, static, durations, bin_idx, events = ds.tensors
    with torch.cpu.amp.autocast(dtype=torch.bfloat16):  # expect: AMP009
        risk, hazard_logits = model(codes, visit_mask, static)
        with torch.autocast("cpu", enabled=False):
            targets, at_risk = make_hazard_targets(bin_idx, events, args.n_bins)
            hazard = torch.sigmoid(hazard_logits.float())
            nll = F.binary_cross_entropy(hazard, targets, weight=at_risk)
    return concordance_index(risk.float(), durations, events), nll.item()


def load_split(path):
    blob = np.load(path)
    return torch.utils.data.TensorDataset(
        torch.from_numpy(blob["codes"]).float(),
        torch.from_numpy(blob["visit_mask"]).bool(),
        torch.from_numpy(blob["static"]).float(),
        torch.from_numpy(blob["durations"]).float(),
        torch.from_numpy(blob["bin_idx"]).long(),
        torch.from_numpy(blob["events"]).long(),
    )


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    p = argparse.ArgumentParser()
    p.add_argument("--train", default="data/ehr_train.npz")
    p.add_argument("--valid", default="data/ehr_valid.npz")
    p.add_argument("--n-codes", type=int, default=2048)
    p.add_argument("--n-static", type=int, default=24)
    p.add_argument("--n-bins", type=int, default=20)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--sigma", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    model = train(args, load_split(args.train), load_split(args.valid))
    torch.save(model.state_dict(), "survival_ehr.pt")
