"""Every GradScaler a user can have, under the guard: disabled ones (nanoGPT's
``GradScaler(enabled=(dtype == "float16"))``, ``torch.cuda.amp.GradScaler()`` without CUDA),
subclasses (FSDP's ``ShardedGradScaler``, a user's, also one defined inside the guard),
``scaler.step(optimizer, *args, **kwargs)`` as frameworks call it, several scalers and optimizers.

Each loop runs unguarded and guarded: the guarded run must give bit-identical losses and weights,
count its steps, report nothing when healthy, and still find what the loss scale says when it is
not. A disabled scaler means no loss scaling: the checks that need one stay quiet, the rest run.
"""
import gc
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.amp.grad_scaler import GradScaler

import amp_runtime
from amp_runtime.events import PACKAGE_DIR


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))


def scaled_update(model, optimizer, scaler, loss):
    """The end of nanoGPT's iteration, unconditional whatever the scaler: scale and backward,
    unscale_, clip, step, update, zero_grad."""
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


def nanogpt_loop(model, optimizer, scaler, steps, dtype, blow_up=1.0, inject_nan_at=None):
    """nanoGPT's scaler calls, unconditional whatever the scaler: scale, unscale_, clip, step,
    update."""
    generator = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        x = torch.randn(8, 16, generator=generator)
        y = x[:, :1] * 2
        with torch.autocast("cpu", dtype=dtype):
            loss = F.mse_loss(model(x).float(), y) * blow_up
        if step == inject_nan_at:
            loss = loss * float("nan")
        scaled_update(model, optimizer, scaler, loss)
        losses.append(loss.item())
    return losses


def run(make_scaler, steps=12, dtype=torch.bfloat16, guarded=True, **loop):
    """Losses, weights and the guard (None unguarded) of one fresh run."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.cuda.amp's deprecation and no-CUDA warnings
        scaler = make_scaler()
        if not guarded:
            return nanogpt_loop(model, optimizer, scaler, steps, dtype, **loop), model, None
        with amp_runtime.guard(policy="record") as g:
            losses = nanogpt_loop(model, optimizer, scaler, steps, dtype, **loop)
    return losses, model, g


def assert_same_training(make_scaler, **options):
    """The guarded run equals the unguarded one; returns the guard."""
    plain_losses, plain_model, _ = run(make_scaler, guarded=False, **options)
    losses, model, g = run(make_scaler, **options)
    assert list(map(repr, losses)) == list(map(repr, plain_losses))  # NaN included
    for (name, mine), theirs in zip(model.state_dict().items(), plain_model.state_dict().values()):
        assert torch.equal(mine.nan_to_num(), theirs.nan_to_num()), name  # NaN where NaN
        assert torch.equal(mine.isnan(), theirs.isnan()), name
    return g


def codes(g):
    return set(g.report.codes())


# -- disabled scalers ---------------------------------------------------------------------


def disabled():
    return torch.amp.GradScaler("cpu", enabled=False)


def test_a_disabled_scaler_in_bf16_trains_as_without_the_guard_and_is_quiet():
    g = assert_same_training(disabled, steps=12)
    assert codes(g) == set()
    assert g.step_index == 12  # steps end at optimizer.step(): a disabled update() does nothing


def test_a_disabled_scaler_means_no_loss_scaling_the_other_checks_run():
    """fp16 without loss scaling is AMP010; a NaN loss is AMP112 and, with nothing to skip the
    step, AMP103; nothing a scaler would have to do (AMP005-AMP006, AMP107-AMP109) is claimed."""
    g = assert_same_training(disabled, steps=6, dtype=torch.float16, inject_nan_at=3)
    assert codes(g) == {"AMP010", "AMP112", "AMP103"}
    assert [group.first_step for group in g.report.groups()
            if group.code in ("AMP112", "AMP103")] == [3, 3]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_torch_cuda_amp_grad_scaler_without_cuda_disables_itself_and_is_quiet():
    def cuda_scaler():
        return torch.cuda.amp.GradScaler()  # noqa: AMP009  (the deprecated API is the point)

    with pytest.warns(UserWarning, match="CUDA is not available"):
        warnings.simplefilter("ignore", FutureWarning)  # the deprecation: not what this is about
        assert not cuda_scaler().is_enabled()
    g = assert_same_training(cuda_scaler, steps=8)
    assert codes(g) == set() and g.step_index == 8


# -- subclasses ---------------------------------------------------------------------------


class CountingScaler(GradScaler):
    """A user's subclass: its overrides call GradScaler's through super()."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = {"step": 0, "update": 0}

    def step(self, optimizer, *args, **kwargs):
        self.calls["step"] += 1
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale=None):
        self.calls["update"] += 1
        return super().update(new_scale)


def counting():
    return CountingScaler("cpu")


def test_a_user_subclass_is_watched_once_per_call():
    g = assert_same_training(counting, steps=10, dtype=torch.float16)
    assert codes(g) == set() and g.step_index == 10


def test_a_user_subclass_still_reports_a_collapsing_loss_scale():
    g = assert_same_training(counting, steps=24, dtype=torch.float16, blow_up=1e30)
    assert {"AMP107", "AMP108"} <= codes(g)
    assert g.step_index == 24  # one step per update, though both GradScaler.update and
    # CountingScaler.update ran: the super() call is not a second update


def test_a_subclass_defined_inside_the_guard_is_watched_and_restored_on_exit():
    """``python -m amp_runtime run`` executes the whole script, class definitions included,
    inside the guard."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with amp_runtime.guard(policy="record") as g:
        class OwnScale(GradScaler):
            """Scales on its own, without GradScaler.scale (so only its own method shows it)."""

            def scale(self, outputs):
                if self._scale is None:
                    self._lazy_init_scale_growth_tracker(outputs.device)
                return outputs * self._scale

        scaler = OwnScale("cpu")
        nanogpt_loop(model, optimizer, scaler, 10, torch.float16, blow_up=1e30)
        # a scaled backward stepped directly: only known if the scaler was seen scaling
        x = torch.randn(8, 16)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().sum()
        scaler.scale(loss).backward()
        optimizer.step()  # noqa: AMP006  (the bug this test makes the guard find)
    assert "AMP006" in codes(g)
    assert g.report.by_code("AMP108")  # its updates were seen: 1e30 overflows every step
    assert not hasattr(vars(OwnScale)["scale"], "__amp_runtime_original__")
    assert not hasattr(vars(GradScaler)["step"], "__amp_runtime_original__")


@pytest.fixture
def process_group():
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def sharded():
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler("cpu")


def test_fsdps_sharded_grad_scaler_trains_as_without_the_guard(process_group):
    g = assert_same_training(sharded, steps=10, dtype=torch.float16)
    assert codes(g) == set() and g.step_index == 10


def test_fsdps_sharded_grad_scaler_loss_scale_is_judged(process_group):
    """On the CPU its update() runs Python (_amp_update_scale_cpu_), not the update kernel: the
    guard reads it from the method, not from a kernel."""
    g = assert_same_training(sharded, steps=24, dtype=torch.float16, blow_up=1e30)
    assert {"AMP107", "AMP108"} <= codes(g)


# -- how frameworks call step() ----------------------------------------------------------


class NotingSGD(torch.optim.SGD):
    """An optimizer whose step takes extra arguments, as framework wrappers pass them."""

    def __init__(self, params):
        super().__init__(params, lr=0.05)
        self.notes = []

    def step(self, closure=None, *, note=None):
        self.notes.append(note)
        return super().step(closure)


class ClippingSGD(torch.optim.SGD):
    """A subclass whose step() does work of its own after SGD's: the optimizer's hooks fire
    for both calls (once SGD.step itself is hooked, by any plain SGD)."""

    def __init__(self, params):
        super().__init__(params, lr=0.05)
        self.modes_after_super = []

    def step(self, closure=None):
        loss = super().step(closure)
        self.modes_after_super.append(len(torch.overrides._get_current_function_mode_stack()))
        with torch.no_grad():
            for group in self.param_groups:
                for parameter in group["params"]:
                    parameter.clamp_(-10, 10)
        return loss


def test_an_optimizer_step_calling_super_step_is_one_step_unobserved_to_its_end():
    torch.optim.SGD([torch.zeros(1, requires_grad=True)])  # hooks SGD.step itself
    model = make_model()
    optimizer = ClippingSGD(model.parameters())
    with amp_runtime.guard(policy="record") as g:
        for _ in range(4):  # watched steps: the guard's mode is on outside the optimizer
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(4, 16)).float().pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    assert optimizer.modes_after_super == [0, 0, 0, 0]
    assert g.step_index == 4 and codes(g) == set()


@pytest.mark.parametrize("enabled", [True, False])
def test_scaler_step_passes_extra_arguments_through(enabled):
    def train(guarded):
        model = make_model()
        optimizer = NotingSGD(model.parameters())
        scaler = GradScaler("cpu", enabled=enabled)
        with amp_runtime.guard(policy="record") if guarded else _nothing() as g:
            for step in range(4):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(torch.randn(4, 16)).float().pow(2).mean()
                scaler.scale(loss).backward()
                scaler.step(optimizer, note=f"step {step}")
                scaler.update()
                optimizer.zero_grad()
        return optimizer.notes, [p.detach().clone() for p in model.parameters()], g

    notes, weights, g = train(guarded=True)
    plain_notes, plain_weights, _ = train(guarded=False)
    assert notes == plain_notes == [f"step {i}" for i in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(weights, plain_weights))
    assert g.step_index == 4
    assert codes(g) <= {"AMP010"}  # fp16 with a disabled scaler is not scaled


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# -- several scalers and optimizers ------------------------------------------------------


def test_two_scalers_and_two_optimizers_one_of_them_overflowing():
    """A GAN-like loop: each model with its own optimizer and scaler; the overflowing one's
    loss scale declines, the other's does not, and numerics are those of the unguarded run."""

    def train(guarded):
        generator_model, critic = make_model(0), make_model(1)
        optimizers = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in (generator_model, critic)]
        scalers = [GradScaler("cpu"), GradScaler("cpu")]
        data = torch.Generator().manual_seed(3)
        with amp_runtime.guard(policy="record") if guarded else _nothing() as g:
            for _ in range(20):
                x = torch.randn(8, 16, generator=data)
                for model, optimizer, scaler, factor in zip(
                        (generator_model, critic), optimizers, scalers, (1.0, 1e30)):
                    with torch.autocast("cpu", dtype=torch.float16):
                        loss = model(x).float().pow(2).mean() * factor
                    scaler.scale(loss).backward()
                    scaler.step(optimizer)
                    scaler.update()
                    optimizer.zero_grad()
        return [s.get_scale() for s in scalers], generator_model, critic, g

    scales, generator_model, critic, g = train(guarded=True)
    plain_scales, plain_generator, plain_critic, _ = train(guarded=False)
    assert scales == plain_scales and scales[0] == 65536.0 and scales[1] < 1.0
    for mine, theirs in ((generator_model, plain_generator), (critic, plain_critic)):
        assert all(torch.equal(a, b) for a, b in zip(mine.parameters(), theirs.parameters()))
    assert {"AMP107", "AMP108"} <= codes(g)
    assert {e.details["init_scale"] for e in g.report.by_code("AMP108")} == {65536.0}


# -- what the guard no longer does: heap walks, stack walks per step ----------------------


def test_no_heap_walk_finds_scalers_optimizers_or_modules(monkeypatch):
    """Names, scalers and optimizers come from what the guard saw, never from the heap."""
    def no_heap_walks():
        raise AssertionError("gc.get_objects() called")

    monkeypatch.setattr(gc, "get_objects", no_heap_walks)
    model = make_model()
    with amp_runtime.guard(policy="record") as g:
        nanogpt_loop(model, torch.optim.SGD(model.parameters(), lr=1e-3), counting(), 7,
                     torch.float16, blow_up=1e30)
        model[2].half()  # AMP001 names a module that is not running
    assert {"AMP001", "AMP108"} <= codes(g) and "AMP100" not in codes(g)
    assert g.report.by_code("AMP001")[0].module == "2"


def test_no_stack_walk_in_the_steps_of_a_healthy_loop(monkeypatch):
    """After the first watched steps, a healthy fp16 loop with a scaler, unscale and clipping
    walks the Python stack on no step, watched ones (every 16th) included. Only the replay of
    a step the scale's settling made the GradScaler skip, a traced forward, walks it."""
    walks = []
    real_getframe = sys._getframe

    def counting_getframe(depth=0):
        caller = real_getframe(1).f_code.co_filename
        if caller.startswith(PACKAGE_DIR) and not g.replayer.replaying:
            walks.append(caller)
        return real_getframe(depth + 1)

    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = GradScaler("cpu")
    with amp_runtime.guard(policy="record") as g:
        nanogpt_loop(model, optimizer, scaler, 10, torch.float16)
        monkeypatch.setattr(sys, "_getframe", counting_getframe)
        nanogpt_loop(model, optimizer, scaler, 40, torch.float16)
        monkeypatch.undo()
        replays = [(outcome.triggers, outcome.origin) for outcome in g.replayer.outcomes]
    assert codes(g) == set() and g.step_index == 50
    assert walks == []
    assert all(replay == (("skipped",), None) for replay in replays)
