"""EXPECT: none
MAY: none
FAULT: none (healthy control). Gradient accumulation with a GradScaler, done the way real
trainers do it: up to 6 micro-batches per optimizer step, an epoch of 250 samples in
micro-batches of 16 (15 full ones and a last one of 10 samples), so each epoch has 2 full
accumulation groups of 6 and an uneven last group of 4 micro-batches whose last is short;
the loss is a sum over the group's samples divided by their number.
`scaler.scale(loss).backward()` runs on every micro-batch, but `unscale_` /
`clip_grad_norm_` / `scaler.step` / `scaler.update` only at the group boundaries (the
script deliberately skips the optimizer step on the other micro-batches). The next
micro-batch is fetched between forward and backward (prefetch idiom). 4 epochs = 12
optimizer steps, 64 backward passes. The padding row of the embedding has exact-zero
gradients by design. The docs: gradient accumulation is judged once per step, not per
micro-batch; a step ends at `scaler.update()`. The scaler never skips, losses are finite,
total gradient norms stay below 5 (the clip threshold; nothing near AMP104).
"""
import json

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

ACCUM = 6
MICRO = 16
N = 250


class TextCNN(nn.Module):
    def __init__(self, vocab=500, d=48, n_classes=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=0)
        self.conv = nn.Conv1d(d, 96, kernel_size=3, padding=1)
        self.fc = nn.Linear(96, n_classes)

    def forward(self, tokens):
        h = self.embed(tokens).transpose(1, 2)
        h = F.relu(self.conv(h))
        h = F.adaptive_max_pool1d(h, 1).squeeze(-1)
        return self.fc(h)


def make_dataset():
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(5, 32, (N,), generator=g)
    tokens = torch.zeros(N, 32, dtype=torch.long)
    labels = torch.randint(0, 3, (N,), generator=g)
    for i in range(N):
        words = torch.randint(1, 500, (int(lengths[i]),), generator=g)
        words[0] = 1 + int(labels[i]) * 7                # a class-indicative token
        tokens[i, : lengths[i]] = words
    return tokens, labels


def loader(tokens, labels, epoch):
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(100 + epoch))
    for i in range(0, N, MICRO):
        idx = perm[i:i + MICRO]
        yield tokens[idx], labels[idx]


def train(model, optimizer, scaler, tokens, labels, epochs=4):
    n_micro = (N + MICRO - 1) // MICRO              # 16 micro-batches per epoch
    losses = []
    for epoch in range(epochs):
        it = loader(tokens, labels, epoch)
        x, y = next(it)
        optimizer.zero_grad(set_to_none=True)
        group_start = 0
        for i in range(n_micro):
            group_end = min(group_start + ACCUM, n_micro)
            group_samples = min(group_end * MICRO, N) - group_start * MICRO
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(x)
                loss = F.cross_entropy(logits.float(), y, reduction="sum") / group_samples
            nxt = next(it, None)                    # prefetch the next micro-batch
            scaler.scale(loss).backward()
            losses.append(loss.item())
            if i + 1 == group_end:                  # end of the accumulation group
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                group_start = group_end
            if nxt is not None:
                x, y = nxt
    return losses


def main():
    tokens, labels = make_dataset()
    model = TextCNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    with amp_runtime.guard(policy="record", model=model) as g:
        losses = train(model, optimizer, scaler, tokens, labels)
    assert sum(losses[-6:]) < sum(losses[:6]), losses
    print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))


if __name__ == "__main__":
    main()
