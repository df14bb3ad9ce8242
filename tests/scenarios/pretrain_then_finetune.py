"""EXPECT: none
MAY: none
FAULT: none (healthy control). Two guards one after the other, with different models:
(1) self-supervised pretraining of a denoising autoencoder (`DenoisingAE`: encoder +
decoder) in fp16 autocast with a GradScaler, guard `model=ae`; (2) fine-tuning of a
classifier (`Classifier`: the pretrained encoder, shared, plus a new head) in bf16
autocast without a scaler (correct for bf16), with a lower LR for the encoder, guard
`model=clf`. Step counting switches from scaler updates (phase 1) to optimizer steps
(phase 2); the decoder keeps the stale gradients of phase 1 (it is not part of phase 2),
the encoder is shared between the two models. Nothing of the first guard may leak into
the second. Losses and gradients are healthy (total norm < 5, no skipped step); all
losses run on `.float()` outputs. The lines GUARD1/GUARD2 are informational (both
expected []), EVENTS is their union.
"""
import json

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)


def mlp(d_in, d_hidden, d_out):
    return nn.Sequential(nn.Linear(d_in, d_hidden), nn.GELU(), nn.Linear(d_hidden, d_out))


class DenoisingAE(nn.Module):
    def __init__(self, d=48, d_latent=16):
        super().__init__()
        self.encoder = mlp(d, 96, d_latent)
        self.decoder = mlp(d_latent, 96, d)

    def forward(self, x, noise_std=0.3):
        return self.decoder(self.encoder(x + noise_std * torch.randn_like(x)))


class Classifier(nn.Module):
    def __init__(self, encoder, d_latent=16, n_classes=4):
        super().__init__()
        self.encoder = encoder
        self.head = nn.Sequential(nn.GELU(), nn.Dropout(0.1), nn.Linear(d_latent, n_classes))

    def forward(self, x):
        return self.head(self.encoder(x))


def unlabeled(n=4096, d=48):
    g = torch.Generator().manual_seed(1)
    z = torch.randn(n, 8, generator=g)
    mix = torch.randn(8, d, generator=torch.Generator().manual_seed(2)) / 8 ** 0.5
    return torch.tanh(z @ mix)


def labeled(n=512, d=48):
    x = unlabeled(n, d)
    w = torch.randn(d, 4, generator=torch.Generator().manual_seed(3))
    return x, (x @ w).argmax(-1)


def pretrain(ae, steps=40, batch_size=128):
    x_all = unlabeled()
    opt = torch.optim.AdamW(ae.parameters(), lr=2e-3)
    scaler = torch.amp.GradScaler("cpu")
    g_data = torch.Generator().manual_seed(4)
    for step in range(steps):
        x = x_all[torch.randint(0, x_all.shape[0], (batch_size,), generator=g_data)]
        with torch.autocast("cpu", dtype=torch.float16):
            recon = ae(x)
            loss = F.mse_loss(recon.float(), x)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return loss.item()


def finetune(clf, epochs=8, batch_size=64):
    x_all, y_all = labeled()
    opt = torch.optim.AdamW([
        {"params": clf.encoder.parameters(), "lr": 1e-3},
        {"params": clf.head.parameters(), "lr": 1e-2},
    ], weight_decay=0.01)
    g_data = torch.Generator().manual_seed(5)
    for epoch in range(epochs):
        perm = torch.randperm(x_all.shape[0], generator=g_data)
        for i in range(0, x_all.shape[0], batch_size):
            idx = perm[i:i + batch_size]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = clf(x_all[idx])
                loss = F.cross_entropy(logits.float(), y_all[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(clf.parameters(), 2.0)
            opt.step()
    with torch.no_grad():
        acc = (clf(x_all).argmax(-1) == y_all).float().mean().item()
    return acc


def main():
    ae = DenoisingAE()
    with amp_runtime.guard(policy="record", model=ae) as g1:
        pretrain(ae)
    clf = Classifier(ae.encoder)
    with amp_runtime.guard(policy="record", model=clf) as g2:
        acc = finetune(clf)
    assert acc > 0.5, acc
    codes1 = sorted({e.code for e in g1.report.events})
    codes2 = sorted({e.code for e in g2.report.events})
    print("GUARD1 " + json.dumps(codes1))
    print("GUARD2 " + json.dumps(codes2))
    print("EVENTS " + json.dumps(sorted(set(codes1) | set(codes2))))


if __name__ == "__main__":
    main()
