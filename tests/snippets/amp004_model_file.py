"""AMP004 in a model file: blocks, the model they make up, and a training function that the
file never calls (its ``model`` is that model)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class GhostNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.register_buffer("running_var", torch.ones(dim))

    def forward(self, x):
        if not self.training:
            x = x / torch.sqrt(self.running_var + self.eps)
            return x
        var = x.var(dim=0, keepdim=True)  # AMP004
        return x / torch.sqrt(var.float() + self.eps).to(x.dtype)


class PlainNorm(nn.Module):
    def forward(self, x):
        mu = x.mean(dim=-1, keepdim=True)  # AMP004
        return x - mu


class FeedForward(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        h = self.fc1(x)
        h = h - h.mean(-1, keepdim=True)  # AMP004
        return self.fc2(F.gelu(h))


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.mix = nn.Sequential(nn.Linear(dim, dim), PlainNorm(), nn.Linear(dim, dim), PlainNorm())
        self.norm = GhostNorm(dim)
        self.ffn = FeedForward(dim)

    def forward(self, x):
        x = x + self.norm(self.mix(x))
        return x + self.ffn(x)

    def step(self, x_t):
        return x_t + self.ffn(x_t.float())


class TinyLM(nn.Module):
    def __init__(self, vocab, dim, depth):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for i in range(len(self.blocks)):
            x = self.blocks[i](x)
        return self.head(x)


@torch.no_grad()
def generate(model, tokens, steps):
    for _ in range(steps):
        x = model.embed(tokens[:, -1:])
        for block in model.blocks:
            x = block.step(x)
        tokens = torch.cat([tokens, model.head(x).argmax(-1)], dim=1)
    return tokens


def train(model, loader, optimizer, scaler):
    for tokens, targets in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(tokens)
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
