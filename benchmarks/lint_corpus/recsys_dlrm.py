"""Click-through-rate model (DLRM-like): embedding bags, interaction, BCE with logits."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class DLRM(nn.Module):
    def __init__(self, num_embeddings, dim=64, dense_in=13):
        super().__init__()
        self.embs = nn.ModuleList([nn.EmbeddingBag(n, dim, mode="sum") for n in num_embeddings])
        self.bottom = nn.Sequential(nn.Linear(dense_in, 256), nn.ReLU(), nn.Linear(256, dim), nn.ReLU())
        n = len(num_embeddings) + 1
        self.top = nn.Sequential(nn.Linear(dim + n * (n - 1) // 2, 512), nn.ReLU(), nn.Linear(512, 1))

    def forward(self, dense, sparse_idx, sparse_off):
        x = self.bottom(dense)
        ly = [emb(sparse_idx[i], sparse_off[i]) for i, emb in enumerate(self.embs)]
        T = torch.stack([x] + ly, dim=1)
        Z = torch.bmm(T, T.transpose(1, 2))
        li, lj = torch.tril_indices(T.size(1), T.size(1), offset=-1)
        return self.top(torch.cat([x, Z[:, li, lj]], dim=1)).squeeze(-1)


def train(model, loader, epochs, lr=0.1, use_amp=True):
    model = model.cuda()
    dense_params = [p for n, p in model.named_parameters() if not n.startswith("embs")]
    sparse_params = [p for n, p in model.named_parameters() if n.startswith("embs")]
    opt_dense = torch.optim.Adam(dense_params, lr=1e-3)
    opt_sparse = torch.optim.SGD(sparse_params, lr=lr)
    scaler = torch.amp.GradScaler("cuda", enabled=use_amp)
    for _ in range(epochs):
        for dense, sparse_idx, sparse_off, labels in loader:
            with torch.autocast("cuda", dtype=torch.float16, enabled=use_amp):
                logits = model(dense.cuda(), sparse_idx, sparse_off)
                loss = F.binary_cross_entropy_with_logits(logits, labels.cuda().float())
            opt_dense.zero_grad()
            opt_sparse.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt_dense)
            scaler.step(opt_sparse)
            scaler.update()


def train_calibrated(model, loader, epochs, use_amp=True):
    """Variant with a calibration term computed on probabilities."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda", enabled=use_amp)
    for _ in range(epochs):
        for dense, sparse_idx, sparse_off, labels in loader:
            with torch.autocast("cuda", dtype=torch.float16, enabled=use_amp):
                logits = model(dense.cuda(), sparse_idx, sparse_off)
                probs = torch.sigmoid(logits)
                bce = F.binary_cross_entropy(probs, labels.cuda().float())  # expect: AMP003
                calib = (probs.mean() - labels.cuda().float().mean()).abs()  # expect: AMP004
                loss = bce + 0.1 * calib
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()


@torch.no_grad()
def auc_eval(model, loader):
    model.eval()
    scores, labels_all = [], []
    for dense, sparse_idx, sparse_off, labels in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            scores.append(torch.sigmoid(model(dense.cuda(), sparse_idx, sparse_off)).float().cpu())
        labels_all.append(labels)
    return torch.cat(scores), torch.cat(labels_all)
