"""Decoder-only mixture-of-experts transformer: sigmoid top-k router, SwiGLU experts, balancing losses."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * self.weight).to(x.dtype)


def precompute_rope(head_dim, max_len, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), freqs)
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x, cos, sin):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim, n_heads, max_len):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.register_buffer("causal", torch.tril(torch.ones(max_len, max_len, dtype=torch.bool)), persistent=False)

    def forward(self, x, cos, sin, key_padding_mask=None):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.n_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        q, k = apply_rope(q, cos[:T], sin[:T]), apply_rope(k, cos[:T], sin[:T])
        att = (q @ k.transpose(-2, -1)) * self.scale
        att = att.masked_fill(~self.causal[:T, :T], float("-inf"))
        if key_padding_mask is not None:
            att = torch.where(key_padding_mask[:, None, None, :], att, torch.full_like(att, -1e5))  # expect: AMP007
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return self.proj(y)


class TopKRouter(nn.Module):
    """Sigmoid-scored top-k router with an auxiliary-free balancing bias (DeepSeek-V3 style)."""

    def __init__(self, dim, num_experts, top_k=2, pad_to=8, bias_update_rate=1e-3):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.num_experts, self.top_k = num_experts, top_k
        self.num_padded = (-num_experts) % pad_to
        self.bias_update_rate = bias_update_rate
        self.register_buffer("expert_bias", torch.zeros(num_experts + self.num_padded))

    def forward(self, x):
        logits = self.gate(x)
        if self.num_padded:
            # pad the expert axis so grouped GEMMs see a multiple of 8; padded experts never win top-k
            logits = F.pad(logits, (0, self.num_padded), value=-1e9)  # expect: AMP007
        scores = torch.sigmoid(logits)
        _, topk_idx = (scores + self.expert_bias).topk(self.top_k, dim=-1)
        topk_w = scores.gather(-1, topk_idx)
        topk_w = topk_w / (topk_w.sum(dim=-1, keepdim=True) + 1e-9)
        # sharpness regulariser: pushes the sigmoid gates towards 0 or 1
        entropy = -(scores * torch.log(scores + 1e-9)).sum(dim=-1).mean()  # expect: AMP011
        density = F.one_hot(topk_idx, num_classes=logits.shape[-1]).sum(dim=1).float().mean(dim=0)
        density_proxy = scores.float().mean(dim=0)
        balance = (density * density_proxy).sum() * self.num_experts / self.top_k
        z_loss = torch.logsumexp(logits.float(), dim=-1).pow(2).mean()
        if self.training:
            with torch.no_grad():
                target = density.new_full(density.shape, self.top_k / self.num_experts)
                self.expert_bias.add_(self.bias_update_rate * torch.sign(target - density))
        return topk_idx, topk_w, balance, z_loss, entropy


class SwiGLUExpert(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoELayer(nn.Module):
    def __init__(self, dim, num_experts=16, top_k=2, hidden_mult=2):
        super().__init__()
        self.router = TopKRouter(dim, num_experts, top_k)
        self.experts = nn.ModuleList([SwiGLUExpert(dim, hidden_mult * dim) for _ in range(num_experts)])
        self.shared = SwiGLUExpert(dim, hidden_mult * dim)

    def forward(self, x):
        B, T, C = x.shape
        flat = x.reshape(-1, C)
        topk_idx, topk_w, balance, z_loss, entropy = self.router(flat)
        out = self.shared(flat).float()
        for e, expert in enumerate(self.experts):
            token_idx, slot = (topk_idx == e).nonzero(as_tuple=True)
            if token_idx.numel() == 0:
                continue
            y = expert(flat[token_idx]) * topk_w[token_idx, slot, None]
            out.index_add_(0, token_idx, y.float())
        return out.view(B, T, C), balance, z_loss, entropy


class MoEBlock(nn.Module):
    def __init__(self, dim, n_heads, max_len, num_experts, top_k):
        super().__init__()
        self.norm1 = RMSNorm(dim)
        self.attn = CausalSelfAttention(dim, n_heads, max_len)
        self.norm2 = RMSNorm(dim)
        self.moe = MoELayer(dim, num_experts, top_k)

    def forward(self, x, cos, sin, key_padding_mask=None):
        x = x + self.attn(self.norm1(x), cos, sin, key_padding_mask)
        h, balance, z_loss, entropy = self.moe(self.norm2(x))
        return x + h, balance, z_loss, entropy


class MoETransformer(nn.Module):
    def __init__(self, vocab_size, dim=768, depth=12, n_heads=12, max_len=2048, num_experts=16, top_k=2,
                 balance_coef=1e-2, z_coef=1e-3, entropy_coef=1e-4):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList([MoEBlock(dim, n_heads, max_len, num_experts, top_k) for _ in range(depth)])
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        self.lm_head.weight = self.tok.weight
        cos, sin = precompute_rope(dim // n_heads, max_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.coefs = (balance_coef, z_coef, entropy_coef)

    def forward(self, idx, key_padding_mask=None):
        x = self.tok(idx)
        aux = x.new_zeros((), dtype=torch.float32)
        for blk in self.blocks:
            x, balance, z_loss, entropy = blk(x, self.cos, self.sin, key_padding_mask)
            aux = aux + self.coefs[0] * balance + self.coefs[1] * z_loss + self.coefs[2] * entropy
        return self.lm_head(self.norm(x)), aux / len(self.blocks)


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=50):
    model.eval()
    for _ in range(max_new_tokens):
        with torch.autocast("cuda", dtype=torch.float16):
            logits, _ = model(idx[:, -2048:])
        logits = logits[:, -1].float() / temperature
        kth = torch.topk(logits, top_k).values[:, [-1]]
        logits[logits < kth] = float("-inf")
        idx = torch.cat([idx, torch.multinomial(F.softmax(logits, dim=-1), 1)], dim=1)
    return idx


def train(loader, vocab_size=32000, lr=3e-4, grad_accum=4, max_steps=100_000, device="cuda"):
    model = MoETransformer(vocab_size).to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), eps=1e-8,
    )
    try:
        scaler = torch.amp.GradScaler("cuda")
    except (AttributeError, TypeError):
        scaler = torch.cuda.amp.GradScaler()
    best_val, step = 1e9, 0
    model.train()
    for it, (idx, targets, keep_mask) in enumerate(loader):
        idx, targets, keep_mask = idx.to(device), targets.to(device), keep_mask.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            logits, aux_loss = model(idx, keep_mask)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-100)  # expect: AMP002
        loss = (loss + aux_loss) / grad_accum
        scaler.scale(loss).backward()
        if (it + 1) % grad_accum == 0:
            optimizer.step()  # expect: AMP006
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 100 == 0:
                print(f"step {step} loss {loss.item() * grad_accum:.4f} best {best_val:.4f}")
            if step >= max_steps:
                break
    return model
