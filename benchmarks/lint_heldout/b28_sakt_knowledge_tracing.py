"""SAKT: Self-Attentive Knowledge Tracing, with an elapsed-time encoder.

Predicts whether a student answers the next exercise correctly from the sequence of
past (exercise, correctness, elapsed-time) interactions.
"""
import argparse
import copy
import math
import os
from typing import Dict, List

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.utils.data import DataLoader, Dataset


def future_mask(seq_len: int, device) -> torch.Tensor:
    return torch.triu(torch.ones(seq_len, seq_len, device=device, dtype=torch.bool), diagonal=1)


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.1):
        super().__init__()
        assert d_model % n_heads == 0
        self.h = n_heads
        self.d_k = d_model // n_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, query, key, value, mask=None):
        bsz, lq, _ = query.shape
        lk = key.size(1)
        q = self.q_proj(query).view(bsz, lq, self.h, self.d_k).transpose(1, 2)
        k = self.k_proj(key).view(bsz, lk, self.h, self.d_k).transpose(1, 2)
        v = self.v_proj(value).view(bsz, lk, self.h, self.d_k).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        if mask is not None:
            scores = scores.masked_fill(mask, -1e9)  # expect: AMP007
        attn = F.softmax(scores, dim=-1)
        out = torch.matmul(self.dropout(attn), v)
        out = out.transpose(1, 2).contiguous().view(bsz, lq, -1)
        return self.out_proj(out), attn


class ElapsedTimeEncoder(nn.Module):
    """Projects the (clipped) answer time and standardises it over the sequence."""

    def __init__(self, d_model: int, max_seconds: float = 300.0):
        super().__init__()
        self.max_seconds = max_seconds
        self.proj = nn.Linear(1, d_model)

    def forward(self, elapsed):
        t = torch.clamp(elapsed, 0, self.max_seconds) / self.max_seconds
        h = self.proj(t.unsqueeze(-1))
        mu = h.mean(dim=1, keepdim=True)  # expect: AMP004
        sigma = h.std(dim=1, keepdim=True)  # expect: AMP004
        return (h - mu) / (sigma + 1e-5)


class FeedForward(nn.Module):
    def __init__(self, d_model: int, dropout: float):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.ReLU(), nn.Dropout(dropout),
                                 nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        return self.net(x)


class SAKT(nn.Module):
    def __init__(self, n_skills: int, max_seq: int = 100, d_model: int = 128, n_heads: int = 8, dropout: float = 0.2):
        super().__init__()
        self.n_skills = n_skills
        self.interaction_emb = nn.Embedding(2 * n_skills + 1, d_model, padding_idx=0)
        self.exercise_emb = nn.Embedding(n_skills + 1, d_model, padding_idx=0)
        self.pos_emb = nn.Embedding(max_seq, d_model)
        self.time_enc = ElapsedTimeEncoder(d_model)
        self.attn = MultiHeadAttention(d_model, n_heads, dropout)
        self.norm1 = nn.LayerNorm(d_model)
        self.ffn = FeedForward(d_model, dropout)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)
        self.pred = nn.Linear(d_model, 1)

    def forward(self, interactions, exercises, elapsed):
        seq_len = interactions.size(1)
        pos = torch.arange(seq_len, device=interactions.device).unsqueeze(0)
        x = self.interaction_emb(interactions) + self.pos_emb(pos) + self.time_enc(elapsed)
        e = self.exercise_emb(exercises)
        att_out, att_w = self.attn(e, x, x, mask=future_mask(seq_len, x.device))
        h = self.norm1(self.dropout(att_out) + e)
        h = self.norm2(h + self.dropout(self.ffn(h)))
        return torch.sigmoid(self.pred(h)).squeeze(-1), att_w


# --------------------------------------------------------------------------- data
class KTDataset(Dataset):
    def __init__(self, groups: Dict[int, tuple], n_skills: int, max_seq: int = 100):
        self.samples: List[tuple] = []
        self.n_skills = n_skills
        self.max_seq = max_seq
        for uid, (skills, correct, elapsed) in groups.items():
            if len(skills) < 2:
                continue
            for start in range(0, len(skills), max_seq):
                end = min(start + max_seq + 1, len(skills))
                if end - start >= 2:
                    self.samples.append((skills[start:end], correct[start:end], elapsed[start:end]))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        skills, correct, elapsed = self.samples[idx]
        n = len(skills) - 1
        interaction = np.zeros(self.max_seq, dtype=np.int64)
        exercise = np.zeros(self.max_seq, dtype=np.int64)
        label = np.zeros(self.max_seq, dtype=np.int64)
        elapsed_arr = np.zeros(self.max_seq, dtype=np.float32)
        mask = np.zeros(self.max_seq, dtype=bool)
        interaction[-n:] = skills[:-1] + correct[:-1] * self.n_skills
        exercise[-n:] = skills[1:]
        label[-n:] = correct[1:]
        elapsed_arr[-n:] = elapsed[:-1]
        mask[-n:] = True
        return {"interaction": interaction, "exercise": exercise, "elapsed": elapsed_arr,
                "label": label, "mask": mask}


def load_groups(csv_path: str):
    df = pd.read_csv(csv_path, usecols=["user_id", "skill_id", "correct", "elapsed_time"])
    df = df.dropna().sort_values(["user_id"], kind="stable")
    skill_ids = {s: i + 1 for i, s in enumerate(sorted(df.skill_id.unique()))}
    df["skill"] = df.skill_id.map(skill_ids)
    groups = df.groupby("user_id").apply(
        lambda r: (r.skill.values, r.correct.values.astype(np.int64), r.elapsed_time.values / 1000.0))
    return groups.to_dict(), len(skill_ids)


# --------------------------------------------------------------------------- train / eval
def train_epoch(model, loader, optimizer, scheduler, scaler, device, ent_weight=0.0):
    model.train()
    total, n = 0.0, 0
    for batch in loader:
        interactions = batch["interaction"].to(device)
        exercises = batch["exercise"].to(device)
        elapsed = batch["elapsed"].to(device, dtype=torch.float16)  # expect: AMP001
        labels = batch["label"].to(device).float()
        valid = batch["mask"].to(device)

        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            probs, att_w = model(interactions, exercises, elapsed)
            loss = F.binary_cross_entropy(probs[valid], labels[valid])  # expect: AMP003
            if ent_weight > 0:
                ent = -(att_w * torch.log(att_w + 1e-9)).sum(-1).mean()
                loss = loss - ent_weight * ent
        loss = scaler.scale(loss)
        loss.backward()
        optimizer.step()  # expect: AMP006
        scheduler.step()
        total += loss.item() / scaler.get_scale()
        n += 1
    return total / max(n, 1)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    preds, targets = [], []
    for batch in loader:
        interactions = batch["interaction"].to(device)
        exercises = batch["exercise"].to(device)
        elapsed = batch["elapsed"].to(device, dtype=torch.float16)
        valid = batch["mask"].to(device)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            probs, _ = model(interactions, exercises, elapsed)
        preds.append(probs[valid].float().cpu())
        targets.append(batch["label"][batch["mask"]].float())
    p = torch.cat(preds)
    t = torch.cat(targets)
    val_loss = F.binary_cross_entropy(p.clamp(1e-6, 1 - 1e-6), t).item()
    return roc_auc_score(t.numpy(), p.numpy()), val_loss


@torch.inference_mode()
def predict_next_response(model, skills, correct, elapsed, next_skill, n_skills, device, max_seq=100):
    serve = copy.deepcopy(model).half().eval()
    skills, correct, elapsed = skills[-max_seq:], correct[-max_seq:], elapsed[-max_seq:]
    inter = torch.zeros(1, max_seq, dtype=torch.long, device=device)
    ex = torch.zeros(1, max_seq, dtype=torch.long, device=device)
    el = torch.zeros(1, max_seq, dtype=torch.float16, device=device)
    n = len(skills)
    inter[0, -n:] = torch.as_tensor(np.asarray(skills) + np.asarray(correct) * n_skills, device=device)
    ex[0, -n:] = torch.as_tensor(list(skills[1:]) + [next_skill], device=device)
    el[0, -n:] = torch.as_tensor(elapsed, device=device).half()
    probs, _ = serve(inter, ex, el)
    return float(probs[0, -1])


def main():
    parser = argparse.ArgumentParser(description="SAKT training")
    parser.add_argument("--csv", default="data/assist2017.csv")
    parser.add_argument("--max-seq", type=int, default=100)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dropout", type=float, default=0.2)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--ent-weight", type=float, default=0.0)
    parser.add_argument("--save-dir", default="checkpoints/sakt")
    args = parser.parse_args()

    torch.manual_seed(0)
    np.random.seed(0)
    device = torch.device("cuda")
    groups, n_skills = load_groups(args.csv)
    users = np.random.permutation(list(groups.keys()))
    cut = int(0.8 * len(users))
    train_ds = KTDataset({u: groups[u] for u in users[:cut]}, n_skills, args.max_seq)
    val_ds = KTDataset({u: groups[u] for u in users[cut:]}, n_skills, args.max_seq)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=4, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, num_workers=4)

    model = SAKT(n_skills, args.max_seq, args.d_model, args.heads, args.dropout).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, epochs=args.epochs,
                                                    steps_per_epoch=len(train_loader))
    scaler = torch.cuda.amp.GradScaler()  # expect: AMP009

    os.makedirs(args.save_dir, exist_ok=True)
    best_auc, patience, bad = 0.0, 5, 0
    for epoch in range(args.epochs):
        train_loss = train_epoch(model, train_loader, optimizer, scheduler, scaler, device, args.ent_weight)
        auc, val_loss = evaluate(model, val_loader, device)
        print(f"epoch {epoch:02d} train {train_loss:.4f} val {val_loss:.4f} auc {auc:.4f}")
        if auc > best_auc:
            best_auc, bad = auc, 0
            torch.save(model.state_dict(), os.path.join(args.save_dir, "sakt_best.pt"))
        else:
            bad += 1
            if bad >= patience:
                break
    print(f"best val AUC {best_auc:.4f}")


if __name__ == "__main__":
    main()
