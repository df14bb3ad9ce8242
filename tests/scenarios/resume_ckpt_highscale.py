"""EXPECT: none

HEALTHY: the look-alike of s19_resume_fp16_ckpt.py, written correctly: the checkpoint keeps
the weights in fp32 (out_shift = 211998.3 after the reload), and the run reloads it mid-run
(preempted at step 50, resumed from step 40: steps 41-49 run twice, 89 iterations in all)
into the same model, optimizer, OneCycleLR scheduler and GradScaler. The GradScaler starts
at a Megatron-style init_scale of 2**32: the first 9 steps (0-8) are skipped in a row while
the scale settles (2**32 -> 2**23), two more at steps 11 and 12 (-> 2**21 = 2097152), then
none: the scale stays at 2**21 to the end, far above 65536/100. Losses are finite
throughout (RMSE $47k -> $7.5k), applied norms 0.06-2.1 (clip at 5 after unscale_).
AMP108 must not fire: its skips come before the first step that went through, or are two
decreases after it; AMP109 must not: its window never fills.
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
            "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
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
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 32)   # Megatron-style initial scale: settles in the first steps
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
