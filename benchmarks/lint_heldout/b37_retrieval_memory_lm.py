"""Retrieval-augmented LM with an external key/value memory (Memorizing
Transformer style).  One layer attends, besides its local causal context, to
the top-k most similar entries of a FIFO memory bank filled with the keys and
values that layer produced on earlier batches.  The bank is kept in fp16 to
halve its footprint; it can be pre-filled from a frozen sentence encoder.

Training: CUDA fp16 autocast + GradScaler.  A small query adapter is
fine-tuned afterwards on the stored keys.
"""
import argparse
import math
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F


class LMOutput(NamedTuple):
    logits: torch.Tensor
    mem_keys: torch.Tensor
    mem_values: torch.Tensor


class MemoryBank:
    """FIFO store of (key, value) pairs."""

    def __init__(self, size, dim, device):
        self.size = size
        self.keys = torch.zeros(size, dim, dtype=torch.float16, device=device)
        self.values = torch.zeros(size, dim, dtype=torch.float16, device=device)
        self.valid = torch.zeros(size, dtype=torch.bool, device=device)
        self.ptr = 0

    @torch.no_grad()
    def add(self, keys, values):
        n = min(keys.size(0), self.size)
        idx = (torch.arange(n, device=keys.device) + self.ptr) % self.size
        self.keys[idx] = keys[:n].to(self.keys.dtype)
        self.values[idx] = values[:n].to(self.values.dtype)
        self.valid[idx] = True
        self.ptr = (self.ptr + n) % self.size

    def as_tuple(self):
        return self.keys, self.values, self.valid


class CausalSelfAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class KNNMemoryAttention(nn.Module):
    def __init__(self, dim, topk, temperature=0.1):
        super().__init__()
        self.q_proj = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.gate = nn.Parameter(torch.zeros(1))
        self.topk = topk
        self.temperature = temperature

    def _retrieve(self, q, mem_keys, mem_values, mem_valid):
        qn = F.normalize(q, dim=-1)
        sims = qn @ mem_keys.t()
        sims = torch.where(mem_valid, sims, torch.tensor(-1e9, device=sims.device))  # expect: AMP007
        top, idx = sims.topk(self.topk, dim=-1)
        w = torch.softmax(top / self.temperature, dim=-1)
        return (w.unsqueeze(-1) * mem_values[idx]).sum(dim=2)

    def forward(self, h, mem_keys, mem_values, mem_valid):
        retrieved = self._retrieve(self.q_proj(h), mem_keys, mem_values, mem_valid)
        return torch.tanh(self.gate) * self.out(retrieved)


class Block(nn.Module):
    def __init__(self, dim, heads, topk=None):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.mem = KNNMemoryAttention(dim, topk) if topk else None
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, memory=None):
        h = self.ln1(x)
        x = x + self.attn(h)
        if self.mem is not None and memory is not None:
            x = x + self.mem(h, *memory)
        return x + self.mlp(self.ln2(x))


class RetrievalLM(nn.Module):
    def __init__(self, vocab, dim=384, heads=6, depth=8, mem_layer=5, topk=32, max_len=1024):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.mem_layer = mem_layer
        self.blocks = nn.ModuleList(Block(dim, heads, topk if i == mem_layer else None) for i in range(depth))
        self.mem_norm = nn.LayerNorm(dim)
        self.mem_kv = nn.Linear(dim, 2 * dim)
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx, memory=None):
        b, t = idx.shape
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks[: self.mem_layer]:
            x = blk(x)
        kv = self.mem_kv(self.mem_norm(x))
        x = self.blocks[self.mem_layer](x, memory)
        for blk in self.blocks[self.mem_layer + 1:]:
            x = blk(x)
        d = kv.size(-1) // 2
        return LMOutput(
            logits=self.head(self.ln_f(x)),
            mem_keys=kv[..., :d].flatten(0, 1),
            mem_values=kv[..., d:].flatten(0, 1),
        )


class QueryAdapter(nn.Module):
    """Residual bottleneck that maps LM queries into the stored key space."""

    def __init__(self, dim, hidden=128):
        super().__init__()
        self.down = nn.Linear(dim, hidden)
        self.up = nn.Linear(hidden, dim)

    def forward(self, q):
        return q + self.up(F.gelu(self.down(q)))


@torch.no_grad()
def prefill_memory(memory, corpus, encoder_name="sentence-transformers/all-MiniLM-L6-v2"):
    from transformers import AutoModel

    encoder = AutoModel.from_pretrained(encoder_name).cuda().eval()
    for ids, mask in corpus:
        with torch.autocast("cuda", dtype=torch.float16):
            hidden = encoder(input_ids=ids.cuda(), attention_mask=mask.cuda()).last_hidden_state
        emb = hidden.mean(dim=1)
        memory.add(emb, emb)


def train(model, memory, loader, args):
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    scaler = torch.amp.GradScaler("cuda")
    model.train()
    for step, (x, y) in enumerate(loader):
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        mem = memory.as_tuple() if step >= args.mem_warmup else None
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x, mem)
            loss = F.cross_entropy(out.logits.flatten(0, 1), y.flatten())
            scaler.scale(loss).backward()  # expect: AMP008
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            keys = out.mem_keys.detach()
            key_norm = keys.norm(dim=-1)  # expect: AMP004
            memory.add(F.normalize(keys, dim=-1), out.mem_values.detach())  # expect: AMP011
        if step % args.log_every == 0:
            print(f"step {step} loss {loss.item():.4f} max key norm {key_norm.max().item():.2f}")


def finetune_adapter(adapter, memory, epochs=1, lr=1e-3, batch=1024):
    adapter = adapter.half()  # expect: AMP001
    optimizer = torch.optim.Adam(adapter.parameters(), lr=lr)  # expect: AMP011
    for _ in range(epochs):
        perm = torch.randperm(memory.size, device=memory.keys.device)
        for start in range(0, memory.size, batch):
            q = memory.keys[perm[start:start + batch]]
            noisy = q + 0.05 * torch.randn_like(q)
            loss = F.mse_loss(adapter(noisy).float(), q.float())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return adapter


def random_tokens(vocab, seq_len, batch_size, n):
    for _ in range(n):
        s = torch.randint(0, vocab, (batch_size, seq_len + 1))
        yield s[:, :-1], s[:, 1:]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--mem-size", dest="mem_size", type=int, default=65536)
    p.add_argument("--mem-warmup", dest="mem_warmup", type=int, default=200)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--log-every", dest="log_every", type=int, default=50)
    p.add_argument("--prefill", action="store_true")
    args = p.parse_args()

    memory = MemoryBank(args.mem_size, args.dim, "cuda")
    if args.prefill:
        corpus = [(torch.randint(0, 30000, (64, 128)), torch.ones(64, 128, dtype=torch.long)) for _ in range(16)]
        prefill_memory(memory, corpus)
    model = RetrievalLM(args.vocab, dim=args.dim)
    model.to("cuda")
    train(model, memory, random_tokens(args.vocab, 256, 8, args.steps), args)
    adapter = finetune_adapter(QueryAdapter(args.dim).cuda(), memory)
    torch.save({"model": model.state_dict(), "adapter": adapter.state_dict()}, "retrieval_lm.pt")


if __name__ == "__main__":
    main()
