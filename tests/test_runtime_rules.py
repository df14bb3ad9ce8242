"""Runtime halves of the code-pattern rules: each has a triggering case and a quiet twin."""
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime


def events(body, code, **guard_options):
    """Run ``body`` under a recording guard; the events of ``code``."""
    with amp_runtime.guard(policy="record", select=[code], **guard_options) as g:
        body()
    return g.report.by_code(code)


def fp16_logits():
    model = nn.Linear(4, 3)
    x = torch.randn(8, 4)
    with torch.autocast("cpu", dtype=torch.float16):
        return model(x)


# -- AMP001 manual-cast ------------------------------------------------------------------

def test_amp001_module_cast_in_training_is_one_event_per_module():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

    def cast():
        model.half()

    (event,) = events(cast, "AMP001")
    assert event.message.startswith("module Sequential cast to float16")
    assert event.op == "half"
    assert event.source.endswith(f"test_runtime_rules.py:{cast.__code__.co_firstlineno + 1}")


def test_amp001_names_a_cast_submodule_by_its_path_in_a_model_seen_running():
    """Without model=: named inside the root module the guard saw running (no heap search)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), nn.Linear(4, 2)))

    def body():
        model(torch.randn(2, 4))
        model[1][1].half()

    (event,) = events(body, "AMP001")
    assert event.module == "1.1"
    assert event.message.startswith("module 1.1 cast to float16")


def test_amp001_names_a_submodule_of_a_model_never_seen_running_from_the_callers_variables():
    """``model.encoder.half()`` before the first forward, without model=: the model is in a
    variable of the code making the call (no heap search), and it becomes a root."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), nn.Linear(4, 2)))

    def setup():
        head = model[1]
        head[1].half()

    with amp_runtime.guard(policy="record", select=["AMP001"]) as g:
        setup()
        model[0].half()
    assert [event.module for event in g.report.by_code("AMP001")] == ["1.1", "0"]


def test_amp001_names_a_submodule_of_a_model_never_seen_by_its_class():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), nn.Linear(4, 2)))

    def cast(layer):
        layer.half()

    (event,) = events(lambda: cast(model[1][1]), "AMP001")
    assert event.module == "Linear"


def test_amp001_grad_requiring_tensor_cast():
    weight = torch.randn(3, requires_grad=True)
    (event,) = events(lambda: weight.to(torch.bfloat16), "AMP001")
    assert event.message.startswith("a grad-requiring tensor cast to bfloat16")


def test_amp001_quiet_for_eval_models_data_no_grad_and_device_moves():
    model = nn.Linear(4, 4)

    def body():
        model.float()  # not low precision
        model.to("cpu")
        torch.randn(3).half()  # data, no grad
        with torch.no_grad():
            torch.randn(3, requires_grad=True).half()
        with torch.inference_mode():
            nn.Linear(2, 2).half()
        model.eval().half()  # inference copy
        model.float().half().float()  # still in eval mode

    assert events(body, "AMP001") == []


# -- AMP002 loss-outside-autocast --------------------------------------------------------

def test_amp002_loss_after_the_autocast_block():
    logits = fp16_logits()
    target = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    (event,) = events(lambda: F.cross_entropy(logits, target), "AMP002")
    assert event.message == (
        "loss cross_entropy computed outside the autocast region that produced its float16 input"
        " (compute the loss inside the autocast block, or upcast its inputs with .float())"
    )


def test_amp002_quiet_inside_autocast_or_after_upcast():
    model = nn.Linear(4, 3)
    x, target = torch.randn(8, 4), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])

    def body():
        with torch.autocast("cpu", dtype=torch.float16):
            F.cross_entropy(model(x), target)
        F.cross_entropy(fp16_logits().float(), target)
        with torch.no_grad():
            F.cross_entropy(fp16_logits(), target)  # evaluation

    assert events(body, "AMP002") == []


def test_half_model_trained_without_autocast_is_amp001_not_amp002():
    """Its fp16 outputs come from a cast model, not from an autocast region."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    target = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    with amp_runtime.guard(policy="record", select=["AMP001", "AMP002"]) as g:
        model.half()
        for _ in range(2):
            loss = F.cross_entropy(model(torch.randn(8, 4).half()), target)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    assert [e.code for e in g.report] == ["AMP001"]


# -- AMP003 bce-under-autocast -----------------------------------------------------------

def test_amp003_bce_under_autocast_even_where_it_runs():
    probabilities, target = torch.rand(4), torch.rand(4)

    def body():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            nn.BCELoss()(probabilities, target)  # noqa: AMP003 (deliberate)

    (event,) = events(body, "AMP003")
    assert event.severity == "P0" and event.module == "BCELoss"


def test_amp003_quiet_for_logits_version_and_outside_autocast():
    logits, target = torch.randn(4), torch.rand(4)

    def body():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            F.binary_cross_entropy_with_logits(logits, target)
        F.binary_cross_entropy(torch.sigmoid(logits), target)

    assert events(body, "AMP003") == []


# -- AMP004 low-precision-reduce ---------------------------------------------------------

def test_amp004_reduction_that_stays_in_fp16():
    x = torch.randn(64, dtype=torch.float16)
    found = events(lambda: (x.sum(), torch.mean(x), x.prod()), "AMP004")
    assert [e.op for e in found] == ["sum", "mean", "prod"]


def test_amp004_judged_by_output_dtype_so_autocast_upcasts_are_respected():
    x = torch.randn(64, dtype=torch.float16)

    def body():
        with torch.autocast("cpu", dtype=torch.float16):
            x.prod()  # CPU autocast runs prod in fp32 (CUDA does the same for sum)
        x.sum(dtype=torch.float32)
        x.float().mean()
        torch.randn(4).sum()
        x[:1].sum()  # a single element

    assert events(body, "AMP004") == []


# -- AMP007 fp16-overflow-literal --------------------------------------------------------

def test_amp007_masked_fill_beyond_fp16_range():
    scores = torch.randn(2, 4, dtype=torch.float16)
    mask = scores > 0

    def body():
        with pytest.raises(RuntimeError, match="overflow"):  # CPU refuses; CUDA writes -inf
            scores.masked_fill(mask, -1e9)  # noqa: AMP007 (deliberate)
        torch.where(mask, scores, -1e5)  # noqa: AMP007 (deliberate)
        torch.where(mask, scores, torch.tensor(-1e5))  # noqa: AMP007 (read deferred)

    found = events(body, "AMP007")
    assert [(e.op, e.details["value"]) for e in found] == [
        ("masked_fill", -1e9), ("where", -1e5), ("where", -1e5)]
    assert found[0].message.startswith("-1e+09 is outside the fp16 range (+-65504) in masked_fill")
    (file1, _, line1), (file2, _, line2) = (e.source.rpartition(":") for e in found[1:])
    assert file1 == file2 == os.path.relpath(__file__) and int(line2) == int(line1) + 1


def test_amp007_quiet_for_safe_values():
    scores = torch.randn(2, 4, dtype=torch.float16)
    mask = scores > 0

    def body():
        scores.masked_fill(mask, torch.finfo(scores.dtype).min)
        scores.masked_fill(mask, float("-inf"))
        scores.masked_fill(mask, -1e4)
        scores.float().masked_fill(mask, -1e9)
        torch.full((2,), -1e9)
        torch.full((2,), -1e4, dtype=torch.float16)

    assert events(body, "AMP007") == []


# -- AMP008 backward-under-autocast ------------------------------------------------------

def test_amp008_backward_inside_the_autocast_block():
    model = nn.Linear(4, 1)

    def body():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(2, 4)).float().mean()
            loss.backward()  # noqa: AMP008 (deliberate)

    (event,) = events(body, "AMP008")
    assert event.op == "backward"


def test_amp008_quiet_after_the_block():
    model = nn.Linear(4, 1)

    def body():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(2, 4)).float().mean()
        loss.backward()
        with torch.autocast("cpu", enabled=False):
            model(torch.randn(2, 4)).mean().backward()

    assert events(body, "AMP008") == []


# -- AMP011 tiny-epsilon -----------------------------------------------------------------

def test_amp011_epsilon_that_flushes_to_zero_in_fp16():
    denominator = torch.zeros(3, dtype=torch.float16)
    with amp_runtime.guard(policy="record", select=["AMP011"]) as g:
        ratio = torch.ones(3, dtype=torch.float16) / (denominator + 1e-8)  # noqa: AMP011
        denominator.clamp(min=1e-9)  # noqa: AMP011 (deliberate)
    assert torch.isinf(ratio).all()  # the epsilon did nothing
    assert [e.op for e in g.report] == ["add", "clamp"]
    assert g.report.events[0].message.startswith("epsilon 1e-08 flushes to zero in fp16")


def test_amp011_quiet_for_representable_epsilons_and_wider_dtypes():
    def body():
        torch.zeros(3, dtype=torch.float16) + 1e-7
        torch.zeros(3, dtype=torch.bfloat16) + 1e-8
        torch.zeros(3) + 1e-12
        torch.zeros(3, dtype=torch.float16) + 0.0

    assert events(body, "AMP011") == []
