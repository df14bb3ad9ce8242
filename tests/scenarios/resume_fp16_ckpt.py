"""EXPECT: AMP107 AMP108 AMP112
MAY: AMP101

FAULT: save_checkpoint stores the weights in half precision to halve the file
(`{k: v.half() for k, v in model.state_dict().items()}`), and the run, preempted at step 50,
reloads the latest checkpoint (step 40) into the same model, optimizer, scheduler and
GradScaler. PriceRegressor has a learned output de-normalisation initialised from the target
statistics: out_shift = 212000 (dollars), above fp16's 65504, so it is saved as inf and
load_state_dict copies inf into the fp32 parameter. Every step after the reload predicts
inf: the loss is inf, the GradScaler skips all 39 remaining steps and halves the scale each
time, 65536 -> 1 at the 16th skip -> 1.2e-7 at the end. fp16 body, fp32 head island.
- AMP112: from the first step after the reload, backward starts from an inf loss (the
  forward started from the parameter out_shift, inf before the forward).
- AMP108: 39 consecutive decreases after 50 good steps; the scale falls below 655 and 128.
- AMP107: the scale reaches 1.0 at the 16th skipped step and keeps falling.
MAY: AMP101 (the `.half()` in save_checkpoint makes inf from a finite value under no_grad at
steps 20 and 40; per-op checks are off there under trace="auto", so it should not be seen,
but naming it would be right).
Must stay silent: AMP109 (89 steps in all, the 100-step window never fills), AMP103 (the
scaler catches every step), AMP104 (the skipped steps' gradients are inf/NaN, but AMP104
measures the gradients the optimizer applies, and none are applied; the healthy
s19_resume_ckpt_highscale.py has 11 such skipped steps too), AMP106.
"""
import json
import os
import shutil
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

N_FEATURES, HIDDEN, BATCH = 32, 256, 512
PRICE_MEAN, PRICE_STD = 212_000.0, 48_000.0      # training-set statistics of the target (dollars)
STEPS, SAVE_EVERY, PREEMPTED_AT = 80, 20, 50
LOG_EVERY = 10


class PriceRegressor(nn.Module):
    """MLP body in autocast; head and output de-normalisation kept in fp32."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(N_FEATURES, HIDDEN), nn.GELU(),
            nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
            nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
        )
        self.head = nn.Linear(HIDDEN, 1)
        # learned de-normalisation, initialised from the target statistics
        self.out_scale = nn.Parameter(torch.tensor(PRICE_STD))
        self.out_shift = nn.Parameter(torch.tensor(PRICE_MEAN))

    def forward(self, x):
        h = self.body(x)
        with torch.autocast("cpu", enabled=False):
            z = self.head(h.float()).squeeze(-1)
            return z * self.out_scale + self.out_shift


WEIGHTS = torch.randn(N_FEATURES, generator=torch.Generator().manual_seed(7))


def make_batch(step):
    """Deterministic per step, so that a resumed run sees the same batches again."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, N_FEATURES, generator=g)
    signal = x @ WEIGHTS / N_FEATURES ** 0.5 + 0.3 * torch.tanh(x[:, 0] * x[:, 1])
    price = PRICE_MEAN + PRICE_STD * (signal + 0.1 * torch.randn(BATCH, generator=g))
    return x, price


def save_checkpoint(path, step, model, optimizer, scheduler, scaler):
    with torch.no_grad():
        state = {
            "step": step,
            # store the weights in half precision: half the size on disk
            "model": {k: v.half() for k, v in model.state_dict().items()},
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),
        }
    torch.save(state, path)


def load_checkpoint(path, model, optimizer, scheduler, scaler):
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])             # copied into the fp32 parameters
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    return state["step"]


def main():
    model = PriceRegressor()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=STEPS, pct_start=0.2)
    scaler = torch.amp.GradScaler("cpu")
    ckpt_dir = tempfile.mkdtemp(prefix="s19_ckpt_")
    latest = os.path.join(ckpt_dir, "latest.pt")
    t0 = time.time()
    preempted = False
    try:
        with amp_runtime.guard(policy="record", model=model) as g:
            step = 0
            while step < STEPS:
                if step == PREEMPTED_AT and not preempted:
                    # the job was preempted: restart from the latest checkpoint, same objects
                    preempted = True
                    step = load_checkpoint(latest, model, optimizer, scheduler, scaler) + 1
                    print(f"resumed from step {step - 1}: out_shift {model.out_shift.item():.1f}")
                x, price = make_batch(step)
                with torch.autocast("cpu", dtype=torch.float16):
                    pred = model(x)
                    loss = F.mse_loss(pred / PRICE_STD, price / PRICE_STD)
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                scaler.step(optimizer)
                scaler.update()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                if step % LOG_EVERY == 0 or step >= PREEMPTED_AT - 10:
                    rmse = (loss.item() ** 0.5) * PRICE_STD
                    print(f"step {step:3d} loss {loss.item():.4f} rmse ${rmse:,.0f} grad_norm {float(grad_norm):.3f} "
                          f"scale {scaler.get_scale():.4g} lr {scheduler.get_last_lr()[0]:.2e}")
                if step % SAVE_EVERY == 0 and step > 0:
                    save_checkpoint(latest, step, model, optimizer, scheduler, scaler)
                step += 1
    finally:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    print(f"done in {time.time() - t0:.1f}s, final scale {scaler.get_scale():.4g}")
    print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))


if __name__ == "__main__":
    main()
