"""Bounded memory for events: a month-long run with an event at every step keeps a few
occurrences per code and place, and exact counts and first/last steps for all, in the report,
``events.jsonl``, the summary and the HTML report."""
import gc
import json
import tracemalloc
import warnings

import pytest
import torch
from torch import nn

import amp_runtime
from amp_runtime.events import KEPT_OCCURRENCES, REPEATS, Event, Report
from amp_runtime.html_report import build_report, load_run

from test_readings import LaggingReadings


def explosion(step, norm):
    return Event.create("AMP104", severity="P1", norm=norm, limit=100.0, op="optimizer.step",
                        module="fc2", source="train.py:40", step=step)


def test_a_report_keeps_the_first_occurrences_and_the_latest_and_counts_all():
    report = Report(explosion(step, 200.0 + step) for step in range(1000))
    report.add(Event.create("AMP112", kind="nan", cause="", source="train.py:38", step=999))
    assert len(report) == 1001
    assert report.codes() == {"AMP104": 1000, "AMP112": 1}
    assert report.severities() == {"P1": 1000, "P0": 1}
    kept = [e.step for e in report.events if e.code == "AMP104"]
    assert kept == list(range(KEPT_OCCURRENCES)) + [999]
    assert report.events[-1].code == "AMP112"  # in the order they happened
    explosions, _ = report.groups()
    assert (explosions.count, explosions.first_step, explosions.last_step) == (1000, 0, 999)
    assert explosions.last.message.startswith("total gradient norm 1199 ")
    row = next(line for line in report.summary().splitlines() if line.startswith("AMP104"))
    assert row.split()[:4] == ["AMP104", "P1", "1000", "0-999"]
    assert report.summary().splitlines()[-1] == "1001 event(s): 1 P0, 1000 P1"
    data = report.to_json()
    assert data["schema"] == "amp_runtime.events/2"
    assert data["counts"] == {"AMP104": 1000, "AMP112": 1}
    assert data["groups"][0]["count"] == 1000 and len(data["events"]) == KEPT_OCCURRENCES + 2


def test_a_report_selects_groups_with_their_exact_counts():
    report = Report(explosion(step, 300.0) for step in range(50))
    report.add(Event.create("AMP112", kind="nan", cause="", step=3))
    selected = report.select(lambda group: group.code == "AMP104")
    assert selected.codes() == {"AMP104": 50} and len(selected) == 50


def guarded_emits(log_dir, count, policy="warn"):
    """``count`` steps, each with an event, through the guard's own emit and step."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with amp_runtime.guard(policy=policy, log_dir=log_dir) as g:
            for step in range(count):
                g.emit("AMP104", severity="P1", op="optimizer.step", norm=200.0 + step,
                       limit=100.0, details={"total_norm": 200.0 + step})
                g.step()
    return g


def test_events_jsonl_holds_the_first_events_and_exact_totals(tmp_path):
    g = guarded_emits(tmp_path, 1000)
    lines = (tmp_path / "events.jsonl").read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines]
    events = [r for r in records if r.get("record") != REPEATS]
    totals = [r for r in records if r.get("record") == REPEATS]
    assert len(events) == KEPT_OCCURRENCES
    # totals at 11 occurrences, each doubling from 16 to 512, and the exact total at exit
    assert [r["count"] for r in totals] == [11, 16, 32, 64, 128, 256, 512, 1000]
    assert totals[-1]["first_step"] == 0 and totals[-1]["last_step"] == 999
    assert totals[-1]["latest"]["details"] == {"total_norm": 1199.0}
    logged = amp_runtime.Report.from_jsonl(tmp_path / "events.jsonl")
    assert logged.to_json()["groups"] == g.report.to_json()["groups"]
    assert logged.codes() == g.report.codes() == {"AMP104": 1000}


def test_an_interrupted_runs_log_holds_the_totals_written_so_far(tmp_path):
    guarded_emits(tmp_path, 100)
    log = tmp_path / "events.jsonl"
    lines = log.read_text(encoding="utf-8").splitlines()
    log.write_text("\n".join(lines[:-1]) + "\n", encoding="utf-8")  # killed before the exit
    assert amp_runtime.Report.from_jsonl(log).codes() == {"AMP104": 64}


def test_the_html_report_counts_every_event_and_lists_the_kept_ones(tmp_path):
    guarded_emits(tmp_path, 500)
    run = load_run(tmp_path)
    assert len(run.report) == 500 and len(run.events) == KEPT_OCCURRENCES + 1
    text = build_report(tmp_path).read_text(encoding="utf-8")
    assert "<td>500</td><td>0-499</td>" in text
    assert "500 event(s)" in text and "489 more event(s)" in text


def traced_growth(body, warm_up, measured):
    """Bytes of Python memory ``body(n)`` still holds after ``measured`` more calls than after
    ``warm_up`` calls."""
    tracemalloc.start()
    try:
        body(warm_up)
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        body(measured)
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def test_memory_stays_flat_over_100k_steps_with_an_event_at_every_step():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with amp_runtime.guard() as g:  # the default policy: warn

            def emit_steps(count):
                for _ in range(count):
                    g.emit("AMP104", severity="P1", op="optimizer.step", norm=250.0,
                           limit=100.0, details={"total_norm": 250.0})
                    g.step()

            growth = traced_growth(emit_steps, 5_000, 95_000)
    assert g.report.codes() == {"AMP104": 100_000} and g.step_index == 100_000
    assert growth < 64 * 1024, f"{growth} bytes more after 95k more events"


def test_memory_stays_flat_in_a_real_training_run_with_an_event_at_every_step(tmp_path):
    """A loop whose loss is NaN at every step (AMP112 each step, the scaler skipping them)."""
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", growth_interval=10**9)
    x = torch.randn(4, 8)

    def train(steps):
        for _ in range(steps):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().sum() * float("nan")
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with amp_runtime.guard(log_dir=tmp_path) as g:
            growth = traced_growth(train, 100, 400)
    assert g.report.codes()["AMP112"] == 500
    assert growth < 64 * 1024, f"{growth} bytes more after 400 more steps"


def test_events_judged_steps_late_are_counted_with_the_steps_they_happened_in(tmp_path):
    """A device three commit points behind the host: each step's AMP112 is judged during a later
    step, as the step it happened in. One group (the same line at every step), exact count and
    first/last steps, the first occurrences and the latest kept, the log's totals the same."""
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", growth_interval=10**9)
    g = amp_runtime.guard(policy="record", log_dir=tmp_path)
    g.readings = LaggingReadings(lag=3)
    with g:
        for _ in range(40):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8)).float().sum() * float("nan")
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        judged_late = g.report.codes()["AMP112"]
    assert judged_late < 40  # the last steps' readings were still in flight before the exit
    (group,) = [group for group in g.report.groups() if group.code == "AMP112"]
    assert (group.count, group.first_step, group.last_step) == (40, 0, 39)
    kept = [event.step for event in g.report.by_code("AMP112")]
    assert kept == list(range(KEPT_OCCURRENCES)) + [39]
    logged = amp_runtime.Report.from_jsonl(tmp_path / "events.jsonl")
    assert logged.to_json()["groups"] == g.report.to_json()["groups"]


@pytest.mark.parametrize("policy", ["warn", "record"])
def test_a_repeated_event_is_one_row_with_its_count_in_the_summary(policy, tmp_path):
    g = guarded_emits(tmp_path, 30, policy=policy)
    (row,) = [line for line in g.report.summary().splitlines() if line.startswith("AMP104")]
    assert row.split()[2:4] == ["30", "0-29"]
