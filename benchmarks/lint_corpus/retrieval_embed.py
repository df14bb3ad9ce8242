"""Dense retrieval: a bi-encoder trained with in-batch negatives, plus an fp16 index builder."""
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class BiEncoder(nn.Module):
    def __init__(self, encoder, dim=768, out_dim=256):
        super().__init__()
        self.encoder = encoder
        self.proj = nn.Linear(dim, out_dim)

    def forward(self, input_ids, attention_mask):
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-6)
        return self.proj(pooled)


class Scorer(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.q = nn.Linear(dim, dim)
        self.d = nn.Linear(dim, dim)
        self.use_amp = True

    def forward(self, queries, docs):
        with torch.autocast("cuda", enabled=self.use_amp):
            q = self.q(queries)
            d = self.d(docs)
            q = q / (q.abs().amax(dim=-1, keepdim=True) + 1e-8)  # expect: AMP011
            d = d / d.norm(dim=-1, keepdim=True).clamp(min=1e-12)
            return q @ d.t()


def build_index(model, loader, device):
    """Encode the corpus once; the index is stored in fp16 to halve its size."""
    model.eval()
    chunks = []
    with torch.no_grad():
        for batch in loader:
            emb = model(batch["input_ids"].to(device), batch["attention_mask"].to(device))
            emb = emb.half()
            emb = emb / (emb.norm(dim=-1, keepdim=True) + 1e-8)  # expect: AMP011
            chunks.append(emb.cpu())
    return torch.cat(chunks)


def search(index, query_emb, k=10):
    scores = index.float() @ F.normalize(query_emb.float(), dim=-1).t()
    return scores.topk(k, dim=0)


def train(model, loader, device, epochs=3, temperature=0.05):
    model = model.to(device).half()  # expect: AMP001
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5, eps=1e-8)  # expect: AMP011
    model.train()
    for _ in range(epochs):
        for batch in loader:
            q = model(batch["q_ids"].to(device), batch["q_mask"].to(device))
            d = model(batch["d_ids"].to(device), batch["d_mask"].to(device))
            q = F.normalize(q.float(), dim=-1)
            d = F.normalize(d.float(), dim=-1)
            scores = q @ d.t() / temperature
            loss = F.cross_entropy(scores, torch.arange(q.size(0), device=device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


def train_amp(model, loader, device, epochs=3, temperature=0.05):
    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5, eps=1e-8)
    scaler = torch.amp.GradScaler("cuda")
    for _ in range(epochs):
        for batch in loader:
            with torch.autocast("cuda", dtype=torch.float16):
                q = model(batch["q_ids"].to(device), batch["q_mask"].to(device))
                d = model(batch["d_ids"].to(device), batch["d_mask"].to(device))
                scores = F.normalize(q, dim=-1) @ F.normalize(d, dim=-1).t() / temperature
                log_probs = torch.log(scores.softmax(dim=-1) + 1e-10)
                loss = -log_probs.diagonal().mean()
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()


def hard_negative_probs(scores_fp16, temperature=0.05):
    probs = (scores_fp16.half() / temperature).softmax(dim=-1)
    return torch.log(probs + 1e-10)  # expect: AMP011


def export_numpy(index):
    arr = index.numpy().astype(np.float16)
    arr /= np.linalg.norm(arr, axis=1, keepdims=True) + 1e-8
    return arr
