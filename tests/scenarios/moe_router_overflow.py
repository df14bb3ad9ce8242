"""EXPECT: AMP101,AMP107,AMP108,AMP112
MAY: AMP102

FAULT: a tabular click model with a top-2 mixture-of-experts layer trained in fp16 autocast with
a GradScaler. The router (module path `moe.router.gate`, line 58, `logits = self.gate(z)`) is
fed, besides the hidden state, the raw service-latency features in milliseconds (lognormal,
median ~8e3, 8 % of the values above 65504, up to ~5e5) that the experts never see (line 73,
`torch.cat([h, gate_feats])`, which autocast promotes to fp32). Under fp16 autocast `linear` casts
its fp32 input to fp16, so the router logits of the rows with large latencies overflow to inf
(even in fp32 a few logits exceed 65504); softmax of inf gives NaN, the combine weights and the
loss are NaN from step 0 on, in every batch. GradScaler skips every step and halves its scale
each time: 65536 -> 1 after 16 updates (step 15), 2^-8 after 24 (plain torch, no guard: loss nan
at every logged step, final scale 0.0039).

Pages: AMP101: "the first op whose output holds NaN/Inf while its inputs were finite", found by
the replay of the first failing step under trace="auto" ("AMP101 names the op of the step where
it happened", the model being a root module) -> op linear, module moe.router.gate, line 58,
step 0. AMP112: "the loss is NaN/Inf when backward starts" (line 117). AMP108: "5 consecutive
decreases, a scale below 1/100 of its initial value, or a scale below 128 that is still falling"
(from step 4). AMP107: "at or below 1 and not rising" (step 15 on). MAY AMP102: the replayed
router output may also hold finite values above 60000 besides the inf ones; the page does not
say whether the op already reported as AMP101 is also AMP102. Not expected: AMP103 ("Steps that
a GradScaler skips ... are not AMP103"), AMP109 (its window of 100 steps "counted from the first
step the scaler did not skip" never fills), AMP004 (the load-balancing loss upcasts with
`.float()` before its mean/sum; cross_entropy runs in fp32 under CPU autocast).
"""
import json

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.set_num_threads(1)
torch.manual_seed(0)

N_EXPERTS, TOP_K, D = 4, 2, 32


class Expert(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, h):
        return self.fc2(F.gelu(self.fc1(h)))


class TopKRouter(nn.Module):
    def __init__(self, d_in, n_experts, k):
        super().__init__()
        self.gate = nn.Linear(d_in, n_experts)
        self.k = k

    def forward(self, z):
        logits = self.gate(z)  # INJECTED (via the raw latency columns of z): overflows fp16
        probs = torch.softmax(logits, dim=-1)
        top_p, top_i = probs.topk(self.k, dim=-1)
        combine = torch.zeros_like(probs).scatter(-1, top_i, top_p)
        return combine, probs, top_i


class MoELayer(nn.Module):
    def __init__(self, d, n_gate_feats):
        super().__init__()
        self.router = TopKRouter(d + n_gate_feats, N_EXPERTS, TOP_K)
        self.experts = nn.ModuleList(Expert(d) for _ in range(N_EXPERTS))

    def forward(self, h, gate_feats):
        # the router also sees the raw service-latency features (milliseconds, not normalised)
        combine, probs, top_i = self.router(torch.cat([h, gate_feats], dim=-1))
        expert_out = torch.stack([expert(h) for expert in self.experts], dim=1)
        out = torch.einsum("be,bed->bd", combine, expert_out)
        return out, probs, top_i


class ClickModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(24, D)
        self.moe = MoELayer(D, 4)
        self.head = nn.Linear(D, 2)

    def forward(self, x, gate_feats):
        h = F.gelu(self.embed(x))
        m, probs, top_i = self.moe(h, gate_feats)
        return self.head(h + m), probs, top_i


def load_balancing_loss(probs, top_i):
    probs = probs.float()
    routed = F.one_hot(top_i, N_EXPERTS).float().sum(1)
    return N_EXPERTS * (probs.mean(0) * routed.mean(0)).sum() / TOP_K


def batch(gen, n=64):
    x = torch.randn(n, 24, generator=gen)
    latency_ms = torch.exp(9.0 + 1.5 * torch.randn(n, 4, generator=gen))  # lognormal, median ~8 s
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return x, latency_ms, y


model = ClickModel()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
scaler = torch.amp.GradScaler("cpu")
gen = torch.Generator().manual_seed(1)

with amp_runtime.guard(policy="record") as g:
    for step in range(24):
        x, latency_ms, y = batch(gen)
        with torch.autocast("cpu", dtype=torch.float16):
            logits, probs, top_i = model(x, latency_ms)
            loss = F.cross_entropy(logits, y) + 0.01 * load_balancing_loss(probs, top_i)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if step % 4 == 0:
            print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():.4g}")

print("final scale", scaler.get_scale())
for e in g.report.events:
    print(f"EVENT {e.code} step={e.step} op={e.op} module={e.module!r} source={e.source} :: {e.message}")
print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
