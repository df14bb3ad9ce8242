"""Gradient health (AMP103-AMP106): fused statistics, their judgement, and guarded training runs."""
import json
import math

import pytest
import torch

from amp_runtime.monitors.grads import (
    CLEAR, NONZERO, GradSample, gradient_stats, host_values, judge_gradients, layer_of,
    layer_stats, quiet_norm, reading_tensors, total_norm, underflow_fraction,
)
from amp_runtime.thresholds import Thresholds


def reference_row(grads, scale):
    """Per-tensor statistics computed one tensor at a time, the slow obvious way."""
    rows = []
    for g in grads:
        g = g.float()
        clear = math.nan
        if scale is not None:  # not zero and not rounding to fp16's smallest subnormal, 2**-24
            in_fp16 = (g * scale).half().abs()
            clear = (in_fp16 > torch.finfo(torch.float16).smallest_normal * 2 ** -10).sum().item()
        nonzero = (g != 0).sum().item()
        rows.append((g.norm().item(), g.abs().max().item(), nonzero, clear))
    return rows


@pytest.mark.parametrize("scale", [None, 1.0, 1024.0, 65536.0])
def test_fused_stats_match_per_tensor_reference(scale):
    torch.manual_seed(0)
    grads = [
        torch.randn(64, 32) * 1e-6,
        torch.zeros(17),
        torch.randn(300) * 1e-9,
        torch.cat([torch.zeros(10), torch.randn(10)]),
        torch.randn(8, 8).half(),
    ]
    stats = gradient_stats(grads, None if scale is None else torch.tensor(scale))
    assert stats.shape == (4, len(grads)) and stats.dtype == torch.float32
    for column, expected in enumerate(reference_row(grads, scale)):
        got = stats[:, column].tolist()
        assert got[0] == pytest.approx(expected[0], rel=1e-5)
        assert got[1] == pytest.approx(expected[1], rel=1e-6)
        assert got[2] == expected[2]
        if scale is None:
            assert math.isnan(got[3])
        else:
            assert got[3] == expected[3]


def test_cheap_stats_are_the_norms_only():
    grads = [torch.randn(5), torch.randn(3, 3)]
    stats = gradient_stats(grads, torch.tensor(1024.0), detailed=False)
    assert stats.shape == (1, 2)
    assert stats[0].tolist() == pytest.approx([g.norm().item() for g in grads])


@pytest.mark.parametrize("detailed", [True, False])
def test_nonfinite_gradients_propagate_into_the_norm(detailed):
    grads = [torch.tensor([1.0, math.nan]), torch.tensor([math.inf, 0.0]), torch.ones(4)]
    stats = gradient_stats(grads, detailed=detailed)
    assert math.isnan(stats[0, 0]) and math.isinf(stats[0, 1]) and stats[0, 2] == 2.0


def sample(named_grads, scale=None, scaled=False):
    """A GradSample as the monitor takes it; ``scaled``: the gradients are still times ``scale``."""
    grads = list(named_grads.values())
    scale_tensor = None if scale is None else torch.tensor(scale)
    flush_factor = torch.tensor(1.0) if scaled else scale_tensor
    return GradSample(
        names=list(named_grads),
        shapes=[g.shape for g in grads],
        stats=gradient_stats(grads, flush_factor),
        scaled_by=scale_tensor if scaled else None,
        loss_scale=scale_tensor,
    )


def read_samples(samples):
    """The samples' per-layer statistics and loss scale, read here at once (in the guard the
    readings copy them without a host sync and judge them once they arrive)."""
    values = [v for t in reading_tensors(samples) for v in t.reshape(-1).tolist()]
    return layer_stats(samples, *host_values(samples, values))


def test_read_divides_still_scaled_gradients_by_the_scale():
    grads = {"fc.weight": torch.full((4,), 3.0 * 1024)}
    (layer,), scale = read_samples([sample(grads, scale=1024.0, scaled=True)])
    assert layer.max == pytest.approx(3.0) and layer.norm == pytest.approx(6.0) and scale == 1024.0
    assert layer.zero_fraction == 0.0


def test_judge_explosion_severity_by_unscaled_total_norm():
    limits = Thresholds()
    for total, severity in ((50.0, None), (150.0, "P1"), (5000.0, "P0")):
        grads = {"a.weight": torch.tensor([total * 0.6]), "b.weight": torch.tensor([total * 0.8])}
        layers, _ = read_samples([sample(grads)])
        found = [kw for code, kw in judge_gradients(layers, None, limits) if code == "AMP104"]
        if severity is None:
            assert not found
        else:
            (kw,) = found
            assert kw["severity"] == severity and kw["norm"] == pytest.approx(total, rel=1e-6)
            assert kw["module"] == "b"


def test_judge_vanishing_names_layers_earliest_first_including_exact_zero():
    grads = {
        "blocks.0.fc.weight": torch.zeros(4), "blocks.0.fc.bias": torch.full((2,), 1e-12),
        "blocks.1.fc.weight": torch.full((4,), 1e-11), "blocks.1.fc.bias": torch.zeros(2),
        "blocks.2.fc.weight": torch.ones(4), "blocks.2.fc.bias": torch.zeros(2),
    }
    layers, _ = read_samples([sample(grads)])
    (kw,) = [kw for code, kw in judge_gradients(layers, None, Thresholds()) if code == "AMP105"]
    assert kw["details"]["layers"] == ["blocks.0.fc", "blocks.1.fc"]
    assert kw["module"] == "blocks.0.fc"


def test_judge_total_vanishing():
    layers, _ = read_samples([sample({"w": torch.full((3,), 1e-8)})])
    (kw,) = [kw for code, kw in judge_gradients(layers, None, Thresholds()) if code == "AMP105"]
    assert "total gradient norm" in kw["detail"]


def test_judge_underflow_estimates_the_flushed_values_and_never_counts_zeros():
    """An fp16 backward at scale 1024 leaves its values on fp16's grid: 2**-24 (the smallest
    subnormal) is the lowest nonzero one, and about half as many values as rounded to it flushed
    to zero. Exact zeros are never counted, however many there are."""
    torch.manual_seed(0)
    scale = 1024.0
    smallest = 2.0 ** -24 / scale  # rounds to fp16's smallest subnormal at this scale
    zeros = torch.zeros(40)  # already flushed, or never nonzero: the two look alike
    at_smallest = torch.full((60,), smallest)
    subnormal = torch.full((100,), 1e-9)  # times 1024 is ~1e-6: subnormal, but far above 2**-24
    healthy = torch.full((800,), 1e-2)
    low = torch.full((800,), 4e-9)  # times 1024 is ~4e-6: clear of the lowest bin, but low
    underflowing = torch.cat([zeros, at_smallest, subnormal, low])
    grads = {
        "a.weight": underflowing.reshape(100, 10),
        # the same values in a 1-D parameter: sums over the batch, not an fp16 matmul's output
        "a.bias": underflowing,
        # as many flushed beside gradients 1e6 times larger: ~1e-9 of the norm, nothing lost
        "e.weight": torch.cat([zeros, at_smallest, subnormal, healthy]).reshape(100, 10),
        # subnormals only above the lowest bin: precision lost near zero, nothing flushed
        "b.weight": torch.cat([subnormal, healthy]).reshape(90, 10),
        # most values exactly zero (embedding rows not in the batch, dead units): sparsity
        "c.weight": torch.cat([torch.zeros(5000), healthy]).reshape(580, 10),
        # half the rows zero, the others small enough (scaled: ~1e-3) that ~5 % of them are
        # subnormal near zero, as gradients spread around zero are: still nothing flushed
        "d.weight": torch.cat([torch.zeros(500, 10), torch.randn(500, 10) * 1e-3 / scale]),
    }
    layers, found_scale = read_samples([sample(grads, scale=scale)])
    found = [kw for code, kw in judge_gradients(layers, found_scale, Thresholds())
             if code == "AMP106"]
    assert [kw["layer"] for kw in found] == ["a.weight"]
    assert found[0]["fraction"] == pytest.approx(30 / 960) and found[0]["scale"] == scale
    assert found[0]["details"]["zero_fraction"] == pytest.approx(40 / 1000)
    assert found[0]["details"]["norm_share"] > Thresholds().grad_underflow_norm_share
    by_name = {g.name: g for g in layers}
    assert by_name["e.weight"].underflow_fraction == pytest.approx(30 / 960)
    assert by_name["b.weight"].underflow_fraction == 0.0
    sparse = by_name["c.weight"]
    assert sparse.zero_fraction == pytest.approx(5000 / 5800) and sparse.underflow_fraction == 0.0
    assert by_name["d.weight"].underflow_fraction < 0.001


def test_judge_nonfinite_grad_hides_norm_findings():
    grads = {"enc.weight": torch.tensor([math.inf, 1.0]), "dec.weight": torch.ones(2)}
    layers, _ = read_samples([sample(grads)])
    findings = judge_gradients(layers, None, Thresholds())
    assert [code for code, _ in findings] == ["AMP103"]
    assert findings[0][1]["module"] == "enc"


def norms_only(named_grads, scale=None):
    """A norms-only sample (the statistics of a step that is not detailed)."""
    grads = list(named_grads.values())
    scale_tensor = None if scale is None else torch.tensor(scale)
    return GradSample(names=list(named_grads), shapes=[g.shape for g in grads],
                      stats=gradient_stats(grads, detailed=False), scaled_by=scale_tensor,
                      loss_scale=scale_tensor)


@pytest.mark.parametrize("values", [
    (1.0, 2.0),  # healthy
    (1e6, 1.0),  # exploding
    (1e-9, 1e-9),  # vanishing in total
    (1.0, 1e-9),  # one vanishing layer
    (math.nan, 1.0),
    (math.inf, 1.0),
])
@pytest.mark.parametrize("scale", [None, 1024.0])
def test_quiet_norm_is_the_total_exactly_when_judging_finds_nothing(values, scale):
    factor = 1.0 if scale is None else scale
    grads = {f"layer{i}.weight": torch.full((4,), v * factor) for i, v in enumerate(values)}
    samples = [norms_only(grads, scale)]
    values = [v for t in reading_tensors(samples) for v in t.reshape(-1).tolist()]
    host, factors, scales = host_values(samples, values)
    layers, loss_scale = layer_stats(samples, host, factors, scales)
    quiet = quiet_norm(samples, host, factors, Thresholds())
    assert (quiet is None) == bool(judge_gradients(layers, loss_scale, Thresholds()))
    assert quiet is None or quiet == total_norm(layers)


def test_layer_of():
    assert layer_of("blocks.0.fc.weight") == "blocks.0.fc" and layer_of("scale") == "scale"


# -- guarded training runs (real torch, CPU) -------------------------------------------------

import amp_runtime  # noqa: E402


def mlp(depth, width, activation=torch.nn.Sigmoid, seed=0):
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), activation()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


def fp16_scaled_steps(model, steps, lr=0.01, batch=32, init_scale=2.0 ** 16, hook=None):
    """A standard CPU fp16 autocast + GradScaler loop; ``hook(step, opt)`` runs before each step."""
    width = model[0].in_features
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    for step in range(steps):
        if hook is not None:
            hook(step, opt)
        x = torch.randn(batch, width)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = out.float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return scaler


def test_deep_sigmoid_mlp_in_fp32_names_the_earliest_layers_as_vanishing():
    model = mlp(depth=20, width=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with amp_runtime.guard(policy="record", model=model) as g:
        for _ in range(3):
            loss = model(torch.randn(32, 16)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    events = g.report.by_code("AMP105")
    assert events and events[0].step == 0
    layers = events[0].details["layers"]
    # the gradient shrinks through every sigmoid: the vanished layers are the first ones, in order
    assert layers[0] == "0" and layers == sorted(layers, key=int)
    assert "19" not in layers and "40" not in layers
    assert not g.report.by_code("AMP103") and not g.report.by_code("AMP104")


def test_fp16_exactly_zero_layers_are_named_without_a_model_argument():
    model = mlp(depth=2, width=16, activation=torch.nn.ReLU)
    torch.nn.init.constant_(model[2].weight, 0.0)  # nothing flows back into layer 0
    with amp_runtime.guard(policy="record") as g:
        fp16_scaled_steps(model, steps=2)
    (event,) = g.report.by_code("AMP105")
    assert event.module == "0" and event.details["layers"] == ["0"] and event.step == 0


class MultiTask(torch.nn.Module):
    """A shared trunk and one head per task; each batch trains one task's head."""

    def __init__(self, tasks=3, dead_trunk=False):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
        self.heads = torch.nn.ModuleList(torch.nn.Linear(16, 1) for _ in range(tasks))
        if dead_trunk:
            torch.nn.init.constant_(self.trunk[0].bias, -100.0)  # every ReLU unit is dead

    def forward(self, x, task):
        return self.heads[task](self.trunk(x))


def multitask_steps(model, steps, task_of_step, fp16=True, set_to_none=False, overflow_at=()):
    """``overflow_at``: steps whose loss overflows the scaled backward (the scaler skips them)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", enabled=fp16, init_scale=1024.0)
    scales = []
    for step in range(steps):
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            out = model(torch.randn(4, 8), task_of_step(step))
        loss = (out.float() - 1).pow(2).mean() * (1e35 if step in overflow_at else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=set_to_none)
        scales.append(scaler.get_scale())
    return scales


@pytest.mark.parametrize("fp16", [True, False])
def test_heads_the_step_did_not_use_are_not_vanishing_with_kept_zero_gradients(fp16):
    """``zero_grad(set_to_none=False)`` leaves zeros in the heads of the other tasks: the backward
    never reached them, so they are not vanishing (every step reported them before)."""
    model = MultiTask()
    with amp_runtime.guard(policy="record", model=model) as g:
        multitask_steps(model, 12, task_of_step=lambda step: step % 3, fp16=fp16)
    assert not g.report.by_code("AMP105")


def test_a_head_trained_only_in_a_skipped_step_is_not_vanishing_in_the_next():
    """The skipped step's backward reached the head; the next step's did not."""
    model = MultiTask()
    with amp_runtime.guard(policy="record", model=model) as g:
        scales = multitask_steps(model, 12, task_of_step=lambda step: step % 3, overflow_at={7})
    assert scales[7] == scales[6] / 2  # the scaler skipped step 7
    assert not g.report.by_code("AMP105")


@pytest.mark.parametrize("set_to_none", [False, True])
def test_a_dead_layer_the_backward_reaches_is_still_vanishing(set_to_none):
    model = MultiTask(dead_trunk=True)
    with amp_runtime.guard(policy="record", model=model) as g:
        multitask_steps(model, 8, task_of_step=lambda step: step % 3, set_to_none=set_to_none)
    (event,) = g.report.by_code("AMP105")
    assert event.details["layers"] == ["trunk.0"]


def test_a_dead_layer_is_reported_at_the_first_step_when_gradients_are_kept():
    model = MultiTask(dead_trunk=True)
    with amp_runtime.guard(policy="record", model=model) as g:
        multitask_steps(model, 1, task_of_step=lambda step: 0, fp16=False)
    (event,) = g.report.by_code("AMP105")
    assert event.step == 0 and event.details["layers"] == ["trunk.0"]


def test_learning_rate_spike_reports_explosion_at_that_step_with_the_unscaled_norm(tmp_path):
    model = mlp(depth=2, width=16, activation=torch.nn.ReLU)
    spike_at = 6

    def spike(step, opt):
        for group in opt.param_groups:
            group["lr"] = 50.0 if step == spike_at else 0.01

    with amp_runtime.guard(policy="record", log_dir=tmp_path) as g:
        # a small initial scale keeps the exploded fp16 gradients finite, so the step is not skipped
        fp16_scaled_steps(model, steps=spike_at + 3, hook=spike, init_scale=16.0)
    events = g.report.by_code("AMP104")
    assert len(events) == 1, g.report.summary()
    (event,) = events
    assert event.step == spike_at + 1  # the weights the spike produced explode the next gradients
    assert event.severity == "P0"
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    metrics = {m["step"]: m for m in map(json.loads, lines)}
    assert metrics[event.step]["loss_scale"] == 16.0 and not metrics[event.step]["skipped"]
    assert event.details["total_norm"] == pytest.approx(metrics[event.step]["grad_norm"])
    assert metrics[event.step]["grad_norm"] > 1000 and metrics[spike_at]["grad_norm"] < 10
    assert not g.report.by_code("AMP103")


def test_inf_in_backward_without_a_scaler_is_reported_at_that_step():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with amp_runtime.guard(policy="record") as g:
        for step in range(4):
            out = model(torch.randn(8, 4))
            if step == 2:
                out = out * torch.tensor(float("inf"))  # the weights' gradient becomes inf/NaN
            out.sum().backward()
            opt.step()
            opt.zero_grad()
    (event,) = g.report.by_code("AMP103")
    assert event.step == 2 and event.severity == "P0"


def test_healthy_fp16_scaled_run_has_no_gradient_or_scale_events(tmp_path):
    model = mlp(depth=3, width=32, activation=torch.nn.GELU)
    with amp_runtime.guard(policy="record", log_dir=tmp_path) as g:
        scaler = fp16_scaled_steps(model, steps=100, lr=0.01)
    assert g.step_index == 100
    assert not [e for e in g.report if "AMP103" <= e.code <= "AMP109"], g.report.summary()
    assert scaler.get_scale() >= 2.0 ** 16
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 100
    record = json.loads(lines[-1])
    assert set(record) == {"step", "loss", "loss_scale", "skipped", "grad_norm", "layers"}
    assert record["loss_scale"] == scaler.get_scale() and record["skipped"] is False
    layer_keys = {"max", "norm", "zero_fraction", "underflow_fraction"}
    assert set(record["layers"]["0.weight"]) == layer_keys


def test_gradient_accumulation_is_judged_once_per_step(tmp_path):
    model = mlp(depth=2, width=8, activation=torch.nn.Tanh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    micro_losses = []
    limits = amp_runtime.Thresholds(grad_explosion=1e-3, grad_explosion_p0=1e9)
    with amp_runtime.guard(policy="record", log_dir=tmp_path, thresholds=limits) as g:
        for step in range(3):
            for micro in range(4):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(torch.randn(16, 8)).float().pow(2).mean() / 4
                micro_losses.append(loss.item())
                scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert g.step_index == 3
    # every step's gradient crosses the (lowered) explosion limit: one event per step, not per
    # micro-batch
    # reported when it starts, not repeated while it lasts
    assert [e.step for e in g.report.by_code("AMP104")] == [0]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert metrics[0]["loss"] == pytest.approx(sum(micro_losses[:4]) / 4, rel=1e-3)


@pytest.mark.parametrize("precision", ["fp16 with a GradScaler", "bf16"])
@pytest.mark.parametrize("watched", ["every step", "step 0 only"])
def test_norm_is_that_of_the_gradients_applied_after_clipping(watched, precision):
    """AMP104 and the logged norm see the gradients the optimizer applies, whatever the precision
    and whichever step: a raw norm the loop's clipping contains is not an explosion. Step 0
    takes detailed statistics (at the unscale, with a scaler), the others only norms."""
    model = mlp(depth=2, width=16, activation=torch.nn.Tanh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    fp16 = precision.startswith("fp16")
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, enabled=fp16)
    raw, applied, recorded = [], [], []
    limits = Thresholds(grad_explosion=1e-2, grad_explosion_p0=1.0, watch_every=1) \
        if watched == "every step" else Thresholds(
            grad_explosion=1e-2, grad_explosion_p0=1.0, watch_steps=1, watch_every=1000)
    with amp_runtime.guard(policy="record", thresholds=limits) as g:
        g.step_listeners.append(lambda step, record: recorded.append(record["grad_norm"]))
        for _ in range(6):
            with torch.autocast("cpu", dtype=torch.float16 if fp16 else torch.bfloat16):
                loss = model(torch.randn(32, 16)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            raw.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3).item())
            applied.append(torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item())
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert min(raw) > 1e-2  # every raw norm above the (lowered) explosion limit, clipped
    assert recorded == pytest.approx(applied, rel=1e-4)
    assert max(recorded) < 1.01e-3
    assert not g.report.by_code("AMP104"), g.report.summary()


@pytest.mark.parametrize("eps, dtype, reported", [
    (1e-8, torch.float16, True),
    (1e-4, torch.float16, False),
    (1e-8, torch.float32, False),
])
def test_adam_epsilon_over_fp16_parameters_is_amp011(eps, dtype, reported):
    model = torch.nn.Linear(4, 2).to(dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=eps)
    with amp_runtime.guard(policy="record", select=["AMP011"]) as g:
        for _ in range(3):
            with torch.no_grad():
                for p in model.parameters():
                    p.grad = torch.ones_like(p)
            opt.step()
    events = g.report.by_code("AMP011")
    assert len(events) == (1 if reported else 0)
    if reported:
        assert events[0].op == "Adam.step" and "1e-08" in events[0].message


def test_unscaled_inf_gradients_the_optimizer_applies_directly_are_amp103():
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with amp_runtime.guard(policy="record") as g:
        loss = (model(torch.randn(8, 4)) * torch.tensor(float("inf"))).sum()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        opt.step()  # noqa: AMP006 - the scaler found inf, but nothing skips this step
    (event,) = g.report.by_code("AMP103")
    assert event.step == 0 and g.step_index == 1


def test_too_small_loss_scale_reports_the_underflowing_layer_by_name():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)  # far too little loss scaling
    with amp_runtime.guard(policy="record") as g:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(64, 256)).mean() * 1e-4
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    (event,) = g.report.by_code("AMP106")
    assert event.module == "0" and event.details["parameter"] == "0.weight"
    assert event.details["loss_scale"] == 8.0 and event.step == 0
    assert "nonzero gradients flush to zero in fp16 at loss scale 8" in event.message


def test_underflow_is_counted_only_for_the_gradients_asked_for():
    """Detailed steps that are not logged count fp16 underflow for weight matrices only."""
    torch.manual_seed(0)
    grads = [torch.randn(4, 4) * 1e-9, torch.randn(4) * 1e-9]
    scale = torch.tensor(2.0 ** 10)
    every = gradient_stats(grads, scale)
    matrices = gradient_stats(grads, scale, counted=[True, False])
    assert not every.isnan().any()
    assert torch.equal(every[:CLEAR], matrices[:CLEAR])
    assert torch.equal(every[CLEAR:, 0], matrices[CLEAR:, 0])
    assert matrices[CLEAR:, 1].isnan().all()


class TokenGPT(torch.nn.Module):
    """A small GPT: a token embedding whose vocabulary far exceeds the tokens of a batch (the rows
    of the others get exact-zero gradients), causal attention, an output head of its own."""

    def __init__(self, vocab=512, width=32, length=16):
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, width)
        self.positions = torch.nn.Embedding(length, width)
        self.attention = torch.nn.MultiheadAttention(width, 2, batch_first=True)
        self.norm = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.ReLU(),
                                       torch.nn.Linear(4 * width, width))
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.register_buffer("causal", torch.ones(length, length, dtype=torch.bool).triu(1))

    def forward(self, idx):
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1]))
        x = x + self.attention(x, x, x, attn_mask=self.causal, need_weights=False)[0]
        x = x + self.mlp(self.norm(x))
        return self.head(x)


def train_fp16_language_model(model, vocab, steps, length, after_backward, clip=False,
                              **guard_options):
    """Train ``model`` (token ids to logits) on random batches of 4 sequences in fp16 with a
    GradScaler under the guard; ``after_backward(scaler)`` runs after each backward (after the
    unscale where the loop clips). Returns the guard and the scaler."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    generator = torch.Generator().manual_seed(0)
    with amp_runtime.guard(policy="record", **guard_options) as g:
        for _ in range(steps):
            batch = torch.randint(vocab, (4, length + 1), generator=generator)
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab),
                                                     batch[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if clip:
                scaler.unscale_(opt)
            after_backward(scaler)
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
    return g, scaler


@pytest.mark.parametrize("logged", [False, True])
def test_healthy_gpt_with_a_sparse_token_embedding_has_no_underflow(logged, tmp_path):
    """The embedding rows of tokens absent from a batch have exact-zero gradients: sparsity, not
    underflow. 40 steps cross the detailed steps 0 and 32 (logged: every step is detailed)."""
    torch.manual_seed(0)
    model = TokenGPT()
    zero_rows = []
    g, scaler = train_fp16_language_model(  # 64 tokens of 512 a batch
        model, 512, 40, 16,
        lambda scaler: zero_rows.append(
            (model.tokens.weight.grad == 0).all(dim=1).float().mean().item()),
        log_dir=tmp_path if logged else None)
    assert g.step_index == 40 and scaler.get_scale() == 2.0 ** 16
    assert min(zero_rows) > 0.01  # the sparsity the old count took for underflow
    assert not g.report.by_code("AMP106"), g.report.summary()
    assert not g.report.by_code("AMP10"), g.report.summary()


@pytest.mark.parametrize("init_scale, reported", [(2.0 ** 16, False), (8.0, True)])
def test_dead_relu_units_are_sparsity_and_underflow_is_still_found(init_scale, reported):
    """Half the hidden units never fire: their rows of the first weight's gradient are exactly
    zero, and the live rows hold gradients small enough that a few percent sit in fp16's
    subnormal range near zero. At the default scale nothing flushes (no AMP106); at scale 8
    the same layer loses a large share of its gradient."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256))
    with torch.no_grad():
        model[0].bias[:128] = -100.0  # dead units
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    with amp_runtime.guard(policy="record", model=model) as g:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(64, 256)).float().mean() * 1e-4
        scaler.scale(loss).backward()
        zero_rows = (model[0].weight.grad == 0).all(dim=1).sum().item()
        scaler.step(opt)
        scaler.update()
    assert zero_rows >= 128
    events = g.report.by_code("AMP106")
    assert ("0.weight" in [e.details["parameter"] for e in events]) == reported


class TiedLM(torch.nn.Module):
    """A language model whose head is its token embedding, both left at PyTorch's N(0, 1)
    initialisation: logits spread by ~sqrt(width), a peaked softmax whose rarest tokens' gradients
    span many orders of magnitude below the others."""

    def __init__(self, vocab=8192, width=64):
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, width)
        self.mlp = torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, 4 * width),
                                       torch.nn.GELU(), torch.nn.Linear(4 * width, width))
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, idx):
        x = self.tokens(idx)
        return self.head(self.norm(x + self.mlp(x)))


def test_the_rarest_tokens_of_a_tied_embedding_flushing_are_not_underflow():
    """Several percent of the tied weight's nonzero gradients sit at fp16's smallest subnormal
    (the count alone would say underflow), but what flushes is ~1e-10 of the layer's gradient
    norm: the layer loses nothing."""
    torch.manual_seed(0)
    model = TiedLM()
    fractions = []

    def count(scaler):
        stats = gradient_stats([model.tokens.weight.grad], torch.tensor(scaler.get_scale()))
        fractions.append(underflow_fraction(stats[NONZERO, 0].item(), stats[CLEAR, 0].item()))

    g, _ = train_fp16_language_model(model, 8192, 2, 64, count, clip=True)
    assert fractions[0] > Thresholds().grad_underflow_fraction  # step 0 is a detailed step
    assert not g.report.by_code("AMP106"), g.report.summary()
