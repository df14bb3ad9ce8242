"""Two-tower retrieval model trained with in-batch sampled softmax, logQ correction
and mixed negative sampling; CUDA fp16 autocast with a GradScaler.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

PAD = 0

USER_FEATURES = {"user_id": 2_000_000, "country": 250, "device": 16, "age_bucket": 12}
ITEM_FEATURES = {"item_id": 5_000_000, "category": 4_000, "creator": 300_000, "lang": 120}


class FrequencyEstimator(nn.Module):
    """Streaming estimate of each item's sampling probability (Yi et al., 2019)."""

    def __init__(self, n_buckets=2 ** 22, alpha=0.01):
        super().__init__()
        self.alpha = alpha
        self.n_buckets = n_buckets
        self.register_buffer("last_step", torch.zeros(n_buckets))
        self.register_buffer("delta", torch.ones(n_buckets))

    @torch.no_grad()
    def update(self, item_ids, step):
        h = item_ids % self.n_buckets
        self.delta[h] = (1 - self.alpha) * self.delta[h] + self.alpha * (step - self.last_step[h])
        self.last_step[h] = float(step)

    def prob(self, item_ids):
        return 1.0 / self.delta[item_ids % self.n_buckets].clamp_min(1.0)


class FeatureEmbedder(nn.Module):
    def __init__(self, vocab_sizes, dim):
        super().__init__()
        self.tables = nn.ModuleDict({name: nn.Embedding(n, dim) for name, n in vocab_sizes.items()})

    def forward(self, feats):
        return torch.cat([table(feats[name]) for name, table in self.tables.items()], dim=-1)


def tower_mlp(d_in, hidden, d_out):
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, d_out))


class UserTower(nn.Module):
    def __init__(self, item_table, emb_dim, n_dense, hidden, out_dim, max_hist=50):
        super().__init__()
        self.embed = FeatureEmbedder(USER_FEATURES, emb_dim)
        self.item_table = item_table                       # shared with the item tower
        self.hist_pos = nn.Parameter(torch.zeros(max_hist, emb_dim))
        self.hist_ffn = nn.Sequential(nn.Linear(emb_dim, 2 * emb_dim), nn.GELU(), nn.Linear(2 * emb_dim, emb_dim))
        self.dense_proj = nn.Linear(n_dense, emb_dim)
        self.mlp = tower_mlp(emb_dim * (len(USER_FEATURES) + 3), hidden, out_dim)

    def forward(self, sparse, dense, history):
        hist = self.item_table(history) + self.hist_pos[: history.size(1)]
        hist = hist + self.hist_ffn(hist)
        keep = (history != PAD).unsqueeze(-1)
        hist_vec = (hist * keep).sum(1) / keep.sum(1).clamp_min(1)
        # fp32 embedding stream (+ fp16 FFN residual promotes to fp32): no reduce finding
        hist_mean = hist.mean(dim=1)
        x = torch.cat([self.embed(sparse), hist_vec, hist_mean, self.dense_proj(dense)], dim=-1)
        return self.mlp(x)


class ItemTower(nn.Module):
    def __init__(self, emb_dim, n_dense, hidden, out_dim):
        super().__init__()
        self.embed = FeatureEmbedder(ITEM_FEATURES, emb_dim)
        self.dense_proj = nn.Linear(n_dense, emb_dim)
        self.mlp = tower_mlp(emb_dim * (len(ITEM_FEATURES) + 1), hidden, out_dim)

    def forward(self, sparse, dense):
        return self.mlp(torch.cat([self.embed(sparse), self.dense_proj(dense)], dim=-1))


class TwoTower(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.item = ItemTower(cfg.emb_dim, cfg.item_dense, cfg.hidden, cfg.out_dim)
        self.user = UserTower(self.item.embed.tables["item_id"], cfg.emb_dim, cfg.user_dense, cfg.hidden, cfg.out_dim)
        self.register_buffer("item_center", torch.zeros(cfg.out_dim))
        self.center_momentum = 0.9

    def encode_items(self, batch):
        return self.item(batch["item_sparse"], batch["item_dense"])

    def forward(self, batch):
        q_raw = self.user(batch["user_sparse"], batch["user_dense"], batch["history"])
        k_raw = self.encode_items(batch)
        # batch standardisation of the user embedding before the cosine
        q = (q_raw - q_raw.mean(dim=0)) / (q_raw.std(dim=0) + 1e-8)  # expect: AMP004, AMP011
        if self.training:
            with torch.no_grad():
                m = self.center_momentum
                self.item_center.mul_(m).add_(k_raw.mean(dim=0), alpha=1 - m)  # expect: AMP004
        k = k_raw - self.item_center
        return F.normalize(q, dim=-1), F.normalize(k, dim=-1)


def sampled_softmax_loss(q, k, item_ids, neg, neg_ids, freq, temperature=0.05):
    """In-batch softmax with logQ correction plus extra (mined and random) negatives."""
    logits = q @ k.t() / temperature
    hits = item_ids[None, :] == item_ids[:, None]
    hits.fill_diagonal_(False)
    logits = logits.masked_fill(hits, -1e9)  # expect: AMP007
    logits = logits - torch.log(freq.prob(item_ids))[None, :]
    # log runs in fp32 under CUDA autocast, so these logits are fp32 after the correction
    neg_logits = q @ neg.t() / temperature - torch.log(freq.prob(neg_ids))[None, :]
    neg_logits = neg_logits.masked_fill(neg_ids[None, :] == item_ids[:, None], -1e9)
    labels = torch.arange(q.size(0), device=q.device)
    return F.cross_entropy(torch.cat([logits, neg_logits], dim=1), labels)


def make_batch(raw, device):
    return {k: v.to(device, non_blocking=True) for k, v in raw.items()}


@torch.no_grad()
def refresh_negative_index(model, item_batches):
    """fp16 copy of every item embedding for hard-negative mining (half the memory)."""
    emb = torch.cat([model.encode_items(b) for b in item_batches]).half()
    return F.normalize(emb, dim=-1)  # expect: AMP011


@torch.no_grad()
def mine_hard_negatives(model, index, batch, k):
    q = F.normalize(model.user(batch["user_sparse"], batch["user_dense"], batch["history"]), dim=-1)
    sims = q.half() @ index.t()
    return sims.topk(k, dim=-1).indices.flatten().unique()


def train(cfg, loader, item_sampler):
    device = "cuda"
    model = TwoTower(cfg).to(device)
    freq = FrequencyEstimator().to(device)
    dense_params = [p for n, p in model.named_parameters() if "tables" not in n]
    sparse_params = [p for n, p in model.named_parameters() if "tables" in n]
    optimizer = torch.optim.Adam([{"params": dense_params, "weight_decay": 1e-6},
                                  {"params": sparse_params, "weight_decay": 0.0}], lr=cfg.lr)
    scaler = torch.amp.GradScaler("cuda")
    index = None
    for step, raw in enumerate(loader):
        batch = make_batch(raw, device)
        freq.update(batch["item_ids"], step)
        if step % cfg.refresh_every == 0:
            index = refresh_negative_index(model, item_sampler.index_batches())
        hard_ids = mine_hard_negatives(model, index, batch, cfg.hard_k)
        neg_batch = make_batch(item_sampler.lookup(hard_ids, extra_random=cfg.num_neg), device)
        with torch.autocast("cuda", dtype=torch.float16):
            q, k = model(batch)
            neg = F.normalize(model.encode_items(neg_batch), dim=-1)
            loss = sampled_softmax_loss(q, k, batch["item_ids"], neg, neg_batch["item_ids"], freq, cfg.temperature)
        loss = scaler.scale(loss)
        loss.backward()
        optimizer.step()  # expect: AMP006
        optimizer.zero_grad(set_to_none=True)
        if step % 1000 == 0:
            print(f"step {step} scaled loss {loss.item():.3f}")
    return model


@torch.no_grad()
def evaluate_recall(model, eval_batches, item_index_batches, k=100):
    model.eval()
    items = torch.cat([F.normalize(model.encode_items(b), dim=-1) for b in item_index_batches]).float()
    hits, total = 0, 0
    for batch in eval_batches:
        q, _ = model(batch)
        scores = (q.float() @ items.t()).float()
        scores = scores.masked_fill(batch["seen_mask"], -1e9)
        topk = scores.topk(k, dim=-1).indices
        hits += (topk == batch["target_index"][:, None]).any(-1).sum().item()
        total += q.size(0)
    model.train()
    return hits / max(total, 1)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--emb-dim", type=int, default=64)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--out-dim", type=int, default=128)
    p.add_argument("--user-dense", type=int, default=32)
    p.add_argument("--item-dense", type=int, default=48)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--num-neg", type=int, default=4096)
    p.add_argument("--temperature", type=float, default=0.05)
    p.add_argument("--refresh-every", type=int, default=2000)
    p.add_argument("--hard-k", type=int, default=8)
    return p.parse_args()


if __name__ == "__main__":
    args = parse_args()
    data = torch.load("interactions.pt")
    model = train(args, data["train_loader"], data["item_sampler"])
    recall = evaluate_recall(model, data["eval_batches"], data["item_index_batches"])
    print(f"recall@100 {recall:.4f}, chance {100 / ITEM_FEATURES['item_id']:.2e}")
