"""amp_runtime.compare on real CPU models: errors measured, culprits named, state kept."""
import json

import pytest
import torch
from torch import nn

from amp_runtime.compare import compare


class Scaled(nn.Module):
    """Multiplies by a large constant: fine in float32, overflows in float16."""

    def forward(self, x):
        return (x * 3000.0) @ (x * 3000.0).transpose(-1, -2)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, 16)
        self.scaled = Scaled()
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x, *, bias=0.0):
        h = self.scaled(self.embed(x))
        return self.head(self.drop(self.norm(h))) + bias


@pytest.fixture
def net_and_input():
    torch.manual_seed(0)
    return Net(), torch.randn(2, 8, 16)


def _params(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_fp16_overflowing_module_is_named_and_the_snippet_fixes_it(net_and_input):
    model, x = net_and_input
    result = compare(model, x, dtype=torch.float16)
    assert result.keep_fp32 == ["scaled"]
    assert result.module("scaled").own.nonfinite
    # the advice is checked: with "scaled" in float32 the output is finite and close
    assert result.output().nonfinite
    assert not result.kept_output.nonfinite and result.kept_output.rel_l2 < result.tolerance
    assert "With these in float32 the model output rel-L2 is" in str(result)
    assert result.modules[0].name == "scaled"  # ranked first
    assert "NaN/Inf" in str(result) and "keep_fp32" in result.snippet()

    with torch.autocast("cpu", dtype=torch.float16):
        assert not torch.isfinite(model(x)).all()
    exec(result.snippet(), {"model": model})
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.isfinite(model(x)).all()
    assert compare(model, x, dtype=torch.float16).keep_fp32 == []


def test_healthy_model_in_bf16_needs_nothing_and_metrics_are_sane():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))
    result = compare(model, torch.randn(16, 32))
    assert result.keep_fp32 == [] and result.snippet() == ""
    assert "stays within tolerance in bfloat16" in str(result)
    assert {m.name for m in result.modules} == {"(model)", "0", "1", "2"}
    first = result.module("0")
    # bf16 rounding: errors are small but real, and a Linear's own error is its output error
    assert 0 < first.output.rel_l2 < result.tolerance
    assert first.own.rel_l2 == pytest.approx(first.output.rel_l2)
    assert first.output.cosine > 0.999
    assert 0 < first.output.mismatch_fraction <= 1
    assert first.output.max_abs > 0 and first.output.numel == 16 * 32
    # ReLU adds no error of its own: what it shows is its input stored in bf16
    assert 0 < result.module("1").own.rel_l2 <= first.output.rel_l2
    assert result.output() == result.module("(model)").output
    assert result.kept_output is None  # nothing to keep, nothing re-checked


def test_model_state_and_rng_are_restored():
    model = nn.Sequential(nn.BatchNorm1d(16), nn.Linear(16, 8), nn.Dropout(0.5), nn.LayerNorm(8))
    model.train()
    model[3].eval()
    before = _params(model)
    x = torch.randn(4, 16) * 5 + 3
    rng = torch.get_rng_state()
    compare(model, x, train=True)  # BN would update its running stats
    assert torch.equal(torch.get_rng_state(), rng)
    after = _params(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert model.training and model[0].training and not model[3].training
    assert all("forward" not in vars(m) for m in model.modules())  # no patch left behind


def test_deterministic_and_json_serialisable(net_and_input):
    model, x = net_and_input
    first = compare(model, x, dtype=torch.float16, train=True)  # dropout active
    second = compare(model, x, dtype=torch.float16, train=True)
    assert first.to_json() == second.to_json()
    data = json.loads(json.dumps(first.to_json(), allow_nan=True))
    assert data["dtype"] == "float16" and data["device_type"] == "cpu"
    assert data["keep_fp32"] == ["scaled"]


def test_keyword_and_positional_inputs(net_and_input):
    model, x = net_and_input
    assert compare(model, {"x": x, "bias": 1.0}).module("head").output.numel == 2 * 8 * 4
    assert compare(model, (x,)).module("head").output.numel == 2 * 8 * 4


def test_shared_modules_dict_outputs_and_integer_inputs():
    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(50, 16)
            self.shared = nn.Linear(16, 16)

        def forward(self, ids):
            return {"logits": self.shared(self.shared(self.embed(ids))), "length": ids.shape[1]}

    torch.manual_seed(0)
    result = compare(Tagger(), {"ids": torch.randint(0, 50, (2, 5))})
    assert result.module("shared").calls == 2
    assert result.module("shared").output.numel == 2 * 2 * 5 * 16  # both calls compared
    assert result.module("embed").output.rel_l2 == 0  # a table lookup loses nothing
    assert result.output().numel == 2 * 5 * 16  # only the float entry of the dict
    nothing = compare(nn.Identity(), torch.arange(3))
    assert nothing.modules == [] and "nothing to compare" in str(nothing)


def test_bad_arguments_are_clear(net_and_input):
    model, x = net_and_input
    with pytest.raises(ValueError, match="dtype must be torch.float16 or torch.bfloat16"):
        compare(model, x, dtype=torch.float32)
    with pytest.raises(ValueError, match="tolerance must be a positive"):
        compare(model, x, tolerance=0)
    with pytest.raises(TypeError, match="needs an nn.Module"):
        compare(lambda t: t, x)


def test_a_model_that_fails_in_float32_or_on_another_device_is_named_as_such():
    with pytest.raises(RuntimeError, match="the model fails in float32 on these inputs: mat1"):
        compare(nn.Linear(4, 2), torch.randn(3, 5))
    with pytest.raises(ValueError, match="device_type 'cuda' does not match .* on 'cpu'"):
        compare(nn.Linear(4, 2), torch.randn(3, 4), device_type="cuda")
