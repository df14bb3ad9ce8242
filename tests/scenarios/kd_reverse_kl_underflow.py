"""EXPECT: AMP101,AMP108,AMP112
MAY: AMP102

FAULT: knowledge distillation of a small MLP student from a confident MLP teacher (trained in
fp32 at line 79, standing in for its checkpoint; its fp32 probabilities go down to 1e-16) with a
mode-seeking reverse-KL loss module `ReverseKLDistillation` (a root module, held in `kd_loss`),
computed inside the fp16 autocast block (line 93) with a GradScaler. Under CPU autocast `softmax` stays
fp16, so the teacher's small probabilities flush to exactly 0 (497 of 640 in the first batch)
and the ratio `q / p` at line 76 divides by 0 (or overflows 65504 for p < ~1e-5): inf, then
`log` inf and the KL term inf (fp32 on the same batch: 18.3, finite). Every step's loss is inf;
GradScaler skips all 10 steps and halves its scale each time, 65536 -> 64. The reduction is
upcast (`.float().sum(-1).mean()`), so the fault is the ratio, not the reduction.

Pages: AMP101: the first op whose output holds Inf while its inputs were finite is the division
`q / p` at line 76 in the `ReverseKLDistillation` module; the loss module is a root module
called with grad enabled, so the replay of step 0 re-runs it from its kept inputs ("Every call made with grad enabled keeps
its inputs", "the step's calls run again, in order") -> step 0. AMP112: "the loss is NaN/Inf
when backward starts" (line 95). AMP108: 5 consecutive decreases (step 4), below 1/100 of 65536
(step 6), below 128 and falling (step 9). Not AMP107: the last scale is 64. MAY AMP102: the
division's traced output may hold finite values in (60000, 65504] besides the inf ones (none in
the first batch); the page does not say whether the op that is AMP101 is also AMP102. The pages
do not say how a root module without a parent is named (`module` may be empty or the class). Not
expected: AMP004 (the sum and mean run on fp32), AMP002 (loss inside the block), AMP103
(skipped steps), AMP011 (no epsilon).
"""
import json

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.set_num_threads(1)
torch.manual_seed(0)

N_CLASSES, D_IN = 10, 32
CENTERS = 2.0 * torch.randn(N_CLASSES, D_IN)


def batch(gen, n=64):
    y = torch.randint(0, N_CLASSES, (n,), generator=gen)
    x = CENTERS[y] + torch.randn(n, D_IN, generator=gen)
    return x, y


def mlp(width):
    return nn.Sequential(nn.Linear(D_IN, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, N_CLASSES))


def train_teacher(steps=300):
    """Stands in for loading the trained teacher's checkpoint (fp32, plain cross-entropy)."""
    teacher = mlp(256)
    opt = torch.optim.Adam(teacher.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(2)
    for _ in range(steps):
        x, y = batch(gen)
        loss = F.cross_entropy(teacher(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return teacher.eval().requires_grad_(False)


class ReverseKLDistillation(nn.Module):
    """Mode-seeking KL(q_student || p_teacher), averaged over the batch."""

    def __init__(self, tau=1.0):
        super().__init__()
        self.tau = tau

    def forward(self, student_logits, teacher_logits):
        q = torch.softmax(student_logits / self.tau, dim=-1)
        p = torch.softmax(teacher_logits / self.tau, dim=-1)
        return (q * torch.log(q / p)).float().sum(-1).mean()  # INJECTED: fp16 ratio, p underflows


teacher = train_teacher()
student = mlp(32)
kd_loss = ReverseKLDistillation(tau=1.0)
optimizer = torch.optim.AdamW(student.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
gen = torch.Generator().manual_seed(3)

with amp_runtime.guard(policy="record") as g:
    for step in range(10):
        x, y = batch(gen)
        with torch.autocast("cpu", dtype=torch.float16):
            with torch.no_grad():
                teacher_logits = teacher(x)
            student_logits = student(x)
            loss = F.cross_entropy(student_logits, y) + 0.5 * kd_loss(student_logits, teacher_logits)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():.4g}")

for e in g.report.events:
    print(f"EVENT {e.code} step={e.step} op={e.op} module={e.module!r} source={e.source} :: {e.message}")
print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
