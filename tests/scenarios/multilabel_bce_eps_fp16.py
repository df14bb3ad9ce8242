"""EXPECT: AMP011 AMP101 AMP107 AMP108 AMP112
MAY: AMP102 AMP106 AMP110

FAULT: a numerically fragile loss in fp16. A multi-label tagger (two optimizers, SGD for
the backbone and AdamW for the head, one GradScaler; warm-up + cosine; `unscale_` for both
then `clip_grad_norm_`; an EMA copy evaluated under `torch.inference_mode()`) computes its
binary cross-entropy by hand in `MultiLabelBCE.forward`:
`-(y * log(sigmoid(x) + 1e-8) + (1 - y) * log(1 - sigmoid(x) + 1e-8))`. Under CPU fp16
autocast the sigmoid output is fp16, and 1e-8 is below fp16's smallest subnormal (5.96e-8):
added to an fp16 tensor it flushes to zero (AMP011, on every watched step from step 0).
While the logits are small the loss is fine (0.354 -> 0.060 by step 9). At step 10 the
largest logit reaches 8.80: sigmoid rounds to exactly 1.0 in fp16, `1 - p + 1e-8` is 0,
`log` gives -inf, and `(1 - y) * -inf` is NaN for positive tags: the loss is NaN (AMP112)
at steps 10-17 and 19-44 (step 18 passes, max logit 8.2). GradScaler skips those steps and
halves the scale: 65536 -> 512 after step 16 (below 1/100 of the initial scale), 5
consecutive decreases after step 18 went through (steps 19-23) (AMP108), 1.0 after step
26, 3.8e-6 at step 44, never rising (AMP107). The replay of step 10 (skipped, weights
unchanged) runs the model and the loss module again with per-op checks: the first op whose
output is non-finite from finite inputs is `torch.log` in `MultiLabelBCE.forward`
(AMP101). Training silently stops at step 17 while the printed F1 stays 0.967. Fewer than
100 steps, so no AMP109 window. Left open by the pages: AMP102 (whether the -inf output
counts as |x| > 60000), AMP106 (whether its 32nd-step count looks at a skipped step's
non-finite gradients: step 32 is skipped) and AMP110 (the 1e-8 operand is wholly absorbed,
ratio ~1e8, but the check is sampled and whether a Python scalar is an operand is not said).
"""
import copy
import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

IN_DIM = 96
NUM_TAGS = 40
TAGS_PER_SAMPLE = 3
BATCH = 256
STEPS = 45
WARMUP_STEPS = 5
LR_BACKBONE, LR_HEAD = 0.1, 1.5e-2
PRIOR = 0.01                 # initial tag probability (RetinaNet-style bias init)
EMA_DECAY = 0.9
CLIP_GRAD = 5.0
LOG_EVERY = 5


class TaggedClips:
    """Clip embeddings that mix the embeddings of their tags, plus noise."""

    def __init__(self, seed):
        g = torch.Generator().manual_seed(17)
        self.tag_vectors = torch.randn(NUM_TAGS, IN_DIM, generator=g)
        self.g = torch.Generator().manual_seed(seed)

    def batch(self, n=BATCH):
        scores = torch.rand(n, NUM_TAGS, generator=self.g)
        tags = scores.topk(TAGS_PER_SAMPLE, dim=-1).indices
        y = torch.zeros(n, NUM_TAGS).scatter_(1, tags, 1.0)
        x = y @ self.tag_vectors / math.sqrt(TAGS_PER_SAMPLE) + 0.3 * torch.randn(n, IN_DIM, generator=self.g)
        return x, y


class Tagger(nn.Module):
    def __init__(self, width=256):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(IN_DIM, width), nn.GELU(), nn.LayerNorm(width),
                                      nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width))
        self.head = nn.Linear(width, NUM_TAGS)
        nn.init.constant_(self.head.bias, -math.log((1 - PRIOR) / PRIOR))

    def forward(self, x):
        return self.head(self.backbone(x))


class MultiLabelBCE(nn.Module):
    """Per-tag binary cross-entropy, written out so tag weights can be added later."""

    def __init__(self, eps=1e-8):
        super().__init__()
        self.eps = eps

    def forward(self, logits, targets):
        p = torch.sigmoid(logits)
        loss = -(targets * torch.log(p + self.eps) + (1 - targets) * torch.log(1 - p + self.eps))
        return loss.mean()


def lr_factor(step):
    if step < WARMUP_STEPS:
        return (step + 1) / WARMUP_STEPS
    return 0.5 * (1 + math.cos(math.pi * (step - WARMUP_STEPS) / (STEPS - WARMUP_STEPS)))


train_data, val_data = TaggedClips(seed=1), TaggedClips(seed=2)
model = Tagger()
criterion = MultiLabelBCE()
ema_model = copy.deepcopy(model).eval().requires_grad_(False)
opt_backbone = torch.optim.SGD(model.backbone.parameters(), lr=LR_BACKBONE, momentum=0.9, nesterov=True)
opt_head = torch.optim.AdamW(model.head.parameters(), lr=LR_HEAD, weight_decay=0.01)
optimizers = {"backbone": (opt_backbone, LR_BACKBONE), "head": (opt_head, LR_HEAD)}
scaler = torch.amp.GradScaler("cpu")
val_x, val_y = val_data.batch(512)


def f1_at_half(net):
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.float16):
        pred = net(val_x).float() > 0
    tp = (pred & (val_y > 0)).sum().item()
    return 2 * tp / max(1, pred.sum().item() + (val_y > 0).sum().item())


with amp_runtime.guard(policy="record", model=model) as g:
    for step in range(STEPS):
        for opt, base_lr in optimizers.values():
            opt.param_groups[0]["lr"] = base_lr * lr_factor(step)
        x, y = train_data.batch()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x)
            loss = criterion(logits, y)
        scaler.scale(loss).backward()
        for opt, _ in optimizers.values():
            scaler.unscale_(opt)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_GRAD)
        for opt, _ in optimizers.values():
            scaler.step(opt)
        scaler.update()
        for opt, _ in optimizers.values():
            opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p_ema, p in zip(ema_model.parameters(), model.parameters()):
                p_ema.lerp_(p, 1 - EMA_DECAY)
        if step % LOG_EVERY == 0 or step == STEPS - 1:
            print(f"step {step:3d} | loss {loss.item():.4f} | grad norm {grad_norm.item():.3g} | "
                  f"scale {scaler.get_scale():g} | max logit {logits.float().max().item():.2f} | "
                  f"val F1 {f1_at_half(model):.3f} (ema {f1_at_half(ema_model):.3f})")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
