"""EXPECT: none
HEALTHY: keyword spotting on synthetic 256-sample waveforms: a conv `encoder` (SGD with
Nesterov momentum) and a separate `decoder` (AdamW), two models with two optimizers and
ONE GradScaler, fp16 autocast, 60 steps. Each step: one scaled backward, then
`scaler.unscale_(opt_enc)` and `scaler.unscale_(opt_dec)`, then `clip_grad_norm_` on each
model's parameters (max_norm 1.0), then `scaler.step` for both optimizers and a single
`scaler.update()` - the recipe of the PyTorch AMP examples ("working with multiple models,
losses, and optimizers" + "gradient clipping"). Checked with plain torch, no guard: the
scaler never skips, the (unscaled) per-model norms grow from ~0.09/0.19 to ~0.9/1.5 (so
clipping acts at the end), the loss falls from 2.48 to 1.25. The decoder pools over time with `amax`, not a sum/mean.
Why no code (from the pages): AMP005 needs clipping "on grads the scaler has scaled but
not unscaled" - both optimizers are unscaled first; AMP006 needs a plain step on scaled
grads or a step without update - both steps go through the scaler and update() follows
once per iteration (index page: several optimizers "count one step per iteration");
AMP010: fp16 with an active scaler; AMP104: norms < 2; nothing non-finite.
"""
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

N_WORDS, SAMPLES = 12, 256


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv1d(1, 32, 9, stride=2, padding=4)
        self.conv2 = nn.Conv1d(32, 64, 9, stride=2, padding=4)
        self.proj = nn.Linear(64, 64)

    def forward(self, wav):
        h = F.gelu(self.conv1(wav.unsqueeze(1)))
        h = F.gelu(self.conv2(h))
        return self.proj(h.transpose(1, 2))


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(64, 128)
        self.out = nn.Linear(128, N_WORDS)

    def forward(self, feats):
        h = F.gelu(self.hidden(feats))
        return self.out(h.amax(dim=1))          # max-pool over time


encoder, decoder = Encoder(), Decoder()
opt_enc = torch.optim.SGD(encoder.parameters(), lr=0.02, momentum=0.9, nesterov=True)
opt_dec = torch.optim.AdamW(decoder.parameters(), lr=1e-3, weight_decay=0.01)
scaler = torch.amp.GradScaler("cpu")

freqs = torch.linspace(2, 40, N_WORDS)
t = torch.linspace(0, 1, SAMPLES)


def batch(n=32):
    words = torch.randint(0, N_WORDS, (n,))
    phase = torch.rand(n, 1) * 6.28
    wav = torch.sin(2 * torch.pi * freqs[words][:, None] * t[None] + phase) + 0.3 * torch.randn(n, SAMPLES)
    return wav, words


with amp_runtime.guard(policy="record") as g:
    for step in range(60):
        wav, words = batch()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = decoder(encoder(wav))
            loss = F.cross_entropy(logits, words)
        opt_enc.zero_grad(set_to_none=True)
        opt_dec.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt_enc)
        scaler.unscale_(opt_dec)
        norm_enc = torch.nn.utils.clip_grad_norm_(encoder.parameters(), max_norm=1.0)
        norm_dec = torch.nn.utils.clip_grad_norm_(decoder.parameters(), max_norm=1.0)
        scaler.step(opt_enc)
        scaler.step(opt_dec)
        scaler.update()
        if step % 20 == 0 or step == 59:
            print(f"step {step} loss {loss.item():.4f} |g_enc| {norm_enc.item():.3f} |g_dec| {norm_dec.item():.3f}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
