"""RetNet-style language model: multi-scale retention (parallel and recurrent forms),
xPos rotation, sub-LN feed-forward blocks and a bf16 training loop."""
import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        normed = (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype)
        return normed * self.weight


class XPos(nn.Module):
    def __init__(self, head_dim, scale_base=512, max_len=4096):
        super().__init__()
        half = head_dim // 2
        inv_freq = 1.0 / (10000 ** (torch.arange(0, half, dtype=torch.float32) / half))
        pos = torch.arange(max_len, dtype=torch.float32)
        angles = pos[:, None] * inv_freq[None, :]
        scale = (torch.arange(0, head_dim, 2, dtype=torch.float32) + 0.4 * head_dim) / (1.4 * head_dim)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        self.register_buffer("scale", scale ** (pos[:, None] / scale_base), persistent=False)

    def forward(self, x, offset=0, downscale=False):
        t = x.shape[-2]
        cos, sin = self.cos[offset:offset + t], self.sin[offset:offset + t]
        scale = self.scale[offset:offset + t]
        if downscale:
            scale = 1.0 / scale
        x1, x2 = x[..., 0::2], x[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
        return rotated * scale.repeat_interleave(2, dim=-1)


class MultiScaleRetention(nn.Module):
    def __init__(self, d_model, n_heads, track_stats=True):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.g_proj = nn.Linear(d_model, d_model, bias=False)
        self.out_proj = nn.Linear(d_model, d_model, bias=False)
        self.group_norm = nn.GroupNorm(n_heads, d_model, affine=False)
        self.xpos = XPos(self.head_dim)
        gammas = 1.0 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), n_heads))
        self.register_buffer("gammas", gammas)
        self.register_buffer("act_rms", torch.zeros(()))
        self.track_stats = track_stats

    def decay_mask(self, t, device):
        idx = torch.arange(t, device=device, dtype=torch.float32)
        exponent = idx[:, None] - idx[None, :]
        decay = torch.exp(exponent[None] * self.gammas.log()[:, None, None])
        decay = decay.masked_fill(exponent[None] < 0, 0.0)
        return decay / decay.sum(dim=-1, keepdim=True).sqrt()

    def split_heads(self, x):
        b, t, _ = x.shape
        return x.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)

    def forward(self, x):
        b, t, c = x.shape
        q = self.xpos(self.split_heads(self.q_proj(x)))
        k = self.xpos(self.split_heads(self.k_proj(x)), downscale=True) * self.head_dim ** -0.5
        v = self.split_heads(self.v_proj(x))
        qk = torch.matmul(q, k.transpose(-1, -2)) * self.decay_mask(t, x.device)
        qk = qk / qk.detach().abs().sum(dim=-1, keepdim=True).clamp(min=1.0)
        out = torch.matmul(qk, v).transpose(1, 2).reshape(b * t, c)
        out = self.group_norm(out).view(b, t, c)
        y = self.out_proj(F.silu(self.g_proj(x)) * out)
        if self.training and self.track_stats:
            with torch.no_grad():
                self.act_rms.mul_(0.99).add_(0.01 * y.std())  # expect: AMP004
        return y

    def recurrent_step(self, x_t, state, n):
        b = x_t.shape[0]
        q = self.xpos(self.split_heads(self.q_proj(x_t)), offset=n)
        k = self.xpos(self.split_heads(self.k_proj(x_t)), offset=n, downscale=True) * self.head_dim ** -0.5
        v = self.split_heads(self.v_proj(x_t))
        kv = k.transpose(-1, -2) @ v
        if state is not None:
            kv = kv + self.gammas.view(1, -1, 1, 1) * state
        out = (q @ kv).transpose(1, 2).reshape(b, -1)
        out = self.group_norm(out).view(b, 1, -1)
        return self.out_proj(F.silu(self.g_proj(x_t)) * out), kv


class SubLNFeedForward(nn.Module):
    """FFN with the sub-LayerNorm of Magneto/RetNet placed on the hidden activations."""

    def __init__(self, d_model, d_ff):
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)
        self.ln_weight = nn.Parameter(torch.ones(d_ff))
        self.ln_bias = nn.Parameter(torch.zeros(d_ff))

    def forward(self, x):
        h = self.fc1(x)
        mu = h.mean(-1, keepdim=True)  # expect: AMP004
        var = h.var(-1, keepdim=True, unbiased=False)  # expect: AMP004
        h = (h - mu) * torch.rsqrt(var + 1e-5) * self.ln_weight + self.ln_bias
        return self.fc2(F.gelu(h))


class RetNetBlock(nn.Module):
    def __init__(self, d_model, n_heads, d_ff, dropout=0.0):
        super().__init__()
        self.norm1 = RMSNorm(d_model)
        self.retention = MultiScaleRetention(d_model, n_heads)
        self.norm2 = RMSNorm(d_model)
        self.ffn = SubLNFeedForward(d_model, d_ff)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        x = x + self.drop(self.retention(self.norm1(x)))
        return x + self.drop(self.ffn(self.norm2(x)))

    def step(self, x_t, state, n):
        y, state = self.retention.recurrent_step(self.norm1(x_t), state, n)
        x_t = x_t + y
        return x_t + self.ffn(self.norm2(x_t)), state


class RetNetLM(nn.Module):
    def __init__(self, vocab_size, d_model=768, n_layers=12, n_heads=12, d_ff=2048):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.embed_scale = math.sqrt(d_model)
        self.blocks = nn.ModuleList([RetNetBlock(d_model, n_heads, d_ff) for _ in range(n_layers)])
        self.norm = RMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens) * self.embed_scale
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


@torch.no_grad()
def generate(model, prompt, max_new_tokens=64, temperature=0.8):
    model.eval()
    states = [None] * len(model.blocks)
    tokens = prompt
    with torch.autocast("cuda", dtype=torch.bfloat16):
        for n in range(prompt.shape[1] + max_new_tokens - 1):
            x_t = model.embed(tokens[:, n:n + 1]) * model.embed_scale
            for i, block in enumerate(model.blocks):
                x_t, states[i] = block.step(x_t, states[i], n)
            if n + 1 < tokens.shape[1]:
                continue
            logits = model.lm_head(model.norm(x_t))[:, -1] / temperature
            probs = torch.softmax(logits.float(), dim=-1)
            tokens = torch.cat([tokens, torch.multinomial(probs, 1)], dim=1)
    return tokens


@torch.no_grad()
def evaluate(model, loader, device="cuda", max_batches=50):
    model.eval()
    losses = []
    for i, (x, y) in enumerate(loader):
        if i >= max_batches:
            break
        x, y = x.to(device), y.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        losses.append(F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).item())
    model.train()
    return sum(losses) / max(len(losses), 1)


def configure_optimizer(model, lr, weight_decay=0.1):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98), eps=1e-8)


def train(model, train_loader, val_loader, steps, lr=6e-4, warmup=2000, device="cuda", grad_clip=1.0):
    model.to(device).train()
    optimizer = configure_optimizer(model, lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010
    best_val = float("inf")
    data_iter = iter(train_loader)
    for step in range(steps):
        try:
            x, y = next(data_iter)
        except StopIteration:
            data_iter = iter(train_loader)
            x, y = next(data_iter)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if step % 1000 == 0:
            val_loss = evaluate(model, val_loader, device)
            if val_loss < best_val:
                best_val = val_loss
                torch.save(model.state_dict(), "retnet_best.pt")
            print(f"step {step} loss {loss.item():.4f} val {val_loss:.4f} act_rms {model.blocks[0].retention.act_rms.item():.3f}")
    return best_val
