"""Replay of a failing step (replay.py): the first anomaly localized in the step it happened in.

Real CPU training in fp16 autocast with injected faults (a weight scaled up so that one layer
overflows, a bad batch, a sample whose backward divides by zero); the guarded run must stay
bit-identical to the unguarded one, and healthy runs silent.
"""
import inspect
import json
import math
import os
import subprocess
import sys
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as module_globals
from torch.optim.optimizer import register_optimizer_step_pre_hook

import amp_runtime
from amp_runtime import GuardError
from amp_runtime.replay import _Localizer
from test_readings import LaggingReadings

THIS_FILE = os.path.relpath(__file__)
WIDTH = 16


class Block(nn.Module):
    def __init__(self, width, batch_norm=False, dropout=0.0):
        super().__init__()
        self.norm = nn.BatchNorm1d(width) if batch_norm else nn.LayerNorm(width)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x):
        hidden = self.drop(F.gelu(self.fc1(self.norm(x))))
        return x + self.fc2(hidden)  # fc2 call


class Masked(nn.Module):
    """Scales each sample by its norm: a fully masked sample has norm 0, a finite forward and
    an infinite derivative (sqrt at 0) in backward."""

    def forward(self, h, mask):
        h = h * mask
        return h * (h * h).sum(-1, keepdim=True).sqrt()  # sqrt call


class Net(nn.Module):
    def __init__(self, width=WIDTH, depth=4, batch_norm=False, dropout=0.0):
        super().__init__()
        self.embed = nn.Linear(width, width)  # embed
        self.blocks = nn.ModuleList(Block(width, batch_norm, dropout) for _ in range(depth))
        self.masked = Masked()
        self.head = nn.Linear(width, 1)

    def forward(self, x, mask=None):
        x = self.embed(x)  # embed call
        for block in self.blocks:
            x = block(x)
        if mask is not None:
            x = self.masked(x, mask)
        return self.head(x)


def line_of(function, marker):
    lines, start = inspect.getsourcelines(function)
    return start + next(i for i, text in enumerate(lines) if marker in text)


FC2_SOURCE = f"{THIS_FILE}:{line_of(Block.forward, '# fc2 call')}"
SQRT_SOURCE = f"{THIS_FILE}:{line_of(Masked.forward, '# sqrt call')}"
EMBED_SOURCE = f"{THIS_FILE}:{line_of(Net.forward, '# embed call')}"


def train(steps, *, scaler=False, weight_fault=(), restore_weight=False, bad_batch=(),
          nan_batch=(), masked_sample=(), micro_steps=1, bad_micro_step=None, model=None,
          grads_seen=None, **model_options):
    """fp16 CPU autocast training of Net with injected faults; returns (losses, model).

    ``weight_fault``: steps where blocks[2].fc2's weight is multiplied by 1e6 (then left so, or
    put back after the step with ``restore_weight``); ``bad_batch``: steps whose batch is 1e6
    times too large; ``nan_batch``: steps whose batch holds a NaN (a missing value in the data);
    ``masked_sample``: steps where one sample's mask is 0; ``bad_micro_step``:
    with ``micro_steps`` > 1, the (step, micro-step) whose batch is bad. ``grads_seen``: a list
    receiving a copy of every gradient just before each optimizer step.
    """
    torch.manual_seed(0)
    model = Net(**model_options) if model is None else model
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    grad_scaler = torch.amp.GradScaler("cpu", enabled=scaler)
    generator = torch.Generator().manual_seed(0)
    weight = (model._orig_mod if hasattr(model, "_orig_mod") else model).blocks[2].fc2.weight
    handle = None
    if grads_seen is not None:  # registered after the guard's: sees what the optimizer gets
        handle = register_optimizer_step_pre_hook(lambda opt, args, kwargs: grads_seen.append(
            [p.grad.clone() for group in opt.param_groups for p in group["params"]]))
    losses = []
    try:
        for step in range(steps):
            if step in weight_fault:
                saved = weight.detach().clone()
                with torch.no_grad():
                    weight.mul_(1e6)
            optimizer.zero_grad()
            for micro in range(micro_steps):
                x = torch.randn(8, WIDTH, generator=generator)
                target = x.sum(dim=1, keepdim=True).tanh()
                if step in bad_batch or (step, micro) == bad_micro_step:
                    x = x * 1e6
                if step in nan_batch:
                    x[3, 0] = math.nan
                mask = torch.ones(8, 1)
                if step in masked_sample:
                    mask[3] = 0
                with torch.autocast("cpu", dtype=torch.float16):
                    out = model(x, mask=mask) if masked_sample else model(x)
                    loss = F.mse_loss(out.float(), target) / micro_steps
                grad_scaler.scale(loss).backward()
                losses.append(loss.detach().clone())
            grad_scaler.step(optimizer)
            grad_scaler.update()
            if step in weight_fault and restore_weight:
                with torch.no_grad():
                    weight.copy_(saved)
    finally:
        if handle is not None:
            handle.remove()
    return losses, model


def built(model_class):
    """A model initialised the same way each time (``train`` seeds only after it is built)."""
    torch.manual_seed(1)
    return model_class()


def assert_identical(first, second):
    """Bit-identical tensors, NaN where the other has NaN."""
    assert len(first) == len(second)
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def assert_same_run(plain, guarded):
    (plain_losses, plain_model), (guarded_losses, guarded_model) = plain, guarded
    assert_identical(plain_losses, guarded_losses)
    assert_identical(list(plain_model.state_dict().values()),
                     list(guarded_model.state_dict().values()))


def guarded(**options):
    """``train(**options)`` under a recording guard: (guard, (losses, model))."""
    guard_options = options.pop("guard_options", {})
    with amp_runtime.guard(policy="record", **guard_options) as g:
        result = train(**options)
    return g, result


def replayed(guard, code="AMP101"):
    return [e for e in guard.report.by_code(code) if e.details.get("replayed")]


# -- item 1: the failing step's forward, replayed before the optimizer applies it ---------------


def test_without_a_scaler_the_faulty_layer_is_named_at_the_step_that_broke_the_weights():
    options = dict(steps=8, weight_fault={5})
    g, result = guarded(**options)
    (event,) = g.report.by_code("AMP101")  # the steps after it only propagate the NaN weights
    assert event.details["replayed"] is True
    assert (event.step, event.op, event.module) == (5, "linear", "blocks.2.fc2")
    assert event.source == FC2_SOURCE
    # the optimizer step of step 5 wrote NaN into every weight: AMP103 points at the cause
    grads = g.report.by_code("AMP103")
    assert grads[0].step == 5 and grads[0].module == "blocks.2.fc2"
    assert "caused by the non-finite output of linear in blocks.2.fc2" in grads[0].message
    assert grads[0].details["origin"]["phase"] == "forward"
    assert_same_run(train(**options), result)


def test_with_a_grad_scaler_the_first_skipped_step_is_localized():
    options = dict(steps=8, scaler=True, weight_fault={5})
    g, result = guarded(**options)
    events = g.report.by_code("AMP101")
    assert [(e.step, e.module, bool(e.details.get("replayed"))) for e in events] == [
        (5, "blocks.2.fc2", True), (6, "blocks.2.fc2", False), (7, "blocks.2.fc2", False)]
    assert events[0].source == FC2_SOURCE
    assert not g.report.by_code("AMP103")  # the scaler skipped those steps
    assert_same_run(train(**options), result)


def test_a_one_off_bad_batch_is_localized():
    options = dict(steps=10, scaler=True, bad_batch={5})
    g, result = guarded(**options)
    (event,) = g.report.by_code("AMP101")
    assert (event.step, event.module, event.source) == (5, "embed", EMBED_SOURCE)
    assert event.details["replayed"] is True
    assert "calls" not in event.details  # one call of the model per step: nothing to tell
    assert [e.step for e in g.report.by_code("AMP112")] == [5]
    assert_same_run(train(**options), result)


def test_a_weight_already_infinite_before_step_0_is_named_as_the_origin():
    # an fp16 checkpoint saved after an overflow: no op of any step is to blame
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.blocks[2].fc2.weight[0, 0] = float("inf")
    g, _ = guarded(steps=10, scaler=True, model=model)
    assert not g.report.by_code("AMP101")
    first = g.report.by_code("AMP112")[0]
    assert first.step == 0
    assert first.details["replay"]["origin"] == {
        "phase": "parameter", "op": None, "module": "blocks.2.fc2", "source": None,
        "parameter": "blocks.2.fc2.weight", "kind": "inf"}
    assert ("loss is NaN when backward starts; the forward started from the parameter "
            "blocks.2.fc2.weight (inf before the forward)") in first.message
    (decline, *_) = g.report.by_code("AMP108")  # every step is skipped: the scale falls
    assert "skipped steps start from the parameter blocks.2.fc2.weight" in decline.message


class MaskedAttentionNet(Net):
    """Keeps ``-inf`` in a buffer and in a frozen parameter, as attention masks often are."""

    def __init__(self):
        super().__init__()
        self.register_buffer("causal", torch.full((8, 8), float("-inf")).triu(1))
        self.frozen_bias = nn.Parameter(torch.full((8,), float("-inf")), requires_grad=False)

    def forward(self, x, mask=None):
        weights = torch.softmax(self.causal + self.frozen_bias.clamp(min=0), dim=-1)
        return super().forward(weights.to(x.dtype) @ x, mask)


def test_an_infinite_mask_kept_in_a_buffer_or_frozen_parameter_is_not_blamed():
    options = dict(steps=8, scaler=True, bad_batch={5})
    g, result = guarded(model=built(MaskedAttentionNet), **options)
    (event,) = g.report.by_code("AMP101")  # the bad batch meets the mask's matmul first
    assert (event.step, event.module, event.op) == (5, "MaskedAttentionNet", "matmul")
    assert g.report.by_code("AMP112")[0].details["replay"]["origin"]["phase"] == "forward"
    assert_same_run(train(model=built(MaskedAttentionNet), **options), result)


class Squashing(nn.Module):
    """``tanh(h * h)``: an fp16 overflow of ``h * h`` leaves the loss finite (tanh(inf) is 1)
    and makes the backward NaN (0 * inf), so the GradScaler only skips the step."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x, boost=1.0):
        h = self.fc(x) * boost
        return self.head(torch.tanh(h * h))  # squash call


def test_an_overflow_while_the_scale_settles_is_localized():
    # every step skips: a loss scale of 1e9 settles for many steps, and at step 3 the forward
    # overflows too; the replays of the settling skips found nothing, which must not stop the
    # replay of step 3
    def run():
        torch.manual_seed(0)
        model = Squashing()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=1e9)
        scales = []
        for step in range(10):
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(torch.randn(8, WIDTH), boost=1e3 if step == 3 else 1.0)
                loss = out.float().pow(2).mean()
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales, model

    plain_scales, plain_model = run()
    with amp_runtime.guard(policy="record") as g:
        scales, model = run()
    assert scales == plain_scales and len(set(scales)) == len(scales)  # every step skipped
    (event,) = g.report.by_code("AMP101")
    assert (event.step, event.op, event.details["replayed"]) == (3, "mul", True)
    assert event.source == f"{THIS_FILE}:{line_of(Squashing.forward, '# squash call')}"
    assert_identical(list(plain_model.state_dict().values()), list(model.state_dict().values()))


def test_policy_raise_stops_at_the_faulty_op_before_the_optimizer_applies_the_step():
    torch.manual_seed(0)
    model = Net()
    with pytest.raises(GuardError) as caught:
        with amp_runtime.guard(policy="raise", ignore=["AMP010"]):  # fp16 without a scaler
            train(8, weight_fault={5}, model=model)
    event = caught.value.event
    assert (event.code, event.step, event.module) == ("AMP101", 5, "blocks.2.fc2")
    assert all(torch.isfinite(p).all() for p in model.parameters())  # step 5 was not applied


def test_the_replay_keeps_grads_batch_norm_statistics_and_rng_as_they_were():
    options = dict(steps=10, scaler=True, weight_fault={5}, restore_weight=True,
                   batch_norm=True, dropout=0.2)
    plain_grads, guarded_grads = [], []
    plain = train(**options, grads_seen=plain_grads)
    plain_rng = torch.get_rng_state()
    g, result = guarded(**options, grads_seen=guarded_grads)
    assert replayed(g) and replayed(g)[0].step == 5
    assert torch.equal(torch.get_rng_state(), plain_rng)
    assert_same_run(plain, result)  # includes BatchNorm's running statistics and counter
    assert len(plain_grads) == len(guarded_grads)
    for before, after in zip(plain_grads, guarded_grads):
        assert_identical(before, after)


def test_healthy_runs_are_silent_unchanged_and_never_replayed():
    options = dict(steps=40, scaler=True, batch_norm=True, dropout=0.1)
    g, result = guarded(**options, guard_options=dict(select=["AMP1"]))
    assert g.report.events == []
    assert_same_run(train(**options), result)
    with amp_runtime.guard(policy="record") as g:
        train(3)
        assert not g.replayer.outcomes


def test_one_replay_per_anomaly_episode():
    g, _ = guarded(steps=30, scaler=True, weight_fault={5}, guard_options=dict(
        thresholds=amp_runtime.Thresholds(auto_quiet_steps=4)))
    # the fault repeats at every step from 5 on: later steps are traced live, not replayed
    assert [e.step for e in replayed(g)] == [5]


def test_a_step_of_an_open_episode_says_which_step_was_replayed_for_it():
    g, _ = guarded(steps=8, scaler=True, nan_batch={5, 6})
    first, second = g.report.by_code("AMP112")
    assert first.details["replay"]["skipped"] is None
    assert second.step == 6 and "not replayed: step 5 was replayed for this episode" in (
        second.message)


def test_steps_after_an_update_that_wrote_nan_name_the_parameter_not_the_episode():
    """Without a GradScaler the NaN step's update reaches the weights: every later loss is NaN
    because of them, and the steps of the episode say so instead of only pointing back."""
    g, _ = guarded(steps=9, nan_batch={5})
    first, *later = g.report.by_code("AMP112")
    assert first.step == 5 and first.details["replay"]["origin"]["phase"] == "input"
    assert later and all(e.details["replay"]["episode"] == 5 for e in later)
    assert all("the forward started from the parameter" in e.message for e in later)


def test_a_nan_in_the_batch_is_named_as_the_models_input_not_an_op():
    """No op made the NaN: every op only propagates it, so there is no AMP101 to blame; the
    replay names the model call's input instead."""
    options = dict(steps=8, scaler=True, nan_batch={5})
    g, result = guarded(**options)
    assert not g.report.by_code("AMP101")
    (event,) = g.report.by_code("AMP112")
    origin = event.details["replay"]["origin"]
    assert (event.step, origin["phase"], origin["input"], origin["kind"]) == (
        5, "input", "argument 0", "NaN")
    assert "the forward started from input argument 0 of Net, already NaN" in event.message
    assert_same_run(train(**options), result)


def test_the_input_named_is_that_of_the_call_that_held_it():
    g, _ = guarded(steps=4, scaler=True, micro_steps=3, nan_batch={2})
    (event,) = g.report.by_code("AMP112")[:1]
    origin = event.details["replay"]["origin"]
    assert (origin["phase"], origin["call"], origin["calls"]) == ("input", 1, 3)
    assert "(forward call 1 of 3)" in event.message


def test_a_loss_gone_to_minus_infinity_says_so():
    weight = torch.ones(4, requires_grad=True)
    with amp_runtime.guard(policy="record") as g:
        loss = torch.log(weight.sum() * 0.0)
        loss.backward()
    (event,) = g.report.by_code("AMP112")
    assert event.message.startswith("loss is -inf when backward starts")


# -- readings judged late (a GPU behind the host: issue 12's LaggingReadings) --------------------


def lagging_guard(lag, **options):
    """A recording guard whose device readings arrive ``lag`` commit points late."""
    g = amp_runtime.guard(policy="record", **options)
    g.readings = LaggingReadings(lag=lag)
    return g


def test_a_step_judged_late_is_replayed_when_its_grad_scaler_skipped_it():
    options = dict(steps=10, scaler=True, bad_batch={5})
    g = lagging_guard(lag=1)
    judged_during = {}  # step -> the step running when its readings were judged
    g.step_listeners.append(lambda step, record: judged_during.setdefault(step, g.step_index))
    with g:
        result = train(**options)
    assert judged_during[5] == 6  # at step 6's optimizer step, before it is applied
    (event,) = g.report.by_code("AMP101")
    assert (event.step, event.module, event.source) == (5, "embed", EMBED_SOURCE)
    assert event.details["replayed"] is True
    assert "calls" not in event.details  # one call of the model per step: nothing to tell
    (loss,) = g.report.by_code("AMP112")
    assert loss.step == 5 and loss.details["replay"]["skipped"] is None
    assert_same_run(train(**options), result)


def test_a_step_judged_after_the_optimizer_applied_it_is_not_replayed_and_says_why():
    options = dict(steps=8, weight_fault={5})  # no GradScaler: step 5 writes NaN into the weights
    g = lagging_guard(lag=1)
    with g:
        result = train(**options)
    assert not replayed(g)
    why = "an optimizer step changed the parameters before it was judged"
    loss = g.report.by_code("AMP112")[0]  # then at every step: the weights are NaN
    assert loss.step == 5 and loss.details["replay"]["skipped"] == why
    assert f"; not replayed: {why} (trace='always' checks every op live)" in loss.message
    grads = g.report.by_code("AMP103")[0]
    assert grads.step == 5 and grads.details["replay"]["skipped"] == why
    assert "origin" not in grads.details  # no cause named on weights already changed
    assert_same_run(train(**options), result)


def test_policy_raise_names_the_replayed_op_when_judged_before_the_next_step_is_applied():
    torch.manual_seed(0)
    model = Net()
    g = amp_runtime.guard(policy="raise")
    g.readings = LaggingReadings(lag=1)
    with pytest.raises(GuardError) as caught:
        with g:
            train(10, scaler=True, bad_batch={5}, model=model)
    event = caught.value.event
    assert (event.code, event.step, event.module) == ("AMP101", 5, "embed")
    # raised at step 6's optimizer step, before it was applied: the weights of steps 0-5
    _, unguarded = train(6, scaler=True, bad_batch={5})
    assert_identical(list(model.state_dict().values()), list(unguarded.state_dict().values()))


@pytest.mark.parametrize("lag", [0, 1, 3])
def test_a_steps_inputs_are_held_exactly_until_its_readings_are_judged(lag):
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    g = lagging_guard(lag)
    judged = set()
    g.step_listeners.append(lambda step, record: judged.add(step))
    batches = []  # a weak reference to each step's batch: alive while something holds it
    with g:
        for step in range(12):
            x = torch.randn(8, WIDTH)
            batches.append(weakref.ref(x))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().square().mean()
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            del x, loss
            held = [s for s, batch in enumerate(batches) if batch() is not None]
            assert held == [s for s in range(step + 1) if s not in judged], step
            # a step's GradScaler update rides with the next step's commit: on the CPU (lag 0)
            # at most the step that just ended is held
            assert len(held) <= lag + 1
    assert all(batch() is None for batch in batches)


# -- item 2: a finite forward with non-finite gradients -------------------------------------


@pytest.mark.parametrize("trace", ["auto", "always"])
def test_a_backward_only_fault_is_localized_to_the_layer_whose_backward_made_it(trace):
    options = dict(steps=8, masked_sample={5})
    seen_plain, seen_guarded = [], []
    plain = train(**options, grads_seen=seen_plain)
    g, result = guarded(**options, grads_seen=seen_guarded, guard_options=dict(trace=trace))
    assert not g.report.by_code("AMP101")
    event = g.report.by_code("AMP103")[0]
    assert event.step == 5
    assert (event.op, event.module, event.source) == ("sqrt", "masked", SQRT_SOURCE)
    assert "first non-finite in the backward of sqrt in masked" in event.message
    origin = event.details["origin"]
    assert origin["node"] == "SqrtBackward0" and origin["phase"] == "backward"
    assert event.details["replay"]["reproduced"] is True
    # the layers before it got NaN gradients, the head after it did not
    assert "head" not in event.details["layers"] and "embed" in event.details["layers"]
    assert_same_run(plain, result)
    for before, after in zip(seen_plain, seen_guarded):  # .grad untouched by the replay
        assert_identical(before, after)


@pytest.mark.parametrize("method", ["record", "backward"])
def test_a_failure_of_the_replays_own_code_is_contained(method, monkeypatch):
    """A bug in the replay (its localizer: a handler of the replay's own mode, or the code around
    the replayed backward) is AMP100 for the replay alone, reported once: the step's AMP103 is
    still reported, and the run is the unguarded one."""
    options = dict(steps=8, masked_sample={5})
    plain = train(**options)

    def failing(*args, **kwargs):
        raise ValueError("a bug in the replay")

    monkeypatch.setattr(_Localizer, method, failing)
    g, result = guarded(**options)
    assert_same_run(plain, result)
    (failure,) = g.report.by_code("AMP100")
    assert (failure.details["component"], failure.step) == ("StepReplay", 5)
    assert g.report.by_code("AMP103")[0].step == 5


class SqrtWithOwnBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        root = x.sqrt()
        ctx.save_for_backward(root)
        return root

    @staticmethod
    def backward(ctx, grad):
        (root,) = ctx.saved_tensors
        return grad / (2 * root)  # infinite at 0


class WithOwnSqrt(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.outer = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x):
        return self.outer(SqrtWithOwnBackward.apply(self.inner(x).square()))


def test_with_the_loss_check_off_a_live_trace_still_explains_the_gradients_of_its_step():
    # the forward's ops are judged before the gradients even when no loss is checked
    g, _ = guarded(steps=8, weight_fault={5}, guard_options=dict(
        trace="always", ignore=["AMP112", "AMP010"]))
    grads = g.report.by_code("AMP103")[0]
    assert (grads.step, grads.module, grads.source) == (5, "blocks.2.fc2", FC2_SOURCE)
    assert grads.details["origin"]["phase"] == "forward"


def test_a_custom_autograd_function_is_named_by_its_node():
    torch.manual_seed(0)
    model = WithOwnSqrt()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with amp_runtime.guard(policy="record") as g:
        for step in range(3):
            x = torch.randn(2, 4)
            if step == 1:  # inner's output is 0: sqrt's own backward divides by 0
                x.zero_()
                with torch.no_grad():
                    model.inner.bias.zero_()
            optimizer.zero_grad()
            model(x).sum().backward()
            optimizer.step()
    event = g.report.by_code("AMP103")[0]
    assert event.step == 1 and event.op == "SqrtWithOwnBackwardBackward"
    assert "first non-finite in autograd node SqrtWithOwnBackwardBackward" in event.message
    assert event.details["replay"]["reproduced"] is True


class OwnSqrt(nn.Module):
    def forward(self, x):
        return SqrtWithOwnBackward.apply(x.square())


def test_a_custom_autograd_function_a_module_returns_is_named_in_that_module():
    """The replay's mode never sees ``Function.apply``: the module whose forward returned the
    node is where it came from."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), OwnSqrt(), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with amp_runtime.guard(policy="record") as g:
        for step in range(3):
            x = torch.randn(2, 4)
            if step == 1:  # the first layer's output is 0: sqrt's own backward divides by 0
                x.zero_()
                with torch.no_grad():
                    model[0].bias.zero_()
            optimizer.zero_grad()
            model(x).square().sum().backward()
            optimizer.step()
    event = g.report.by_code("AMP103")[0]
    assert (event.step, event.module) == (1, "1")
    assert "first non-finite in autograd node SqrtWithOwnBackwardBackward in 1" in event.message


def test_a_loss_returned_by_the_model_is_where_the_replayed_backward_starts():
    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = Net()

        def forward(self, x, mask, target):
            return {"loss": F.mse_loss(self.net(x, mask).float(), target)}

    torch.manual_seed(0)
    model = WithLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with amp_runtime.guard(policy="record") as g:
        for step in range(4):
            x, mask = torch.randn(8, WIDTH), torch.ones(8, 1)
            mask[2] = 0 if step == 2 else 1
            with torch.autocast("cpu", dtype=torch.float16):  # noqa: AMP010 - no scaler on purpose
                loss = model(x, mask=mask, target=torch.zeros(8, 1))["loss"]
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        outcome = g.replayer.outcomes[0]
    assert outcome.origin.details["backward_from"] == "loss" and outcome.reproduced
    assert g.report.by_code("AMP103")[0].module == "net.masked"


# -- item 3: compiled models, DDP, several calls per step, no model= ------------------------


def test_root_modules_are_learned_in_the_first_steps_then_followed_by_their_own_hook():
    hooks = module_globals._global_forward_pre_hooks, module_globals._global_forward_hooks
    before = [len(h) for h in hooks]
    torch.manual_seed(0)
    model = Net()
    with amp_runtime.guard(policy="record") as g:
        assert [len(h) for h in hooks] != before  # learning, until a step finds no new root
        train(2, model=model)
        assert [len(h) for h in hooks] == before  # then one pre-hook on the root module only
        assert len(model._forward_pre_hooks) == 1
        assert all(not m._forward_pre_hooks for m in model.modules() if m is not model)
        train(6, model=model, scaler=True, bad_batch={3})
    assert [(e.step, e.module) for e in replayed(g)] == [(5, "embed")]  # step 3 of the 2nd loop
    assert not model._forward_pre_hooks


def test_each_call_of_the_step_is_replayed_in_order():
    # gradient accumulation: four calls of the model per step, the third of step 3 is bad
    options = dict(steps=6, scaler=True, micro_steps=4, bad_micro_step=(3, 2))
    g, result = guarded(**options)
    (event,) = replayed(g)
    assert (event.step, event.module) == (3, "embed")
    # which micro-batch: the event, its text, and the cause the loss check names
    assert (event.details["call"], event.details["calls"]) == (3, 4)
    assert "in embed (forward call 3 of 4) at" in str(event)
    (loss_event,) = g.report.by_code("AMP112")
    assert loss_event.details["replay"]["origin"]["call"] == 3
    assert_same_run(train(**options), result)


class CheckpointedNet(Net):
    """Net whose blocks are activation-checkpointed: the backward recomputes their forward."""

    def forward(self, x, mask=None):
        x = self.embed(x)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.head(x)


def test_forwards_recomputed_by_activation_checkpointing_are_not_calls_of_the_step():
    options = dict(steps=6, scaler=True, micro_steps=4, bad_micro_step=(3, 2))
    g, result = guarded(model=built(CheckpointedNet), **options)
    (event,) = replayed(g)
    assert (event.step, event.module, event.details["call"], event.details["calls"]) == (
        3, "embed", 3, 4)
    assert_same_run(train(model=built(CheckpointedNet), **options), result)


def test_a_second_network_stepped_after_the_first_is_replayed_without_it():
    # two networks, a GradScaler each: the first's optimizer has stepped when the second's NaN
    # loss is judged; its parameters are not the second's, so the second's call still replays
    def run():
        torch.manual_seed(0)
        first, second = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()), Net()
        optimizers = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in (first, second)]
        scalers = [torch.amp.GradScaler("cpu") for _ in range(2)]
        for step in range(6):
            for index, model in enumerate((first, second)):
                x = torch.randn(8, WIDTH) * (1e6 if (step, index) == (4, 1) else 1.0)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(x).float().square().mean()
                optimizers[index].zero_grad()
                scalers[index].scale(loss).backward()
                scalers[index].step(optimizers[index])
                scalers[index].update()
        return [*first.state_dict().values(), *second.state_dict().values()]

    plain = run()
    with amp_runtime.guard(policy="record") as g:
        guarded_state = run()
    (event,) = replayed(g)
    assert (event.module, event.source) == ("embed", EMBED_SOURCE)
    assert g.report.by_code("AMP112")[0].details["replay"]["origin"]["module"] == "embed"
    assert_identical(plain, guarded_state)


def test_two_root_modules_are_replayed_in_their_order():
    torch.manual_seed(0)
    encoder, decoder = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()), Net()
    parameters = [*encoder.parameters(), *decoder.parameters()]
    optimizer = torch.optim.SGD(parameters, lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with amp_runtime.guard(policy="record") as g:
        for step in range(4):
            if step == 2:
                with torch.no_grad():
                    decoder.blocks[2].fc2.weight.mul_(1e6)
            with torch.autocast("cpu", dtype=torch.float16):
                code = encoder(torch.randn(8, WIDTH))
                loss = decoder(code).float().square().mean()
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    (event,) = replayed(g)
    assert (event.step, event.module, event.source) == (2, "blocks.2.fc2", FC2_SOURCE)
    assert (event.details["call"], event.details["calls"]) == (2, 2)  # the decoder's


def test_inputs_changed_in_place_after_the_forward_are_not_replayed():
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = torch.empty(8, WIDTH)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with amp_runtime.guard() as g:
            for step in range(3):
                batch.copy_(torch.randn(8, WIDTH) * (1e6 if step == 1 else 1))  # one buffer
                with torch.autocast("cpu", dtype=torch.float16):  # noqa: AMP010 - no scaler
                    loss = model(batch).float().mean()
                if step == 1:
                    batch.zero_()  # changed in place between the forward and the optimizer
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    assert not replayed(g)
    messages = [str(w.message) for w in caught]
    assert any("step 1 was not replayed: an input was modified in place" in m for m in messages)


COMPILED = """
import json, sys
import torch
from torch._dynamo.utils import counters
sys.path.insert(0, {tests!r})
import amp_runtime
from test_replay import Net, train

def run(fault, guarded):
    counters.clear()
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net()
    compiled = torch.compile(model, backend="aot_eager")
    options = dict(weight_fault={{5}} if fault else set(), model=compiled)
    if not guarded:
        return train(8, **options), None, dict(counters["stats"])
    # model= names the parameters: without it the gradient monitor's heap walk meets dynamo's
    # dead weak proxies (issue 11)
    with amp_runtime.guard(policy="record", model=model) as g:
        result = train(8, **options)
    return result, g, dict(counters["stats"])

(losses, _), g, _ = run(True, True)
(plain, _), _, _ = run(True, False)
same = all(torch.equal(a, b) or (a.isnan().all() and b.isnan().all())
           for a, b in zip(losses, plain))
events = [[e.code, e.step, e.module, bool(e.details.get("replayed"))] for e in g.report]
_, _, healthy = run(False, True)
_, _, unguarded = run(False, False)
print(json.dumps({{"same": same, "events": events, "healthy": healthy, "unguarded": unguarded}}))
"""


def test_a_compiled_model_is_replayed_on_its_eager_module(tmp_path):
    script = tmp_path / "compiled.py"
    script.write_text(COMPILED.format(tests=os.path.dirname(__file__)))
    done = subprocess.run([sys.executable, "-W", "error::UserWarning", str(script)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert ["AMP101", 5, "blocks.2.fc2", True] in result["events"]
    assert result["same"]
    # learning the root modules neither recompiled nor warned about global hooks
    assert result["healthy"] == result["unguarded"]


DISTRIBUTED = """
import gc, json, os, sys
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
sys.path.insert(0, {tests!r})
import amp_runtime
from test_replay import Net, WIDTH

class AllReduced(nn.Module):
    # a tensor-parallel-like layer: its forward communicates
    def forward(self, x):
        dist.all_reduce(x.detach().clone())
        return x

def main(rank, world, out, communicating):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["TEST_PORT"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    net = Net(batch_norm=True)
    if communicating:
        net.blocks[1].drop = AllReduced()
    model = torch.nn.parallel.DistributedDataParallel(net, broadcast_buffers=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    generator = torch.Generator().manual_seed(rank)
    with amp_runtime.guard(policy="record") as g:
        for step in range(8):
            x = torch.randn(8, WIDTH, generator=generator)
            if rank == 0 and step == 5:
                x = x * 1e6
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x).float(), torch.zeros(8, 1))
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        outcomes = [o.to_json() for o in g.replayer.outcomes]
    events = [[e.code, e.step, e.module, bool(e.details.get("replayed"))] for e in g.report]
    with open(os.path.join(out, f"rank{{rank}}.json"), "w") as fh:
        json.dump({{"events": events, "outcomes": outcomes}}, fh)
    # DDP's reducer holds gloo work; free it before the group goes
    del model, optimizer, g
    gc.collect()
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()

if __name__ == "__main__":
    torch.multiprocessing.spawn(main, args=(2, sys.argv[1], sys.argv[2] == "1"), nprocs=2)
"""


@pytest.mark.parametrize("communicating", [False, True])
def test_under_ddp_the_replay_is_local_and_never_communicates(tmp_path, communicating):
    script = tmp_path / "ddp.py"
    script.write_text(DISTRIBUTED.format(tests=os.path.dirname(__file__)))
    env = {**os.environ, "TEST_PORT": str(29500 + os.getpid() % 1000 + communicating)}
    done = subprocess.run([sys.executable, str(script), str(tmp_path), str(int(communicating))],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    if communicating:
        # a forward that communicates cannot run on one rank alone: no replay, no hang
        (outcome,) = [o for o in rank0["outcomes"] if o["step"] == 5]
        assert "calls torch.distributed.all_reduce" in outcome["skipped"]
    else:
        # the DDP wrapper's forward (a buffer broadcast) would have hung rank 1
        (event,) = [e for e in rank0["events"] if e[0] == "AMP101"]
        assert event[1] == 5 and event[2].endswith("embed") and event[3]
    assert not [e for e in rank1["events"] if e[0] == "AMP101" and e[3]]


# -- item 5: the repro bundle and `python -m amp_runtime replay` ----------------------------

MODEL_FILE = '''
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))  # fc2 call


class Net(nn.Module):
    def __init__(self, width=16, depth=3):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.scale = nn.Parameter(torch.ones(()))
        self.head = nn.Linear(width, 1)

    def forward(self, x, mask):
        for block in self.blocks:
            x = block(x)
        x = x * mask
        x = x * (x * x).sum(-1, keepdim=True).sqrt() * self.scale  # sqrt call
        return self.head(x)


def build():
    return Net()


def build_wider():
    return Net(width=32)


def broken():
    raise RuntimeError("no checkpoint here")


def not_a_model():
    return 42
'''

TRAIN_FILE = '''
import sys
import torch
import torch.nn.functional as F
from model import Net

torch.manual_seed(0)
model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
fault = sys.argv[1]
for step in range(7):
    x, mask = torch.randn(8, 16), torch.ones(8, 1)
    if step == 5 and fault == "forward":
        with torch.no_grad():
            model.blocks[1].fc2.weight.mul_(1e6)
    if step == 5 and fault == "backward":
        mask[4] = 0
    if step == 5 and fault == "parameter":
        with torch.no_grad():
            model.blocks[1].fc2.weight[0, 0] = float("inf")
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(x, mask=mask).float(), torch.zeros(8, 1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
'''


def amp_runtime_cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "amp_runtime", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A project whose training broke at step 5, run under ``python -m amp_runtime run``: in the
    forward (logs/), in the backward only (logs-backward/), and from a weight set to inf
    (logs-parameter/)."""
    folder = tmp_path_factory.mktemp("project")
    (folder / "model.py").write_text(MODEL_FILE)
    (folder / "train.py").write_text(TRAIN_FILE)
    for fault, out in (("forward", "logs"), ("backward", "logs-backward"),
                       ("parameter", "logs-parameter")):
        ran = amp_runtime_cli("run", "--out", out, "--no-report", "train.py", fault, cwd=folder)
        assert ran.returncode == 0, ran.stderr
    return folder


def test_the_failing_step_is_saved_and_replays_offline(project):
    bundle = project / "logs" / "repro-step5.pt"
    assert bundle.is_file()
    saved = torch.load(bundle, weights_only=True)
    assert saved["step"] == 5 and saved["calls"][0]["kwargs"]["mask"].shape == (8, 1)
    assert saved["calls"][0]["autocast"] == [["cpu", "float16"]]
    assert set(saved["calls"][0]["rng"]) == {"cpu"}
    assert "blocks.1.fc2.weight" in saved["modules"][0]["parameters"]

    done = amp_runtime_cli("replay", bundle, "--model", "model.py:build", cwd=project)
    assert done.returncode == 0, done.stderr
    # replayed when its loss was judged, before its gradients were
    assert "replay of step 5 (AMP112): the first NaN/Inf came from linear in blocks.1.fc2" \
        in done.stdout
    assert "AMP101" in done.stdout and "blocks.1.fc2" in done.stdout
    assert "model.py:" in done.stdout

    as_json = json.loads(amp_runtime_cli("replay", bundle, "--model", "model.py:build",
                                         "--json", cwd=project).stdout)
    (event,) = [e for e in as_json["events"] if e["code"] == "AMP101"]
    assert (event["step"], event["module"]) == (5, "blocks.1.fc2")
    assert as_json["outcome"]["origin"]["phase"] == "forward"


def test_a_weight_already_infinite_replays_offline_to_that_parameter(project):
    done = amp_runtime_cli("replay", "logs-parameter/repro-step5.pt", "--model", "model.py:build",
                           cwd=project)
    assert done.returncode == 0, done.stderr
    assert ("replay of step 5 (AMP112): the forward started from the parameter "
            "blocks.1.fc2.weight (inf before the forward)") in done.stdout


def test_a_backward_fault_replays_offline_to_the_same_layer(project):
    done = amp_runtime_cli("replay", "logs-backward/repro-step5.pt", "--model", "model.py:build",
                           "--json", cwd=project)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    (event,) = [e for e in result["events"] if e["code"] == "AMP103"]
    sqrt_line = MODEL_FILE.splitlines().index(next(
        line for line in MODEL_FILE.splitlines() if "# sqrt call" in line)) + 1
    assert (event["op"], event["source"]) == ("sqrt", f"model.py:{sqrt_line}")
    assert result["outcome"]["reproduced"] is True


@pytest.mark.parametrize("args, status, message", [
    (["missing.pt", "--model", "model.py:build"], 2, "replay: missing.pt: no such file"),
    (["model.py", "--model", "model.py:build"], 2, "model.py is not a repro bundle"),
    (["logs/repro-step5.pt", "--model", "model.py:build_wider"], 2,
     "the model does not match the bundle's"),
    (["logs/repro-step5.pt", "--model", "model.py:broken"], 1, "no checkpoint here"),
    (["logs/repro-step5.pt", "--model", "model.py:not_a_model"], 2,
     "not_a_model() must return a torch.nn.Module"),
    (["logs/repro-step5.pt", "--model", "model.py:nothing"], 2, "has no callable 'nothing'"),
    (["logs/repro-step5.pt"], 2, "--model"),
])
def test_replay_errors_are_one_clear_line(project, args, status, message):
    done = amp_runtime_cli("replay", *args, cwd=project)
    assert done.returncode == status
    assert message in done.stderr
    if status == 2:
        assert "Traceback" not in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_replay_on_a_missing_device_is_a_clear_error(project):
    done = amp_runtime_cli("replay", "logs/repro-step5.pt", "--model", "model.py:build",
                           "--device", "cuda", cwd=project)
    assert done.returncode == 2
    assert "--device cuda: CUDA is not available here" in done.stderr


def test_replay_help_explains_the_bundle_and_the_factory():
    done = subprocess.run([sys.executable, "-m", "amp_runtime", "replay", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    assert "repro-step<N>.pt" in done.stdout and "MODULE:FACTORY" in done.stdout


def test_a_bundle_names_the_module_of_each_non_finite_gradient_when_names_repeat(tmp_path):
    """Two root modules whose parameters have the same names (a GAN's two ``nn.Sequential``):
    the bundle places the first one's non-finite gradients in the first one."""
    torch.manual_seed(0)
    generator, critic = nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4))
    optimizer = torch.optim.SGD([*generator.parameters(), *critic.parameters()], lr=1e-3)
    with amp_runtime.guard(policy="record", log_dir=tmp_path):
        for step in range(4):
            x = torch.randn(8, 4)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                silenced = generator(x).float() * (0.0 if step == 2 else 1.0)
                loss = (silenced * silenced).sum().sqrt() + critic(x).float().mean()
            optimizer.zero_grad()
            loss.backward()  # at step 2: sqrt'(0) * 0 is NaN in the generator's gradients
            optimizer.step()
    saved = torch.load(tmp_path / "repro-step2.pt", weights_only=True)
    assert {tuple(pair) for pair in saved["nonfinite_grads"]} == {(0, "0.weight"), (0, "0.bias")}


def test_a_replay_that_found_nothing_leaves_the_next_failing_step_to_be_replayed():
    """bf16, no scaler. At step 2 a NaN reaches the optimizer in a gradient the loop itself
    wrote (nothing the model ran made it, so the replay finds nothing); at step 3 the model's
    forward overflows. The empty replay of step 2 opens no episode: step 3 is replayed and
    AMP101 names its op (AMP103 turns no per-op trace on, so only the replay can)."""
    torch.manual_seed(0)
    model = Net()
    temperature = nn.Parameter(torch.ones(1))  # stepped, never used by the forward
    optimizer = torch.optim.SGD([*model.parameters(), temperature], lr=1e-3)
    with amp_runtime.guard(policy="record", model=model) as g:
        for step in range(5):
            x = torch.randn(8, WIDTH)
            if step == 3:
                x[0, 0] = 3e38  # finite, but the first linear's bf16 output overflows
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            loss = out.float().pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            temperature.grad = torch.full((1,), float("nan") if step == 2 else 0.0)
            optimizer.step()
    assert [e.step for e in g.report.by_code("AMP103")][:1] == [2]
    assert [e.step for e in g.report.by_code("AMP101")] == [3]
