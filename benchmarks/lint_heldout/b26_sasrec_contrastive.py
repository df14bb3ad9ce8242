"""CL4SRec-style sequential recommender: a SASRec encoder trained on next-item prediction,
a sampled BPR term on the last position, and an NT-Xent loss between two augmented views
of every user history (crop / mask / reorder).
"""
import argparse
import math
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


class PointWiseFeedForward(nn.Module):
    def __init__(self, hidden_units, dropout_rate):
        super().__init__()
        self.conv1 = nn.Conv1d(hidden_units, hidden_units, kernel_size=1)
        self.dropout1 = nn.Dropout(p=dropout_rate)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv1d(hidden_units, hidden_units, kernel_size=1)
        self.dropout2 = nn.Dropout(p=dropout_rate)

    def forward(self, inputs):
        outputs = self.dropout2(self.conv2(self.relu(self.dropout1(self.conv1(inputs.transpose(-1, -2))))))
        return outputs.transpose(-1, -2) + inputs


class CausalSelfAttention(nn.Module):
    def __init__(self, hidden, n_heads, dropout):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = hidden // n_heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.attn_drop = nn.Dropout(dropout)

    def forward(self, x, pad_mask):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        causal = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device))
        scores = torch.where(causal, scores, -1e9)  # expect: AMP007
        # histories are left-padded: padded keys are never attended to
        scores = scores.masked_fill(pad_mask[:, None, None, :], -1e4)
        attn = self.attn_drop(F.softmax(scores, dim=-1))
        y = torch.matmul(attn, v).transpose(1, 2).reshape(B, T, C)
        return self.out(y)


class CL4SRec(nn.Module):
    def __init__(self, item_num, maxlen=50, hidden=64, n_blocks=2, n_heads=1, dropout=0.2, proj_dim=64):
        super().__init__()
        self.item_num = item_num
        # 0 = padding, item_num + 1 = [mask] token used by the item-mask augmentation
        self.item_emb = nn.Embedding(item_num + 2, hidden, padding_idx=0)
        self.pos_emb = nn.Embedding(maxlen, hidden)
        self.emb_dropout = nn.Dropout(p=dropout)
        self.attn_norms = nn.ModuleList([nn.LayerNorm(hidden, eps=1e-8) for _ in range(n_blocks)])
        self.attns = nn.ModuleList([CausalSelfAttention(hidden, n_heads, dropout) for _ in range(n_blocks)])
        self.ffn_norms = nn.ModuleList([nn.LayerNorm(hidden, eps=1e-8) for _ in range(n_blocks)])
        self.ffns = nn.ModuleList([PointWiseFeedForward(hidden, dropout) for _ in range(n_blocks)])
        self.last_layernorm = nn.LayerNorm(hidden, eps=1e-8)
        self.seq_proj = nn.Linear(hidden, hidden)
        self.proj_in = nn.Linear(2 * hidden, hidden)
        self.proj_out = nn.Linear(hidden, proj_dim)

    def log2feats(self, log_seqs):
        pad_mask = log_seqs.eq(0)
        seqs = self.item_emb(log_seqs) * (self.item_emb.embedding_dim ** 0.5)
        positions = torch.arange(log_seqs.size(1), device=log_seqs.device).unsqueeze(0)
        seqs = self.emb_dropout(seqs + self.pos_emb(positions))
        seqs = seqs * (~pad_mask).unsqueeze(-1)
        for i in range(len(self.attns)):
            q = self.attn_norms[i](seqs)
            seqs = q + self.attns[i](q, pad_mask)
            seqs = self.ffns[i](self.ffn_norms[i](seqs))
            seqs = seqs * (~pad_mask).unsqueeze(-1)
        return self.last_layernorm(seqs)

    def summarize(self, feats):
        h = self.seq_proj(feats)
        # last position plus an average over the whole (augmented) history
        return torch.cat([h[:, -1, :], h.mean(dim=1)], dim=-1)  # expect: AMP004

    def project(self, user):
        z = self.proj_out(F.relu(self.proj_in(user)))
        return z - z.mean(dim=0, keepdim=True)  # expect: AMP004

    def forward(self, log_seqs, pos_seqs, neg_seqs, view1=None, view2=None):
        log_feats = self.log2feats(log_seqs)
        pos_logits = (log_feats * self.item_emb(pos_seqs)).sum(dim=-1)
        neg_logits = (log_feats * self.item_emb(neg_seqs)).sum(dim=-1)
        last = log_feats[:, -1, :]
        if view1 is None:
            return pos_logits, neg_logits, last
        z1 = self.project(self.summarize(self.log2feats(view1)))
        z2 = self.project(self.summarize(self.log2feats(view2)))
        return pos_logits, neg_logits, last, z1, z2


def sampled_bpr_loss(seq_out, pos_embs, neg_embs):
    # seq_out: (B, D), pos_embs: (B, 1, D), neg_embs: (B, N, D)
    pos_logits = torch.bmm(pos_embs, seq_out.unsqueeze(-1)).squeeze(-1)
    neg_logits = torch.bmm(neg_embs, seq_out.unsqueeze(-1)).squeeze(-1)
    return -torch.log(torch.sigmoid(pos_logits - neg_logits) + 1e-24).mean()  # expect: AMP011


def nt_xent(z1, z2, temperature):
    n = z1.size(0)
    z = F.normalize(torch.cat([z1, z2], dim=0), dim=-1)
    sim = torch.matmul(z, z.t()) / temperature
    sim.fill_diagonal_(-1e9)  # expect: AMP007
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]).to(z.device)
    return F.cross_entropy(sim, targets)


class SeqDataset(Dataset):
    """Left-padded user histories with next-item targets, sampled negatives and two views."""

    def __init__(self, user_seqs, item_num, maxlen=50, n_bpr_neg=16, crop=0.6, mask=0.3, reorder=0.2):
        self.user_seqs = [s for s in user_seqs if len(s) > 1]
        self.item_num, self.maxlen, self.n_bpr_neg = item_num, maxlen, n_bpr_neg
        self.crop, self.mask, self.reorder = crop, mask, reorder

    def __len__(self):
        return len(self.user_seqs)

    def _pad(self, seq):
        seq = list(seq)[-self.maxlen:]
        return np.asarray([0] * (self.maxlen - len(seq)) + seq, dtype=np.int64)

    def _augment(self, seq):
        op = np.random.randint(3)
        seq = list(seq)
        if op == 0 and len(seq) > 2:
            L = max(1, int(self.crop * len(seq)))
            start = np.random.randint(0, len(seq) - L + 1)
            return seq[start:start + L]
        if op == 1:
            return [self.item_num + 1 if np.random.rand() < self.mask else s for s in seq]
        L = max(2, int(self.reorder * len(seq)))
        start = np.random.randint(0, max(1, len(seq) - L + 1))
        sub = seq[start:start + L]
        np.random.shuffle(sub)
        return seq[:start] + sub + seq[start + L:]

    def __getitem__(self, idx):
        full = self.user_seqs[idx]
        hist, target = full[:-1], full[1:]
        seen = set(full)
        negs = [np.random.randint(1, self.item_num + 1) for _ in target]
        negs = [n if n not in seen else 1 + (n % self.item_num) for n in negs]
        bpr_negs = np.random.randint(1, self.item_num + 1, size=self.n_bpr_neg)
        return (torch.from_numpy(self._pad(hist)), torch.from_numpy(self._pad(target)), torch.from_numpy(self._pad(negs)),
                torch.from_numpy(self._pad(self._augment(hist))), torch.from_numpy(self._pad(self._augment(hist))),
                torch.from_numpy(bpr_negs.astype(np.int64)))


@torch.no_grad()
def evaluate(model, loader, device, k=10):
    model.eval()
    ndcg, hit, n = 0.0, 0.0, 0
    for seq, target, history_mask in loader:
        seq, target, history_mask = seq.to(device), target.to(device), history_mask.to(device)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            feats = model.log2feats(seq)[:, -1, :]
            scores = feats @ model.item_emb.weight[1: model.item_num + 1].t()
        scores = scores.float()
        scores[history_mask] = -1e9
        rank = (scores > scores.gather(1, target.view(-1, 1) - 1)).sum(dim=1)
        in_top = rank < k
        ndcg += (in_top.float() / torch.log2(rank.float() + 2.0)).sum().item()
        hit += in_top.sum().item()
        n += seq.size(0)
    model.train()
    return ndcg / n, hit / n


def export_item_embeddings(model, path):
    table = model.item_emb.weight.detach().half().cpu().numpy()
    np.save(path, table)


def train(model, train_loader, eval_loader, optimizer, args, device):
    bce = nn.BCEWithLogitsLoss()
    best_ndcg = -1.0
    for epoch in range(args.epochs):
        model.train()
        for step, batch in enumerate(train_loader):
            seq, pos, neg, view1, view2, bpr_neg = (t.to(device, non_blocking=True) for t in batch)
            with torch.autocast(device_type="cuda", dtype=torch.float16):  # expect: AMP010
                pos_logits, neg_logits, last, z1, z2 = model(seq, pos, neg, view1, view2)
                valid = pos.ne(0)
                rec_loss = bce(pos_logits[valid], torch.ones_like(pos_logits[valid])) + bce(neg_logits[valid], torch.zeros_like(neg_logits[valid]))
                bpr = sampled_bpr_loss(last, model.item_emb(pos[:, -1:]), model.item_emb(bpr_neg))
                cl_loss = nt_xent(z1, z2, args.temperature)
                loss = rec_loss + args.bpr_weight * bpr + args.cl_weight * cl_loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step % 100 == 0:
                print(f"epoch {epoch} step {step} rec {rec_loss.item():.4f} bpr {bpr.item():.4f} cl {cl_loss.item():.4f}")
        ndcg, hit = evaluate(model, eval_loader, device)
        print(f"epoch {epoch}: NDCG@10 {ndcg:.4f} HR@10 {hit:.4f}")
        if ndcg > best_ndcg:
            best_ndcg = ndcg
            torch.save(model.state_dict(), os.path.join(args.out_dir, "cl4srec.pt"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="data/ml-1m.npz")
    parser.add_argument("--out_dir", default="runs/cl4srec")
    parser.add_argument("--maxlen", type=int, default=200)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--n_blocks", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--temperature", type=float, default=0.2)
    parser.add_argument("--cl_weight", type=float, default=0.1)
    parser.add_argument("--bpr_weight", type=float, default=0.5)
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)

    blob = np.load(args.data, allow_pickle=True)
    item_num = int(blob["item_num"])
    train_ds = SeqDataset(blob["train_seqs"], item_num, args.maxlen)
    eval_ds = torch.utils.data.TensorDataset(torch.from_numpy(blob["eval_seqs"]), torch.from_numpy(blob["eval_targets"]),
                                             torch.from_numpy(blob["eval_history_mask"]))
    device = torch.device("cuda")
    model = CL4SRec(item_num, maxlen=args.maxlen, hidden=args.hidden, n_blocks=args.n_blocks).to(device)
    for name, param in model.named_parameters():
        if param.dim() > 1:
            nn.init.xavier_normal_(param.data)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98))
    train(model, DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=4, drop_last=True),
          DataLoader(eval_ds, batch_size=512), optimizer, args, device)
    export_item_embeddings(model, os.path.join(args.out_dir, "item_emb_fp16.npy"))


if __name__ == "__main__":
    main()
