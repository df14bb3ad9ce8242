import math
import random

import torch
import torch.nn.functional as F
from torch import nn, einsum
from einops import rearrange

# helpers

def exists(val):
    return val is not None

def default(val, d):
    return val if exists(val) else d

def max_neg_value(t):
    return -torch.finfo(t.dtype).max

def log(t, eps = 1e-20):
    return torch.log(t.clamp(min = eps))

def gumbel_noise(t):
    noise = torch.zeros_like(t).uniform_(0, 1)
    return -log(-log(noise))

def top_k(logits, thres = 0.9):
    k = math.ceil((1 - thres) * logits.shape[-1])
    val, ind = torch.topk(logits, k)
    probs = torch.full_like(logits, float('-inf'))
    probs.scatter_(1, ind, val)
    return probs

# normalization and feedforward

class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.normalize(x, dim = -1) * self.scale * self.gamma

class GEGLU(nn.Module):
    def forward(self, x):
        x, gate = x.chunk(2, dim = -1)
        return F.gelu(gate) * x

def FeedForward(dim, mult = 4, dropout = 0.):
    inner_dim = int(dim * mult * 2 / 3)
    return nn.Sequential(
        RMSNorm(dim),
        nn.Linear(dim, inner_dim * 2, bias = False),
        GEGLU(),
        nn.Dropout(dropout),
        nn.Linear(inner_dim, dim, bias = False)
    )

# attention

class Attention(nn.Module):
    def __init__(self, dim, dim_head = 64, heads = 8, causal = True, dropout = 0.):
        super().__init__()
        self.heads = heads
        self.causal = causal
        self.scale = dim_head ** -0.5
        inner_dim = dim_head * heads
        self.norm = RMSNorm(dim)
        self.to_qkv = nn.Linear(dim, inner_dim * 3, bias = False)
        self.attn_dropout = nn.Dropout(dropout)
        self.to_out = nn.Linear(inner_dim, dim, bias = False)

    def forward(self, x, mask = None):
        x = self.norm(x)
        q, k, v = self.to_qkv(x).chunk(3, dim = -1)
        q, k, v = map(lambda t: rearrange(t, 'b n (h d) -> b h n d', h = self.heads), (q, k, v))

        sim = einsum('b h i d, b h j d -> b h i j', q, k) * self.scale

        if exists(mask):
            mask = rearrange(mask, 'b j -> b 1 1 j')
            sim = sim.masked_fill(~mask, max_neg_value(sim))

        if self.causal:
            i, j = sim.shape[-2:]
            causal_mask = torch.ones((i, j), device = x.device, dtype = torch.bool).triu(j - i + 1)
            sim = sim.masked_fill(causal_mask, max_neg_value(sim))

        attn = sim.softmax(dim = -1, dtype = torch.float32).to(q.dtype)
        attn = self.attn_dropout(attn)

        out = einsum('b h i j, b h j d -> b h i d', attn, v)
        out = rearrange(out, 'b h n d -> b n (h d)')
        return self.to_out(out)

class LocalAttention(nn.Module):
    """ windowed causal attention, each bucket attends to itself and the previous bucket """

    def __init__(self, dim, window_size = 128, dim_head = 64, heads = 8):
        super().__init__()
        self.heads = heads
        self.window_size = window_size
        self.scale = dim_head ** -0.5
        inner_dim = dim_head * heads
        self.norm = RMSNorm(dim)
        self.to_qkv = nn.Linear(dim, inner_dim * 3, bias = False)
        self.to_out = nn.Linear(inner_dim, dim, bias = False)

    def forward(self, x):
        b, n, _, w = *x.shape, self.window_size
        assert (n % w) == 0, f'sequence length {n} must be divisible by window size {w}'
        x = self.norm(x)
        q, k, v = self.to_qkv(x).chunk(3, dim = -1)
        q, k, v = map(lambda t: rearrange(t, 'b (nw w) (h d) -> b h nw w d', w = w, h = self.heads), (q, k, v))

        # look one bucket back
        k = torch.cat((F.pad(k, (0, 0, 0, 0, 1, -1)), k), dim = -2)
        v = torch.cat((F.pad(v, (0, 0, 0, 0, 1, -1)), v), dim = -2)

        dots = einsum('b h n i d, b h n j d -> b h n i j', q, k) * self.scale

        q_pos = torch.arange(w, device = x.device)
        k_pos = torch.arange(-w, w, device = x.device)
        future = rearrange(q_pos, 'i -> i 1') < rearrange(k_pos, 'j -> 1 j')
        dots.masked_fill_(future, -1e9)  # expect: AMP007

        attn = dots.softmax(dim = -1)
        out = einsum('b h n i j, b h n j d -> b h n i d', attn, v)
        out = rearrange(out, 'b h nw w d -> b (nw w) (h d)')
        return self.to_out(out)

# main class

class TransformerWrapper(nn.Module):
    def __init__(self, *, num_tokens, dim, depth, max_seq_len, window_size = 128, heads = 8, dim_head = 64):
        super().__init__()
        self.max_seq_len = max_seq_len
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.pos_emb = nn.Embedding(max_seq_len, dim)

        self.layers = nn.ModuleList([])
        for ind in range(depth):
            attn = Attention(dim, dim_head, heads) if (ind % 2) else LocalAttention(dim, window_size, dim_head, heads)
            self.layers.append(nn.ModuleList([attn, FeedForward(dim)]))

        self.norm = RMSNorm(dim)
        self.to_logits = nn.Linear(dim, num_tokens, bias = False)

    @torch.no_grad()
    def generate(self, prime, seq_len, temperature = 1., filter_thres = 0.9):
        out = prime
        for _ in range(seq_len):
            logits = self.forward(out[:, -self.max_seq_len:])[:, -1]
            filtered = top_k(logits, thres = filter_thres)
            sample = (filtered / max(temperature, 1e-10) + gumbel_noise(filtered)).argmax(dim = -1)
            out = torch.cat((out, sample[:, None]), dim = -1)
        return out[:, prime.shape[-1]:]

    def forward(self, x, return_loss = False):
        if return_loss:
            x, labels = x[:, :-1], x[:, 1:]

        n, device = x.shape[-1], x.device
        x = self.token_emb(x) + self.pos_emb(torch.arange(n, device = device))

        for attn, ff in self.layers:
            x = attn(x) + x
            x = ff(x) + x

        logits = self.to_logits(self.norm(x))

        if not return_loss:
            return logits

        return F.cross_entropy(rearrange(logits, 'b n c -> b c n'), labels)

# training on random data, just to smoke test

if __name__ == '__main__':
    NUM_BATCHES = 1000
    BATCH_SIZE = 4
    GRADIENT_ACCUMULATE_EVERY = 4
    LEARNING_RATE = 2e-4
    SEQ_LEN = 1024

    def cycle():
        while True:
            yield torch.randint(0, 256, (BATCH_SIZE, SEQ_LEN + 1)).cuda()

    train_loader, val_loader = cycle(), cycle()

    model = TransformerWrapper(num_tokens = 256, dim = 512, depth = 6, max_seq_len = SEQ_LEN).cuda()
    optim = torch.optim.Adam(model.parameters(), lr = LEARNING_RATE)

    for i in range(NUM_BATCHES):
        model.train()

        for _ in range(GRADIENT_ACCUMULATE_EVERY):
            with torch.autocast(device_type = 'cuda', dtype = torch.float16):  # expect: AMP010
                loss = model(next(train_loader), return_loss = True)
                (loss / GRADIENT_ACCUMULATE_EVERY).backward()  # expect: AMP008

        print(f'training loss: {loss.item()}')
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optim.step()
        optim.zero_grad()

        if i % 100 == 0:
            model.eval()
            with torch.no_grad():
                loss = model(next(val_loader), return_loss = True)
                print(f'validation loss: {loss.item()}')

        if i % 500 == 0:
            model.eval()
            inp = random.choice(next(val_loader))[:-1]
            sample = model.generate(inp[None, ...], 256)
            print(sample.shape)
