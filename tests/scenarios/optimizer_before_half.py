"""EXPECT: AMP001,AMP010,AMP011,AMP103,AMP112
MAY: AMP101
FAULT: news-topic classifier (EmbeddingBag + MLP). `setup()` builds the Adam optimizer
(default eps=1e-8) over the fp32 model and only then "saves memory" with `model.half()`
(line 49, marked `# <-- FAULT`, before step 0, grad mode on). `Module.half()` converts the
same Parameter objects in place, so the optimizer silently trains pure-fp16 weights;
Adam's state is created in fp16 at step 0, its `eps=1e-8` flushes to 0 in fp16, and
wherever the second moment v = 0.001*g^2 underflows fp16 the update is m/0 = inf or
0/0 = NaN. Checked with plain torch (no guard): step 0 has a finite fp16 loss and finite
gradients, its optimizer step writes inf/NaN into the weights, and from step 1 on the
loss is NaN and every gradient non-finite. No autocast, no GradScaler.
Why these codes (from the pages): AMP001 runtime = "a module ... is cast to fp16/bf16
while grad mode is on" (`model.half()`). AMP011 runtime = "an epsilon that flushes to
zero in the dtype of the tensor it is added to": Adam adds eps=1e-8 to its fp16
denominator in optimizer.step at step 0 (a watched step). AMP112 = NaN loss at backward
(step 1 on). AMP103 = "NaN/Inf gradients that no GradScaler caught (the optimizer
stepped on them)" (step 1 on). MAY AMP101: from step 1 every op already receives NaN/inf
*parameters*, so by the page's definition ("while its inputs were finite") no forward op
qualifies, but the pages do not say how parameters count as inputs in the replay.
Not AMP002: no autocast region exists. Written blind without AMP010 ("no autocast region
exists"); the guard reported it, and AMP010's page now says that an fp16 backward with no
scaler counts whether the fp16 comes from autocast or from a model cast with `.half()`.
"""
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

VOCAB, TOPICS = 2000, 4


class TopicClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(VOCAB, 64, mode="mean")
        self.mlp = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, TOPICS))

    def forward(self, tokens):
        return self.mlp(self.emb(tokens))


def setup():
    model = TopicClassifier()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-4)
    model.half()  # <-- FAULT: after the optimizer was built; trains pure fp16
    return model, optimizer


def batch(n=32, length=24):
    topic = torch.randint(0, TOPICS, (n,))
    # each topic prefers its own quarter of the vocabulary
    base = torch.randint(0, VOCAB // TOPICS, (n, length)) + (topic * (VOCAB // TOPICS))[:, None]
    noise = torch.randint(0, VOCAB, (n, length))
    tokens = torch.where(torch.rand(n, length) < 0.6, base, noise)
    return tokens, topic


with amp_runtime.guard(policy="record") as g:
    model, optimizer = setup()
    for step in range(30):
        tokens, topic = batch()
        logits = model(tokens)
        loss = F.cross_entropy(logits, topic)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
