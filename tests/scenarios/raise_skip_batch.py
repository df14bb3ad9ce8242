"""EXPECT: AMP101
MAY: AMP112,AMP103

FAULT: a bag-of-words text classifier (nn.EmbeddingBag(mode="mean") -> manual L2
normalisation -> MLP) trained with bf16 CPU autocast, AdamW and clip_grad_norm_, no
GradScaler (bf16). The loop runs under `amp_runtime.guard(policy="raise")` and skips a
batch when the guard raises: it catches `amp_runtime.GuardError`, checks that the weights
and the AdamW state are exactly those from before the bad step, zeroes the grads and goes
on. At step 7 (0-based) the batch holds one document whose tokens were all out of
vocabulary and dropped by the tokenizer (`make_batches`, the line marked
`# FAULT: empty document`): its bag is empty, EmbeddingBag returns a zero row, and the
model's own L2 normalisation `e / e.norm(dim=-1, keepdim=True)` (BowClassifier.forward,
line marked `# FAULT OP`, module `stem`, an L2Norm module) computes 0/0 = NaN from finite
inputs. The loss of step 7 is NaN and all gradients are NaN; without the guard
`optimizer.step()` would write NaN into every weight.

Codes from the pages: index.md ("On the CPU a copy is complete at once: a step's problems
are judged at its optimizer step, before the optimizer applies it (under policy="raise" the
GuardError stops it there)"; replay point 4: "Under policy="raise" the GuardError raised
where the problem is judged names the replay's op; at the optimizer step it stops the
optimizer before it applies the step"), AMP101.md (replay with trace="auto"), so the
GuardError's event is AMP101 for the div in `stem`, step 7, and the weights and AdamW
state are unchanged. The events recorded up to the raise must contain AMP101. MAY: AMP112
(its judge is the one that asks for the replay; whether it is recorded before the
GuardError is raised for the replay's AMP101 is not said) and AMP103 (NaN grads reach the
optimizer's pre-hook; judged in the same place, order not said). Nothing must be raised
before step 7. The printed EVENTS are the codes recorded at the raise; the events after
the skipped batch are printed separately (AFTER line, not part of EXPECT).
Losses and final weights must equal an unguarded run that skips a non-finite loss by hand.
"""
import json
import math

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.set_num_threads(1)
torch.manual_seed(0)

VOCAB, STEPS, BS, BAD_STEP = 300, 14, 12, 7


class L2Norm(nn.Module):
    def forward(self, e):
        return e / e.norm(dim=-1, keepdim=True)  # FAULT OP: 0 / 0 for an empty bag


class BowClassifier(nn.Module):
    def __init__(self, d=48, n_cls=4):
        super().__init__()
        self.bag = nn.EmbeddingBag(VOCAB, d, mode="mean")
        self.stem = L2Norm()
        self.mlp = nn.Sequential(nn.Linear(d, 96), nn.GELU(), nn.Linear(96, n_cls))

    def forward(self, tokens, offsets):
        e = self.stem(self.bag(tokens, offsets))
        return self.mlp(e)


def make_batches():
    gen = torch.Generator().manual_seed(7)
    batches = []
    for step in range(STEPS):
        docs, labels = [], []
        for i in range(BS):
            n = int(torch.randint(3, 12, (1,), generator=gen))
            if step == BAD_STEP and i == 4:
                n = 0  # FAULT: empty document (every token out of vocabulary)
            toks = torch.randint(0, VOCAB, (n,), generator=gen)
            docs.append(toks)
            labels.append(int(toks.sum()) % 4 if n else 0)
        offsets = torch.tensor([0] + [len(d) for d in docs[:-1]]).cumsum(0)
        batches.append((torch.cat(docs), offsets, torch.tensor(labels)))
    return batches


def build():
    torch.manual_seed(0)
    model = BowClassifier()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def snapshot(model, opt):
    params = [p.detach().clone() for p in model.parameters()]
    state = {k: {n: (v.clone() if torch.is_tensor(v) else v) for n, v in s.items()}
             for k, s in opt.state_dict()["state"].items()}
    return params, state


def same_snapshot(a, b):
    pa, sa = a
    pb, sb = b
    if not all(torch.equal(x, y) for x, y in zip(pa, pb)):
        return False
    if sa.keys() != sb.keys():
        return False
    for k in sa:
        for n in sa[k]:
            x, y = sa[k][n], sb[k][n]
            if torch.is_tensor(x) and not torch.equal(x, y):
                return False
            if not torch.is_tensor(x) and x != y:
                return False
    return True


def forward_backward(model, opt, tokens, offsets, labels):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens, offsets)
        loss = F.cross_entropy(logits, labels)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    return loss


def train_reference(model, opt, batches):
    losses = []
    for tokens, offsets, labels in batches:
        loss = forward_backward(model, opt, tokens, offsets, labels)
        losses.append(loss.item())
        if not torch.isfinite(loss):  # skip the bad batch by hand
            opt.zero_grad(set_to_none=True)
            continue
        opt.step()
    return losses


def same(a, b):
    return len(a) == len(b) and all((math.isnan(p) and math.isnan(q)) or p == q for p, q in zip(a, b))


def fmt(e):
    d = e.details or {}
    return (f"{e.code} sev={e.severity} step={e.step} module={e.module!r} op={e.op!r} source={e.source!r} "
            f"details={str({k: d[k] for k in sorted(d) if k != 'traceback'})[:400]}")


batches = make_batches()
ref_model, ref_opt = build()
ref_losses = train_reference(ref_model, ref_opt, batches)
print("unguarded losses", [round(v, 4) for v in ref_losses])

model, opt = build()
losses, raised = [], []
codes_at_raise, n_at_raise = None, 0
with amp_runtime.guard(policy="raise", model=model) as g:
    for step, (tokens, offsets, labels) in enumerate(batches):
        before = snapshot(model, opt)
        loss = None
        try:
            loss = forward_backward(model, opt, tokens, offsets, labels)
            opt.step()
        except amp_runtime.GuardError as err:
            raised.append(step)
            ev = err.event
            print(f"GuardError at loop step {step}: {fmt(ev)}")
            print("  state unchanged by the bad step:", same_snapshot(before, snapshot(model, opt)))
            print("  loss of the bad step:", None if loss is None else loss.item())
            if codes_at_raise is None:
                codes_at_raise = sorted({e.code for e in g.report.events})
                n_at_raise = len(g.report.events)
                for e in g.report.events:
                    print("  recorded:", fmt(e))
            opt.zero_grad(set_to_none=True)
            if loss is None:  # raised before the loss was returned: recompute nothing, log NaN
                losses.append(float("nan"))
            else:
                losses.append(loss.item())
            continue
        losses.append(loss.item())

print("raised at steps", raised)
print("LOSSES_MATCH", same(ref_losses, losses),
      "WEIGHTS_MATCH", all(torch.equal(p, q) for p, q in zip(ref_model.parameters(), model.parameters())),
      "FINITE_WEIGHTS", all(torch.isfinite(p).all().item() for p in model.parameters()))
print("AFTER", json.dumps([fmt(e) for e in g.report.events[n_at_raise:]]))
print("EVENTS " + json.dumps(codes_at_raise if codes_at_raise is not None else []))
