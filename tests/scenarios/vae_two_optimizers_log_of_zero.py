"""EXPECT: AMP101 AMP112
MAY: AMP104

FAULT: a VAE trained in fp16 autocast with two optimizers (encoder at lr 1e-3 in two clip
groups, decoder at lr 3e-4) sharing one GradScaler, per-parameter-group clip_grad_norm_
after scaler.unscale_ of both. Its Bernoulli reconstruction NLL is written by hand,
-(t*log(p) + (1-t)*log(1-p)) with p = sigmoid(logits) in fp16 (a way around
binary_cross_entropy under autocast), with no clamp and no logits form. Batches rotate
over two capture rigs; every 20th comes from rig B, whose 14-bit frames are divided by
255 like rig A's 8-bit ones, so those inputs are up to 64x too bright. Checked without
the guard: the loss is NaN at exactly steps 19, 39 and 59 (the rig B batches) and finite
at the 67 others. At step 19 the first op with a non-finite output from finite inputs is
log: fp16 sigmoid rounds the decoder's large logits to exactly 1.0 or 0.0, and log(1 - p)
or log(p) is log(0) = -inf (0 * -inf then gives NaN; the latent peaks at 6.2e4, the
logits at 1.1e4, 286 p's are exactly 1 and 1738 exactly 0); at steps 39 and 59 it is the
decoder's first linear (the fp32 latent, 3e35 and 3e14, overflows when autocast casts it
to fp16; at step 39 logvar.exp() in the KL term overflows fp32 as well). GradScaler skips
both optimizers on those three steps only: 65536 -> 8192, one halving at a time.
- AMP112 (nonfinite-loss page): the loss is NaN when backward starts at steps 19, 39, 59.
- AMP101 (nonfinite-forward page): on the CPU the step is judged before any optimizer
  applies it, and the loss is computed inside VAE.forward (the root module), so the replay
  of step 19 names torch.log in VAE (later rig B steps name the decoder's linear).
MAY: AMP104 (the pages do not say whether a skipped step's non-finite norm is judged;
applied norms are 0.003-0.29).
Not expected: AMP107/AMP108 (three isolated halvings, never two in a row, scale >= 8192),
AMP109 (70 steps: the 100-step window never fills), AMP102 (largest finite fp16 value
3.2e4), AMP103 (the scaler catches the non-finite gradients), AMP105 (every parameter's
largest gradient >= 1.9e-5), AMP106 (scale >= 8192: no weight's gradients near fp16's
floor), code-pattern rules (the loss is computed inside autocast, t*log(p) promotes to
fp32 before the sums, unscale_ before clipping).
"""
import json

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

SIDE, LATENT, HIDDEN, BATCH, STEPS = 8, 8, 128, 64, 70
PIXELS = SIDE * SIDE


def sprite_batch(gen, bits=8, batch=BATCH):
    """8x8 sprites: a filled rectangle at a random place, integer intensities of `bits` bits."""
    r0 = torch.randint(0, 5, (batch,), generator=gen)
    c0 = torch.randint(0, 5, (batch,), generator=gen)
    h = torch.randint(2, 4, (batch,), generator=gen)
    w = torch.randint(2, 4, (batch,), generator=gen)
    rows = torch.arange(SIDE)[None, :, None]
    cols = torch.arange(SIDE)[None, None, :]
    inside = ((rows >= r0[:, None, None]) & (rows < (r0 + h)[:, None, None])
              & (cols >= c0[:, None, None]) & (cols < (c0 + w)[:, None, None]))
    full = 2 ** bits - 1
    level = torch.randint(int(0.7 * full), full + 1, (batch, 1, 1), generator=gen)
    return (inside * level).flatten(1).float()


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(PIXELS, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU())
        self.mu = nn.Linear(HIDDEN, LATENT)
        self.logvar = nn.Linear(HIDDEN, LATENT)

    def forward(self, x):
        h = self.body(x)
        return self.mu(h), self.logvar(h)


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(LATENT, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU())
        self.out = nn.Linear(HIDDEN, PIXELS)

    def forward(self, z):
        return self.out(self.body(z))


class VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Encoder()
        self.decoder = Decoder()

    def forward(self, x, target, beta=0.1):
        mu, logvar = self.encoder(x)
        mu, logvar = mu.float(), logvar.float()
        z = mu + torch.exp(0.5 * logvar) * torch.randn_like(mu)
        logits = self.decoder(z)
        p = torch.sigmoid(logits)
        recon = -(target * torch.log(p) + (1 - target) * torch.log(1 - p)).sum(-1)
        kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(-1)
        return (recon + beta * kl).mean() / PIXELS


model = VAE()
# two optimizers, different learning rates, each with its own clipping group(s)
enc_opt = torch.optim.AdamW([
    {"params": model.encoder.body.parameters(), "max_norm": 1.0},
    {"params": list(model.encoder.mu.parameters()) + list(model.encoder.logvar.parameters()), "max_norm": 0.5},
], lr=1e-3)
dec_opt = torch.optim.AdamW([
    {"params": model.decoder.parameters(), "max_norm": 1.0},
], lr=3e-4)
scaler = torch.amp.GradScaler("cpu")
gen = torch.Generator().manual_seed(1)
# batches rotate over the capture rigs; rig B was added later and records 12-bit frames
CAMERAS = [{"name": "rig_a", "bits": 8}] * 19 + [{"name": "rig_b", "bits": 14}]

with amp_runtime.guard(policy="record", model=model) as g:
    for step in range(STEPS):
        camera = CAMERAS[step % len(CAMERAS)]
        raw = sprite_batch(gen, bits=camera["bits"])
        x = raw / 255.0
        target = (raw > 0).float()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x, target)
        scaler.scale(loss).backward()
        scaler.unscale_(enc_opt)
        scaler.unscale_(dec_opt)
        for opt in (enc_opt, dec_opt):
            for group in opt.param_groups:
                torch.nn.utils.clip_grad_norm_(group["params"], group["max_norm"])
        scaler.step(enc_opt)
        scaler.step(dec_opt)
        scaler.update()
        enc_opt.zero_grad(set_to_none=True)
        dec_opt.zero_grad(set_to_none=True)
        if step % 10 == 0:
            print(f"step {step} loss {loss.item():.3f} scale {scaler.get_scale():g}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
