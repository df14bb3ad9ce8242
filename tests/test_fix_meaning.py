"""The fixes keep what the code means, checked with real torch on the CPU: the rewritten
deprecated calls build the same objects, the inserted ``unscale_`` makes the clip act on
true gradients, and the ``finfo`` fill works in fp16 where the literal raised."""

from __future__ import annotations

import inspect
import textwrap
import warnings

import pytest
import torch

from flake8_amp.fix import FIXABLE
from flake8_amp.fix.amp009 import OLD_AUTOCAST_PARAMETERS, OLD_SCALER_PARAMETERS
from flake8_amp.fix.driver import fix_file


def fixed(source: str, code: str) -> str:
    """``source`` after the real driver fixed ``code`` (at least one finding of it)."""
    result = fix_file(source.encode(), "case.py", frozenset({code}))
    assert result.applied and {f.code for f in result.applied} == {code}, result.left_alone
    return result.fixed.decode()


def run(source: str) -> dict:
    """Execute ``source``; its globals and the FutureWarnings (deprecations) it raised."""
    namespace: dict = {"__name__": "case"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(source, "case.py", "exec"), namespace)
    namespace["future_warnings"] = [w for w in caught if issubclass(w.category, FutureWarning)]
    return namespace


def parameters(function) -> list:
    return [name for name in inspect.signature(function).parameters if name != "self"]


def test_the_fixer_knows_torch_s_signatures():
    for old in (torch.cuda.amp.autocast, torch.cpu.amp.autocast):
        assert tuple(parameters(old.__init__)) == OLD_AUTOCAST_PARAMETERS
    assert parameters(torch.amp.autocast.__init__)[0] == "device_type"
    assert set(parameters(torch.cuda.amp.GradScaler.__init__)) == OLD_SCALER_PARAMETERS
    assert set(parameters(torch.cpu.amp.GradScaler.__init__)) == OLD_SCALER_PARAMETERS
    new_scaler = parameters(torch.amp.GradScaler.__init__)
    assert new_scaler[0] == "device"  # the old positional arguments follow it, in order
    assert new_scaler[1:] == parameters(torch.cuda.amp.GradScaler.__init__)
    for new in (torch.amp.custom_fwd, torch.amp.custom_bwd):
        device_type = inspect.signature(new).parameters["device_type"]
        assert device_type.kind is inspect.Parameter.KEYWORD_ONLY
    assert FIXABLE == ("AMP005", "AMP007", "AMP009")


DEPRECATED_CALLS = """\
import torch

objects = [
    torch.cpu.amp.autocast(),
    torch.cpu.amp.autocast(False),
    torch.cpu.amp.autocast(True, torch.float16),
    torch.cpu.amp.autocast(True, torch.bfloat16, False),
    torch.cpu.amp.autocast(dtype=torch.float16, cache_enabled=False),
    torch.cuda.amp.autocast(True, torch.bfloat16, False),
    torch.cuda.amp.GradScaler(),
    torch.cuda.amp.GradScaler(1024.0, 3.0, 0.25, 10, False),
    torch.cpu.amp.GradScaler(512.0, growth_interval=7),
    torch.cpu.amp.GradScaler(256.0, 4.0, 0.125, 3),
]


class Double(torch.autograd.Function):
    @staticmethod
    @torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)
    def forward(ctx, x):
        return x * 2

    @staticmethod
    @torch.cuda.amp.custom_bwd
    def backward(ctx, grad):
        return grad * 2


x = torch.ones(3, requires_grad=True)
Double.apply(x).sum().backward()
gradient = x.grad
"""


def describe(obj) -> tuple:
    if isinstance(obj, torch.amp.GradScaler):
        fields = ("_device", "_init_scale", "_growth_factor", "_backoff_factor",
                  "_growth_interval", "_enabled")
    else:
        fields = ("device", "fast_dtype", "_enabled", "_cache_enabled")
    return tuple(getattr(obj, name, None) for name in fields)  # a disabled scaler has fewer


def test_rewritten_deprecated_calls_build_the_same_objects():
    new_source = fixed(DEPRECATED_CALLS, "AMP009")
    assert "torch.cuda.amp" not in new_source and "torch.cpu.amp" not in new_source
    old, new = run(DEPRECATED_CALLS), run(new_source)
    assert [describe(o) for o in new["objects"]] == [describe(o) for o in old["objects"]]
    assert torch.equal(new["gradient"], old["gradient"])
    assert old["future_warnings"] and not new["future_warnings"]


CLIPPED_STEP = """\
import torch


def train_step(model, x, y, optimizer, scaler):
    loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    scaler.step(optimizer)
    scaler.update()
"""


def one_step(train_step) -> list:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    train_step(model, x, y, optimizer, scaler)
    return [p.detach().clone() for p in model.parameters()]


def reference_step(model, x, y, optimizer, scaler):
    """The documented order: unscale_, then clip, then step."""
    loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    scaler.step(optimizer)
    scaler.update()


def test_the_inserted_unscale_makes_the_clip_see_true_gradients():
    new_source = fixed(CLIPPED_STEP, "AMP005")
    reference = one_step(reference_step)
    after = one_step(run(new_source)["train_step"])
    before = one_step(run(CLIPPED_STEP)["train_step"])
    assert all(torch.equal(a, r) for a, r in zip(after, reference))
    assert not all(torch.equal(b, r) for b, r in zip(before, reference))


MASKED_SOFTMAX = """\
import torch
from torch import nn


class Head(nn.Module):
    def forward(self, scores, mask):
        return scores.masked_fill(mask, -1e9).softmax(-1)
"""


def test_the_finfo_fill_works_in_fp16_where_the_literal_raised():
    new_source = fixed(MASKED_SOFTMAX, "AMP007")
    assert "torch.finfo(scores.dtype).min" in new_source
    scores = torch.randn(3, 4)
    mask = torch.tensor([[False, True, False, True]] * 2 + [[True] * 4])  # last row all masked
    old_head, new_head = run(MASKED_SOFTMAX)["Head"](), run(new_source)["Head"]()
    with pytest.raises(RuntimeError, match="overflow"):
        old_head(scores.half(), mask)
    probabilities = new_head(scores.half(), mask)
    assert torch.isfinite(probabilities).all()
    assert torch.equal(new_head(scores, mask)[:2], old_head(scores, mask)[:2])
    assert textwrap.dedent(MASKED_SOFTMAX).count("-1e9") == 1 and "-1e9" not in new_source
