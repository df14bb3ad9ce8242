"""The guard kernel: lifecycle, policies, selection, nesting, threads and numerics."""
import json
import subprocess
import sys
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as module_globals
from torch.optim import optimizer as optimizer_globals
from torch.overrides import _get_current_function_mode_stack

import amp_runtime
from amp_runtime import AmpRuntimeWarning, GuardError, Thresholds


def global_hook_counts():
    """Sizes of every global hook registry a guard may touch."""
    return (
        len(module_globals._global_forward_pre_hooks),
        len(module_globals._global_forward_hooks),
        len(module_globals._global_forward_hooks_always_called),
        len(module_globals._global_backward_hooks),
        len(module_globals._global_backward_pre_hooks),
        len(optimizer_globals._global_optimizer_pre_hooks),
        len(optimizer_globals._global_optimizer_post_hooks),
    )


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def train(model, steps, guard=None, dtype=torch.bfloat16):
    """Plain autocast training; returns the losses."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 8, generator=generator)
        y = x[:, :1] * 2 - 1
        with torch.autocast("cpu", dtype=dtype):
            loss = F.mse_loss(model(x).float(), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().clone())
    return losses


def test_guard_installs_and_removes_its_mode_and_hooks():
    before = global_hook_counts()
    with amp_runtime.guard() as g:
        assert len(_get_current_function_mode_stack()) == 1
        assert global_hook_counts() != before
        train(small_model(), 2)
    assert _get_current_function_mode_stack() == []
    assert global_hook_counts() == before
    assert g.step_index == 0 or g.step_index == 2  # automatic step detection may be absent


def test_exception_inside_the_block_leaves_no_hook():
    before = global_hook_counts()
    with pytest.raises(ZeroDivisionError):
        with amp_runtime.guard(trace="always"):
            small_model()(torch.randn(2, 8))
            1 / 0
    assert _get_current_function_mode_stack() == []
    assert global_hook_counts() == before


def test_exception_inside_optimizer_step_leaves_no_mode():
    model = small_model()

    class Failing(torch.optim.SGD):
        def step(self, closure=None):
            raise RuntimeError("boom")

    optimizer = Failing(model.parameters(), lr=0.1)
    before = global_hook_counts()
    with pytest.raises(RuntimeError, match="boom"):
        with amp_runtime.guard():
            model(torch.randn(2, 8)).sum().backward()
            optimizer.step()
    assert _get_current_function_mode_stack() == []
    assert global_hook_counts() == before


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"policy": "loud"}, ValueError),
        ({"trace": "sometimes"}, ValueError),
        ({"raise_at": "P9"}, ValueError),
        ({"select": ["XYZ"]}, ValueError),
        ({"ignore": 3}, TypeError),
        ({"thresholds": {"near_overflow": 1}}, TypeError),
        ({"model": "resnet"}, TypeError),
        ({"log_dir": 5}, TypeError),
    ],
)
def test_invalid_arguments_are_clear_errors(kwargs, error):
    with pytest.raises(error, match="guard"):
        amp_runtime.guard(**kwargs)


def test_a_guard_cannot_be_entered_twice():
    g = amp_runtime.guard()
    with g:
        with pytest.raises(RuntimeError, match="already active"):
            g.__enter__()
    assert _get_current_function_mode_stack() == []


def test_select_and_ignore_filter_by_prefix():
    with amp_runtime.guard(policy="record", select=["AMP1"], ignore=["AMP102"]) as g:
        assert g.emit("AMP004", op="sum", dtype="float16") is None
        assert g.emit("AMP102", op="mul", value=61000.0) is None
        event = g.emit("AMP112", op="backward", kind="NaN", cause="")
    assert [e.code for e in g.report] == ["AMP112"]
    assert event.step == 0 and event.severity == "P0"


def test_emit_fills_source_module_and_step():
    model = small_model()
    seen = []

    def record_inside(module, args):
        seen.append(g.emit("AMP102", op=torch.relu, value=61000.0))

    with amp_runtime.guard(policy="record", model=model) as g:
        g.step()
        handle = model[1].register_forward_pre_hook(record_inside)
        try:
            model(torch.randn(2, 8))
        finally:
            handle.remove()
    (event,) = seen
    assert event.module == "1" and event.op == "relu" and event.step == 1
    assert event.source.endswith(f"test_guard.py:{record_inside.__code__.co_firstlineno + 1}")


def test_policy_raise_stops_at_or_above_raise_at():
    with amp_runtime.guard(policy="raise", raise_at="P0") as g:
        with pytest.warns(AmpRuntimeWarning, match="AMP004"):  # below raise_at: a warning
            assert g.emit("AMP004", op="sum", dtype="float16") is not None
        with pytest.raises(GuardError) as caught:
            g.emit("AMP112", op="backward", kind="NaN", cause="")
    assert caught.value.event.code == "AMP112"
    assert g.report.codes() == {"AMP004": 1, "AMP112": 1}


def test_policy_warn_warns_once_per_code_and_line_and_counts_all():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with amp_runtime.guard() as g:
            for _ in range(3):
                g.emit("AMP004", op="sum", dtype="float16")
            g.emit("AMP004", op="sum", dtype="float16")
    ours = [w for w in caught if issubclass(w.category, AmpRuntimeWarning)]
    assert len(ours) == 2  # two source lines
    assert "AMP004" in str(ours[0].message)
    assert len(g.report) == 4
    assert "4" in g.report.summary().splitlines()[-1]


def test_policy_record_is_silent():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with amp_runtime.guard(policy="record") as g:
            g.emit("AMP004", op="sum", dtype="float16")
    assert len(g.report) == 1


def test_nested_guard_checks_and_reports_to_the_outer(tmp_path):
    with amp_runtime.guard(policy="record", log_dir=tmp_path) as outer:
        with amp_runtime.guard(policy="record") as inner:
            # the outer mode leaves the stack while the inner guard does the checking
            assert _get_current_function_mode_stack() == [inner._mode]
            assert outer.suspended and not inner.suspended
            assert outer.emit("AMP004", op="sum", dtype="float16") is None
            inner.emit("AMP112", op="backward", kind="NaN", cause="")
        assert not outer.suspended
        assert _get_current_function_mode_stack() == [outer._mode]
        outer.emit("AMP004", op="sum", dtype="float16")
    assert [e.code for e in inner.report] == ["AMP112"]
    assert [e.code for e in outer.report] == ["AMP112", "AMP004"]
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert [json.loads(line)["code"] for line in lines] == ["AMP112", "AMP004"]
    assert amp_runtime.Report.from_jsonl(tmp_path / "events.jsonl").codes() == outer.report.codes()


def test_other_threads_are_not_checked():
    results = {}

    def other_thread():
        results["modes"] = len(_get_current_function_mode_stack())
        x = torch.randn(4, dtype=torch.float16)
        results["sum"] = x.sum()  # would be AMP004 in the guarded thread

    with amp_runtime.guard(policy="record", trace="always") as g:
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
    assert results["modes"] == 0
    assert g.report.events == []


def test_guard_never_changes_numerics():
    plain_model = small_model()
    plain = train(plain_model, 12)
    for trace in ("off", "auto", "always"):
        guarded_model = small_model()
        with amp_runtime.guard(policy="record", trace=trace):
            guarded = train(guarded_model, 12)
        assert all(torch.equal(a, b) for a, b in zip(plain, guarded)), trace
        for p, q in zip(plain_model.parameters(), guarded_model.parameters()):
            assert torch.equal(p, q), trace


def test_manual_steps_and_auto_back_off():
    limits = Thresholds(auto_quiet_steps=2)
    with amp_runtime.guard(policy="record", thresholds=limits) as g:
        assert not g.tracing
        g.request_tracing("AMP112")
        assert g.tracing and g.tracing_reason == "AMP112"
        g.step()
        assert g.tracing
        g.step()
        assert not g.tracing and g.step_index == 2
    with amp_runtime.guard(trace="off") as g:
        g.request_tracing("AMP112")
        assert not g.tracing


def test_step_listeners_receive_the_record():
    seen = []
    with amp_runtime.guard(policy="record") as g:
        g.step_listeners.append(lambda step, record: seen.append((step, dict(record))))
        g.step()
        g.step()
    assert [s for s, _ in seen] == [0, 1]
    assert all(record["step"] == step for step, record in seen)


def test_a_guard_entered_in_a_worker_thread_checks_that_thread():
    found = {}

    def worker():
        with amp_runtime.guard(policy="record", select=["AMP004"]) as g:
            torch.randn(8, dtype=torch.float16).sum()
        found["codes"] = [e.code for e in g.report]

    thread = threading.Thread(target=worker)
    thread.start()
    torch.randn(8, dtype=torch.float16).sum()  # main thread: no guard, nothing recorded
    thread.join()
    assert found["codes"] == ["AMP004"]
    assert _get_current_function_mode_stack() == []


def test_zero_grad_runs_unobserved_and_is_restored_on_exit():
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with amp_runtime.guard(policy="record"):
        for _ in range(2):
            optimizer.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()
        assert "zero_grad" in vars(optimizer)
        optimizer.zero_grad()
        assert all(p.grad is None for p in model.parameters())
    assert "zero_grad" not in vars(optimizer)


def test_meta_empty_and_sparse_tensors_pass_through_every_check():
    with amp_runtime.guard(policy="record", trace="always") as g:
        layer = nn.Linear(4, 4, device="meta")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(torch.empty(2, 4, device="meta", dtype=torch.float16))
        out.float().sum().backward()
        empty = torch.empty(0, dtype=torch.float16)
        (empty + empty).sum()
        torch.eye(3, dtype=torch.float16).to_sparse() * 2
        g.step()
    assert out.is_meta
    assert [e.code for e in g.report if e.code.startswith("AMP1")] == []


COMPILED_UNDER_GUARD = """
import torch
from torch import nn
from torch._dynamo.utils import counters
import amp_runtime

model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
compiled = torch.compile(model, backend="eager")
x = torch.randn(4, 8)
with amp_runtime.guard(policy="record", trace="always"):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        guarded = compiled(x)
with torch.autocast("cpu", dtype=torch.bfloat16):
    assert torch.equal(guarded, model(x))
assert not counters["graph_break"], dict(counters["graph_break"])
assert torch.overrides._get_current_function_mode_stack() == []
print("compiled ok")
"""


def test_compiled_code_runs_unchecked_without_graph_breaks(tmp_path):
    # In a fresh interpreter: torch.compile's caches are process-wide.
    script = tmp_path / "compiled.py"
    script.write_text(COMPILED_UNDER_GUARD)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "compiled ok"
