"""EXPECT: none
MAY: none
FAULT: none (healthy control). Teacher-student distillation with two models in one
loop. The teacher (a wider MLP, pretrained in fp32 before the guard) is frozen for
serving the soft targets: `teacher.half().eval().requires_grad_(False)` happens BEFORE
the guard, and inside the loop it is called under `torch.no_grad()` within the fp16
autocast region. The student trains in fp16 autocast with a GradScaler; loss =
0.7 * KL(student/T || teacher/T) * T^2 + 0.3 * CE, both on `.float()` logits, with a
cosine schedule and an eval of the student every 15 steps. The guard gets
`model=student`. The teacher has no gradients (not a vanishing layer), it is not replayed
(no_grad), and its pure-fp16 weights are not a manual cast inside training (done before
the guard, frozen, under no grad mode for its use). Student gradients are healthy (norm
< 3), the scaler never skips: no event expected.
"""
import json
import math

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

T = 2.0
N_CLASSES = 10


def mlp(d_in, widths, d_out, p_drop=0.0):
    layers, d = [], d_in
    for w in widths:
        layers += [nn.Linear(d, w), nn.ReLU(), nn.Dropout(p_drop)]
        d = w
    layers.append(nn.Linear(d, d_out))
    return nn.Sequential(*layers)


def make_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    protos = torch.randn(N_CLASSES, 32, generator=torch.Generator().manual_seed(42)) * 1.2
    y = torch.randint(0, N_CLASSES, (n,), generator=g)
    x = protos[y] + torch.randn(n, 32, generator=g)
    return x, y


def pretrain_teacher(teacher, x, y, steps=60):
    opt = torch.optim.Adam(teacher.parameters(), lr=2e-3)
    for _ in range(steps):
        idx = torch.randint(0, x.shape[0], (128,))
        loss = F.cross_entropy(teacher(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()


def distill_loss(student_logits, teacher_logits, targets, alpha=0.7):
    soft = F.kl_div(F.log_softmax(student_logits / T, dim=-1),
                    F.softmax(teacher_logits / T, dim=-1), reduction="batchmean") * T * T
    hard = F.cross_entropy(student_logits, targets)
    return alpha * soft + (1 - alpha) * hard


@torch.no_grad()
def evaluate(student, x, y):
    student.eval()
    with torch.autocast("cpu", dtype=torch.float16):
        acc = (student(x).float().argmax(-1) == y).float().mean().item()
    student.train()
    return acc


def main(steps=45, batch_size=64):
    x_tr, y_tr = make_data(4096, 1)
    x_va, y_va = make_data(512, 2)
    teacher = mlp(32, [256, 256], N_CLASSES)
    pretrain_teacher(teacher, x_tr, y_tr)
    teacher = teacher.half().eval().requires_grad_(False)   # frozen fp16 teacher for serving

    student = mlp(32, [48], N_CLASSES, p_drop=0.1)
    optimizer = torch.optim.AdamW(student.parameters(), lr=5e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    scaler = torch.amp.GradScaler("cpu")
    g_data = torch.Generator().manual_seed(3)
    accs = []
    with amp_runtime.guard(policy="record", model=student) as g:
        for step in range(steps):
            idx = torch.randint(0, x_tr.shape[0], (batch_size,), generator=g_data)
            x, y = x_tr[idx], y_tr[idx]
            with torch.autocast("cpu", dtype=torch.float16):
                with torch.no_grad():
                    t_logits = teacher(x)
                s_logits = student(x)
                loss = distill_loss(s_logits.float(), t_logits.float(), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(student.parameters(), 2.0)
            scaler.step(optimizer)
            scaler.update()
            sched.step()
            if step % 15 == 14:
                accs.append(evaluate(student, x_va, y_va))
    assert accs[-1] > 0.6, accs
    print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))


if __name__ == "__main__":
    main()
