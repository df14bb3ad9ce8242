"""What every trainer integration relies on: closures run by ``optimizer.step`` (Lightning's
bf16 and fp32 steps, LBFGS, SAM) are watched like any forward and backward, and neither framework
is imported until its integration is, which then says what to install."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import amp_runtime
from frameworks.support import line_of, place


def _closure_training(steps, optimizer_class=torch.optim.SGD, overflow_at=None, **options):
    """Steps of ``optimizer.step(closure)`` under bf16 autocast; losses and final weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = optimizer_class(model.parameters(), lr=0.05)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    losses = []
    for step in range(steps):
        def closure():
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
                if step == overflow_at:
                    out = out * 1e39  # overflow in the closure
            loss = nn.functional.mse_loss(out.float(), y)
            loss.backward()
            return loss

        losses.append(optimizer.step(closure).item())
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("optimizer_class", [torch.optim.SGD, torch.optim.LBFGS])
def test_closure_steps_keep_their_numerics_and_are_silent(optimizer_class):
    plain_losses, plain_weights = _closure_training(5, optimizer_class)
    with amp_runtime.guard(policy="raise", trace="always") as guard:
        losses, weights = _closure_training(5, optimizer_class)
    assert losses == plain_losses  # LBFGS calls its closure several times per step
    assert all(torch.equal(a, b) for a, b in zip(weights, plain_weights))
    assert guard.step_index == 5 and len(guard.report) == 0


def test_an_overflow_inside_a_closure_is_found_at_its_step_before_the_optimizer_applies_it():
    with amp_runtime.guard(policy="record", trace="always") as guard:
        _closure_training(4, overflow_at=2)
    first = guard.report.events[0]
    assert (first.code, first.step, first.op) == ("AMP101", 2, "mul")
    assert place(first.source) == line_of(Path(__file__), "# overflow in the closure")
    grads = [e for e in guard.report.events if e.code == "AMP103"]
    assert grads and grads[0].step == 2  # the closure's gradients, not the previous step's


class SharpnessAware(torch.optim.Optimizer):
    """SAM as its reference implementation steps: the weights move up the gradient computed
    outside the step, the closure's forward and backward run there, the weights move back and the
    base optimizer applies the closure's gradients. Pre-running its closure before the step (as
    for torch.optim's optimizers, which call it first) would compute them at the wrong weights."""

    def __init__(self, params, lr=0.05, rho=0.05):
        super().__init__(params, {"lr": lr, "rho": rho})
        self.base = torch.optim.SGD(self.param_groups, lr=lr)

    @torch.no_grad()
    def step(self, closure):
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
        moves = [p.grad * (self.defaults["rho"] / (norm + 1e-12)) for p in params]
        torch._foreach_add_(params, moves)
        self.zero_grad()
        with torch.enable_grad():
            loss = closure()
        torch._foreach_sub_(params, moves)
        self.base.step()
        return loss


def _sharpness_aware_training(steps, overflow_at=None):
    """bf16 SAM steps: a first forward and backward, then ``optimizer.step(closure)``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = SharpnessAware(model.parameters())
    x, y = torch.randn(32, 8), torch.randn(32, 1)

    def loss_of(overflow=False):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
            if overflow:
                out = out * 1e39  # overflow in the SAM closure
        return nn.functional.mse_loss(out.float(), y)

    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        loss_of().backward()

        def closure():
            loss = loss_of(overflow=step == overflow_at)
            loss.backward()
            return loss

        losses.append(optimizer.step(closure).item())
    return losses, [p.detach().clone() for p in model.parameters()]


def test_the_closure_of_an_optimizer_that_moves_the_weights_first_runs_where_it_calls_it():
    """An optimizer that is not torch.optim's may change the weights before it calls the
    closure (SAM): the guard lets it call the closure itself, and watches it there."""
    plain_losses, plain_weights = _sharpness_aware_training(5)
    with amp_runtime.guard(policy="raise", trace="always") as guard:
        losses, weights = _sharpness_aware_training(5)
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(weights, plain_weights))
    assert guard.step_index == 5 and len(guard.report) == 0

    with amp_runtime.guard(policy="record", trace="always") as guard:
        _sharpness_aware_training(4, overflow_at=2)
    first = guard.report.events[0]
    assert (first.code, first.step, first.op) == ("AMP101", 2, "mul")
    assert place(first.source) == line_of(Path(__file__), "# overflow in the SAM closure")


def _import_in_a_fresh_python(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def test_no_framework_is_imported_by_the_guard_or_the_integrations_package():
    result = _import_in_a_fresh_python(
        "import sys, amp_runtime.guard, amp_runtime.integrations\n"
        "with amp_runtime.guard(): pass\n"
        "print(sorted(m for m in ('lightning', 'pytorch_lightning', 'transformers', "
        "'accelerate') if m in sys.modules))")
    assert (result.returncode, result.stdout.strip()) == (0, "[]"), result.stderr


@pytest.mark.parametrize("integration, blocked, install", [
    ("lightning", "lightning", "pip install lightning"),
    ("pytorch_lightning", "pytorch_lightning", "pip install pytorch-lightning"),
    ("transformers", "transformers", "pip install transformers"),
])
def test_a_missing_framework_is_named_with_what_to_install(integration, blocked, install):
    result = _import_in_a_fresh_python(
        f"import sys; sys.modules[{blocked!r}] = None\n"
        f"import amp_runtime.integrations.{integration}")
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: amp_runtime.integrations.")
    assert f"needs {blocked}, which is not installed" in last
    assert last.endswith(install), last


def test_a_trainer_resumed_at_its_step_count_numbers_events_readings_and_metrics_from_it(tmp_path):
    """The callbacks' session renumbers the guard at the trainer's step (a resumed run): the
    first step's event and its metrics record carry that number, like the steps after it."""
    import json

    from amp_runtime.integrations.session import GuardSession

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = GuardSession(policy="record", log_dir=tmp_path, report=False)
    session.start(model, None, rank=None, world_size=1)
    for step in (1000, 1001):
        session.sync_step(step)
        offset = torch.tensor(float("inf") if step == 1000 else 0.0)  # no gradient: only the loss
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.ones(2, 4)).float().mean() + offset
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    session.finish()
    (nonfinite_loss,) = session.guard.report.by_code("AMP112")
    assert nonfinite_loss.step == 1000
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [1000, 1001]
