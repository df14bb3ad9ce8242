"""Long-document classifier (LRA-style) that interleaves local windowed softmax attention
with Performer FAVOR+ linear attention. Trains in bf16 autocast.
"""
import argparse
import math
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


def orthogonal_matrix_chunk(cols, device=None):
    unstructured = torch.randn((cols, cols), device="cpu")
    q, _ = torch.linalg.qr(unstructured, mode="reduced")
    return q.to(device).t()


def gaussian_orthogonal_random_matrix(nb_rows, nb_columns, device=None):
    nb_full_blocks = nb_rows // nb_columns
    blocks = [orthogonal_matrix_chunk(nb_columns, device) for _ in range(nb_full_blocks)]
    remaining = nb_rows - nb_full_blocks * nb_columns
    if remaining > 0:
        blocks.append(orthogonal_matrix_chunk(nb_columns, device)[:remaining])
    final = torch.cat(blocks)
    multiplier = torch.randn((nb_rows, nb_columns), device=device).norm(dim=1)
    return torch.diag(multiplier) @ final


def softmax_kernel(data, projection_matrix, is_query, normalize_data=True, eps=1e-4):
    # positive random features for exp(q.k / sqrt(d)) (Choromanski et al., 2021)
    data_normalizer = (data.shape[-1] ** -0.25) if normalize_data else 1.0
    ratio = projection_matrix.shape[0] ** -0.5
    data_dash = torch.matmul(data_normalizer * data, projection_matrix.t())
    diag_data = ((data ** 2).sum(dim=-1) / 2.0 * (data_normalizer ** 2)).unsqueeze(-1)
    if is_query:
        stab = data_dash.amax(dim=-1, keepdim=True).detach()
    else:
        stab = data_dash.amax(dim=(-1, -2), keepdim=True).detach()
    return ratio * (torch.exp(data_dash - diag_data - stab) + eps)


def linear_attention(q, k, v):
    k_sum = k.sum(dim=-2)
    denom = torch.matmul(q, k_sum.unsqueeze(-1))
    context = torch.matmul(k.transpose(-2, -1), v)
    return torch.matmul(q, context) / (denom + 1e-8)


class FastAttention(nn.Module):
    def __init__(self, dim_heads, nb_features=None):
        super().__init__()
        self.dim_heads = dim_heads
        self.nb_features = nb_features or int(dim_heads * math.log(dim_heads))
        self.register_buffer("projection_matrix", gaussian_orthogonal_random_matrix(self.nb_features, dim_heads))

    @torch.no_grad()
    def redraw_projection_matrix(self):
        fresh = gaussian_orthogonal_random_matrix(self.nb_features, self.dim_heads, device=self.projection_matrix.device)
        self.projection_matrix.copy_(fresh)

    def forward(self, q, k, v, key_mask=None):
        q = softmax_kernel(q, self.projection_matrix, is_query=True)
        k = softmax_kernel(k, self.projection_matrix, is_query=False)
        if key_mask is not None:
            k = k.masked_fill(~key_mask[:, None, :, None], 0.0)
        return linear_attention(q, k, v)


class PerformerSelfAttention(nn.Module):
    def __init__(self, dim, heads=8, dim_head=64, nb_features=256, dropout=0.0, center_keys=True):
        super().__init__()
        inner = heads * dim_head
        self.heads = heads
        self.center_keys = center_keys
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.fast_attention = FastAttention(dim_head, nb_features)
        self.to_out = nn.Linear(inner, dim)
        self.dropout = nn.Dropout(dropout)

    def _heads(self, t):
        b, n, _ = t.shape
        return t.view(b, n, self.heads, -1).transpose(1, 2)

    def forward(self, x, mask=None):
        q = self.to_q(x)
        k = self.to_k(x)
        v = self.to_v(x)
        if self.center_keys:
            # a shared offset on every key leaves softmax attention unchanged but keeps exp() in range
            k = k - k.mean(dim=1, keepdim=True)  # expect: AMP004
        out = self.fast_attention(self._heads(q), self._heads(k), self._heads(v), key_mask=mask)
        b, h, n, d = out.shape
        return self.dropout(self.to_out(out.transpose(1, 2).reshape(b, n, h * d)))


class LocalSelfAttention(nn.Module):
    """Non-overlapping windowed softmax attention."""

    def __init__(self, dim, heads=8, dim_head=64, window_size=128, dropout=0.0):
        super().__init__()
        self.heads = heads
        self.dim_head = dim_head
        self.window_size = window_size
        self.scale = dim_head ** -0.5
        self.to_qkv = nn.Linear(dim, heads * dim_head * 3, bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, mask=None):
        b, n, _ = x.shape
        w = self.window_size
        pad = (w - n % w) % w
        if mask is None:
            mask = torch.ones(b, n, dtype=torch.bool, device=x.device)
        x = F.pad(x, (0, 0, 0, pad))
        key_mask = F.pad(mask, (0, pad), value=False).view(b, 1, -1, 1, w)
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = (t.view(b, -1, w, self.heads, self.dim_head).permute(0, 3, 1, 2, 4) for t in (q, k, v))
        sim = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        sim = sim.masked_fill(~key_mask, -torch.finfo(sim.dtype).max)
        attn = self.dropout(sim.softmax(dim=-1))
        out = torch.matmul(attn, v).permute(0, 2, 3, 1, 4).reshape(b, -1, self.heads * self.dim_head)
        return self.to_out(out[:, :n])


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


class ScaleNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.g = nn.Parameter(torch.tensor(dim ** 0.5))
        self.eps = eps

    def forward(self, x):
        return x / torch.norm(x, dim=-1, keepdim=True).clamp(min=self.eps) * self.g


class GEGLU(nn.Module):
    def __init__(self, dim, mult=4, dropout=0.0):
        super().__init__()
        self.proj_in = nn.Linear(dim, dim * mult * 2)
        self.proj_out = nn.Linear(dim * mult, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        x, gate = self.proj_in(x).chunk(2, dim=-1)
        return self.proj_out(self.dropout(x * F.gelu(gate)))


class Block(nn.Module):
    def __init__(self, dim, heads, dim_head, attn_type, nb_features, window_size, dropout):
        super().__init__()
        self.norm1 = RMSNorm(dim)
        if attn_type == "performer":
            self.attn = PerformerSelfAttention(dim, heads, dim_head, nb_features, dropout)
        else:
            self.attn = LocalSelfAttention(dim, heads, dim_head, window_size, dropout)
        self.norm2 = ScaleNorm(dim)
        self.ff = GEGLU(dim, dropout=dropout)

    def forward(self, x, mask=None):
        x = x + self.attn(self.norm1(x), mask)
        return x + self.ff(self.norm2(x))


class ClassificationHead(nn.Module):
    def __init__(self, dim, num_classes, dropout=0.1):
        super().__init__()
        self.dense = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout)
        self.out = nn.Linear(dim, num_classes)

    def forward(self, x, mask=None):
        h = self.dense(x)
        if mask is None:
            pooled = h.mean(dim=1)  # expect: AMP004
        else:
            m = mask.unsqueeze(-1).float()
            pooled = (h * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
        return self.out(self.dropout(torch.tanh(pooled)))


class LongDocClassifier(nn.Module):
    def __init__(self, vocab_size, num_classes, max_len=4096, dim=512, depth=6, heads=8, dim_head=64,
                 nb_features=256, window_size=128, dropout=0.1):
        super().__init__()
        self.token_emb = nn.Embedding(vocab_size, dim, padding_idx=0)
        self.pos_emb = nn.Embedding(max_len, dim)
        self.layers = nn.ModuleList([
            Block(dim, heads, dim_head, "local" if i % 2 == 0 else "performer", nb_features, window_size, dropout)
            for i in range(depth)
        ])
        self.norm = nn.LayerNorm(dim)
        self.head = ClassificationHead(dim, num_classes, dropout)

    def forward(self, tokens, mask=None, labels=None):
        pos = torch.arange(tokens.size(1), device=tokens.device)
        x = self.token_emb(tokens) + self.pos_emb(pos)
        for layer in self.layers:
            x = layer(x, mask)
        logits = self.head(self.norm(x), mask)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits, labels, label_smoothing=0.1)
        return logits, loss

    @torch.no_grad()
    def redraw_random_features(self):
        for module in self.modules():
            if isinstance(module, FastAttention):
                module.redraw_projection_matrix()


class TokenFileDataset(Dataset):
    def __init__(self, path, max_len):
        blob = np.load(path, allow_pickle=True)
        self.docs, self.labels, self.max_len = blob["docs"], blob["labels"], max_len

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        ids = np.asarray(self.docs[i][: self.max_len], dtype=np.int64)
        tokens = np.zeros(self.max_len, dtype=np.int64)
        tokens[: len(ids)] = ids
        return torch.from_numpy(tokens), torch.from_numpy(tokens != 0), int(self.labels[i])


@torch.inference_mode()
def evaluate(model, loader, device):
    model.eval()
    correct = total = 0
    for tokens, mask, labels in loader:
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            logits, _ = model(tokens.to(device), mask.to(device))
        correct += (logits.argmax(-1).cpu() == labels).sum().item()
        total += labels.numel()
    model.train()
    return correct / max(total, 1)


def export_bf16_checkpoint(model, path):
    state = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in model.state_dict().items()}
    torch.save(state, path)


def train(args):
    device = torch.device("cuda")
    train_loader = DataLoader(TokenFileDataset(args.train, args.max_len), batch_size=args.batch_size, shuffle=True, num_workers=4, drop_last=True)
    val_loader = DataLoader(TokenFileDataset(args.val, args.max_len), batch_size=args.batch_size, num_workers=4)
    model = LongDocClassifier(args.vocab_size, args.num_classes, max_len=args.max_len, dim=args.dim, depth=args.depth).to(device)

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "emb" in name else decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.98))
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010

    step, best = 0, 0.0
    for epoch in range(args.epochs):
        for tokens, mask, labels in train_loader:
            tokens, mask, labels = tokens.to(device), mask.to(device), labels.to(device)
            if step % args.redraw_every == 0:
                model.redraw_random_features()
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                logits, loss = model(tokens, mask, labels)
                loss = loss / args.grad_accum
            scaler.scale(loss).backward()
            if (step + 1) % args.grad_accum == 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
            step += 1
        acc = evaluate(model, val_loader, device)
        print(f"epoch {epoch}: val acc {acc:.4f}")
        if acc > best:
            best = acc
            export_bf16_checkpoint(model, os.path.join(args.out_dir, "best_bf16.pt"))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--train", default="data/lra_text/train.npz")
    p.add_argument("--val", default="data/lra_text/val.npz")
    p.add_argument("--out_dir", default="runs/performer")
    p.add_argument("--vocab_size", type=int, default=256)
    p.add_argument("--num_classes", type=int, default=2)
    p.add_argument("--max_len", type=int, default=4096)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--weight_decay", type=float, default=0.05)
    p.add_argument("--grad_accum", type=int, default=1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--redraw_every", type=int, default=1000)
    args = p.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    train(args)
