"""EXPECT: AMP101,AMP102,AMP108,AMP112
MAY: AMP110

FAULT: an IRNN sequence classifier (ReLU RNN cell whose recurrent weight is initialised to
1.05 * I, "tuned on 50-step sequences") unrolled in a Python loop over the sequence, trained under
fp16 autocast with a GradScaler (unscale_ before the clip: correct). A length curriculum (line
88) feeds T=50 for steps 0-7, which are healthy (loss 0.69 -> 0.68, grad norm <= 2.1, scale stays
65536), and T=200 from step 8 on. Over 200 steps the hidden state grows by ~1.05 per step: in fp16
the recurrent projection `self.hh(h)` (module `rnn.hh`, called at line 56 in
`IRNNCell.forward`) first exceeds 60000 at t=178 and overflows to inf at t=179 of step 8 (plain
torch check, no guard; in fp32 the largest |h| would be 3.2e5, finite). The loss is NaN at every
step from 8 on; GradScaler skips steps 8-21 and halves its scale 14 times, 65536 -> 4.

Pages: AMP101: the first op whose output is non-finite while its inputs were finite, step 8,
found by the replay of the first failing step (the model is a root module): `linear` in `rnn.hh`
(or the `add` in `rnn`), line 56. AMP102: "an op whose fp16 output holds a value with |x| above
60000 ... Requires per-op checks (trace="always", or "auto" after an anomaly)"; the replay runs
"with the per-op checks of trace="always"", and per-op checks stay on from step 9 on ("switches
per-op checks on for the next occurrences"); the hidden state grows by 1.05 < 65504/60000 per
step, so every overflowing unit passes through (60000, 65504] first (t=178 of step 8). AMP112:
the loss is NaN when backward starts (line 94), steps 8-21. AMP108: 5 consecutive decreases
(step 12), a scale below 1/100 of 65536 (step 14), below 128 and falling (step 17). Not AMP107:
the scale ends at 4 > 1. MAY AMP110: once per-op checks are on, `self.ih(x_t) + self.hh(h)` adds
an input drive of ~0.03 to a recurrent term of up to 6.5e4, a ratio far beyond fp16's 2^11 for
the growing units, while units that ReLU holds at 0 are not absorbed; the page's "one operand is
wholly absorbed" does not say whether that is judged per tensor or per element. Not expected:
AMP103 (the scaler skips those steps), AMP104 (finite unscaled norms <= 2.1; the skipped steps'
norms are NaN, which exceeds nothing), AMP105, AMP005 (unscale_ comes before the clip).
"""
import json

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.set_num_threads(1)
torch.manual_seed(0)


class IRNNCell(nn.Module):
    """ReLU RNN cell with a scaled-identity recurrent init (Le et al., 2015)."""

    def __init__(self, d_in, d_hidden, gain, input_scale=0.01):
        super().__init__()
        self.ih = nn.Linear(d_in, d_hidden)
        self.hh = nn.Linear(d_hidden, d_hidden)
        with torch.no_grad():
            self.ih.weight.mul_(input_scale)
            self.ih.bias.mul_(input_scale)
            self.hh.weight.copy_(gain * torch.eye(d_hidden))  # tuned on 50-step sequences
            self.hh.bias.zero_()

    def forward(self, x_t, h):
        return torch.relu(self.ih(x_t) + self.hh(h))  # hidden state, fp16 under autocast


class SequenceClassifier(nn.Module):
    def __init__(self, d_in=4, d_hidden=64, n_classes=2, gain=1.05):
        super().__init__()
        self.rnn = IRNNCell(d_in, d_hidden, gain)
        self.head = nn.Linear(d_hidden, n_classes)
        with torch.no_grad():
            self.head.weight.mul_(0.01)
            self.head.bias.zero_()

    def forward(self, x):
        h = x.new_zeros(x.shape[0], self.rnn.hh.in_features)
        for t in range(x.shape[1]):  # unrolled over the whole sequence
            h = self.rnn(x[:, t], h)
        return self.head(h)


def batch(gen, seq_len, n=32):
    x = torch.randn(n, seq_len, 4, generator=gen)
    y = (x[:, :, 0].sum(1) > 0).long()  # sign of the running sum of channel 0
    return x, y


model = SequenceClassifier()
optimizer = torch.optim.Adam(model.parameters(), lr=3e-4)
scaler = torch.amp.GradScaler("cpu")
gen = torch.Generator().manual_seed(1)

with amp_runtime.guard(policy="record") as g:
    for step in range(22):
        seq_len = 50 if step < 8 else 200  # INJECTED: T=200 from step 8 overflows the fp16 hidden state
        x, y = batch(gen, seq_len)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} T={seq_len} loss {loss.item():.4f} grad_norm {grad_norm.item():.3g} "
              f"scale {scaler.get_scale():.4g}")

for e in g.report.events:
    print(f"EVENT {e.code} step={e.step} op={e.op} module={e.module!r} source={e.source} :: {e.message}")
print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
