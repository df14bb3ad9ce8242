"""
Faster CPU training for tabular models with bfloat16 autocast
-------------------------------------------------------------

Code for the blog post. We train the same small MLP on the "Give Me Some Credit"
dataset four ways on a 32-core Sapphire Rapids box (AMX) and compare epoch time and
validation AUC:

  1. fp32 baseline
  2. autocast with the old `torch.cpu.amp` API
  3. autocast with `torch.autocast("cpu", dtype=torch.bfloat16)` + a small logit penalty
  4. the whole model in bf16

No GradScaler anywhere: bf16 has the exponent range of fp32, so gradients do not
underflow the way they do in fp16.
"""
# %%
import functools
import time

import numpy as np
import pandas as pd
import torch as th
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import QuantileTransformer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

th.manual_seed(0)
th.set_num_threads(32)

BATCH_SIZE = 2048
EPOCHS = 8
LR = 3e-3
HIDDEN = 512
LOGIT_PENALTY = 1e-3

# %% data
df = pd.read_csv("data/cs-training.csv", index_col=0)
target = "SeriousDlqin2yrs"
features = [c for c in df.columns if c != target]
df[features] = df[features].fillna(df[features].median())

X_train, X_valid, y_train, y_valid = train_test_split(
    df[features].values, df[target].values, test_size=0.2, stratify=df[target].values, random_state=0
)
qt = QuantileTransformer(n_quantiles=1000, output_distribution="normal", random_state=0)
X_train = qt.fit_transform(X_train).astype(np.float32)
X_valid = qt.transform(X_valid).astype(np.float32)

train_ds = TensorDataset(th.from_numpy(X_train), th.from_numpy(y_train.astype(np.float32)))
valid_ds = TensorDataset(th.from_numpy(X_valid), th.from_numpy(y_valid.astype(np.float32)))
train_loader = DataLoader(train_ds, batch_size=BATCH_SIZE, shuffle=True, drop_last=True)
valid_loader = DataLoader(valid_ds, batch_size=BATCH_SIZE * 4)
n_features = X_train.shape[1]
pos_weight = th.tensor([(y_train == 0).sum() / max((y_train == 1).sum(), 1)], dtype=th.float32)


# %% model
def make_mlp(in_dim, hidden=HIDDEN, depth=3, dropout=0.1):
    layers = []
    d = in_dim
    for _ in range(depth):
        layers += [nn.Linear(d, hidden), nn.SiLU(), nn.Dropout(dropout)]
        d = hidden
    return nn.Sequential(*layers, nn.Linear(d, 1))


def count_params(model):
    return sum(p.numel() for p in model.parameters())


# version-gated alias used by the evaluation helper (the post also runs on torch 1.9)
try:
    cpu_autocast = functools.partial(th.amp.autocast, "cpu", dtype=th.bfloat16)
except AttributeError:
    cpu_autocast = th.cpu.amp.autocast


@th.no_grad()
def evaluate(model, loader):
    model.eval()
    preds, labels, nll, n = [], [], 0.0, 0
    for xb, yb in loader:
        with cpu_autocast():
            probs = th.sigmoid(model(xb).squeeze(-1))
        per_sample = -th.log(th.where(yb > 0.5, probs, 1 - probs) + 1e-8)
        nll += per_sample.float().sum().item()
        n += len(yb)
        preds.append(probs.float().numpy())
        labels.append(yb.numpy())
    model.train()
    return roc_auc_score(np.concatenate(labels), np.concatenate(preds)), nll / n


def report(name, model, times):
    auc, nll = evaluate(model, valid_loader)
    print(f"{name:<22} {np.mean(times):6.2f} s/epoch   val AUC {auc:.4f}   val NLL {nll:.4f}")


# %% 1. fp32 baseline
def fit_fp32(model, epochs=EPOCHS):
    optimizer = th.optim.AdamW(model.parameters(), lr=LR, weight_decay=1e-5)
    times = []
    for epoch in range(epochs):
        t0 = time.perf_counter()
        for xb, yb in train_loader:
            logits = model(xb).squeeze(-1)
            loss = F.binary_cross_entropy_with_logits(logits, yb, pos_weight=pos_weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        times.append(time.perf_counter() - t0)
    return times


model = make_mlp(n_features)
print(f"params: {count_params(model):,}")
report("fp32", model, fit_fp32(model))


# %% 2. autocast, old API
# The spelling used in the IPEX docs and most CPU examples.
def fit_autocast_legacy(model, epochs=EPOCHS):
    optimizer = th.optim.AdamW(model.parameters(), lr=LR, weight_decay=1e-5)
    weights = {0: 1.0, 1: float(pos_weight)}
    times = []
    for epoch in range(epochs):
        t0 = time.perf_counter()
        for xb, yb in train_loader:
            w = th.where(yb > 0.5, weights[1], weights[0])
            with th.cpu.amp.autocast():  # expect: AMP009
                probs = th.sigmoid(model(xb).squeeze(-1))
                loss = F.binary_cross_entropy(probs, yb, weight=w)  # expect: AMP003
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        times.append(time.perf_counter() - t0)
    return times


model = make_mlp(n_features)
report("autocast (cpu.amp)", model, fit_autocast_legacy(model))


# %% 3. autocast, current API, with a logit penalty
# Keeping the logits near zero helps calibration on this imbalanced target.
def fit_autocast(model, epochs=EPOCHS, penalty=LOGIT_PENALTY):
    optimizer = th.optim.AdamW(model.parameters(), lr=LR, weight_decay=1e-5)
    scheduler = th.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=LR, total_steps=epochs * len(train_loader))
    times = []
    for epoch in range(epochs):
        t0 = time.perf_counter()
        for xb, yb in train_loader:
            with th.autocast("cpu", dtype=th.bfloat16):
                logits = model(xb).squeeze(-1)
                bce = F.binary_cross_entropy_with_logits(logits, yb, pos_weight=pos_weight)
                loss = bce + penalty * logits.pow(2).mean()  # expect: AMP004
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
        times.append(time.perf_counter() - t0)
    return times


model = make_mlp(n_features)
report("autocast (torch.amp)", model, fit_autocast(model))


# %% 4. everything in bf16
# Weights, optimizer state and activations all in bf16.
def fit_pure_bf16(model, epochs=EPOCHS):
    model = model.to(th.bfloat16)  # expect: AMP001
    optimizer = th.optim.AdamW(model.parameters(), lr=LR, weight_decay=1e-5)
    times = []
    for epoch in range(epochs):
        t0 = time.perf_counter()
        for xb, yb in train_loader:
            xb = xb.to(th.bfloat16)  # expect: AMP001
            logits = model(xb).squeeze(-1)
            loss = F.binary_cross_entropy_with_logits(logits.float(), yb, pos_weight=pos_weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        times.append(time.perf_counter() - t0)
    return times, model


model = make_mlp(n_features)
times, model = fit_pure_bf16(model)
report("pure bf16", model.float(), times)

# %% export the autocast model for the serving benchmark
final = make_mlp(n_features)
fit_autocast(final, epochs=EPOCHS)
final.eval()
example = th.randn(1, n_features)
with th.no_grad():
    traced = th.jit.trace(final.to(th.bfloat16), example.to(th.bfloat16))
traced.save("credit_mlp_bf16.pt")
th.save({k: v.to(th.bfloat16) for k, v in final.state_dict().items()}, "credit_mlp_bf16_state.pt")
