"""ESMM-style multi-task CTR/CVR recommender with sparse embedding tables (DLRM-like loop, fp16 AMP)."""
import argparse
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.utils.data import DataLoader


class FeatureEmbedding(nn.Module):
    def __init__(self, field_dims, embed_dim):
        super().__init__()
        self.embeddings = nn.ModuleList([nn.Embedding(n, embed_dim, sparse=True) for n in field_dims])
        for emb in self.embeddings:
            nn.init.uniform_(emb.weight, -0.01, 0.01)

    def forward(self, sparse):
        return torch.stack([emb(sparse[:, i]) for i, emb in enumerate(self.embeddings)], dim=1)


class Tower(nn.Module):
    def __init__(self, in_dim, hidden=(256, 128), dropout=0.1):
        super().__init__()
        layers = []
        for h in hidden:
            layers += [nn.Linear(in_dim, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Dropout(dropout)]
            in_dim = h
        layers.append(nn.Linear(in_dim, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, x):
        return self.mlp(x).squeeze(-1)


class ESMM(nn.Module):
    def __init__(self, field_dims, num_dense, embed_dim=16, hidden=(256, 128)):
        super().__init__()
        self.embedding = FeatureEmbedding(field_dims, embed_dim)
        self.dense_proj = nn.Linear(num_dense, embed_dim)
        in_dim = (len(field_dims) + 1) * embed_dim
        self.ctr_tower = Tower(in_dim, hidden)
        self.cvr_tower = Tower(in_dim, hidden)
        self.reg_head = nn.Linear(in_dim, 64)

    def forward(self, dense, sparse):
        dense_emb = self.dense_proj(torch.log1p(dense.clamp(min=0))).unsqueeze(1)
        h = torch.cat([self.embedding(sparse), dense_emb], dim=1).flatten(1)
        return self.ctr_tower(h), self.cvr_tower(h), h


def train_epoch(model, loader, dense_opt, sparse_opt, scaler, criterion, device, args):
    model.train()
    clip = torch.nn.utils.clip_grad_norm_
    dense_params = [p for n, p in model.named_parameters() if not n.startswith("embedding.")]
    t0 = time.time()
    for step, (dense, sparse, click, conv) in enumerate(loader):
        dense = dense.type(torch.cuda.HalfTensor)  # expect: AMP001
        sparse = sparse.to(device, non_blocking=True)
        click, conv = click.to(device).float(), conv.to(device).float()
        with torch.autocast("cuda", dtype=torch.float16):
            ctr_logit, cvr_logit, h = model(dense, sparse)
            p_ctcvr = torch.sigmoid(ctr_logit) * torch.sigmoid(cvr_logit)
            loss_ctcvr = F.binary_cross_entropy(p_ctcvr, click * conv)  # expect: AMP003
            z = model.reg_head(h)
            std_loss = F.relu(1.0 - torch.sqrt(torch.var(z, dim=0) + 1e-4)).mean()  # expect: AMP004
        loss_ctr = criterion(ctr_logit, click)  # expect: AMP002
        loss = loss_ctr + loss_ctcvr + args.std_weight * std_loss

        dense_opt.zero_grad(set_to_none=True)
        sparse_opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(dense_opt)
        clip(dense_params, args.max_grad_norm)
        scaler.step(dense_opt)
        sparse_opt.step()  # expect: AMP006
        scaler.update()

        if step % args.log_every == 0:
            print(f"step {step}: loss {loss.item():.4f} ctr {loss_ctr.item():.4f} ctcvr {loss_ctcvr.item():.4f} "
                  f"scale {scaler.get_scale():.0f} {args.batch_size * args.log_every / (time.time() - t0):.0f} ex/s")
            t0 = time.time()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    ctr_preds, ctcvr_preds, clicks, convs = [], [], [], []
    for dense, sparse, click, conv in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            ctr_logit, cvr_logit, _ = model(dense.to(device), sparse.to(device))
        p_ctr = torch.sigmoid(ctr_logit.float())
        ctr_preds.append(p_ctr.cpu().numpy())
        ctcvr_preds.append((p_ctr * torch.sigmoid(cvr_logit.float())).cpu().numpy())
        clicks.append(click.numpy())
        convs.append((click * conv).numpy())
    ctr_auc = roc_auc_score(np.concatenate(clicks), np.concatenate(ctr_preds))
    ctcvr_auc = roc_auc_score(np.concatenate(convs), np.concatenate(ctcvr_preds))
    return ctr_auc, ctcvr_auc


@torch.no_grad()
def build_user_index(model, loader, device):
    """fp16 user vectors for the ANN service (inner-product index)."""
    model.eval()
    vecs = []
    for dense, sparse, _, _ in loader:
        _, _, h = model(dense.to(device), sparse.to(device))
        emb = model.reg_head(h).half()
        emb = F.normalize(emb, dim=-1)  # expect: AMP011
        vecs.append(emb.cpu())
    return torch.cat(vecs).numpy()


def main(train_set, val_set, field_dims, num_dense):
    p = argparse.ArgumentParser()
    p.add_argument("--batch_size", type=int, default=4096)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--dense_lr", type=float, default=1e-3)
    p.add_argument("--sparse_lr", type=float, default=1e-2)
    p.add_argument("--std_weight", type=float, default=0.01)
    p.add_argument("--max_grad_norm", type=float, default=10.0)
    p.add_argument("--log_every", type=int, default=200)
    args = p.parse_args()

    device = torch.device("cuda")
    model = ESMM(field_dims, num_dense).to(device)
    sparse_params = list(model.embedding.parameters())
    dense_params = [p for n, p in model.named_parameters() if not n.startswith("embedding.")]
    dense_opt = torch.optim.Adam(dense_params, lr=args.dense_lr)
    sparse_opt = torch.optim.SparseAdam(sparse_params, lr=args.sparse_lr)
    try:
        scaler = torch.amp.GradScaler("cuda")
    except (AttributeError, TypeError):
        scaler = torch.cuda.amp.GradScaler()
    criterion = nn.BCEWithLogitsLoss()

    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=8, pin_memory=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size * 4, num_workers=8)
    best_auc = 0.0
    for epoch in range(args.epochs):
        train_epoch(model, train_loader, dense_opt, sparse_opt, scaler, criterion, device, args)
        ctr_auc, ctcvr_auc = evaluate(model, val_loader, device)
        print(f"epoch {epoch}: CTR AUC {ctr_auc:.4f} CTCVR AUC {ctcvr_auc:.4f}")
        if ctr_auc > best_auc:
            best_auc = ctr_auc
            torch.save({"model": model.state_dict(), "scaler": scaler.state_dict()}, "esmm_best.pt")
    np.save("user_index.npy", build_user_index(model, val_loader, device))
