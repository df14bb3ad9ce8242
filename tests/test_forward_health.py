"""Forward-side numeric health: AMP101, AMP102, AMP110, AMP111, AMP112, on real CPU training."""
import inspect
import math
import os
import traceback

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime
from amp_runtime import GuardError, Thresholds


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x):
        hidden = F.gelu(self.fc1(self.norm(x)))
        return x + self.fc2(hidden)  # fc2 call


class ResidualMLP(nn.Module):
    def __init__(self, width=16, depth=4):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


FC2_CALL = "        return x + self.fc2(hidden)  # fc2 call"
FC2_LINE = inspect.getsourcelines(Block.forward)[1] + (
    inspect.getsource(Block.forward).splitlines().index(FC2_CALL)
)
THIS_FILE = os.path.relpath(__file__)


def run_training(steps, guard, *, dtype=torch.float16, overflow_steps=(), width=16):
    """CPU autocast training of ResidualMLP; in ``overflow_steps`` blocks[2].fc2's weight is
    scaled up so that its output overflows fp16. Returns the guard's step index at the
    start of each iteration; steps end by the guard's own detection, else by guard.step()."""
    torch.manual_seed(0)
    model = ResidualMLP(width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    generator = torch.Generator().manual_seed(0)
    weight = model.blocks[2].fc2.weight
    step_at_start = []
    for step in range(steps):
        step_at_start.append(guard.step_index)
        x = torch.randn(8, width, generator=generator)
        target = x.sum(dim=1, keepdim=True).tanh()
        if step in overflow_steps:
            saved = weight.detach().clone()
            with torch.no_grad():
                weight.mul_(1e6)
        with torch.autocast("cpu", dtype=dtype):
            prediction = model(x)
            loss = F.mse_loss(prediction.float(), target)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if step in overflow_steps:
            with torch.no_grad():
                weight.copy_(saved)
        if guard.step_index == step_at_start[-1]:
            guard.step()
    assert step_at_start == list(range(steps))
    return step_at_start


def test_trace_always_names_the_first_overflowing_op_module_line_and_step():
    with amp_runtime.guard(policy="record", trace="always") as g:
        run_training(6, g, overflow_steps={3})
    (event,) = g.report.by_code("AMP101")
    assert event.module == "blocks.2.fc2"
    assert event.op == "linear"
    assert event.source == f"{THIS_FILE}:{FC2_LINE}"
    assert event.step == 3 and event.severity == "P0"
    assert event.details["dtype"] == "float16"
    assert event.details["input_dtypes"] == ["float16", "float32", "float32"]
    assert math.isfinite(event.details["input_max"])
    assert not math.isfinite(event.details["output_max"])
    assert "blocks.2.fc2" in str(event)
    assert "linear produced NaN from finite inputs" in event.message


def test_trace_auto_replays_the_failing_step_then_traces_the_next_occurrence():
    with amp_runtime.guard(policy="record", trace="auto") as g:
        assert not g.tracing
        run_training(6, g, overflow_steps={3, 4})
    losses = g.report.by_code("AMP112")
    assert losses and losses[0].step == 3 and losses[0].severity == "P0"
    replayed, traced = g.report.by_code("AMP101")
    assert (replayed.step, replayed.details.get("replayed")) == (3, True)  # replay.py
    assert traced.step == 4 and "replayed" not in traced.details
    for event in (replayed, traced):
        assert event.module == "blocks.2.fc2" and event.op == "linear"
        assert event.source == f"{THIS_FILE}:{FC2_LINE}"
    assert g.tracing  # still within the quiet period


def test_trace_off_reports_the_loss_only():
    with amp_runtime.guard(policy="record", trace="off") as g:
        run_training(5, g, overflow_steps={3, 4})
    assert {e.code for e in g.report} == {"AMP112"}


def test_policy_raise_stops_the_faulty_step_naming_the_op():
    """Per-op peaks are judged together at the step's commit point (no host sync per op): here
    the scaler's update, since the scaler skips the step. GuardError stops the run there, and
    the event names the op's module and line as they were when it ran."""
    with pytest.raises(GuardError) as caught:
        with amp_runtime.guard(policy="raise", trace="always") as g:
            run_training(5, g, overflow_steps={2})
    event = caught.value.event
    assert (event.code, event.module, event.step) == ("AMP101", "blocks.2.fc2", 2)
    assert event.source == f"{THIS_FILE}:{FC2_LINE}"
    frames = traceback.extract_tb(caught.value.__traceback__)
    assert [f.line for f in frames if f.filename == __file__][-1] == "scaler.update()"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_healthy_run_of_100_steps_has_no_health_event(dtype):
    with amp_runtime.guard(policy="record", trace="always", select=["AMP1"]) as g:
        run_training(100, g, dtype=dtype, width=8)
    assert g.report.events == []


def test_near_overflow_is_reported_for_fp16_only():
    x = torch.full((4,), 250.0, dtype=torch.float16)
    square = float((x * x).max())  # 62500 rounded to fp16
    with amp_runtime.guard(policy="record", trace="always") as g:
        x * x
        x.to(torch.bfloat16) * x.to(torch.bfloat16)
        x * 2
    (event,) = g.report.by_code("AMP102")
    assert event.op == "mul" and event.details["output_max"] == square > 60000
    assert not g.report.by_code("AMP101")


def test_propagating_ops_are_not_new_first_causes():
    x = torch.tensor([300.0, 1.0], dtype=torch.float16)
    with amp_runtime.guard(policy="record", trace="always") as g:
        y = x * x * x  # overflows in the second multiply
        z = (y - y).exp()  # inf - inf = NaN, then propagates
    assert torch.isnan(z).any()
    (event,) = g.report.by_code("AMP101")
    assert event.op == "mul" and event.details["input_max"] == 300.0


def test_in_place_overflow_is_a_first_cause():
    x = torch.tensor([60000.0, 1.0], dtype=torch.float16)
    with amp_runtime.guard(policy="record", trace="always") as g:
        x.mul_(2)
    (event,) = g.report.by_code("AMP101")
    assert event.op == "mul_" and event.message.startswith("mul_ produced inf")


def test_nonfinite_loss_at_backward():
    weight = torch.ones(3, requires_grad=True)
    with amp_runtime.guard(policy="record", trace="off") as g:
        loss = (weight * float("nan")).sum()
        loss.backward()
        torch.autograd.backward((weight * 2).sum())
    (event,) = g.report.by_code("AMP112")
    assert event.message.startswith("loss is NaN") and event.op == "backward"


def test_a_near_overflow_from_a_large_weight_of_small_values_is_reported():
    # a weight's L2 norm (64000) is past the near-overflow limit though none of its values
    # (16000) is: the op, not its input, brought the output near 65504
    layer = nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        layer.weight.fill_(16000.0)
    x = torch.full((2, 4), 62000.0 / (4 * 16000.0))
    with amp_runtime.guard(policy="record", trace="always") as g:
        with torch.autocast("cpu", dtype=torch.float16):
            layer(x)
    (event,) = g.report.by_code("AMP102")
    assert event.op == "linear" and 60000 < event.details["output_max"] < 65504


def test_absorption_in_a_low_precision_accumulator():
    limits = Thresholds(sample_every=1)
    total = torch.full((8,), 4096.0, dtype=torch.float16)
    small = torch.full((8,), 0.5, dtype=torch.float16)
    with amp_runtime.guard(policy="record", thresholds=limits) as g:
        total += small  # lost entirely: half an ulp of 4096 in fp16 is 2
        kept = total + torch.full((8,), 4.0, dtype=torch.float16)  # changes the sum
        total.float() + small.float()  # fp32: out of scope
    assert torch.equal(total, torch.full((8,), 4096.0, dtype=torch.float16))
    assert not torch.equal(kept, total)
    (event,) = g.report.by_code("AMP110")
    assert event.op == "add_" and event.details["ratio"] == 8192.0


def test_an_operand_already_infinite_is_not_absorption_nor_an_imbalanced_reduction():
    limits = Thresholds(sample_every=1)
    total = torch.full((8,), float("inf"), dtype=torch.float16)
    small = torch.full((8,), 0.5, dtype=torch.float16)
    with amp_runtime.guard(policy="record", thresholds=limits, ignore=["AMP004"]) as g:
        total + small  # inf stays inf: an overflow upstream (AMP101's), nothing absorbed here
        torch.cat([total, small]).sum()
    assert not g.report.by_code("AMP110") and not g.report.by_code("AMP111")


def test_absorption_is_sampled():
    limits = Thresholds(sample_every=4)
    total = torch.full((8,), 4096.0, dtype=torch.float16)
    small = torch.full((8,), 0.5, dtype=torch.float16)
    with amp_runtime.guard(policy="record", thresholds=limits) as g:
        for _ in range(8):
            total + small
    assert len(g.report.by_code("AMP110")) == 2


def test_imbalanced_low_precision_reduction():
    limits = Thresholds(sample_every=1)
    values = torch.full((1000,), 0.01, dtype=torch.bfloat16)
    values[0] = 1000.0
    balanced = torch.rand(1000, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with amp_runtime.guard(policy="record", thresholds=limits, ignore=["AMP004"]) as g:
        values.sum()
        balanced.sum()
        values.float().sum()  # reduced in fp32: fine
    (event,) = g.report.by_code("AMP111")
    assert event.op == "sum" and event.details["ratio"] > 1e4


def test_no_grad_inference_mode_custom_function_and_shared_weights():
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    shared = nn.Linear(4, 4)
    x = torch.randn(3, 4)
    with amp_runtime.guard(policy="record", trace="always") as g:
        with torch.no_grad():
            shared(shared(x))
        with torch.inference_mode():
            shared(x).sum()
        out = Double.apply(shared(shared(x).requires_grad_()))
        out.sum().backward()
        torch.arange(10).sum()
        (torch.arange(10) > 3).any()
        with torch.no_grad():
            shared.half()(torch.ones(3, 4, dtype=torch.float16))
    assert [e.code for e in g.report if e.code.startswith("AMP1")] == []


def test_deliberate_infinite_masks_are_not_first_causes():
    scores = torch.randn(4, 4, dtype=torch.float16)
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    with amp_runtime.guard(policy="record", trace="always") as g:
        masked = scores.masked_fill(~causal, float("-inf"))
        weights = torch.softmax(masked, dim=-1)
    assert torch.isfinite(weights).all()
    assert g.report.events == []


def test_masks_at_fp16s_most_negative_value_are_not_near_overflow():
    """torch.finfo(dtype).min is AMP007's fix; the op that first makes a large value is reported."""
    q = torch.randn(2, 8, 8)
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    lowest = torch.finfo(torch.float16).min
    big = torch.full((4,), 250.0, dtype=torch.float16)
    with amp_runtime.guard(policy="record", trace="always") as g:
        with torch.autocast("cpu", dtype=torch.float16):
            scores = q @ q.transpose(-1, -2)
            torch.softmax(scores.masked_fill(~causal, lowest), dim=-1)
            additive = torch.where(causal, 0.0, lowest).to(torch.float16)
            torch.softmax(scores + additive, dim=-1)
        big * big
    assert [(e.code, e.op) for e in g.report.by_code("AMP1")] == [("AMP102", "mul")]


def test_module_paths_without_a_model_follow_the_running_modules():
    shared = nn.Linear(4, 4)
    model = nn.Sequential(nn.Sequential(shared, nn.ReLU()), shared)
    x = torch.full((1, 4), 300.0, dtype=torch.float16)
    with torch.no_grad():
        shared.weight.fill_(300.0)
    with amp_runtime.guard(policy="record", trace="always", select=["AMP101"]) as g:
        with torch.autocast("cpu", dtype=torch.float16):
            model(x)  # the first call of ``shared`` overflows: 4 * 300 * 300 > 65504
    (event,) = g.report
    assert event.module == "0.0" and event.op == "linear"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("special", [math.nan, math.inf, -math.inf, None])
def test_peak_is_max_abs_and_propagates_nan_and_inf(dtype, special):
    from amp_runtime.monitors import peak

    values = torch.linspace(-7.0, 3.0, 5000).to(dtype)
    if special is not None:
        values[1234] = special
    expected = 7.0 if special is None else abs(special)
    got = peak(values).item()
    assert got == expected or (math.isnan(expected) and math.isnan(got))
    assert peak(torch.tensor(-2.5, dtype=dtype)).item() == 2.5


def test_ops_that_hand_back_their_input_are_not_first_causes():
    """A batch that arrives holding inf, through ops that return their input unchanged
    (``.float()`` of a float tensor, ``contiguous()``, dropout with p=0) and a layer: no op made
    inf of finite values, so none is AMP101; the non-finite loss is still AMP112. An op that
    writes its input (``mul_``, ``out=``) stays a possible first cause."""
    layer = nn.Linear(8, 8)
    batch = torch.randn(4, 8)
    batch[0, 0] = float("inf")
    with amp_runtime.guard(policy="record", trace="always") as g:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = F.dropout(batch.float().contiguous(), p=0.0, training=True)
            loss = layer(h).float().sum()
        loss.backward()
        finite = torch.full((2,), 300.0, dtype=torch.float16)
        torch.mul(finite, 300.0, out=finite)  # the first cause: written in place
    (event,) = g.report.by_code("AMP101")
    assert event.op == "mul" and event.message.startswith("mul produced inf")
    assert g.report.by_code("AMP112")


def test_inputs_that_were_already_non_finite_are_not_first_causes():
    """An additive -inf mask made before the guard (a buffer), a parameter already holding NaN,
    and a traced tensor set to inf in place since it was produced: the ops reading them
    propagate what they were given. Only the op that makes inf of finite values is reported."""
    mask = torch.zeros(4, 4, dtype=torch.float16).masked_fill(
        ~torch.ones(4, 4, dtype=torch.bool).tril(), float("-inf"))
    broken = nn.Linear(4, 4).half()
    with torch.no_grad():
        broken.weight[0, 0] = float("nan")
    scores = torch.randn(4, 4, dtype=torch.float16)
    with amp_runtime.guard(policy="record", trace="always", select=["AMP101"]) as g:
        masked = scores + mask  # -inf from the mask, as asked
        broken(scores)  # NaN from the weight
        doubled = scores * 2
        doubled[0, 0] = float("inf")  # in place, after doubled was traced
        (doubled + 1).sum()
        overflow = torch.full((2,), 300.0, dtype=torch.float16) * 300.0  # the first cause
    assert torch.isinf(masked).any() and torch.isinf(overflow).all()
    (event,) = g.report
    assert event.op == "mul" and event.details["input_max"] == 300.0
    this = test_inputs_that_were_already_non_finite_are_not_first_causes
    lines, first = inspect.getsourcelines(this)
    cause = first + next(n for n, line in enumerate(lines) if "# the first cause" in line)
    assert event.source == f"{THIS_FILE}:{cause}"


def test_a_traced_stretch_reads_each_outputs_largest_magnitude():
    """OpTrace keeps two extremes per checked output (one list per dtype and device) and hands
    over one peak per output, max |x|, NaN kept, whatever the dtypes' order in the stretch."""
    from amp_runtime.monitors.forward import OpTrace
    from amp_runtime.tracking import ModuleTracker

    trace = OpTrace(ModuleTracker())
    outputs = [torch.tensor([-3.0, 2.0]).bfloat16(), torch.tensor([1.0, -7.5]),
               torch.tensor([float("nan"), 1.0]).bfloat16(), torch.tensor([0.25, 4.0]).half(),
               torch.tensor([-float("inf"), 0.0]).bfloat16()]
    for out in outputs:
        trace.record(torch.relu, (), {}, out)
    stacked, positions, ops = trace.take()
    values = [v for tensor in stacked for v in tensor.tolist()]
    peaks = [values[positions[op.output]] for op in ops]
    assert peaks[:2] == [3.0, 7.5] and math.isnan(peaks[2]) and peaks[3:] == [4.0, math.inf]
    assert [op.dtype for op in ops] == [out.dtype for out in outputs]


def test_a_traced_stretch_measures_parameters_without_an_autograd_graph():
    """The parameters' peaks a stretch hands over carry no autograd history (no graph over the
    model's weights is built per step), and keep a NaN weight."""
    from amp_runtime.monitors.forward import OpTrace
    from amp_runtime.tracking import ModuleTracker

    layer = nn.Linear(3, 2)
    with torch.no_grad():
        layer.weight[0, 0] = float("nan")
    trace = OpTrace(ModuleTracker())
    x = torch.ones(1, 3).bfloat16()
    trace.record(F.linear, (x, layer.weight, layer.bias), {}, torch.zeros(1, 2).bfloat16())
    stacked, positions, ops = trace.take()
    assert all(tensor.grad_fn is None for tensor in stacked)
    values = [v for tensor in stacked for v in tensor.tolist()]
    weight, bias = (values[positions[index]] for index in ops[0].inputs[1:])
    assert math.isnan(weight) and bias == layer.bias.abs().max().item()
