"""FT-Transformer for tabular data with piecewise-linear numeric embeddings (PLE),
a TabNet-style feature gate, SCARF/Barlow-Twins pre-training and supervised fine-tuning.
"""
import argparse
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def compute_bins(x_num: torch.Tensor, n_bins: int):
    qs = torch.linspace(0.0, 1.0, n_bins + 1)
    return [torch.unique(torch.quantile(x_num[:, j], qs)) for j in range(x_num.shape[1])]


class PiecewiseLinearEncoding(nn.Module):
    def __init__(self, bins):
        super().__init__()
        n_bins = max(len(b) - 1 for b in bins)
        left = torch.zeros(len(bins), n_bins)
        width = torch.ones(len(bins), n_bins)
        for i, b in enumerate(bins):
            left[i, : len(b) - 1] = b[:-1]
            width[i, : len(b) - 1] = b[1:] - b[:-1]
        self.register_buffer("left", left)
        self.register_buffer("width", width)

    def forward(self, x):  # (B, F) fp32 -> (B, F, n_bins)
        t = (x[..., None] - self.left) / self.width
        return torch.cat([t[..., :1].clamp(max=1.0), t[..., 1:-1].clamp(0.0, 1.0), t[..., -1:].clamp(min=0.0)], dim=-1)


class PLEEmbeddings(nn.Module):
    """PLE followed by a per-feature linear layer and ReLU ("Q-LR" in Gorishniy et al.)."""

    def __init__(self, bins, d_token):
        super().__init__()
        self.ple = PiecewiseLinearEncoding(bins)
        n_bins = self.ple.left.shape[1]
        self.weight = nn.Parameter(torch.randn(len(bins), n_bins, d_token) / math.sqrt(n_bins))
        self.bias = nn.Parameter(torch.zeros(len(bins), d_token))

    def forward(self, x):
        e = self.ple(x)
        return F.relu((e[..., None] * self.weight).sum(dim=-2) + self.bias)


class FeatureGate(nn.Module):
    """Soft feature selection on the tokens; returns the gated tokens and the mask entropy."""

    def __init__(self, d_token):
        super().__init__()
        self.fc = nn.Linear(d_token, 1)

    def forward(self, tokens):
        m = torch.sigmoid(self.fc(tokens).squeeze(-1))
        logm = torch.log(m + 1e-15)  # expect: AMP011
        entropy = -(m * logm).sum(dim=-1).mean()
        return tokens * m[..., None], entropy


class MultiheadAttention(nn.Module):
    def __init__(self, d, n_heads, dropout):
        super().__init__()
        self.n_heads, self.d_head = n_heads, d // n_heads
        self.W_q, self.W_k, self.W_v, self.W_out = (nn.Linear(d, d) for _ in range(4))
        self.dropout = nn.Dropout(dropout)

    def _split(self, x):
        b, n, _ = x.shape
        return x.view(b, n, self.n_heads, self.d_head).transpose(1, 2)

    def forward(self, x_q, x_kv):
        q, k, v = self._split(self.W_q(x_q)), self._split(self.W_k(x_kv)), self._split(self.W_v(x_kv))
        probs = F.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.d_head), dim=-1)
        x = (self.dropout(probs) @ v).transpose(1, 2).flatten(2)
        return self.W_out(x), probs


class ReGLU(nn.Module):
    def forward(self, x):
        a, b = x.chunk(2, dim=-1)
        return a * F.relu(b)


class Block(nn.Module):
    def __init__(self, d, n_heads, ffn_d, dropout, first):
        super().__init__()
        self.attn_norm = nn.Identity() if first else nn.LayerNorm(d)
        self.attn = MultiheadAttention(d, n_heads, dropout)
        self.ffn_norm = nn.LayerNorm(d)
        self.ffn = nn.Sequential(nn.Linear(d, 2 * ffn_d), ReGLU(), nn.Dropout(dropout), nn.Linear(ffn_d, d))

    def forward(self, x):
        a, probs = self.attn(self.attn_norm(x), self.attn_norm(x))
        x = x + a
        return x + self.ffn(self.ffn_norm(x)), probs


class PoolingHead(nn.Module):
    def __init__(self, d, d_out, pool="cls"):
        super().__init__()
        self.pool = pool
        self.norm = nn.LayerNorm(d)
        self.proj = nn.Linear(d, d)
        self.out = nn.Linear(d, d_out)

    def forward(self, x):
        h = F.relu(self.proj(self.norm(x)))
        pooled = h.mean(dim=1) if self.pool == "mean" else h[:, 0]  # expect: AMP004
        return self.out(pooled)


class FTTransformer(nn.Module):
    def __init__(self, bins, cat_cardinalities, d_out, d=192, n_blocks=3, n_heads=8, pool="cls"):
        super().__init__()
        self.num_emb = PLEEmbeddings(bins, d)
        self.cat_emb = nn.ModuleList(nn.Embedding(c, d) for c in cat_cardinalities)
        self.cls = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        self.gate = FeatureGate(d)
        self.blocks = nn.ModuleList(Block(d, n_heads, int(d * 4 / 3), 0.1, first=(i == 0)) for i in range(n_blocks))
        self.head = PoolingHead(d, d_out, pool)
        self.proj_head = nn.Sequential(nn.Linear(d, 256), nn.ReLU(), nn.Linear(256, 256))

    def project(self, cls_token):
        z = self.proj_head(cls_token)
        z = (z - z.mean(dim=0)) / (z.std(dim=0) + 1e-10)  # expect: AMP004, AMP011
        return z

    def forward(self, x_num, x_cat, with_projection=False):
        tokens = [self.num_emb(x_num)] + [emb(x_cat[:, i])[:, None] for i, emb in enumerate(self.cat_emb)]
        x = torch.cat(tokens, dim=1)
        x, gate_entropy = self.gate(x)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)
        attn_maps = []
        for block in self.blocks:
            x, probs = block(x)
            attn_maps.append(probs)
        importance = torch.stack(attn_maps).mean(dim=(0, 2))[:, 0, 1:]
        out = {"logits": self.head(x), "gate_entropy": gate_entropy, "importance": importance.detach()}
        if with_projection:
            out["z"] = self.project(x[:, 0])
        return out


def corrupt(x_num, x_cat, rate):
    """SCARF: replace a random subset of features by values drawn from other rows."""
    mask = torch.rand_like(x_num) < rate
    x_num = torch.where(mask, x_num[torch.randperm(x_num.shape[0])], x_num)
    cmask = torch.rand(x_cat.shape, device=x_cat.device) < rate
    return x_num, torch.where(cmask, x_cat[torch.randperm(x_cat.shape[0])], x_cat)


def barlow_twins_loss(z1, z2, lambd=5e-3):
    c = z1.T @ z2 / z1.shape[0]
    on_diag = (torch.diagonal(c) - 1).pow(2).sum()
    off_diag = c.flatten()[:-1].view(c.shape[0] - 1, c.shape[0] + 1)[:, 1:].pow(2).sum()
    return on_diag + lambd * off_diag


def pretrain(model, loader, optimizer, scaler, epochs, rate=0.3):
    model.train()
    for _ in range(epochs):
        for x_num, x_cat, _ in loader:
            x_num, x_cat = x_num.cuda(), x_cat.cuda()
            with torch.autocast("cuda", dtype=torch.float16):
                z1 = model(*corrupt(x_num, x_cat, rate), with_projection=True)["z"]
                z2 = model(x_num, x_cat, with_projection=True)["z"]
                loss = barlow_twins_loss(z1, z2)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            optimizer.step()  # expect: AMP006


def finetune(model, loader, optimizer, scaler, task, accum_steps=2, gate_coef=1e-3):
    model.train()
    for step, (x_num, x_cat, y) in enumerate(loader):
        x_num, x_cat, y = x_num.cuda(), x_cat.cuda(), y.cuda()
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x_num, x_cat)
            logits = out["logits"].squeeze(-1)
            if task == "binclass":
                loss = F.binary_cross_entropy(torch.sigmoid(logits), y)  # expect: AMP003
            else:
                loss = F.mse_loss(logits, y)
            loss = (loss + gate_coef * out["gate_entropy"]) / accum_steps
        scaler.scale(loss).backward()
        if (step + 1) % accum_steps == 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)


@torch.inference_mode()
def evaluate(model, loader, task):
    model.eval()
    correct, n, sq = 0.0, 0, 0.0
    for x_num, x_cat, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(x_num.cuda(), x_cat.cuda())["logits"].squeeze(-1).float()
        y = y.cuda()
        if task == "binclass":
            correct += ((logits > 0).float() == y).float().sum().item()
        else:
            sq += (logits - y).pow(2).sum().item()
        n += y.numel()
    return correct / n if task == "binclass" else math.sqrt(sq / n)


def export_for_serving(model, path):
    serving = copy.deepcopy(model).half().eval()
    torch.save(serving.state_dict(), path)


def param_groups(model, wd):
    no_decay = ("norm", "bias", "cls", "num_emb", "cat_emb")
    decay = [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)]
    rest = [p for n, p in model.named_parameters() if any(k in n for k in no_decay)]
    return [{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="binclass", choices=["binclass", "regression"])
    ap.add_argument("--pretrain_epochs", type=int, default=20)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--pool", default="mean", choices=["cls", "mean"])
    args = ap.parse_args()
    x_num, x_cat = torch.randn(4096, 12), torch.randint(0, 5, (4096, 3))
    y = (x_num[:, 0] > 0).float() if args.task == "binclass" else x_num[:, :3].sum(1)
    ds = torch.utils.data.TensorDataset(x_num, x_cat, y)
    loader = torch.utils.data.DataLoader(ds, batch_size=256, shuffle=True, drop_last=True)
    model = FTTransformer(compute_bins(x_num, 48), [5, 5, 5], d_out=1, pool=args.pool).cuda()
    scaler = torch.amp.GradScaler("cuda")
    opt = torch.optim.AdamW(param_groups(model, 1e-5), lr=1e-4)
    pretrain(model, loader, opt, scaler, args.pretrain_epochs)
    opt = torch.optim.AdamW(param_groups(model, 1e-5), lr=3e-5)
    for epoch in range(args.epochs):
        finetune(model, loader, opt, scaler, args.task)
        print(f"epoch {epoch}: {evaluate(model, loader, args.task):.4f}")
    export_for_serving(model, "ft_transformer_fp16.pt")


if __name__ == "__main__":
    main()
