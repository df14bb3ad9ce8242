"""Watched steps: the mode sees every call on some steps; step-level checks run on all of them."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import _get_current_function_mode_stack

import amp_runtime
from amp_runtime import Thresholds
from amp_runtime.entry_points import ENTRY_POINTS, ORIGINALS

#: With these limits steps 0-1 are watched, then every 4th: 4, 8, 12, ...
SPARSE = Thresholds(watch_steps=2, watch_every=4)
UNWATCHED = (2, 3, 5, 6, 7, 9)


def entry_points_restored():
    return all(vars(owner)[name] is original
               for (owner, name), original in zip(ENTRY_POINTS, ORIGINALS))


def model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def test_the_mode_is_on_the_stack_exactly_on_watched_steps():
    with amp_runtime.guard(policy="record", thresholds=SPARSE) as g:
        watched = []
        for _ in range(10):
            on_stack = _get_current_function_mode_stack() == [g._mode]
            assert on_stack == g.watching
            watched.append(g.watching)
            g.step()
    assert [step for step, on in enumerate(watched) if on] == [0, 1, 4, 8]
    assert _get_current_function_mode_stack() == [] and entry_points_restored()


def test_code_pattern_rules_see_watched_steps_only():
    with amp_runtime.guard(policy="record", thresholds=SPARSE, select=["AMP004"]) as g:
        for _ in range(10):
            torch.randn(8, dtype=torch.float16).sum()  # fp16 sum: AMP004 where watched
            g.step()
    assert [e.step for e in g.report] == [0, 1, 4, 8]


def test_a_resumed_run_watches_its_first_steps_under_the_guard():
    # numbered from step 45 of a checkpoint: the first steps under this guard are watched
    with amp_runtime.guard(policy="record", thresholds=SPARSE, select=["AMP004"]) as g:
        g.number_step(45)
        for _ in range(10):
            torch.randn(8, dtype=torch.float16).sum()
            g.step()
    assert [e.step for e in g.report] == [45, 46, 49, 53]


def test_every_step_is_watched_with_watch_every_1_and_while_tracing():
    every_step = Thresholds(watch_steps=0, watch_every=1)
    with amp_runtime.guard(policy="record", thresholds=every_step) as g:
        for _ in range(3):
            assert g.watching
            g.step()
    with amp_runtime.guard(policy="record", thresholds=SPARSE, trace="always") as g:
        for _ in range(6):
            assert g.watching
            g.step()
    with amp_runtime.guard(policy="record", thresholds=SPARSE) as g:
        g.step(), g.step(), g.step()
        assert not g.watching and _get_current_function_mode_stack() == []
        g.request_tracing("AMP112")  # an anomaly: watch from now on
        assert g.watching and _get_current_function_mode_stack() == [g._mode]


def test_step_level_checks_run_on_unwatched_steps():
    """Backward under autocast, a NaN loss and NaN gradients at unwatched steps are all seen,
    through the entry points, at the step they happen; steps are counted throughout."""
    model, optimizer = model_and_optimizer()
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    with amp_runtime.guard(policy="record", thresholds=SPARSE, trace="off") as g:
        for step in range(10):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.mse_loss(model(x).float(), y)
                if step == 3:
                    loss.backward()  # noqa: AMP008 (deliberate)
            if step == 6:
                loss = loss * float("nan")  # AMP112, then AMP103 (no scaler)
                healthy = {k: v.clone() for k, v in model.state_dict().items()}
            if step != 3:
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if step == 6:
                model.load_state_dict(healthy)  # undo the NaN update
    assert g.step_index == 10
    assert [(e.code, e.step) for e in g.report] == [
        ("AMP008", 3), ("AMP112", 6), ("AMP103", 6)]
    assert entry_points_restored()


def test_clipping_scaled_gradients_is_seen_on_unwatched_steps():
    """clip_grad_norm_'s norms reach AMP005 (and the gradient monitor) through the entry point
    ``torch._foreach_norm``; the unscale_ before the clip is missing from step 5 on."""
    model, optimizer = model_and_optimizer()
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    with amp_runtime.guard(policy="record", thresholds=SPARSE, select=["AMP005"]) as g:
        for step in range(8):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            if step < 5:
                scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    assert {5, 6, 7} & set(UNWATCHED)
    assert [e.step for e in g.report] == [5, 6, 7]


@pytest.mark.parametrize("step_of_error", [0, 2])
def test_an_exception_on_any_step_restores_the_entry_points(step_of_error):
    model, optimizer = model_and_optimizer()
    with pytest.raises(ZeroDivisionError):
        with amp_runtime.guard(policy="record", thresholds=SPARSE) as g:
            for step in range(4):
                model(torch.randn(2, 8)).sum().backward()
                optimizer.step()
                if step == step_of_error:
                    assert g.watching == (step_of_error == 0)
                    1 / 0
    assert _get_current_function_mode_stack() == [] and entry_points_restored()


def test_nested_guards_route_entry_points_to_the_innermost():
    model, _ = model_and_optimizer()
    with amp_runtime.guard(policy="record", select=["AMP112"]) as outer:
        with amp_runtime.guard(policy="record", select=["AMP112"]) as inner:
            (model(torch.randn(2, 8)).sum() * float("inf")).backward()
        assert not entry_points_restored()
        (model(torch.randn(2, 8)).sum() * float("nan")).backward()
    assert entry_points_restored()
    assert [e.code for e in inner.report] == ["AMP112"]
    assert [e.code for e in outer.report] == ["AMP112", "AMP112"]  # the inner guard's, then its own


def test_a_mode_entered_while_the_guard_is_off_the_stack_keeps_its_place():
    """``with torch.device(...)`` (a TorchFunctionMode) entered on an unwatched step and left on a
    watched one: its exit pops the top of the stack, so the guard comes back only after it."""
    with amp_runtime.guard(policy="record", thresholds=SPARSE, select=["AMP004"]) as g:
        g.step(), g.step()
        assert not g.watching
        with torch.device("cpu"):
            g.step(), g.step()  # step 4 is watched, but the device mode is on top
            assert g.watching
            stack = _get_current_function_mode_stack()
            assert len(stack) == 1 and g._mode not in stack
        assert _get_current_function_mode_stack() == []
        torch.randn(8, dtype=torch.float16).sum()  # not seen yet: no sync point since
        g.step()  # the step end is a sync point: back on the stack for the next watched step
        g.step(), g.step(), g.step()
        assert g.watching and _get_current_function_mode_stack() == [g._mode]
        torch.randn(8, dtype=torch.float16).sum()
    assert _get_current_function_mode_stack() == []
    assert [e.step for e in g.report] == [8]
