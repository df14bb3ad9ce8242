"""EXPECT: AMP007 AMP101 AMP107 AMP108 AMP112
MAY: AMP102 AMP106

FAULT: a small causal LM trained in fp16 (CPU autocast + torch.amp.GradScaler("cpu")) on
left-padded batches of variable-length documents. `CausalSelfAttention.forward` combines
the causal mask with the key-padding mask and fills the disallowed scores with
`torch.where(allowed, att, -1e9)`, a constant carried over from an fp32 codebase. -1e9 is
beyond fp16's 65504: on the fp16 scores it silently becomes -inf (AMP007: a fill constant
meets an fp16 tensor and the result holds inf; the code-pattern rules watch step 0).
With left padding, the query rows of the padding positions see only padding keys, so the
whole row is -inf and softmax returns NaN; the second layer spreads the NaN to every
position (probability 0 times a NaN value), and the loss is NaN at every step from step 0
(AMP112). GradScaler skips every step and halves the scale each time: 65536 -> 32768 after
step 0, 512 after step 6 (below 1/100 of the initial scale: AMP108), 1.0 after step 15,
and it only falls from there (6e-8 at step 39): at or below 1 and not rising (AMP107). The
first skipped step is replayed on the CPU with the weights untouched (the scaler skipped
it), and the first op whose output is non-finite from finite inputs is the `where` fill
(AMP101). No step ever goes through, so no AMP109 (its window starts at the first step the
scaler does not skip) and no AMP103 (skipped steps are not AMP103). The same script in fp32
trains (loss 6.25 -> 2.99 in 40 steps): a fully masked row of -1e9 is a uniform softmax.
Left open by the pages: AMP102 (whether a -inf output counts as |x| > 60000 under per-op
checks) and AMP106 (whether its count runs on a step whose gradients are all NaN).
"""
import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

# -- config ---------------------------------------------------------------------
vocab_size = 512
pad_id = 0
block_size = 32
n_layer, n_head, n_embd = 2, 4, 64
batch_size = 8
max_iters = 40
warmup_iters = 10
learning_rate = 3e-3
min_lr = 3e-4
weight_decay = 0.1
grad_clip = 1.0
log_interval = 5
eval_interval = 20
eval_iters = 2
device_type = "cpu"
ptdtype = torch.float16
ctx = torch.amp.autocast(device_type=device_type, dtype=ptdtype)


# -- data: variable-length "documents", left-padded to the longest in the batch --------
class DocStream:
    """Documents from a noisy affine recurrence over the vocabulary, 12..33 tokens long."""

    def __init__(self, seed):
        self.g = torch.Generator().manual_seed(seed)

    def document(self):
        n = int(torch.randint(12, block_size + 2, (1,), generator=self.g))
        tok = int(torch.randint(1, vocab_size, (1,), generator=self.g))
        out = [tok]
        for _ in range(n - 1):
            if float(torch.rand(1, generator=self.g)) < 0.1:
                tok = int(torch.randint(1, vocab_size, (1,), generator=self.g))
            else:
                tok = (tok * 7 + 3) % (vocab_size - 1) + 1
            out.append(tok)
        return out

    def batch(self):
        docs = [self.document() for _ in range(batch_size)]
        T = max(len(d) for d in docs) - 1
        x = torch.full((batch_size, T), pad_id, dtype=torch.long)
        y = torch.full((batch_size, T), -100, dtype=torch.long)
        key_mask = torch.zeros(batch_size, T, dtype=torch.bool)
        for i, d in enumerate(docs):
            d = torch.tensor(d)
            n = len(d) - 1
            x[i, T - n:] = d[:-1]          # left padding, as for generation-style batches
            y[i, T - n:] = d[1:]
            key_mask[i, T - n:] = True
        return x, y, key_mask


# -- model ----------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.register_buffer("bias", torch.ones(block_size, block_size, dtype=torch.bool).tril())

    def forward(self, x, key_mask):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(n_embd, dim=2)
        q = q.view(B, T, n_head, C // n_head).transpose(1, 2)
        k = k.view(B, T, n_head, C // n_head).transpose(1, 2)
        v = v.view(B, T, n_head, C // n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        allowed = self.bias[:T, :T][None, None] & key_mask[:, None, None, :]
        att = torch.where(allowed, att, -1e9)
        att = F.softmax(att, dim=-1)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP()

    def forward(self, x, key_mask):
        x = x + self.attn(self.ln_1(x), key_mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([Block() for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.apply(self._init_weights)

    def _init_weights(self, m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, key_mask, targets=None):
        B, T = idx.size()
        pos = torch.arange(T)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x, key_mask)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-100)
        return logits, loss


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / warmup_iters
    ratio = (it - warmup_iters) / max(1, max_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


model = GPT()
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.95), weight_decay=weight_decay)
scaler = torch.amp.GradScaler(device_type)
train_data, val_data = DocStream(1), DocStream(2)


@torch.no_grad()
def estimate_loss():
    model.eval()
    losses = []
    for _ in range(eval_iters):
        x, y, m = val_data.batch()
        with ctx:
            _, loss = model(x, m, y)
        losses.append(loss.item())
    model.train()
    return sum(losses) / len(losses)


with amp_runtime.guard(policy="record", model=model) as g:
    for it in range(max_iters):
        lr = get_lr(it)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if it > 0 and it % eval_interval == 0:
            print(f"step {it}: val loss {estimate_loss():.4f}")
        x, y, key_mask = train_data.batch()
        with ctx:
            logits, loss = model(x, key_mask, y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if it % log_interval == 0 or it == max_iters - 1:
            print(f"iter {it}: loss {loss.item():.4f}, lr {lr:.2e}, scale {scaler.get_scale():g}, "
                  f"grad norm {norm.item():.3g}, left-padded rows {int((~key_mask[:, 0]).sum())}/{batch_size}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
