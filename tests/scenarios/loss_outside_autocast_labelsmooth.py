"""EXPECT: AMP002,AMP101,AMP112
MAY: AMP102
FAULT: character-level tagger (token classification, 40 tags, 16x48 tokens per batch)
trained in fp16 autocast with a GradScaler. The criterion, an
`nn.CrossEntropyLoss(label_smoothing=0.1)` module held in `criterion`, is called AFTER
the `with torch.autocast(...)` block (line 70, marked `# <-- FAULT`) on the fp16 logits the
model produced inside it, at every step from step 0. Cross-entropy then runs in fp16:
the label-smoothing term sums -log p over all 768x40 entries (~1e5 > 65504), so the
fp16 loss is inf on EVERY step although logits and targets are finite, while its
gradients stay finite (checked with plain torch, no guard: loss prints `inf`, the scaler
skips step 0 only - the fp16 loss node receives the scale 65536 as gradient, inf in fp16 -
and then trains at 32768). Under CUDA autocast cross_entropy would have run in fp32.
Why these codes (from the pages): AMP002 runtime = "a loss function runs with autocast
off on low-precision inputs produced under autocast" (`criterion`, step 0). AMP112 =
"the loss is NaN/Inf when backward starts" (every step). AMP101: the AMP112 (and the
skipped step 0) trigger a replay of the step's root-module calls, and the index page
names "a loss module" among the root modules, so the replay re-runs `criterion` with
autocast off and must name `cross_entropy` in module `criterion` as the first op with
an inf output from finite inputs; per-op checks then stay on and see it live too. Not
AMP103: the only non-finite gradients (step 0) were caught by the scaler. One decrease
is not AMP108; 40 steps cannot fill the AMP109 window. MAY AMP102: the pages do not say
whether an inf fp16 output also counts as |x| > 60000. The model has no explicit adds
or low-precision reductions for the sampled AMP110/AMP111 checks.
"""
import json

import torch
import torch.nn as nn

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

VOCAB, TAGS, T, B = 96, 40, 48, 16


class CharTagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 64)
        self.conv = nn.Conv1d(64, 128, kernel_size=5, padding=2)
        self.proj = nn.Linear(128, 128)
        self.out = nn.Linear(128, TAGS)

    def forward(self, chars):
        h = self.emb(chars).transpose(1, 2)
        h = torch.relu(self.conv(h)).transpose(1, 2)
        return self.out(torch.relu(self.proj(h)))


def make_batch():
    chars = torch.randint(0, VOCAB, (B, T))
    # a learnable rule: the tag depends on the character and its left neighbour
    left = torch.roll(chars, 1, dims=1)
    tags = (chars * 7 + left * 3) % TAGS
    return chars, tags


model = CharTagger()
criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
scaler = torch.amp.GradScaler("cpu")

with amp_runtime.guard(policy="record") as g:
    for step in range(40):
        chars, tags = make_batch()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(chars)
        loss = criterion(logits.reshape(-1, TAGS), tags.reshape(-1))  # <-- FAULT: fp16 logits, autocast off
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f} ({loss.dtype}) scale {scaler.get_scale():.0f}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
