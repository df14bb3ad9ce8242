"""EXPECT: AMP010

FAULT: a bad constant that disables loss scaling in fp16. The config names precisions
"fp32"/"bf16"/"fp16" and the autocast dtype is looked up from it (fp16), but the scaler
line, copied from a nanoGPT-style script, is
`torch.amp.GradScaler("cpu", enabled=(config["precision"] == "float16"))`: it compares
with "float16", so the scaler is disabled while the model trains under fp16 autocast.
Every backward is an fp16 backward with no active scaler (AMP010, from step 0). The
multi-task model adds an auxiliary reconstruction loss weighted 3e-4 (tuned in fp32) to
the classification loss and divides by 4 accumulation steps; the MSE's mean over 64 x 128
values makes the reconstruction head's gradients ~1e-8..1e-6, below or at fp16's floor
(5.96e-8) without scaling. Measured on the unguarded run at steps 0, 31, 32, 63, 64:
recon_head.0.weight (256x256) has 88-98 % of its gradients exactly zero (0 % with the
scaler working), the page's estimate of the flushed share of its nonzero gradients (half
the values in fp16's lowest bin) is 21-25 % and the bound on the norm share they carried
0.17-0.19; recon_head.2.weight (128x256): 13-35 % zeros, estimate 11-19 %, share bound
0.035-0.077. Both far above AMP106's 1 % and 0.1 % (AMP106, at its 32nd-step checks). The
cost: validation reconstruction MSE 0.78 after 70 steps against 0.47 with the scaler
enabled (classification is unaffected: accuracy 0.965 both). Not AMP105: the smallest
per-step max |grad| of any parameter is 6e-8 (recon_head.0.bias) and the total norm stays
at or above 0.38. No overflow, nothing non-finite, no low-precision reduction.
Written expecting AMP106 as well; AMP106 judges the steps a GradScaler scaled, and an fp16
backward with no working scaler is AMP010's finding (its message says gradients flush).
"""
import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

config = {
    "precision": "fp16",            # one of "fp32", "bf16", "fp16"
    "num_features": 128,
    "num_classes": 12,
    "hidden": 256,
    "micro_batch": 64,
    "accum_steps": 4,
    "steps": 70,
    "warmup_steps": 10,
    "lr": 1e-3,
    "loss_weights": {"cls": 1.0, "recon": 0.0003},   # recon MSE starts ~1000x the CE: down-weighted
    "grad_clip": 5.0,
    "log_every": 10,
}
AMP_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
amp_dtype = AMP_DTYPES[config["precision"]]
use_amp = amp_dtype != torch.float32


class FrameDataset:
    """Synthetic acoustic frames: a class prototype, a speaker offset and noise; the
    reconstruction target is the clean frame (prototype + speaker offset)."""

    def __init__(self, seed):
        g = torch.Generator().manual_seed(99)
        self.prototypes = torch.randn(config["num_classes"], config["num_features"], generator=g)
        self.speakers = 0.5 * torch.randn(16, config["num_features"], generator=g)
        self.g = torch.Generator().manual_seed(seed)

    def batch(self, n):
        y = torch.randint(0, config["num_classes"], (n,), generator=self.g)
        spk = torch.randint(0, 16, (n,), generator=self.g)
        clean = self.prototypes[y] + self.speakers[spk]
        noisy = clean + 2.5 * torch.randn(n, config["num_features"], generator=self.g)
        return noisy, y, clean


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        h = config["hidden"]
        self.inp = nn.Linear(config["num_features"], h)
        self.norm1 = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, h)
        self.norm2 = nn.LayerNorm(h)
        self.fc2 = nn.Linear(h, h)

    def forward(self, x):
        x = F.gelu(self.inp(x))
        x = x + F.gelu(self.fc1(self.norm1(x)))
        return x + F.gelu(self.fc2(self.norm2(x)))


class MultiTaskNet(nn.Module):
    def __init__(self):
        super().__init__()
        h = config["hidden"]
        self.encoder = Encoder()
        self.cls_head = nn.Linear(h, config["num_classes"])
        self.recon_head = nn.Sequential(nn.Linear(h, h), nn.GELU(), nn.Linear(h, config["num_features"]))

    def forward(self, x):
        z = self.encoder(x)
        return self.cls_head(z), self.recon_head(z)


def lr_lambda(step):
    if step < config["warmup_steps"]:
        return (step + 1) / config["warmup_steps"]
    progress = (step - config["warmup_steps"]) / (config["steps"] - config["warmup_steps"])
    return 0.5 * (1.0 + math.cos(math.pi * progress))


model = MultiTaskNet()
optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=0.01)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
# loss scaling is only needed for float16
scaler = torch.amp.GradScaler("cpu", enabled=(config["precision"] == "float16"))
train_set, val_set = FrameDataset(seed=1), FrameDataset(seed=2)
val_x, val_y, val_clean = val_set.batch(256)
w = config["loss_weights"]


def evaluate():
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=amp_dtype, enabled=use_amp):
        logits, recon = model(val_x)
        ce = F.cross_entropy(logits, val_y)
        mse = F.mse_loss(recon, val_clean)
    acc = (logits.argmax(-1) == val_y).float().mean().item()
    model.train()
    return ce.item(), mse.item(), acc


with amp_runtime.guard(policy="record", model=model) as g:
    for step in range(config["steps"]):
        stats = {"cls": 0.0, "recon": 0.0}
        for _ in range(config["accum_steps"]):
            x, y, clean = train_set.batch(config["micro_batch"])
            with torch.autocast("cpu", dtype=amp_dtype, enabled=use_amp):
                logits, recon = model(x)
                losses = {"cls": F.cross_entropy(logits, y), "recon": F.mse_loss(recon, clean)}
                loss = sum(w[k] * v for k, v in losses.items()) / config["accum_steps"]
            scaler.scale(loss).backward()
            for k in stats:
                stats[k] += losses[k].item() / config["accum_steps"]
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config["grad_clip"])
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % config["log_every"] == 0 or step == config["steps"] - 1:
            ce, mse, acc = evaluate()
            print(f"step {step:3d} | cls {stats['cls']:.4f} recon {stats['recon']:.4f} | val ce {ce:.4f} "
                  f"mse {mse:.4f} acc {acc:.3f} | grad norm {grad_norm.item():.3g} | "
                  f"scale {scaler.get_scale():g} | lr {scheduler.get_last_lr()[0]:.2e}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
