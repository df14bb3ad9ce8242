"""Multi-agent trajectory forecasting (Argoverse-style) with a social transformer.

Each agent's 2 s history is encoded with temporal attention pooling, agents
attend to each other, and a K-mode Gaussian mixture head predicts 3 s futures.
"""
import argparse
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F


class TemporalAttentionPool(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        self.inp = nn.Linear(4, d_model)
        self.score = nn.Linear(d_model, 1)

    def forward(self, steps, valid):
        x = F.gelu(self.inp(steps))
        scores = self.score(x).squeeze(-1)
        scores = scores.masked_fill(~valid, torch.finfo(scores.dtype).min)
        w = scores.softmax(dim=-1)
        return (w.unsqueeze(1) @ x).squeeze(1)


class SocialAttention(nn.Module):
    def __init__(self, d_model, n_heads=4):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ff = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.scale = (d_model // n_heads) ** -0.5

    def forward(self, h, agent_mask):
        b, n, d = h.shape
        q, k, v = self.qkv(h).view(b, n, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) * self.scale
        scores = scores.masked_fill(~agent_mask[:, None, None, :], -1e9)  # expect: AMP007
        ctx = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, n, d)
        h = h + self.proj(ctx)
        return h + self.ff(h)


class GMMHead(nn.Module):
    def __init__(self, d_model, horizon=30, n_modes=6):
        super().__init__()
        self.horizon, self.n_modes = horizon, n_modes
        self.traj = nn.Linear(d_model, n_modes * horizon * 4)
        self.mode = nn.Linear(d_model, n_modes)

    def forward(self, h):
        b, n, _ = h.shape
        out = self.traj(h).view(b, n, self.n_modes, self.horizon, 4)
        return {
            "mu": out[..., :2],
            "log_sigma": out[..., 2:].clamp(-7.0, 7.0),
            "pi_logits": self.mode(h),
        }


class TrajFormer(nn.Module):
    def __init__(self, d_model=128, n_layers=3, horizon=30, n_modes=6):
        super().__init__()
        self.encoder = TemporalAttentionPool(d_model)
        self.social = nn.ModuleList([SocialAttention(d_model) for _ in range(n_layers)])
        self.head = GMMHead(d_model, horizon, n_modes)

    def forward(self, hist, agent_mask, valid):
        b, n, t, _ = hist.shape
        origin = hist[:, :, -1:, :2]
        rel = torch.cat([hist[..., :2] - origin, hist[..., 2:]], dim=-1)
        h = self.encoder(rel.view(b * n, t, -1), valid.view(b * n, t)).view(b, n, -1)
        for layer in self.social:
            h = layer(h, agent_mask)
        pred = self.head(h)
        pred["mu"] = pred["mu"] + origin.unsqueeze(2)
        return pred


def gmm_nll_loss(pred, fut, agent_mask):
    pred = {k: v.float() for k, v in pred.items()}
    diff = (fut.unsqueeze(2) - pred["mu"]) * torch.exp(-pred["log_sigma"])
    log_prob = -0.5 * diff.pow(2).sum(-1) - pred["log_sigma"].sum(-1)
    log_mix = F.log_softmax(pred["pi_logits"], dim=-1) + log_prob.sum(-1)
    nll = -torch.logsumexp(log_mix, dim=-1)
    return nll[agent_mask].mean()


@torch.no_grad()
def evaluate_min_ade(model, loader, device):
    model.eval()
    ades = []
    for hist, fut, agent_mask, valid in loader:
        pred = model(hist.to(device), agent_mask.to(device), valid.to(device))
        err = (pred["mu"].float() - fut.to(device).unsqueeze(2)).norm(dim=-1).mean(-1)
        ades.append(err.min(dim=-1).values[agent_mask.to(device)].mean().item())
    model.train()
    return sum(ades) / max(len(ades), 1)


def predict(model, hist, agent_mask, valid, half=False):
    hist = hist.half() if half else hist
    with torch.inference_mode():
        return model(hist, agent_mask, valid)


def export_torchscript(model, path):
    scripted = torch.jit.script(copy.deepcopy(model).eval().half())
    torch.jit.save(scripted, path)


def train(args, train_loader, val_loader):
    device = torch.device("cuda")
    model = TrajFormer(d_model=args.d_model, n_modes=args.n_modes).to(device)
    model = model.half()  # expect: AMP001
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)  # expect: AMP011
    weight_dtype = next(model.parameters()).dtype
    best_ade = 1e9
    for epoch in range(args.epochs):
        for hist, fut, agent_mask, valid in train_loader:
            hist = hist.to(device, dtype=weight_dtype)
            fut, agent_mask, valid = fut.to(device), agent_mask.to(device), valid.to(device)
            loss = gmm_nll_loss(model(hist, agent_mask, valid), fut, agent_mask)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        ade = evaluate_min_ade(model, val_loader, device)
        if ade < best_ade:
            best_ade = ade
            torch.save({"model": model.state_dict(), "epoch": epoch}, args.ckpt)
    return best_ade


def finetune(args, ckpt_path, train_loader):
    device = torch.device("cuda")
    model = TrajFormer(d_model=args.d_model, n_modes=args.n_modes).to(device)
    model.load_state_dict(torch.load(ckpt_path, map_location=device)["model"])
    model.encoder.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr * 0.1)
    for hist, fut, agent_mask, valid in train_loader:
        hist, fut = hist.to(device), fut.to(device)
        agent_mask, valid = agent_mask.to(device), valid.to(device)
        with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
            loss = gmm_nll_loss(model(hist, agent_mask, valid), fut, agent_mask)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    export_torchscript(model, args.ckpt.replace(".pt", "_ts_fp16.pt"))
    return model


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--d-model", dest="d_model", type=int, default=128)
    parser.add_argument("--n-modes", dest="n_modes", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=36)
    parser.add_argument("--ckpt", default="trajformer.pt")
    cli_args = parser.parse_args()
    from argoverse_loader import build_loaders  # project-local

    tr, va = build_loaders(cli_args)
    train(cli_args, tr, va)
    finetune(cli_args, cli_args.ckpt, tr)
