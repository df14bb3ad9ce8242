"""EXPECT: none
HEALTHY: a plain accelerate training loop, `Accelerator(mixed_precision="bf16", cpu=True,
gradient_accumulation_steps=2)` (accelerate 1.15 turns on native bf16 autocast on the CPU:
`prepare` wraps the model's forward in `torch.autocast("cpu", dtype=torch.bfloat16)` and
`convert_outputs_to_fp32`; no GradScaler for bf16). A small token-classification model
(Embedding, two pre-norm MLP residual blocks, a head); the loader, model, AdamW and a linear
warm-up scheduler all go through `accelerator.prepare`; the loop is the documented idiom:
`with accelerator.accumulate(model):`, the loss `F.cross_entropy(logits, y)` on the
(fp32-converted) outputs, `accelerator.backward(loss)`, `accelerator.clip_grad_norm_` only
when `accelerator.sync_gradients`, `optimizer.step()`, `scheduler.step()`,
`optimizer.zero_grad()`. Token embeddings get exact-zero rows for tokens absent from a batch
(REAL_WORLD_IDIOMS: "Zero is not underflow"). An evaluation pass under `torch.no_grad()` and
`model.eval()` runs halfway, then `model.train()` again. REAL_WORLD_IDIOMS lists
`accelerator.backward`, a prepared optimizer's `.step()` and `accelerator.clip_grad_norm_`
among the wrappers that must not produce findings and "bf16 autocast with no scaler
(correct)"; the loss is computed on fp32 values (accelerate converts the outputs), so
AMP002's "loss function that runs with autocast off on fp16/bf16 inputs" does not apply.
No reduction runs in bf16 (checked in a plain run). So no event is expected.
"""
import json
import time
import warnings

import torch

torch.set_num_threads(1)

import torch.nn.functional as F  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import amp_runtime  # noqa: E402

warnings.filterwarnings("ignore")
VOCAB, SEQ, NCLS = 200, 12, 6


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, h):
        return h + self.fc2(F.gelu(self.fc1(self.norm(h))))


class Tagger(nn.Module):
    def __init__(self, d=48):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(2)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, NCLS)

    def forward(self, ids):
        h = self.embed(ids)
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.norm(h))


def make_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    tags = (ids % NCLS + (ids // 50)) % NCLS  # a learnable rule
    return TensorDataset(ids, tags)


def main():
    set_seed(0)
    accelerator = Accelerator(mixed_precision="bf16", cpu=True, gradient_accumulation_steps=2)
    model = Tagger()
    loader = DataLoader(make_data(384, 5), batch_size=16, shuffle=True)
    eval_loader = DataLoader(make_data(64, 6), batch_size=32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    model, optimizer, loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, loader, eval_loader, scheduler
    )
    losses, evals = [], []
    t0 = time.time()
    with amp_runtime.guard(policy="record") as g:
        model.train()
        for i, (ids, tags) in enumerate(loader):
            with accelerator.accumulate(model):
                logits = model(ids)
                loss = F.cross_entropy(logits.reshape(-1, NCLS), tags.reshape(-1))
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.append(round(loss.item(), 6))
            if i == len(loader) // 2:
                model.eval()
                with torch.no_grad():
                    correct = 0
                    for eids, etags in eval_loader:
                        correct += (model(eids).argmax(-1) == etags).sum().item()
                evals.append(correct / (64 * SEQ))
                model.train()
    print(f"WALL {time.time() - t0:.2f}s")
    print("LOSSES", losses)
    print("EVAL", evals, "logits dtype", logits.dtype)
    print("WEIGHTSUM", float(sum(p.detach().double().sum() for p in model.parameters())))
    print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))


if __name__ == "__main__":
    main()
