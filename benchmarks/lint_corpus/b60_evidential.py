"""Evidential deep learning classifier with Dirichlet outputs.

The network outputs non-negative evidence e for each class; alpha = e + 1 parametrises a
Dirichlet over class probabilities (Sensoy et al., 2018).  Backbone: a convolutional stem,
two linear-attention blocks over the spatial tokens and a 1x1 conv head with global
average pooling.  Loss: the Fisher-weighted squared-error Bayes risk (I-EDL, Deng et al.,
2023), an annealed KL towards the uniform Dirichlet, and a log-evidence term for the true
class.  Mixed precision: fp16 autocast with a GradScaler.
"""
import argparse
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class ConvStem(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.conv1 = nn.Conv2d(3, ch // 2, 3, 2, 1)
        self.gn1 = nn.GroupNorm(8, ch // 2, eps=1e-8)
        self.conv2 = nn.Conv2d(ch // 2, ch, 3, 2, 1)

    def forward(self, x):
        x = F.gelu(self.gn1(self.conv1(x)))
        return self.conv2(x)


class LinearAttention(nn.Module):
    """Kernelised attention (Katharopoulos et al., 2020) with phi(x) = elu(x) + 1."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.to_qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        qkv = self.to_qkv(x).view(b, n, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        q = F.elu(q) + 1.0
        k = F.elu(k) + 1.0
        kv = k.transpose(-2, -1) @ v
        num = q @ kv
        den = q @ k.sum(dim=2, keepdim=True).transpose(-2, -1)
        out = num / (den + 1e-8)  # expect: AMP011
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class AttnBlock(nn.Module):
    def __init__(self, dim, heads, mlp_ratio=2):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = LinearAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, dim * mlp_ratio), nn.GELU(), nn.Linear(dim * mlp_ratio, dim)
        )

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class EvidentialNet(nn.Module):
    def __init__(self, num_classes=10, dim=128, heads=4, depth=2):
        super().__init__()
        self.stem = ConvStem(dim)
        self.blocks = nn.ModuleList([AttnBlock(dim, heads) for _ in range(depth)])
        self.conv_out = nn.Conv2d(dim, 2 * dim, 1)
        self.head = nn.Linear(2 * dim, num_classes)

    def forward(self, img):
        h = self.stem(img)
        b, c, hh, ww = h.shape
        tokens = h.flatten(2).transpose(1, 2)
        for blk in self.blocks:
            tokens = blk(tokens)
        h = tokens.transpose(1, 2).reshape(b, c, hh, ww)
        pooled = self.conv_out(h).mean(dim=(2, 3))  # expect: AMP004
        return F.relu(self.head(F.gelu(pooled)))


def fisher_mse_loss(evidence, y_onehot):
    """Squared-error Bayes risk weighted by the Dirichlet's Fisher information (I-EDL)."""
    alpha = evidence + 1.0
    alpha0 = alpha.sum(dim=-1, keepdim=True)
    trigamma = torch.polygamma(1, alpha)
    trigamma0 = torch.polygamma(1, alpha0)
    gap = y_onehot - alpha / alpha0
    mse = (gap.pow(2) * trigamma).sum(dim=-1)
    var = (alpha * (alpha0 - alpha) * trigamma / (alpha0 * alpha0 * (alpha0 + 1.0))).sum(dim=-1)
    log_det = torch.log(trigamma + 1e-10).sum(dim=-1)  # expect: AMP011
    log_det = log_det + torch.log(1.0 - (trigamma0 / trigamma).sum(dim=-1) + 1e-8)
    return (mse + var - 0.01 * log_det).mean()


def kl_to_uniform(evidence, y_onehot, num_classes):
    """KL(Dir(alpha_tilde) || Dir(1)) with the true-class evidence removed."""
    alpha = evidence + 1.0
    alpha_tilde = y_onehot + (1.0 - y_onehot) * alpha
    s = alpha_tilde.sum(dim=-1, keepdim=True)
    kl = (torch.lgamma(s) - math.lgamma(num_classes)
          - torch.lgamma(alpha_tilde).sum(dim=-1, keepdim=True)
          + ((alpha_tilde - 1.0) * (torch.digamma(alpha_tilde) - torch.digamma(s))).sum(dim=-1, keepdim=True))
    return kl.mean()


def evidence_regulariser(evidence, y):
    """Push evidence up on the true class; ReLU regions with zero evidence get no other signal."""
    true_ev = evidence.gather(1, y[:, None]).squeeze(1)
    log_ev = torch.log(true_ev + 1e-8)  # expect: AMP011
    return -log_ev.mean()


def dirichlet_stats(evidence):
    alpha = evidence.float() + 1.0
    s = alpha.sum(dim=-1, keepdim=True)
    probs = alpha / s
    vacuity = alpha.size(-1) / s.squeeze(-1)
    entropy = -(probs * torch.log(probs.clamp(min=1e-10))).sum(dim=-1)
    return probs, vacuity, entropy


def auroc(scores_pos, scores_neg):
    scores = np.concatenate([scores_pos, scores_neg])
    labels = np.concatenate([np.ones_like(scores_pos), np.zeros_like(scores_neg)])
    order = np.argsort(-scores)
    tps = np.cumsum(labels[order])
    fps = np.cumsum(1 - labels[order])
    tpr = tps / (tps[-1] + 1e-12)
    fpr = fps / (fps[-1] + 1e-12)
    return float(np.sum(np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2.0))


@torch.no_grad()
def evaluate(model, batches, ood_batches, device):
    model.eval()
    correct, n, vac_in, vac_out = 0, 0, [], []
    for x, y in batches:
        probs, vacuity, _ = dirichlet_stats(model(x.to(device)))
        correct += (probs.argmax(-1).cpu() == y).sum().item()
        n += y.size(0)
        vac_in.append(vacuity.cpu().numpy())
    for x in ood_batches:
        _, vacuity, _ = dirichlet_stats(model(x.to(device)))
        vac_out.append(vacuity.cpu().numpy())
    model.train()
    return correct / n, auroc(np.concatenate(vac_out), np.concatenate(vac_in))


@torch.no_grad()
def select_pseudo_labels(model, pool, device, min_margin=0.5, max_vacuity=0.2):
    """Self-training: keep unlabelled images whose evidence is confident and decisive (bf16)."""
    model.eval()
    keep_x, keep_y = [], []
    for x in pool:
        x = x.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            evidence = model(x)
            top2 = evidence.topk(2, dim=-1).values
            margin = (top2[:, 0] - top2[:, 1]) / (top2[:, 0] + 1e-8)
            vacuity = evidence.size(-1) / (evidence.sum(dim=-1) + evidence.size(-1))
        keep = (margin > min_margin) & (vacuity < max_vacuity)
        keep_x.append(x[keep].cpu())
        keep_y.append(evidence.argmax(dim=-1)[keep].cpu())
    model.train()
    return list(zip(torch.cat(keep_x).split(128), torch.cat(keep_y).split(128)))


def synthetic_batches(n_batches, batch_size, num_classes, seed):
    g = torch.Generator().manual_seed(seed)
    protos = torch.randn(num_classes, 3, 1, 1, generator=g)
    out = []
    for _ in range(n_batches):
        y = torch.randint(0, num_classes, (batch_size,), generator=g)
        x = protos[y] + 0.8 * torch.randn(batch_size, 3, 32, 32, generator=g)
        out.append((x, y))
    return out


def train(args):
    device = torch.device("cuda")
    model = EvidentialNet(args.classes, args.dim).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05, eps=1e-8)
    scaler = torch.amp.GradScaler("cuda")
    base_batches = synthetic_batches(200, args.batch_size, args.classes, seed=0)
    train_batches = base_batches
    pool = [x for x, _ in synthetic_batches(10, 256, args.classes, seed=2)]
    val_batches = synthetic_batches(20, 256, args.classes, seed=1)
    ood_batches = [torch.rand(256, 3, 32, 32) * 4.0 - 2.0 for _ in range(5)]

    for epoch in range(args.epochs):
        anneal = min(1.0, epoch / max(1, args.anneal_epochs))
        running = 0.0
        for x, y in train_batches:
            x, y = x.to(device), y.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                evidence = model(x)
                y1 = F.one_hot(y, args.classes).float()
                loss = fisher_mse_loss(evidence, y1)
                loss = loss + anneal * kl_to_uniform(evidence, y1, args.classes)
                loss = loss + args.reg_weight * evidence_regulariser(evidence, y)
                optimizer.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()  # expect: AMP008
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            running += loss.item()

        acc, ood_auc = evaluate(model, val_batches, ood_batches, device)
        print(f"epoch {epoch}: loss {running / len(train_batches):.4f} acc {acc:.3f} "
              f"vacuity AUROC {ood_auc:.3f} (kl weight {anneal:.2f})")
        if epoch + 1 >= args.self_train_from:
            pseudo = select_pseudo_labels(model, pool, device)
            train_batches = base_batches + pseudo
            print(f"  self-training with {sum(len(b[1]) for b in pseudo)} pseudo-labelled images")
    return model


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--anneal-epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--reg-weight", type=float, default=0.01)
    p.add_argument("--self-train-from", type=int, default=10)
    p.add_argument("--out", default="edl.pt")
    return p.parse_args()


def main():
    args = parse_args()
    torch.manual_seed(0)
    model = train(args)
    torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    main()
