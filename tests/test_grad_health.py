"""Gradient health (AMP103-AMP106): fused statistics, their judgement, and guarded training runs."""
import math

import pytest
import torch

from amp_runtime.monitors.grads import (
    FP16_FLUSH_LIMIT, GradSample, gradient_stats, judge_gradients, layer_of, read_samples,
)
from amp_runtime.thresholds import Thresholds


def reference_row(grads, scale):
    """Per-tensor statistics computed one tensor at a time, the slow obvious way."""
    rows = []
    for g in grads:
        g = g.float()
        survives = ((g * scale).half() != 0).sum().item() if scale is not None else math.nan
        rows.append((g.abs().max().item(), g.norm().item(), (g != 0).sum().item(), survives))
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
        assert got[0] == pytest.approx(expected[0], rel=1e-6)
        assert got[1] == pytest.approx(expected[1], rel=1e-5)
        assert got[2] == expected[2]
        if scale is None:
            assert math.isnan(got[3])
        else:
            assert got[3] == expected[3]


def test_flush_limit_is_where_float16_rounds_to_zero():
    below = torch.tensor(FP16_FLUSH_LIMIT * 0.999)
    above = torch.tensor(FP16_FLUSH_LIMIT * 1.001)
    assert below.half().item() == 0.0 and above.half().item() > 0.0


def test_nonfinite_gradients_propagate_into_max():
    stats = gradient_stats([torch.tensor([1.0, math.nan]), torch.tensor([math.inf, 0.0]), torch.ones(3)])
    assert math.isnan(stats[0, 0]) and math.isinf(stats[0, 1]) and stats[0, 2] == 1.0


def sample(named_grads, scale=None, scaled=False):
    """A GradSample as the monitor takes it; ``scaled``: the gradients are still multiplied by ``scale``."""
    grads = list(named_grads.values())
    scale_tensor = None if scale is None else torch.tensor(scale)
    flush_factor = torch.tensor(1.0) if scaled else scale_tensor
    return GradSample(
        names=list(named_grads),
        numels=[g.numel() for g in grads],
        stats=gradient_stats(grads, flush_factor),
        scaled_by=scale_tensor if scaled else None,
        loss_scale=scale_tensor,
    )


def test_read_divides_still_scaled_gradients_by_the_scale():
    grads = {"fc.weight": torch.full((4,), 3.0 * 1024)}
    (layer,), scale = read_samples([sample(grads, scale=1024.0, scaled=True)])
    assert layer.max == pytest.approx(3.0) and layer.norm == pytest.approx(6.0) and scale == 1024.0


def test_judge_explosion_severity_by_unscaled_total_norm():
    limits = Thresholds()
    for total, severity in ((50.0, None), (150.0, "P1"), (5000.0, "P0")):
        layers, _ = read_samples([sample({"a.weight": torch.tensor([total * 0.6]), "b.weight": torch.tensor([total * 0.8])})])
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


def test_judge_underflow_counts_only_nonzero_values_that_would_flush():
    tiny = torch.full((90,), 1e-13)  # times 1024 is ~1e-10: flushes in fp16
    healthy = torch.full((900,), 1e-2)
    grads = {"a.weight": torch.cat([tiny, healthy]), "b.weight": torch.cat([torch.zeros(500), healthy])}
    layers, scale = read_samples([sample(grads, scale=1024.0)])
    found = [kw for code, kw in judge_gradients(layers, scale, Thresholds()) if code == "AMP106"]
    assert [kw["layer"] for kw in found] == ["a.weight"]
    assert found[0]["fraction"] == pytest.approx(90 / 990) and found[0]["scale"] == 1024.0
    assert layers[1].zero_fraction == pytest.approx(500 / 1400) and layers[1].underflow_fraction == 0.0


def test_judge_nonfinite_grad_hides_norm_findings():
    layers, _ = read_samples([sample({"enc.weight": torch.tensor([math.inf, 1.0]), "dec.weight": torch.ones(2)})])
    findings = judge_gradients(layers, None, Thresholds())
    assert [code for code, _ in findings] == ["AMP103"]
    assert findings[0][1]["module"] == "enc"


def test_layer_of():
    assert layer_of("blocks.0.fc.weight") == "blocks.0.fc" and layer_of("scale") == "scale"
