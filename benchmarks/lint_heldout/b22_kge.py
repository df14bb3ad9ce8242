"""Inductive knowledge-graph embedding: entities encoded from their text features,
ComplEx scoring, N3 regularisation and self-adversarial negative sampling (RotatE paper)."""
import torch
import torch.nn.functional as F
from torch import nn


class EntityEncoder(nn.Module):
    """Maps precomputed entity description features to complex embeddings [re | im]."""

    def __init__(self, feat_dim, rank, dropout=0.1):
        super().__init__()
        self.proj = nn.Sequential(nn.Linear(feat_dim, 2 * rank), nn.GELU(), nn.Dropout(dropout),
                                  nn.Linear(2 * rank, 2 * rank))

    def forward(self, feats):
        return self.proj(feats)


class InductiveComplEx(nn.Module):
    def __init__(self, entity_feats, num_relations, rank=256, init_size=1e-3):
        super().__init__()
        self.rank = rank
        self.register_buffer("entity_feats", entity_feats)
        self.entity_encoder = EntityEncoder(entity_feats.size(1), rank)
        self.relation_emb = nn.Embedding(num_relations, 2 * rank)
        self.relation_emb.weight.data.mul_(init_size)
        self.rel_proj = nn.Linear(2 * rank, 2 * rank)

    def encode_entities(self, idx):
        return self.entity_encoder(self.entity_feats[idx])

    def encode_relations(self, idx):
        return self.rel_proj(self.relation_emb(idx))

    def split(self, x):
        return x[..., : self.rank], x[..., self.rank:]

    def score(self, h, r, t):
        re_h, im_h = self.split(h)
        re_r, im_r = self.split(r)
        re_t, im_t = self.split(t)
        prod = re_h * re_r * re_t + im_h * re_r * im_t + re_h * im_r * im_t - im_h * im_r * re_t
        # average over the rank so the score scale does not depend on it
        return prod.mean(dim=-1)  # expect: AMP004

    def forward(self, sample):
        h = self.encode_entities(sample[:, 0]).unsqueeze(1)
        r = self.encode_relations(sample[:, 1]).unsqueeze(1)
        t = self.encode_entities(sample[:, 2]).unsqueeze(1)
        return self.score(h, r, t)

    def score_negatives(self, positive, negative, mode):
        r = self.encode_relations(positive[:, 1]).unsqueeze(1)
        neg = self.encode_entities(negative.reshape(-1)).view(negative.size(0), negative.size(1), -1)
        if mode == "head-batch":
            t = self.encode_entities(positive[:, 2]).unsqueeze(1)
            return self.score(neg, r, t)
        h = self.encode_entities(positive[:, 0]).unsqueeze(1)
        return self.score(h, r, neg)

    def complex_modulus(self, x):
        re, im = self.split(x)
        return torch.sqrt(re * re + im * im + 1e-10)  # expect: AMP011

    def n3_regularizer(self, sample):
        h = self.encode_entities(sample[:, 0])
        r = self.encode_relations(sample[:, 1])
        t = self.encode_entities(sample[:, 2])
        reg = (self.complex_modulus(h) ** 3).sum() + (self.complex_modulus(r) ** 3).sum()
        reg = reg + (self.complex_modulus(t) ** 3).sum()
        return reg / h.shape[0]

    def score_all_tails(self, sample, all_entities):
        h = self.encode_entities(sample[:, 0])
        r = self.encode_relations(sample[:, 1])
        re_h, im_h = self.split(h)
        re_r, im_r = self.split(r)
        re_e, im_e = self.split(all_entities)
        return (re_h * re_r - im_h * im_r) @ re_e.t() + (re_h * im_r + im_h * re_r) @ im_e.t()


def self_adversarial_loss(positive_score, negative_score, subsampling_weight, temperature, uni_weight=False):
    negative_score = (F.softmax(negative_score * temperature, dim=1).detach()
                      * F.logsigmoid(-negative_score)).sum(dim=1)
    positive_score = F.logsigmoid(positive_score).squeeze(dim=1)
    if uni_weight:
        positive_sample_loss = -positive_score.mean()  # expect: AMP004
        negative_sample_loss = -negative_score.mean()
    else:
        positive_sample_loss = -(subsampling_weight * positive_score).sum() / subsampling_weight.sum()
        negative_sample_loss = -(subsampling_weight * negative_score).sum() / subsampling_weight.sum()
    return (positive_sample_loss + negative_sample_loss) / 2


def train_step(model, optimizer, scaler, batch, args):
    model.train()
    positive, negative, subsampling_weight, mode, false_negative = batch
    with torch.autocast("cuda", dtype=torch.float16):
        negative_score = model.score_negatives(positive, negative, mode)
        negative_score = negative_score.masked_fill(false_negative, -1e9)  # expect: AMP007
        positive_score = model(positive)
        loss = self_adversarial_loss(positive_score, negative_score, subsampling_weight,
                                     args.adversarial_temperature, args.uni_weight)
        if args.regularization > 0:
            loss = loss + args.regularization * model.n3_regularizer(positive)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
    scaler.step(optimizer)
    scaler.update()
    return loss.item()


@torch.no_grad()
def evaluate_link_prediction(model, test_triples, known_tails, batch_size=256):
    model.eval()
    ranks = []
    with torch.autocast("cuda", dtype=torch.float16):
        all_entities = model.encode_entities(torch.arange(model.entity_feats.size(0), device="cuda"))
        for sample in test_triples.split(batch_size):
            sample = sample.cuda()
            scores = model.score_all_tails(sample, all_entities)
            target = scores.gather(1, sample[:, 2:3])
            scores = scores.masked_fill(known_tails(sample), -1e9)  # expect: AMP007
            ranks.append((scores > target).sum(dim=1) + 1)
    ranks = torch.cat(ranks).float()
    return {"MRR": (1.0 / ranks).mean().item(), "MR": ranks.mean().item(),
            "HITS@10": (ranks <= 10).float().mean().item()}


class EntityTyper(nn.Module):
    """Auxiliary entity-type classifier trained on its own embedding table."""

    def __init__(self, num_entities, num_types, dim=128):
        super().__init__()
        self.emb = nn.Embedding(num_entities, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, num_types))

    def forward(self, idx):
        return self.mlp(self.emb(idx))


def train_entity_typer(num_entities, num_types, loader, epochs=5, lr=1e-3):
    typer = EntityTyper(num_entities, num_types).cuda().half()  # expect: AMP001
    optimizer = torch.optim.Adam(typer.parameters(), lr=lr)  # expect: AMP011
    for _ in range(epochs):
        for idx, types in loader:
            logits = typer(idx.cuda())
            loss = F.cross_entropy(logits, types.cuda())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return typer


def export_embeddings(model, path):
    with torch.inference_mode():
        ent = model.encode_entities(torch.arange(model.entity_feats.size(0), device="cuda"))
        torch.save(ent.half().cpu(), path)


def train(model, loader, valid_triples, known_tails, args):
    optimizer = torch.optim.Adam(model.parameters(), lr=args.learning_rate)
    scaler = torch.amp.GradScaler("cuda")
    best_mrr, step = 0.0, 0
    for epoch in range(args.epochs):
        for batch in loader:
            batch = [b.cuda(non_blocking=True) if torch.is_tensor(b) else b for b in batch]
            loss = train_step(model, optimizer, scaler, batch, args)
            step += 1
            if step % args.log_steps == 0:
                print(f"step {step}: loss {loss:.4f}")
        metrics = evaluate_link_prediction(model, valid_triples, known_tails)
        if metrics["MRR"] > best_mrr:
            best_mrr = metrics["MRR"]
            torch.save(model.state_dict(), "complex_best.pt")
        print(f"epoch {epoch}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    export_embeddings(model, "entity_embeddings_fp16.pt")
    return best_mrr
