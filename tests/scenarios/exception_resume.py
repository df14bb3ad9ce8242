"""EXPECT: AMP112
MAY: none
FAULT: a tabular click model trains in fp16 autocast with a GradScaler and 2 micro-batches
per optimizer step, reading records from a (simulated) CSV shard. The shard is corrupt
around record block 5: the first micro-batch of step 5 holds a row with a missing value
parsed as NaN, so its loss is NaN when `scaler.scale(loss).backward()` starts (AMP112,
step 5, the backward line in `run_steps`); fetching the second micro-batch of step 5 then
raises `ValueError` (a truncated line) inside the guarded block, before that step's
`scaler.step`/`update`. The ValueError is caught OUTSIDE the with-block; the script drops
the half-accumulated gradients and goes on from the next record block under a new guard.
AMP112 was observed in the step the exception interrupted: the guard left by the
exception must still report it (docs: what is in flight is judged when the guard exits,
"normally or by exception"). The NaN is in the data, not made by an op, so there is no
AMP101 (no op turns finite inputs into NaN). The script asserts that leaving the guard by
exception removed every mode and hook it installed (torch-function mode stack, global
module/optimizer hooks, the patched Tensor.backward / autograd.grad / GradScaler /
Optimizer methods are back) and that the whole run, resumed under a second guard, gives
bit-identical losses and weights to the same run without any guard (dropout included).
The second guard should see nothing (its line AFTER is informational); EVENTS is the
first guard's.
"""
import json

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.set_num_threads(1)

N_BLOCKS = 14
ACCUM = 2
BATCH = 32
CORRUPT_BLOCK = 5


class ClickModel(nn.Module):
    def __init__(self, d_in=24, d_hidden=64):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d_in, d_hidden), nn.ReLU(), nn.Dropout(0.2),
            nn.Linear(d_hidden, d_hidden), nn.ReLU(), nn.Dropout(0.2),
            nn.Linear(d_hidden, 1),
        )

    def forward(self, x):
        return self.net(x).squeeze(-1)


class ShardReader:
    """Yields (features, clicked) micro-batches; block 5 of the shard is damaged."""

    def __init__(self, seed=11):
        self.g = torch.Generator().manual_seed(seed)
        self.w = torch.randn(24, generator=torch.Generator().manual_seed(12))

    def micro_batches(self, block):
        for micro in range(ACCUM):
            x = torch.randn(BATCH, 24, generator=self.g)
            y = (x @ self.w + 0.3 * torch.randn(BATCH, generator=self.g) > 0).float()
            if block == CORRUPT_BLOCK:
                if micro == 0:
                    x[7, 3] = float("nan")        # empty field parsed as NaN
                else:
                    raise ValueError(f"shard line {block * ACCUM * BATCH + micro * BATCH}: "
                                     "expected 25 fields, got 9")
            yield x, y


def run_steps(model, optimizer, scaler, reader, blocks, losses):
    for block in blocks:
        optimizer.zero_grad(set_to_none=True)
        for x, y in reader.micro_batches(block):
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(x)
                loss = F.binary_cross_entropy_with_logits(logits.float(), y) / ACCUM
            scaler.scale(loss).backward()
            losses.append(loss.item())
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()


def global_state(model, optimizer, scaler):
    """What a guard may install; must be identical before it is entered and after it is left."""
    import torch.nn.modules.module as mm
    import torch.optim.optimizer as oo
    hook_dicts = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
                  "_state_dict_hooks", "_load_state_dict_pre_hooks")
    return {
        "tf_mode_stack": torch._C._len_torch_function_stack(),
        "global_module_hooks": tuple(len(getattr(mm, n)) for n in sorted(dir(mm))
                                     if n.startswith("_global_")
                                     and isinstance(getattr(mm, n), dict)),
        "module_hooks": tuple(len(getattr(m, d)) for m in model.modules() for d in hook_dicts),
        "param_hooks": tuple((len(p._backward_hooks or {}),
                              len(getattr(p, "_post_accumulate_grad_hooks", None) or {}))
                             for p in model.parameters()),
        "optim_hooks": (len(oo._global_optimizer_pre_hooks), len(oo._global_optimizer_post_hooks),
                        len(optimizer._optimizer_step_pre_hooks),
                        len(optimizer._optimizer_step_post_hooks)),
        "instance_callables": tuple(sorted(k for obj in (model, optimizer, scaler)
                                           for k, v in vars(obj).items() if callable(v)
                                           and not isinstance(v, (nn.Module, torch.Tensor)))),
        "Tensor.backward": torch.Tensor.backward,
        "autograd.backward": torch.autograd.backward,
        "autograd.grad": torch.autograd.grad,
        "_foreach_norm": torch._foreach_norm,
        "GradScaler": tuple(getattr(torch.amp.GradScaler, n) for n in
                            ("scale", "unscale_", "step", "update", "get_scale")),
        "Optimizer": (torch.optim.Optimizer.zero_grad, torch.optim.AdamW.step),
        "clip": torch.nn.utils.clip_grad_norm_,
    }


def train(guarded):
    torch.manual_seed(0)
    model = ClickModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    scaler = torch.amp.GradScaler("cpu")
    reader = ShardReader()
    losses, first, second = [], None, None
    before = global_state(model, optimizer, scaler)
    try:
        if guarded:
            with amp_runtime.guard(policy="record", model=model) as first:
                run_steps(model, optimizer, scaler, reader, range(N_BLOCKS), losses)
        else:
            run_steps(model, optimizer, scaler, reader, range(N_BLOCKS), losses)
    except ValueError:
        pass                                     # log and skip the damaged block
    assert global_state(model, optimizer, scaler) == before, "state left behind by the guard"
    optimizer.zero_grad(set_to_none=True)        # drop the half-accumulated step
    if guarded:
        with amp_runtime.guard(policy="record", model=model) as second:
            run_steps(model, optimizer, scaler, reader, range(CORRUPT_BLOCK + 1, N_BLOCKS), losses)
    else:
        run_steps(model, optimizer, scaler, reader, range(CORRUPT_BLOCK + 1, N_BLOCKS), losses)
    assert global_state(model, optimizer, scaler) == before
    return model, losses, scaler.get_scale(), first, second


def main():
    ref_model, ref_losses, ref_scale, _, _ = train(guarded=False)
    model, losses, scale, g, g2 = train(guarded=True)
    assert len(losses) == len(ref_losses) == 2 * (N_BLOCKS - 1) + 1
    same_losses = all((a == b) or (a != a and b != b) for a, b in zip(losses, ref_losses))
    assert same_losses, "losses differ from the unguarded run"
    assert scale == ref_scale
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), f"{n} differs from the unguarded run"
    print("AFTER " + json.dumps(sorted({e.code for e in g2.report.events})))
    print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))


if __name__ == "__main__":
    main()
