"""EXPECT: AMP103 AMP112

FAULT: a NaN that comes from the data. An hourly building-load forecaster trained in
nanoGPT style: bf16 CPU autocast (`ctx = torch.amp.autocast(...)`), `GradScaler(enabled=
(dtype == "float16"))` (disabled in bf16 and called anyway, correct), AdamW, warm-up +
cosine, `unscale_` then `clip_grad_norm_`, an EMA (`AveragedModel`) and an evaluation under
`torch.no_grad()` every 20 steps. The humidity sensor dropped out for three hours, and
`load_meter_table` keeps those readings as NaN; the standardisation uses `torch.nanmean`,
so the statistics are finite but the three training rows (5096-5098) stay NaN. The
shuffled loader first serves one of them at step 30: the loss is NaN when backward starts
(AMP112), every gradient is NaN, `clip_grad_norm_` returns NaN and scales the gradients by
it, and the disabled scaler catches nothing: AdamW applies NaN gradients (AMP103) and
writes NaN into every weight. From step 31 on every loss is NaN (AMP112 again), the
validation loss and the EMA's are NaN at step 40. Steps 0-29 are healthy: loss 0.60 ->
0.17, raw gradient norm 4.5-11 clipped to 1.0. Not AMP101: no op turns finite values into
NaN (the batch is already NaN at step 30; from step 31 the parameters are). Not AMP010
(bf16 with a disabled scaler), not AMP104 (the applied norm is at most 1.0 before step 30
and NaN afterwards, which exceeds no limit).
"""
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_runtime

# ---------------------------------------------------------------- config
dtype = "bfloat16"                # 'float32', 'bfloat16' or 'float16'
device_type = "cpu"
n_rows = 8192
context_hours = 24
batch_size = 128
max_iters = 70
warmup_iters = 8
learning_rate = 2e-3
min_lr = 2e-4
weight_decay = 0.05
grad_clip = 1.0
log_interval = 10
eval_interval = 20
ema_decay = 0.98
# ----------------------------------------------------------------
torch.manual_seed(7)
torch.set_num_threads(1)
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = torch.amp.autocast(device_type=device_type, dtype=ptdtype)


def load_meter_table():
    """Hourly building-load table: the last `context_hours` of load plus weather and
    calendar features, target = next hour's load. Humidity is read from a second sensor."""
    g = torch.Generator().manual_seed(11)
    t = torch.arange(n_rows + context_hours + 1, dtype=torch.float32)
    temp = 12 + 8 * torch.sin(2 * math.pi * t / (24 * 365)) + 5 * torch.sin(2 * math.pi * (t - 14) / 24) \
        + torch.randn(len(t), generator=g)
    humidity = 60 + 15 * torch.sin(2 * math.pi * (t + 5) / 24) + 3 * torch.randn(len(t), generator=g)
    load = 40 + 0.8 * (temp - 12).abs() + 10 * (torch.sin(2 * math.pi * (t - 8) / 24) > 0).float() \
        + 0.05 * humidity + torch.randn(len(t), generator=g)
    humidity[5120:5123] = float("nan")     # the humidity sensor dropped out for three hours
    rows = []
    for i in range(context_hours, context_hours + n_rows):
        hour = t[i] % 24
        rows.append(torch.cat([
            load[i - context_hours:i],
            torch.stack([temp[i], humidity[i], torch.sin(2 * math.pi * hour / 24), torch.cos(2 * math.pi * hour / 24)]),
        ]))
    x = torch.stack(rows)
    y = load[context_hours + 1:context_hours + 1 + n_rows].unsqueeze(1)
    return x, y


x_all, y_all = load_meter_table()
split = int(0.85 * n_rows)                  # time-based split: the last 15% is validation
x_train, y_train, x_val, y_val = x_all[:split], y_all[:split], x_all[split:], y_all[split:]
# standardise with statistics that skip missing readings
feat_mean = torch.nanmean(x_train, dim=0)
feat_std = torch.sqrt(torch.nanmean((x_train - feat_mean) ** 2, dim=0)) + 1e-6
y_mean, y_std = y_train.mean(), y_train.std()


def normalise(x, y):
    return (x - feat_mean) / feat_std, (y - y_mean) / y_std


x_train, y_train = normalise(x_train, y_train)
x_val, y_val = normalise(x_val, y_val)
n_features = x_train.size(1)


class TrainLoader:
    def __init__(self, seed):
        self.g = torch.Generator().manual_seed(seed)
        self.order, self.pos = torch.randperm(len(x_train), generator=self.g), 0

    def next(self):
        if self.pos + batch_size > len(self.order):
            self.order, self.pos = torch.randperm(len(x_train), generator=self.g), 0
        idx = self.order[self.pos:self.pos + batch_size]
        self.pos += batch_size
        return x_train[idx], y_train[idx]


class GatedResidual(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 2 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        a, b = self.fc(self.norm(x)).chunk(2, dim=-1)
        return x + self.out(a * torch.sigmoid(b))


class LoadForecaster(nn.Module):
    def __init__(self, d=384, depth=4):
        super().__init__()
        self.inp = nn.Linear(n_features, d)
        self.blocks = nn.ModuleList([GatedResidual(d) for _ in range(depth)])
        self.head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 1))

    def forward(self, x, targets=None):
        h = self.inp(x)
        for blk in self.blocks:
            h = blk(h)
        pred = self.head(h)
        loss = None if targets is None else F.smooth_l1_loss(pred, targets, beta=0.5)
        return pred, loss


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / warmup_iters
    ratio = (it - warmup_iters) / (max_iters - warmup_iters)
    return min_lr + 0.5 * (1 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


model = LoadForecaster()
ema = torch.optim.swa_utils.AveragedModel(
    model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(ema_decay))
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=weight_decay)
# initialize a GradScaler. If enabled=False scaler is a no-op
scaler = torch.amp.GradScaler(device_type, enabled=(dtype == "float16"))
loader = TrainLoader(seed=29)


@torch.no_grad()
def estimate_loss(net):
    net.eval()
    with ctx:
        pred, loss = net(x_val, y_val)
    mae_kw = ((pred.float() - y_val).abs().mean() * y_std).item()
    net.train()
    return loss.item(), mae_kw


with amp_runtime.guard(policy="record", model=model) as g:
    t0 = time.time()
    for it in range(max_iters):
        lr = get_lr(it)
        for group in optimizer.param_groups:
            group["lr"] = lr
        xb, yb = loader.next()
        with ctx:
            _, loss = model(xb, yb)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        ema.update_parameters(model)
        if it % log_interval == 0 or it == max_iters - 1:
            print(f"iter {it}: loss {loss.item():.4f}, grad norm {norm.item():.3g}, lr {lr:.2e}, "
                  f"nan rows in batch {int(xb.isnan().any(dim=1).sum())}, {time.time() - t0:.1f}s")
        if (it + 1) % eval_interval == 0:
            val_loss, mae = estimate_loss(model)
            ema_loss, ema_mae = estimate_loss(ema.module)
            print(f"step {it + 1}: val loss {val_loss:.4f} (MAE {mae:.2f} kW), ema val loss {ema_loss:.4f}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
