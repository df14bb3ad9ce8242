"""Loss-scale history (AMP107-AMP109): the judgement on its own and in guarded fp16 runs."""
import pytest
import torch

from amp_runtime.monitors.scaler import LossScaleHistory
from amp_runtime.thresholds import Thresholds


def codes(findings):
    return [code for code, _ in findings]


def run_history(scales_and_skips, init=65536.0, limits=Thresholds()):
    history = LossScaleHistory(init, limits)
    return [history.observe(scale, skipped) for scale, skipped in scales_and_skips]


def halving(init=65536.0, steps=20):
    return [(init / 2 ** (i + 1), True) for i in range(steps)]


def test_steady_or_growing_scale_is_healthy():
    sequence = [(65536.0, False)] * 50 + [(131072.0, False)] * 50
    assert not any(run_history(sequence))


def test_five_consecutive_decreases_report_decline_once():
    per_step = run_history([(65536.0, False)] + halving(steps=6))[1:]
    assert [codes(f) for f in per_step[:4]] == [[], [], [], []]
    assert codes(per_step[4]) == ["AMP108"]
    assert "5 consecutive decreases" in per_step[4][0][1]["reason"]
    assert per_step[5] == []


def test_the_first_skips_settling_the_scale_are_calibration_not_a_decline():
    """Six skips before any step went through (65536 -> 1024), then training: no AMP108; a
    scale that never lets a step through is still reported by its fraction and floor."""
    assert not any(run_history(halving(steps=6) + [(1024.0, False)] * 50))
    per_step = run_history(halving(steps=10))
    assert [i for i, f in enumerate(per_step) if "AMP108" in codes(f)] == [6, 9]


def test_collapse_at_first_scale_at_or_below_one():
    per_step = run_history(halving(steps=18))
    first_collapse = next(i for i, f in enumerate(per_step) if "AMP107" in codes(f))
    assert 65536.0 / 2 ** (first_collapse + 1) == 1.0
    assert sum(codes(f).count("AMP107") for f in per_step) == 1
    reasons = [kw["reason"] for f in per_step for code, kw in f if code == "AMP108"]
    assert len(reasons) == 2  # below init/100, below 128 and falling: each once (no step yet)


def test_rising_scale_ends_the_decline_episode():
    sequence = [(65536.0, False)] + halving(steps=5) + [(65536.0, False)] + halving(steps=5)
    per_step = run_history(sequence)
    assert [i for i, f in enumerate(per_step) if "AMP108" in codes(f)] == [5, 11]


def test_small_initial_scale_falling_below_floor():
    per_step = run_history([(512.0, False), (256.0, True), (64.0, True)], init=512.0)
    assert codes(per_step[2]) == ["AMP108"]
    assert "below 128 and falling" in per_step[2][0][1]["reason"]


def test_a_high_initial_scale_calibrating_down_to_the_default_is_not_a_decline():
    """init_scale=2**24 halves to 2**16 in the first steps of a healthy run, then trains."""
    sequence = halving(init=2.0 ** 24, steps=8) + [(65536.0, False)] * 20
    assert not any(run_history(sequence, init=2.0 ** 24))
    per_step = run_history(halving(init=2.0 ** 24, steps=16), init=2.0 ** 24)
    assert [i for i, f in enumerate(per_step) if "AMP108" in codes(f)] == [14]


def test_calibration_skips_do_not_count_towards_overflow_rate():
    sequence = halving(steps=3) + [(8192.0, False)] * 200
    assert not any(run_history(sequence))


def test_overflow_rate_reported_when_skips_recur():
    steady = [(1024.0, False)] * 60
    sequence = [(1024.0, False)] + steady + [(1024.0, True)] + steady + [(1024.0, True)] + steady
    per_step = run_history(sequence, init=1024.0)
    hits = [(i, kw) for i, f in enumerate(per_step) for code, kw in f if code == "AMP109"]
    assert len(hits) == 1
    index, fields = hits[0]
    assert sequence[index][1] is True and fields["skipped"] == 2


@pytest.mark.parametrize("rate, reported", [(0.25, False), (0.1, True)])
def test_overflow_rate_threshold_and_window_are_configurable(rate, reported):
    limits = Thresholds(overflow_rate=rate, overflow_window=10)
    # two skips in every ten steps
    sequence = [(1024.0, False)] + [(1024.0, i % 5 == 0) for i in range(1, 30)]
    per_step = run_history(sequence, init=1024.0, limits=limits)
    assert any("AMP109" in codes(f) for f in per_step) is reported


# -- guarded fp16 training with a real GradScaler --------------------------------------------

import amp_runtime  # noqa: E402


def overflowing_run(steps, loss_factor=1e6):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    scales = []
    with amp_runtime.guard(policy="record") as g:
        for _ in range(steps):
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(torch.randn(32, 8))
            loss = out.float().pow(2).mean() * loss_factor  # every fp16 backward overflows
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            scales.append(scaler.get_scale())
    return g, scales


def test_every_backward_overflowing_declines_then_collapses_the_scale():
    g, scales = overflowing_run(steps=20)
    assert scales == [2.0 ** (15 - i) for i in range(20)]  # the scale halves each step
    decline = g.report.by_code("AMP108")
    assert [e.step for e in decline] == [6, 9]  # no step went through: the fraction, the floor
    assert all(scales[e.step] == e.details["loss_scale"] for e in decline)
    (collapse,) = g.report.by_code("AMP107")
    assert collapse.step == scales.index(1.0) and collapse.severity == "P0"
    assert not g.report.by_code("AMP103")  # the scaler caught every inf
    assert not g.report.by_code("AMP104") and not g.report.by_code("AMP109")


class FlooredNet(torch.nn.Module):
    """A scalar kept non-negative through ``sqrt``: at 0 its derivative is inf on every step,
    whatever the loss scale, while the forward stays finite."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 1)
        self.floor = torch.nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return self.fc(x) + self.floor.sqrt()  # the backward-only fault


def test_a_backward_only_fault_skipping_every_step_is_named_by_the_scale_events():
    """No AMP101 (the forward is finite) and no AMP103 (the scaler catches every inf): the
    replay of the first skipped step names the op, and AMP108/AMP107 carry it."""
    torch.manual_seed(0)
    model = FlooredNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with amp_runtime.guard(policy="record") as g:
        for _ in range(20):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(16, 8)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    fault_line = f"{__file__}:{FlooredNet.forward.__code__.co_firstlineno + 1}"
    events = g.report.by_code("AMP108") + g.report.by_code("AMP107")
    assert {e.code for e in events} == {"AMP107", "AMP108"}
    for event in events:
        assert "overflow in the backward of sqrt in FlooredNet" in event.message
        assert event.details["origin"]["source"].endswith(fault_line.split("/")[-1])
    assert not g.report.by_code("AMP101") and not g.report.by_code("AMP103")


def test_the_scale_events_name_the_forward_op_a_replay_of_a_failing_step_found():
    """Every forward overflows in the same layer: the loss check (AMP112) asks for the replay
    first, and AMP108/AMP107 carry the AMP101 it found."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with amp_runtime.guard(policy="record", model=model) as g:
        for _ in range(20):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(16, 8) * 1e5).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    (first,) = [e for e in g.report.by_code("AMP101") if e.step == 0]
    call_line = next(n for n, text in enumerate(open(__file__), 1) if "* 1e5" in text)
    assert first.details["replayed"] and first.source.endswith(f":{call_line}")  # not the judge's
    events = g.report.by_code("AMP108") + g.report.by_code("AMP107")
    assert {e.code for e in events} == {"AMP107", "AMP108"}
    for event in events:
        assert f"overflow in {first.op} in {first.module} at {first.source}" in event.message
        assert event.details["origin"]["phase"] == "forward"


def test_loss_scale_thresholds_come_from_the_guard():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    limits = Thresholds(scale_collapse=256.0)
    with amp_runtime.guard(policy="record", thresholds=limits) as g:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 4)).float().sum() * 1e6
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    (collapse,) = g.report.by_code("AMP107")
    assert collapse.step == 1 and collapse.details["loss_scale"] == 256.0


# -- GradScaler's own bookkeeping runs without the guard's mode -------------------------------

import json  # noqa: E402

from torch.amp.grad_scaler import GradScaler  # noqa: E402
from torch.overrides import _get_current_function_mode_stack  # noqa: E402

from amp_runtime.mode import GuardMode  # noqa: E402


class ModeRecordingScaler(torch.amp.GradScaler):
    """Records, as each public method starts, whether the guard's mode sees its ops."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mode_seen = []

    def _check_scale_growth_tracker(self, funcname):
        stack = _get_current_function_mode_stack()
        self.mode_seen.append((funcname, any(isinstance(m, GuardMode) for m in stack)))
        return super()._check_scale_growth_tracker(funcname)


class OwnUpdateScaler(torch.amp.GradScaler):
    def update(self, new_scale=None):
        super().update(new_scale)


def scaled_steps(scaler, steps, loss_factor=1e6, **guard_options):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with amp_runtime.guard(policy="record", **guard_options) as g:
        for _ in range(steps):
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(torch.randn(32, 8))
            scaler.scale(out.float().pow(2).mean() * loss_factor).backward()
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return g


def test_scaler_methods_run_without_the_guards_mode_and_are_still_judged():
    # unscale_ reads .grad/.dtype/.device of every parameter: each read would cross into the mode
    scaler = ModeRecordingScaler("cpu")
    g = scaled_steps(scaler, steps=10)
    assert {name for name, _ in scaler.mode_seen} == {"unscale_", "step", "update"}
    assert not any(seen for _, seen in scaler.mode_seen)
    assert g.step_index == 10
    assert [e.step for e in g.report.by_code("AMP108")] == [6, 9]


def test_a_scaler_subclass_with_its_own_update_is_judged_through_the_mode():
    g = scaled_steps(OwnUpdateScaler("cpu"), steps=10)
    assert g.step_index == 10
    assert [e.step for e in g.report.by_code("AMP108")] == [6, 9]


def test_leaving_the_last_guard_restores_grad_scalers_methods():
    torch_methods = {name: vars(GradScaler)[name] for name in ("unscale_", "step", "update")}
    with amp_runtime.guard(policy="record"):
        with amp_runtime.guard(policy="record"):
            pass
        assert all(vars(GradScaler)[name] is not m for name, m in torch_methods.items())
    assert all(vars(GradScaler)[name] is m for name, m in torch_methods.items())


def test_an_overflow_in_one_of_two_optimizers_skips_the_step(tmp_path):
    torch.manual_seed(0)
    first, second = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (first, second)]
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with amp_runtime.guard(policy="record", log_dir=tmp_path) as g:
        for factor in (1.0, 1e6):  # the second step overflows in the first model only
            with torch.autocast("cpu", dtype=torch.float16):
                x = torch.randn(4, 4)
                loss = first(x).float().sum() * factor + second(x).float().sum()
            scaler.scale(loss).backward()
            for opt in opts:
                scaler.step(opt)
            scaler.update()
            for opt in opts:
                opt.zero_grad()
    assert g.step_index == 2
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["skipped"] for line in lines] == [False, True]
    assert scaler.get_scale() == 512.0
