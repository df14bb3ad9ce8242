"""The guard never breaks the run it watches: its own failures are contained (AMP100).

Each monitor is made to fail on purpose (one of its own methods raises); the training must
complete with losses and weights bit-identical to the unguarded run, the failure must be reported
once as AMP100 naming the monitor, and the failed monitor's handlers and hooks must stop running.
The user's own calls run exactly once whatever the guard does around them, and the exceptions
they raise reach the user unchanged.
"""
import os
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime
from amp_runtime.guard import Guard
from amp_runtime.monitors import Monitor
from amp_runtime.metrics import MetricsLog
from amp_runtime.monitors.forward import ForwardMonitor
from amp_runtime.monitors.grads import GradHealth, OptimizerEpsilon
from amp_runtime.monitors.scaler import ScalerWatch
from amp_runtime.rules.amp001 import ManualCast
from amp_runtime.rules.amp002 import LossOutsideAutocast
from amp_runtime.rules.amp003 import BceUnderAutocast
from amp_runtime.rules.amp004 import LowPrecisionReduce
from amp_runtime.rules.amp005 import ClipBeforeUnscale
from amp_runtime.rules.amp006 import StepBypassesScaler
from amp_runtime.rules.amp007 import Fp16OverflowLiteral
from amp_runtime.rules.amp008 import BackwardUnderAutocast
from amp_runtime.rules.amp010 import ScalerDtypeMismatch
from amp_runtime.replay import StepReplay
from amp_runtime.rules.amp011 import TinyEpsilon
from amp_runtime.steps import StepDetector
from amp_runtime.tensorboard import TensorBoardWriter

from test_guard import global_hook_counts
from test_readings import LaggingReadings
from test_scaler_kinds import scaled_update

STEPS = 12


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        h = F.relu(self.fc1(x))
        h = h.masked_fill(h > 1e3, 0.0)  # a safe constant: AMP007's handler looks at it
        h = h + 1e-3  # AMP011's and AMP110's handlers look at adds
        return self.fc2(h)


def train(steps=STEPS):
    """An fp16 loop with a GradScaler, unscale, clipping and every op a check looks at."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    scaler = torch.amp.GradScaler("cpu")
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 16, generator=generator).to(torch.float32)  # AMP001 looks at .to
        y = torch.randint(0, 4, (8,), generator=generator)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x)
            loss = F.cross_entropy(logits.float(), y)
        # fp32 outside autocast: AMP002's and AMP003's handlers look, nothing to report
        loss = loss + 0.1 * F.binary_cross_entropy(torch.sigmoid(logits.float()),
                                                   F.one_hot(y, 4).float())
        scaled_update(model, optimizer, scaler, loss)
        losses.append(loss.detach().mean())  # a reduction: AMP004's handler looks
    return losses, {name: value.clone() for name, value in model.state_dict().items()}


@pytest.fixture(scope="module")
def unguarded():
    return train()


def guarded_train(tmp_path, **options):
    options.setdefault("policy", "raise")  # raises for findings only, never for failures
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with amp_runtime.guard(log_dir=tmp_path / "logs", tensorboard=tmp_path / "tb",
                               **options) as g:
            result = train()
    return g, result


def assert_identical(result, unguarded):
    losses, weights = result
    expected_losses, expected_weights = unguarded
    assert [float(v) for v in losses] == [float(v) for v in expected_losses]
    assert weights.keys() == expected_weights.keys()
    assert all(torch.equal(weights[k], expected_weights[k]) for k in weights)


def failures(report):
    return [e for e in report.events if e.code == "AMP100"]


def test_the_healthy_loop_is_quiet_under_the_guard(tmp_path, unguarded):
    g, result = guarded_train(tmp_path, trace="always")
    assert [str(e) for e in g.report.events] == []
    assert_identical(result, unguarded)
    assert g.step_index == STEPS


def failing(counter):
    def fail(*args, **kwargs):
        counter.append(1)
        raise ValueError("a bug in the check")

    return fail


#: (monitor class, the method made to fail, a guard option it needs)
FAILURE_POINTS = [
    (ManualCast, "_check_cast", {}),
    (LossOutsideAutocast, "_check_loss", {}),
    (BceUnderAutocast, "_check", {}),
    (LowPrecisionReduce, "_check", {}),
    (ClipBeforeUnscale, "_kernel_runs", {}),
    (StepBypassesScaler, "_optimizer_step_starts", {}),  # a kept optimizer hook
    (StepBypassesScaler, "_backward_starts", {}),  # a handler reached through an entry point
    (Fp16OverflowLiteral, "_check", {}),
    (BackwardUnderAutocast, "_check", {}),
    (ScalerDtypeMismatch, "_backward_starts", {}),
    (TinyEpsilon, "_check_add", {}),
    (ForwardMonitor, "_check_loss", {}),
    (ForwardMonitor, "_check_output", {"trace": "always"}),  # the per-op tracer
    (ForwardMonitor, "_check_absorption", {}),
    (ForwardMonitor, "_judge_loss", {}),  # the judge of a deferred reading
    (ForwardMonitor, "_submit_trace", {"trace": "always"}),  # work at the readings' commits
    (ForwardMonitor, "_judge_trace", {"trace": "always"}),
    (GradHealth, "_unscaled", {}),  # a listener of the scaler watch
    (GradHealth, "_judge", {}),
    (GradHealth, "on_step_end", {}),
    (OptimizerEpsilon, "_optimizer_step_starts", {}),
    (MetricsLog, "write", {}),  # a step listener
    (MetricsLog, "_backward_starts", {}),
    (TensorBoardWriter, "write_step", {}),
]


@pytest.mark.parametrize("monitor, method, options", FAILURE_POINTS,
                         ids=[f"{m.__name__}.{name}" for m, name, _ in FAILURE_POINTS])
def test_a_failing_monitor_is_switched_off_and_reported_once(
        monitor, method, options, tmp_path, monkeypatch, unguarded):
    calls = []
    monkeypatch.setattr(monitor, method, failing(calls))
    hooks_before = global_hook_counts()
    g, result = guarded_train(tmp_path, **options)

    assert_identical(result, unguarded)
    assert len(calls) == 1, "the failed monitor's handlers and hooks must stop running"
    (event,) = failures(g.report)
    assert event.details["component"] == monitor.__name__
    assert event.details["exception"] == "ValueError: a bug in the check"
    assert "a bug in the check" in event.details["traceback"]
    assert event.message.startswith(f"amp_runtime's {monitor.__name__} failed (ValueError")
    assert "its checks are off for the rest of the run" in event.message
    assert event.severity == "P2"
    # the other checks and the step count go on
    assert g.step_index == STEPS
    assert [e.code for e in g.report.events] == ["AMP100"]
    assert global_hook_counts() == hooks_before
    # the failure is in the run's log too
    logged = amp_runtime.Report.from_jsonl(tmp_path / "logs" / "events.jsonl")
    assert logged.codes() == {"AMP100": 1}


def test_the_checks_of_the_other_monitors_go_on_after_one_failed(monkeypatch):
    calls = []
    monkeypatch.setattr(GradHealth, "on_step_end", failing(calls))
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with amp_runtime.guard(policy="record") as g:
        for step in range(3):
            loss = model(torch.randn(2, 4)).sum() * (float("nan") if step == 2 else 1.0)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    assert [e.code for e in g.report.events] == ["AMP100", "AMP112"]
    assert g.report.by_code("AMP112")[0].step == 2
    assert len(calls) == 1


#: (monitor class, the method made to fail, the steps the guard counted before it went off)
ESSENTIAL = [
    (StepDetector, "_scaler_updated", 0),
    (ScalerWatch, "_before", 0),  # before GradScaler's own method runs
    (ScalerWatch, "_after", 0),  # after it
    (ScalerWatch, "_judge_update", 1),  # the judge of its readings, at the first step's end
]


@pytest.mark.parametrize("monitor, method, steps", ESSENTIAL,
                         ids=[f"{m.__name__}.{name}" for m, name, _ in ESSENTIAL])
def test_a_failing_monitor_the_others_rely_on_switches_the_guard_off(
        monitor, method, steps, tmp_path, monkeypatch, unguarded):
    """Step detection and the scaler watch are what the other checks rely on: without them the
    guard stops entirely rather than judge gradients it cannot tell scaled from unscaled."""
    calls = []
    monkeypatch.setattr(monitor, method, failing(calls))
    hooks_before = global_hook_counts()
    g, result = guarded_train(tmp_path)
    assert_identical(result, unguarded)
    (event,) = failures(g.report)
    assert event.details["component"] == monitor.__name__
    assert "the guard is off for the rest of the run" in event.message
    assert len(calls) == 1 and g.step_index == steps
    assert [e.code for e in g.report.events] == ["AMP100"]
    assert global_hook_counts() == hooks_before
    assert torch.overrides._get_current_function_mode_stack() == []


@pytest.mark.parametrize("method", ["_finish_step", "_optimizer_step_starts", "_look_for_modules",
                                    "_sync_mode", "run_entry_point",
                                    "_judge_before_step", "_step_judged"])  # the readings' commits
def test_a_failure_in_the_guards_core_switches_the_guard_off(method, tmp_path, monkeypatch,
                                                             unguarded):
    calls = []
    monkeypatch.setattr(Guard, method, failing(calls))
    g, result = guarded_train(tmp_path)
    assert_identical(result, unguarded)
    (event,) = failures(g.report)
    assert event.details["component"] == "guard"
    assert "the guard is off" in event.message
    assert len(calls) == 1


def test_a_judge_failing_when_the_guard_exits_costs_its_monitor_not_the_exit(
        monkeypatch, unguarded):
    """A device that never catches up: every reading is judged by the flush at the guard's exit.
    A judge failing there is AMP100 and the block ends normally, even under policy="raise"."""
    calls = []
    monkeypatch.setattr(GradHealth, "_judge", failing(calls))
    g = amp_runtime.guard(policy="raise")
    g.readings = LaggingReadings(lag=10 ** 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with g:
            result = train()
            assert len(g.report) == 0  # nothing judged before the exit
    assert_identical(result, unguarded)
    assert len(calls) == 1 and g.readings.counts.waits == 1
    (event,) = failures(g.report)
    assert event.details["component"] == "GradHealth" and g.report.codes() == {"AMP100": 1}


class NormedNet(nn.Module):
    """State a replay must put back: BatchNorm's running statistics and dropout's RNG."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.norm = nn.BatchNorm1d(32)
        self.out = nn.Linear(32, 1)

    def forward(self, x):
        return self.out(F.dropout(F.relu(self.norm(self.fc(x))), 0.2))


def nan_step_training(nan_at=3, steps=8):
    """fp16 with a GradScaler and a NaN loss at ``nan_at`` (the scaler skips it, the guard
    replays it): the losses as text (NaN compares equal so), the state dict and the RNG state."""
    torch.manual_seed(0)
    model = NormedNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    generator = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        x = torch.randn(8, 16, generator=generator)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        if step == nan_at:
            loss = loss * float("nan")
        scaled_update(model, optimizer, scaler, loss)
        losses.append(repr(loss.item()))
    state = {name: value.clone() for name, value in model.state_dict().items()}
    return losses, state, torch.get_rng_state()


@pytest.mark.parametrize("method", ["_replay_step", "_judge_trace"])
def test_a_failing_replay_is_switched_off_and_the_run_goes_on(method, monkeypatch):
    """The replay of a failing step runs the user's forward again: a failure of its own code,
    before the forward or after it, is AMP100 for the replay alone, the step's own finding is
    reported, and the run goes on as without the guard (weights, BatchNorm statistics, RNG)."""
    losses, state, rng = nan_step_training()
    calls = []
    monkeypatch.setattr(StepReplay, method, failing(calls))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with amp_runtime.guard(policy="record") as g:
            guarded = nan_step_training()
    assert guarded[0] == losses and torch.equal(guarded[2], rng)
    assert all(torch.equal(guarded[1][k], state[k]) for k in state)
    assert len(calls) == 1
    (event,) = failures(g.report)
    assert event.details["component"] == "StepReplay"
    assert (g.report.by_code("AMP112")[0].step, g.step_index) == (3, 8)


def test_a_monitor_failing_to_attach_is_off_and_the_others_run(tmp_path, monkeypatch, unguarded):
    calls = []
    monkeypatch.setattr(GradHealth, "attach", failing(calls))
    g, result = guarded_train(tmp_path)
    assert_identical(result, unguarded)
    (event,) = failures(g.report)
    assert event.details["component"] == "GradHealth" and g.step_index == STEPS


def test_policy_raise_never_raises_for_a_failure_but_warns(monkeypatch):
    monkeypatch.setattr(BackwardUnderAutocast, "_check", failing([]))
    model = nn.Linear(4, 1)
    with pytest.warns(amp_runtime.AmpRuntimeWarning, match="AMP100"):
        with amp_runtime.guard(policy="raise", raise_at="P2") as g:
            model(torch.randn(2, 4)).sum().backward()
    assert g.report.codes() == {"AMP100": 1}


def test_findings_still_raise_through_the_containment():
    """GuardError is a finding, not a failure of the guard: it reaches the user."""
    model = nn.Linear(4, 1)
    with pytest.raises(amp_runtime.GuardError, match="AMP112"):
        with amp_runtime.guard(policy="raise"):
            (model(torch.randn(2, 4)).sum() * float("inf")).backward()


def full_disk_file(folder, name):
    folder.mkdir(parents=True, exist_ok=True)
    os.symlink("/dev/full", folder / name)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("name, component", [("events.jsonl", "events.jsonl"),
                                             ("metrics.jsonl", "MetricsLog")])
def test_a_full_disk_under_log_dir_costs_the_log_not_the_run(name, component, tmp_path):
    full_disk_file(tmp_path / "logs", name)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with amp_runtime.guard(log_dir=tmp_path / "logs") as g:
            for _ in range(3):
                loss = model(torch.randn(2, 4)).sum() * float("nan")  # an event every step
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    failed = [e for e in g.report.events if e.code == "AMP100"]
    assert [e.details["component"] for e in failed] == [component]
    assert g.report.codes()["AMP112"] == 3 and g.step_index == 3


def test_the_users_call_runs_once_when_the_guard_fails_before_or_after_it(monkeypatch):
    """GradScaler.step through a watch failing before it, then (next run) after it."""
    for method in ("_before", "_after"):
        monkeypatch.setattr(ScalerWatch, method, failing([]))
        stepped = []
        model = nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        optimizer.register_step_post_hook(lambda *args: stepped.append(1))
        scaler = torch.amp.GradScaler("cpu")
        with amp_runtime.guard(policy="record") as g:
            for _ in range(4):
                scaler.scale(model(torch.randn(2, 4)).sum()).backward()
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
        assert len(stepped) == 4, method
        assert scaler.get_scale() == 65536.0
        assert g.report.codes() == {"AMP100": 1}
        monkeypatch.undo()


def raised_by(call):
    try:
        call()
    except Exception as error:  # the user's own error
        return type(error), str(error)
    return None


def test_the_users_own_errors_reach_the_user_unchanged():
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")

    def step_with_a_closure():
        scaler.scale(model(torch.randn(2, 4)).sum()).backward()
        scaler.step(optimizer, closure=lambda: None)  # noqa: AMP006  (GradScaler refuses it)

    def backward_twice():
        loss = model(torch.randn(2, 4)).sum()
        loss.backward()
        loss.backward()

    def unscale_twice():
        scaler.update()
        scaler.scale(model(torch.randn(2, 4)).sum()).backward()
        scaler.unscale_(optimizer)
        scaler.unscale_(optimizer)

    for call in (step_with_a_closure, backward_twice, unscale_twice):
        expected = raised_by(call)
        assert expected is not None
        scaler = torch.amp.GradScaler("cpu")
        with amp_runtime.guard(policy="record") as g:
            assert raised_by(call) == expected
        assert [e.code for e in g.report.events if e.code == "AMP100"] == []
        scaler = torch.amp.GradScaler("cpu")


class HookMonitor(Monitor):
    """A monitor as another lane would write one: a global module forward hook, kept."""

    calls = []

    def attach(self, guard):
        super().attach(guard)
        self.keep(torch.nn.modules.module.register_module_forward_hook(self._forward_ran))

    def _forward_ran(self, module, args, output):
        HookMonitor.calls.append(module)
        raise ValueError("a bug in a new hook")


def monitors(guard):
    """This module as one of the guard's MONITOR_MODULES (``test_hooks_kept_...``)."""
    return [HookMonitor()]


def test_hooks_kept_by_any_monitor_are_contained(monkeypatch, tmp_path, unguarded):
    guard_module = sys.modules["amp_runtime.guard"]
    monkeypatch.setattr(guard_module, "MONITOR_MODULES", (*guard_module.MONITOR_MODULES, __name__))
    HookMonitor.calls.clear()
    hooks_before = global_hook_counts()
    g, result = guarded_train(tmp_path)
    assert_identical(result, unguarded)
    assert len(HookMonitor.calls) == 1
    (event,) = failures(g.report)
    assert event.details["component"] == "HookMonitor"
    assert global_hook_counts() == hooks_before


def closure_step(guarded, fail_at=None):
    """``optimizer.step(closure)``, as Lightning and LBFGS run it; the guard runs the closure
    first in its pre-hook. Returns how often the closure ran, the weights and the guard."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    runs = []

    def closure():
        runs.append(1)
        optimizer.zero_grad()
        loss = model(torch.ones(2, 4)).sum()
        loss.backward()
        if len(runs) == fail_at:
            raise ValueError("the user's own bug")
        return loss

    with amp_runtime.guard(policy="record") if guarded else torch.no_grad() as g:
        try:
            for _ in range(3):
                optimizer.step(closure)
            error = None
        except ValueError as raised:
            error = str(raised)
    return len(runs), error, [p.detach().clone() for p in model.parameters()], g


@pytest.mark.parametrize("fail_at", [None, 2])
def test_a_closure_the_guard_runs_first_runs_once_and_its_error_reaches_the_user(fail_at):
    runs, error, weights, g = closure_step(guarded=True, fail_at=fail_at)
    plain_runs, plain_error, plain_weights, _ = closure_step(guarded=False, fail_at=fail_at)
    assert (runs, error) == (plain_runs, plain_error)
    assert all(torch.equal(a, b) for a, b in zip(weights, plain_weights))
    assert "AMP100" not in g.report.codes()


def test_the_guards_work_after_a_closure_it_ran_does_not_run_it_again(monkeypatch):
    monkeypatch.setattr(Guard, "_zero_grad_unobserved", failing([]))
    runs, error, weights, g = closure_step(guarded=True)
    plain_runs, _, plain_weights, _ = closure_step(guarded=False)
    assert runs == plain_runs == 3 and error is None
    assert all(torch.equal(a, b) for a, b in zip(weights, plain_weights))
    assert g.report.codes() == {"AMP100": 1}
