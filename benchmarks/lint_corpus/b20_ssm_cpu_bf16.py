"""Hybrid state-space sequence classifier for long-range tasks: diagonal S4D
convolution layers, gated linear attention with data-dependent decay, and a
linear-attention encoder layer. Trained on CPU with bf16 autocast (no scaler).
"""
import math

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


class S4DKernel(nn.Module):
    """Diagonal state matrix with ZOH discretisation; kernel built in fp32."""

    def __init__(self, d_model, d_state=64, dt_min=1e-3, dt_max=1e-1):
        super().__init__()
        log_dt = torch.rand(d_model) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)
        self.log_dt = nn.Parameter(log_dt)
        self.log_A_real = nn.Parameter(torch.log(0.5 * torch.ones(d_model, d_state // 2)))
        self.A_imag = nn.Parameter(math.pi * torch.arange(d_state // 2).float().repeat(d_model, 1))
        self.C = nn.Parameter(torch.randn(d_model, d_state // 2, dtype=torch.cfloat) * 0.5 ** 0.5)

    def forward(self, L):
        dt = torch.exp(self.log_dt)
        A = -torch.exp(self.log_A_real) + 1j * self.A_imag
        dtA = A * dt[:, None]
        K = dtA[..., None] * torch.arange(L, device=A.device)
        C = self.C * (torch.exp(dtA) - 1.0) / A
        return 2 * torch.einsum("hn,hnl->hl", C, torch.exp(K)).real


class S4DLayer(nn.Module):
    def __init__(self, d_model, d_state=64, dropout=0.1):
        super().__init__()
        self.kernel = S4DKernel(d_model, d_state)
        self.D = nn.Parameter(torch.randn(d_model))
        self.out = nn.Linear(d_model, 2 * d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, u):
        L = u.size(1)
        k = self.kernel(L)
        uf = u.float().transpose(1, 2)
        y = torch.fft.irfft(torch.fft.rfft(uf, n=2 * L) * torch.fft.rfft(k, n=2 * L), n=2 * L)[..., :L]
        y = (y + uf * self.D[:, None]).transpose(1, 2)
        return F.glu(self.out(self.drop(F.gelu(y))), dim=-1)


class GatedLinearAttention(nn.Module):
    """Causal linear attention with per-step forget gates (chunk-free form)."""

    def __init__(self, d_model, n_heads=4):
        super().__init__()
        self.h = n_heads
        self.dk = d_model // n_heads
        self.q = nn.Linear(d_model, d_model, bias=False)
        self.k = nn.Linear(d_model, d_model, bias=False)
        self.v = nn.Linear(d_model, d_model, bias=False)
        self.g = nn.Linear(d_model, n_heads)
        self.o = nn.Linear(d_model, d_model, bias=False)
        self.state_reg = None

    def forward(self, x):
        B, L, D = x.shape
        q = self.q(x).view(B, L, self.h, self.dk).transpose(1, 2)
        k = self.k(x).view(B, L, self.h, self.dk).transpose(1, 2)
        v = self.v(x).view(B, L, self.h, self.dk).transpose(1, 2)
        log_gate = F.logsigmoid(self.g(x)).transpose(1, 2)
        decay = torch.cumsum(log_gate, dim=-1)  # expect: AMP004
        seg = decay[..., :, None] - decay[..., None, :]
        causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
        weights = torch.exp(seg.float().masked_fill(~causal, float("-inf")))
        scores = (q @ k.transpose(-2, -1)) * weights.to(q.dtype) / math.sqrt(self.dk)
        y = scores @ v
        self.state_reg = (y * y).mean()  # expect: AMP004
        return self.o(y.transpose(1, 2).reshape(B, L, D))


class LinearAttention(nn.Module):
    """elu+1 feature-map linear attention (Katharopoulos et al.)."""

    def __init__(self, d_model, causal=False, eps=1e-6):
        super().__init__()
        self.causal = causal
        self.eps = eps
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k = F.elu(q) + 1.0, F.elu(k) + 1.0
        if self.causal:
            kv = (k.float()[..., :, None] * v.float()[..., None, :]).cumsum(dim=1)
            k_norm = k.cumsum(dim=1)  # expect: AMP004
            num = torch.einsum("bld,blde->ble", q, kv)
        else:
            kv = torch.einsum("bld,ble->bde", k, v)
            k_norm = k.sum(dim=1, keepdim=True)  # expect: AMP004
            num = torch.einsum("bld,bde->ble", q, kv)
        den = (q.float() * k_norm.float()).sum(dim=-1, keepdim=True) + self.eps
        return self.proj(num / den)


class HybridBlock(nn.Module):
    def __init__(self, d_model, mixer, dropout=0.1):
        super().__init__()
        self.norm1 = RMSNorm(d_model)
        self.mixer = mixer
        self.norm2 = RMSNorm(d_model)
        self.ff = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        x = x + self.drop(self.mixer(self.norm1(x)))
        return x + self.drop(self.ff(self.norm2(x)))


class SSMClassifier(nn.Module):
    def __init__(self, vocab=256, d_model=256, n_classes=10, n_layers=6, aux_targets=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        mixers = []
        for i in range(n_layers):
            if i % 3 == 0:
                mixers.append(S4DLayer(d_model))
            elif i % 3 == 1:
                mixers.append(GatedLinearAttention(d_model))
            else:
                mixers.append(LinearAttention(d_model, causal=(i == n_layers - 1)))
        self.blocks = nn.ModuleList([HybridBlock(d_model, m) for m in mixers])
        self.norm = RMSNorm(d_model)
        self.pool_proj = nn.Linear(d_model, d_model)
        self.head = nn.Linear(d_model, n_classes)
        self.aux_head = nn.Linear(d_model, aux_targets)

    def forward(self, tokens, mask):
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x)
        h = self.norm(x)
        z = self.pool_proj(h)
        pooled = z.mean(dim=1)  # expect: AMP004
        masked = (h.float() * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
        reg = sum(b.mixer.state_reg for b in self.blocks if isinstance(b.mixer, GatedLinearAttention))
        return self.head(pooled + masked), self.aux_head(masked), reg


def label_smoothed_nll(logits, target, eps=0.1):
    logp = F.log_softmax(logits.float(), dim=-1)
    nll = -logp.gather(-1, target[:, None]).squeeze(-1)
    smooth = -logp.mean(dim=-1)
    return ((1 - eps) * nll + eps * smooth).mean()


def train(loader, epochs=20, lr=1e-3, wd=0.05, vocab=256, n_classes=10):
    model = SSMClassifier(vocab=vocab, n_classes=n_classes)
    ssm_params = [p for n, p in model.named_parameters() if "kernel" in n]
    other = [p for n, p in model.named_parameters() if "kernel" not in n]
    optimizer = torch.optim.AdamW([
        {"params": ssm_params, "lr": 1e-3, "weight_decay": 0.0},
        {"params": other, "lr": lr, "weight_decay": wd},
    ])
    sched = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=epochs * len(loader))
    # the loop is shared with the fp16 GPU recipe; on CPU bf16 the scaler stays off
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for epoch in range(epochs):
        model.train()
        for tokens, mask, y, aux_y in loader:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits, aux_logits, reg = model(tokens, mask.float())
                loss = label_smoothed_nll(logits, y) + 1e-4 * reg
                aux_prob = torch.sigmoid(aux_logits)
                loss = loss + 0.2 * F.binary_cross_entropy(aux_prob, aux_y.float())  # expect: AMP003
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            sched.step()
    return model


@torch.inference_mode()
def predict(model, tokens, mask):
    model.eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _, _ = model(tokens, mask.float())
    return logits.float().softmax(-1)
