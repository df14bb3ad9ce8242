"""report.html from the logs of real guarded training runs on CPU."""
import base64
import json
import shutil
import subprocess
import sys
from html.parser import HTMLParser

import pytest
import torch
from torch import nn

import amp_runtime
from amp_runtime.html_report import ReportError, build_report, diagnose, load_run

PLOTS = ("loss", "loss-scale", "grad-norm", "layer-heatmap", "underflow", "timeline")


class Interaction(nn.Module):
    def forward(self, h):
        return h @ h.transpose(1, 2)  # overflows fp16 when the inputs are large


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.interaction = Interaction()
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.interaction(self.embed(x).view(-1, 4, 8)).flatten(1))


def _train(log_dir, steps, dtype=torch.float16, blow_up_every=4):
    """A guarded fp16 (GradScaler) or bf16 training run; every few batches carry raw
    values 300x larger, which overflow fp16 in ``interaction``."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    with amp_runtime.guard(log_dir=log_dir, policy="record", trace="always", model=model) as g:
        for step in range(steps):
            x = torch.rand(16, 8) * (300.0 if blow_up_every and step % blow_up_every == 3 else 1.0)
            with torch.autocast("cpu", dtype=dtype):
                loss = model(x).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return g


@pytest.fixture(scope="module")
def overflow_run(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("overflow")
    guard = _train(log_dir, steps=24)
    return log_dir, guard


class _Page(HTMLParser):
    """Collects element ids, figures with their images, and table rows."""

    def __init__(self, text):
        super().__init__()
        self.ids, self.images, self.external, self.rows = set(), {}, [], 0
        self._figure = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        if tag == "figure":
            self._figure = attrs.get("id")
        if tag == "img":
            self.images[self._figure] = attrs["src"]
        remote = any(str(v).startswith(("http:", "https:", "//")) for v in attrs.values())
        if tag in ("link", "script") or remote:
            self.external.append((tag, attrs))
        if tag == "tr":
            self.rows += 1


def test_report_has_every_plot_embedded_and_no_external_assets(overflow_run):
    log_dir, guard = overflow_run
    page_path = build_report(log_dir)
    assert page_path == log_dir / "report.html"
    page = _Page(page_path.read_text(encoding="utf-8"))
    assert {"diagnosis", "plots", "summary", "events"} <= page.ids
    assert {f"plot-{key}" for key in PLOTS} <= page.ids
    for key in PLOTS:
        if key == "underflow":  # this run's fp16 gradients do not underflow: a sentence says so
            continue
        src = page.images[f"plot-{key}"]
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    assert page.external == []


def test_events_table_lists_every_event_with_its_source_line(overflow_run):
    log_dir, guard = overflow_run
    text = build_report(log_dir).read_text(encoding="utf-8")
    events = guard.report.events
    assert events and any(e.code == "AMP101" for e in events)
    groups = len(guard.report.grouped())
    assert _Page(text).rows == (1 + groups) + (1 + len(events))  # two tables with header rows
    # the user's line is quoted next to its file:line
    assert "return h @ h.transpose(1, 2)  # overflows fp16 when the inputs are large" in text


def test_diagnosis_names_the_overflowing_module_and_the_skipped_steps(overflow_run):
    log_dir, guard = overflow_run
    run = load_run(log_dir)
    sentences = diagnose(run)
    first = next(e for e in guard.report.events if e.code == "AMP101")
    line = first.source.rpartition(":")[2]
    assert first.module == "interaction"
    assert any(f"overflow in interaction ({first.op}, " in s and f"test_html_report.py:{line})" in s
               for s in sentences)
    skipped = run.skipped_steps()
    assert skipped
    assert any(f"{len(skipped)} of {len(run.steps)} steps skipped" in s for s in sentences)


def test_healthy_bf16_run_says_no_problems_and_explains_missing_plots(tmp_path):
    _train(tmp_path, steps=6, dtype=torch.bfloat16, blow_up_every=0)
    run = load_run(tmp_path)
    assert diagnose(run)[0] == "No problems found: 6 step(s), no events."
    page = _Page(build_report(tmp_path).read_text(encoding="utf-8"))
    assert "plot-loss" in page.images and "plot-grad-norm" in page.images
    # no GradScaler in bf16: the figure says why instead of showing an empty plot
    assert "plot-loss-scale" in page.ids and "plot-loss-scale" not in page.images


def test_without_matplotlib_the_report_says_so_and_lists_events(overflow_run, tmp_path):
    log_dir, guard = overflow_run
    out = tmp_path / "page.html"
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from amp_runtime.html_report import build_report\n"
        f"build_report({str(log_dir)!r}, {str(out)!r})\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    text = out.read_text(encoding="utf-8")
    page = _Page(text)
    assert "no-matplotlib" in page.ids and "Plots need matplotlib" in text
    assert page.images == {}
    assert page.rows == (1 + len(guard.report.grouped())) + (1 + len(guard.report.events))


@pytest.mark.parametrize("files, message", [
    ({}, "neither events.jsonl nor metrics.jsonl found"),
    ({"events.jsonl": "", "metrics.jsonl": "\n"}, "the logs are empty"),
    ({"events.jsonl": '{"code": "AMP101"\n'}, "events.jsonl:1: not JSON"),
    ({"metrics.jsonl": '{"step": 0}\nnot json\n'}, "metrics.jsonl:2: not JSON"),
    ({"metrics.jsonl": '{"loss": 1.0}\n'}, 'metrics.jsonl:1: a metrics line needs an integer'),
])
def test_unusable_log_folders_give_one_clear_error(tmp_path, files, message):
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    with pytest.raises(ReportError, match=message.replace("[", r"\[")):
        build_report(tmp_path)
    assert not (tmp_path / "report.html").exists()


def test_missing_folder(tmp_path):
    with pytest.raises(ReportError, match="no such directory"):
        load_run(tmp_path / "nope")


def test_metrics_lines_are_read_in_step_order(tmp_path):
    lines = [{"step": 1, "loss": 2.0, "loss_scale": 8.0, "skipped": True}, {"step": 0, "loss": 3.0}]
    text = "\n".join(json.dumps(x) for x in lines)
    (tmp_path / "metrics.jsonl").write_text(text, encoding="utf-8")
    run = load_run(tmp_path)
    assert run.series("loss") == ([0, 1], [3.0, 2.0])
    assert run.skipped_steps() == [1]


def _event_line(code, step, severity="P0"):
    return json.dumps({"code": code, "name": "x", "severity": severity, "message": "m",
                       "step": step})


def test_a_last_line_cut_off_by_a_killed_run_is_left_out_with_a_note(tmp_path):
    (tmp_path / "events.jsonl").write_text(
        _event_line("AMP112", 1) + "\n" + _event_line("AMP101", 2)[:25], encoding="utf-8")
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 0, "loss": 2.0}\n{"step": 1, "loss": null}\n{"step": 2, "lo', encoding="utf-8")
    run = load_run(tmp_path)
    assert [e.code for e in run.events] == ["AMP112"] and len(run.steps) == 2
    text = build_report(tmp_path).read_text(encoding="utf-8")
    assert "The last line of events.jsonl was cut off" in text
    assert "The last line of metrics.jsonl was cut off" in text


def test_nan_losses_written_as_null_are_found_through_their_amp112_events(tmp_path):
    (tmp_path / "events.jsonl").write_text(
        _event_line("AMP112", 3) + "\n" + _event_line("AMP112", 5) + "\n", encoding="utf-8")
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": None if s in (3, 5) else 1.0}) + "\n" for s in range(6)),
        encoding="utf-8")
    run = load_run(tmp_path)
    assert run.nonfinite_loss_steps() == [3, 5]
    assert "The loss was NaN/Inf from step 3 (2 step(s))." in diagnose(run)


@pytest.mark.parametrize("events, metrics, message", [
    (_event_line("AMP101", "3"), "", "events.jsonl:1: not an amp_runtime event ('step' is '3')"),
    ("[1, 2]", "", "events.jsonl:1: not an amp_runtime event (not a JSON object)"),
    ('{"code": "AMP101"}', "", "events.jsonl:1: not an amp_runtime event (no 'name')"),
    ("", '{"step": true}', 'metrics.jsonl:1: a metrics line needs an integer "step"'),
])
def test_malformed_fields_are_one_clear_error(tmp_path, events, metrics, message):
    (tmp_path / "events.jsonl").write_text(events + "\n", encoding="utf-8")
    (tmp_path / "metrics.jsonl").write_text(metrics + "\n", encoding="utf-8")
    with pytest.raises(ReportError) as error:
        build_report(tmp_path)
    assert message in str(error.value)


def test_binary_logs_name_the_file(tmp_path):
    (tmp_path / "events.jsonl").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    with pytest.raises(ReportError, match=r"events\.jsonl: not a text file"):
        load_run(tmp_path)


def test_malformed_layer_statistics_are_left_out_of_the_plots(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 0, "loss": 1.0, "layers": {"fc.weight": 5, "fc.bias": {"norm": 0.5}}}\n'
        '{"step": 1, "loss": 0.9, "layers": [1, 2]}\n', encoding="utf-8")
    page = _Page(build_report(tmp_path).read_text(encoding="utf-8"))
    assert "plot-layer-heatmap" in page.images
    assert load_run(tmp_path).layer_matrix("norm")[0] == ["fc.bias"]


def test_underflow_plot_says_so_when_no_gradient_underflowed(tmp_path):
    layers = {"fc.weight": {"norm": 1.0, "underflow_fraction": 0.0}}
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 1.0, "layers": layers}) + "\n" for s in range(3)),
        encoding="utf-8")
    text = build_report(tmp_path).read_text(encoding="utf-8")
    page = _Page(text)
    assert "plot-underflow" in page.ids and "plot-underflow" not in page.images
    assert "no gradient underflowed" in text


def test_diagnosis_says_how_to_find_an_op_it_could_not_pin_down(tmp_path):
    weight = json.dumps({"code": "AMP103", "name": "x", "severity": "P0", "message": "m",
                         "op": "optimizer.step", "module": "weight", "step": 0})
    (tmp_path / "events.jsonl").write_text(_event_line("AMP112", 0) + "\n" + weight + "\n",
                                           encoding="utf-8")
    (headline, *_) = diagnose(load_run(tmp_path))
    assert "no op was pinned down: rerun with per-op tracing (run --trace always" in headline
    mul = json.dumps({"code": "AMP101", "name": "x", "severity": "P0", "message": "m",
                      "op": "mul", "source": "train.py:10", "step": 8})
    with open(tmp_path / "events.jsonl", "a", encoding="utf-8") as fh:
        fh.write(mul + "\n")
    (headline, *_) = diagnose(load_run(tmp_path))
    assert headline.endswith("first localized overflow (mul, train.py:10) at step 8 [AMP101].")


def test_a_rank_folder_without_logs_is_a_note_and_the_other_ranks_are_reported(
        overflow_run, tmp_path):
    log_dir, guard = overflow_run
    base = tmp_path / "ddp"
    shutil.copytree(log_dir, base / "rank-0")
    (base / "rank-1").mkdir()  # a rank that died before its first step
    page = build_report(base).read_text(encoding="utf-8")
    assert "Rank 1 is left out" in page
    first_step = min(e.step for e in guard.report.events)
    assert f"First failing rank: rank 0 at step {first_step}: " in page
    shutil.rmtree(base / "rank-0")
    with pytest.raises(ReportError, match="no rank folder holds usable logs"):
        build_report(base)
