"""Deferred device readings (readings.py): the one path from device values to host numbers.

A CPU copy is complete at once; a GPU's arrives when the device has caught up. ``LaggingReadings``
lets the CPU suite run what a GPU running behind the host runs: the same readings, whose copies
(real ones) are known complete only a number of commit points after they started.
"""
import ast
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import amp_runtime
from amp_runtime import GuardError
from amp_runtime.readings import MAX_IN_FLIGHT, Readings


class LaggingReadings(Readings):
    """Readings whose copies arrive ``lag`` commit points after they started (a GPU behind the
    host); waiting for a batch lets it and the older ones arrive, as the device's stream order
    does. Only the completion check is replaced; submitting, copying and judging are the guard's."""

    def __init__(self, lag):
        super().__init__()
        self.lag = lag
        self.commits = 0
        self.arrival = {}  # id(batch) -> the commit count at which its copies have arrived

    def commit(self):
        newest = self._in_flight[-1] if self._in_flight else None
        super().commit()
        self.commits += 1
        if self._in_flight and self._in_flight[-1] is not newest:
            self.arrival[id(self._in_flight[-1])] = self.commits + self.lag

    def _complete(self, batch):
        return self.commits >= self.arrival.get(id(batch), 0)

    def _wait(self, batch):
        super()._wait(batch)
        self.arrival[id(batch)] = 0
        for older in self._in_flight:
            self.arrival[id(older)] = 0
            if older is batch:
                break


def train(guard, steps, dtype=torch.float16, nan_at=None):
    """The usual loop (fp16: GradScaler with unscale_ and clip_grad_norm_; bf16: no scaler) inside
    ``guard``; a NaN loss at step ``nan_at``. Per step: the copies started, batches read and host
    waits of the guard's readings, and how many events the guard had reported by the step's end."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
    generator = torch.Generator().manual_seed(0)
    per_step = []
    for step in range(steps):
        before = dataclasses.replace(guard.readings.counts)
        x = torch.randn(8, 16, generator=generator)
        with torch.autocast("cpu", dtype=dtype):
            loss = model(x).float().pow(2).mean()
        if step == nan_at:
            loss = loss * float("nan")
        opt.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        after = guard.readings.counts
        per_step.append({"copies": after.copies - before.copies,
                         "reads": after.reads - before.reads,
                         "waits": after.waits - before.waits, "events": len(guard.report)})
    assert guard.step_index == steps
    return per_step


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_steady_step_copies_once_and_never_waits(dtype):
    """One copy per step, at the optimizer step: the loss, the gradient statistics, the trace,
    and the previous step's GradScaler update, which rides with it. On the CPU it is read at
    once, and the host never waits. Per-op tracing adds no copy: its peaks go into the same
    buffers."""
    counts = {}
    for trace in ("off", "auto", "always"):
        with amp_runtime.guard(policy="record", trace=trace) as g:
            per_step = train(g, 40, dtype=dtype)
        counts[trace] = per_step
        assert g.report.events == [] and g.readings.counts.waits == 0
        for step, row in enumerate(per_step):
            assert row["copies"] == 1, (trace, step, row)
            assert row["reads"] == row["copies"] and row["waits"] == 0, (trace, step, row)
    assert counts["always"] == counts["auto"] == counts["off"]


def test_steps_where_nothing_is_due_read_nothing_and_the_exit_waits_once():
    """A device that never catches up during the loop: no step reads anything or waits; the
    guard's exit waits once and judges everything, each event with the step it happened in."""
    g = amp_runtime.guard(policy="record")
    g.readings = LaggingReadings(lag=10 ** 6)
    with g:
        per_step = train(g, 20, nan_at=12)
        assert all(row["reads"] == row["waits"] == row["events"] == 0 for row in per_step)
    assert g.readings.counts.waits == 1
    assert g.readings.counts.reads == g.readings.counts.copies == 21  # the exit commits the last
    assert [(e.code, e.step) for e in g.report] == [("AMP112", 12)]


def test_readings_judged_steps_later_still_carry_their_step(tmp_path):
    """Copies arriving three commit points (three steps) late: the NaN loss of step 5, which the
    GradScaler skips (no optimizer step: copied at the step's end), is reported during step 8,
    as step 5's; the per-step records reach metrics.jsonl in step order, each as complete as on
    the CPU, and the host never waits until the exit."""
    g = amp_runtime.guard(policy="record", log_dir=tmp_path)
    g.readings = LaggingReadings(lag=3)
    with g:
        per_step = train(g, 12, nan_at=5)
    assert [row["events"] for row in per_step[4:10]] == [0, 0, 0, 0, 1, 1]
    assert all(row["waits"] == 0 for row in per_step)
    (event,) = g.report
    assert (event.code, event.step, event.op) == ("AMP112", 5, "backward")
    assert event.source.endswith("test_readings.py:" + str(_line_of("scaler.scale(loss)")))
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(12))
    assert lines[5]["skipped"] and lines[5]["loss"] is None and lines[5]["grad_norm"] is None
    assert all(not m["skipped"] and m["grad_norm"] > 0 and math.isfinite(m["loss"])
               for i, m in enumerate(lines) if i != 5)
    assert lines[5]["loss_scale"] == 2.0 ** 16 and lines[6]["loss_scale"] == 2.0 ** 15


def test_policy_raise_raises_at_the_exit_when_the_device_never_caught_up():
    g = amp_runtime.guard(policy="raise")
    g.readings = LaggingReadings(lag=10 ** 6)
    with pytest.raises(GuardError) as caught:
        with g:
            train(g, 6, nan_at=2)  # no GuardError inside the loop: nothing was due
    assert (caught.value.event.code, caught.value.event.step) == ("AMP112", 2)


def test_policy_raise_stops_the_optimizer_before_it_applies_the_step_on_the_cpu():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    with pytest.raises(GuardError) as caught:
        with amp_runtime.guard(policy="raise", select=["AMP103"]):
            (model(torch.ones(2, 4)) * float("inf")).sum().backward()
            opt.step()
    assert caught.value.event.code == "AMP103" and caught.value.event.step == 0
    assert torch.equal(model.weight, before)


def test_a_steps_listeners_run_before_the_next_steps_readings_copied_with_its_own():
    """A step's GradScaler update rides with the next step's copy; the step's record is complete
    (its listeners run) once its own readings are judged, before the next step's are: an event
    of step 1 found in that copy is not counted as step 0's."""
    readings = Readings()
    judged = []
    readings.submit([torch.tensor(1.0)], lambda values, step: judged.append(("update", step)))
    readings.after(lambda: judged.append("step 0 complete"))
    readings.step = 1
    readings.submit([torch.tensor(2.0)], lambda values, step: judged.append(("grads", step)))
    readings.commit()
    readings.after(lambda: judged.append("after the commit"))
    readings.poll()
    assert judged == [("update", 0), "step 0 complete", ("grads", 1), "after the commit"]


def test_batches_in_flight_are_bounded():
    """A device that never catches up cannot make the host hold more than MAX_IN_FLIGHT batches:
    the oldest is waited for and judged instead."""
    readings = LaggingReadings(lag=10 ** 6)
    judged = []
    for index in range(MAX_IN_FLIGHT + 10):
        readings.submit([torch.tensor([float(index)])], lambda values, step: judged.append(values))
        readings.commit()
    assert len(readings._in_flight) == MAX_IN_FLIGHT
    assert readings.counts.waits == 10 and judged == [[float(i)] for i in range(10)]
    readings.flush()
    assert judged == [[float(i)] for i in range(MAX_IN_FLIGHT + 10)]


def test_values_are_judged_in_submission_order_with_their_step():
    readings = Readings()
    judged = []
    readings.submit([torch.tensor(1.0), torch.tensor([2.0, 3.0], dtype=torch.float16)],
                    lambda values, step: judged.append((values, step)))
    readings.step = 7
    readings.submit([torch.tensor([[4.0]], dtype=torch.float64)],
                    lambda values, step: judged.append((values, step)))
    readings.after(lambda: judged.append("after the first two"))  # with their commit
    readings.commit()
    readings.after(lambda: judged.append("after the commit"))
    readings.poll()
    readings.after(lambda: judged.append("nothing left: now"))
    assert judged == [([1.0, 2.0, 3.0], 0), ([4.0], 7), "after the first two", "after the commit",
                      "nothing left: now"]
    assert dataclasses.astuple(readings.counts) == (1, 1, 0)


# -- no host reads outside the readings ---------------------------------------------------

PACKAGE = Path(amp_runtime.__file__).parent
#: Modules that run outside a training step: they read values as they like.
OFFLINE = {"cli.py", "compare.py", "doctor.py", "html_report.py", "__main__.py"}
#: Functions that copy to the host once per run: the repro bundle of the first replayed anomaly.
ONCE_PER_RUN = {"replay.py": {"_portable", "save_bundle"}}
#: Tensor methods that copy device values to the host (a host sync on a GPU).
HOST_READS = {"item", "tolist", "cpu", "numpy"}


class HostReads(ast.NodeVisitor):
    """The host reads of a module, outside the functions named ``exempt``."""

    def __init__(self, exempt):
        self.exempt, self.found = exempt, []

    def visit_FunctionDef(self, node):
        if node.name not in self.exempt:
            self.generic_visit(node)

    def visit_Call(self, node):
        if isinstance(node.func, ast.Attribute) and node.func.attr in HOST_READS:
            self.found.append(f"{node.lineno} .{node.func.attr}()")
        self.generic_visit(node)


def test_the_step_path_reads_device_values_only_through_the_readings():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative in OFFLINE or relative == "readings.py":
            continue
        reads = HostReads(ONCE_PER_RUN.get(relative, set()))
        reads.visit(ast.parse(path.read_text(encoding="utf-8")))
        offenders += [f"{relative}:{found}" for found in reads.found]
    assert offenders == []


def _line_of(text):
    """The line number of ``text`` in ``train`` (in this file)."""
    lines = Path(__file__).read_text(encoding="utf-8").splitlines()
    return next(number for number, line in enumerate(lines, 1) if text in line)
