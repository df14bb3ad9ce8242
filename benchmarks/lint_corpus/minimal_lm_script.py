"""Character-level LM training in a flat script, with precision chosen on the command line."""
import argparse
import time

import torch
import torch.nn as nn
from torch.nn import functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
parser.add_argument("--steps", type=int, default=5000)
parser.add_argument("--compile", action="store_true")
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
text = open("input.txt").read()
chars = sorted(set(text))
stoi = {ch: i for i, ch in enumerate(chars)}
data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
block_size, batch_size, n_embd = 256, 64, 384


class Head(nn.Module):
    def __init__(self, head_size):
        super().__init__()
        self.key = nn.Linear(n_embd, head_size, bias=False)
        self.query = nn.Linear(n_embd, head_size, bias=False)
        self.value = nn.Linear(n_embd, head_size, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(block_size, block_size)))

    def forward(self, x):
        B, T, C = x.shape
        k, q = self.key(x), self.query(x)
        wei = q @ k.transpose(-2, -1) * C ** -0.5
        wei = wei.masked_fill(self.tril[:T, :T] == 0, float("-inf"))
        return F.softmax(wei, dim=-1) @ self.value(x)


class BigramLM(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.tok = nn.Embedding(vocab, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.heads = nn.ModuleList([Head(n_embd // 6) for _ in range(6)])
        self.ln = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        x = torch.cat([h(x) for h in self.heads], dim=-1)
        logits = self.lm_head(self.ln(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def get_batch():
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([data[i : i + block_size] for i in ix])
    y = torch.stack([data[i + 1 : i + block_size + 1] for i in ix])
    return x.to(device), y.to(device)


model = BigramLM(len(chars)).to(device)
if args.compile:
    model = torch.compile(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
amp_dtype = torch.bfloat16
scaler = torch.amp.GradScaler(device)  # expect: AMP010
use_amp = args.precision != "fp32"

t0 = time.time()
for step in range(args.steps):
    xb, yb = get_batch()
    with torch.autocast(device_type=device, dtype=amp_dtype, enabled=use_amp):
        logits, loss = model(xb, yb)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    if step % 500 == 0:
        print(f"step {step}: loss {loss.item():.4f} ({time.time() - t0:.1f}s)")

model.eval()
with torch.no_grad():
    idx = torch.zeros((1, 1), dtype=torch.long, device=device)
    for _ in range(500):
        logits, _ = model(idx[:, -block_size:])
        probs = F.softmax(logits[:, -1, :], dim=-1)
        idx = torch.cat((idx, torch.multinomial(probs, num_samples=1)), dim=1)
print("".join(chars[i] for i in idx[0].tolist()))
