"""One self-contained ``report.html`` from a guard's log folder.

Reads ``events.jsonl`` (one ``Event.to_json()`` per line) and ``metrics.jsonl`` (one
object per step: ``step``, ``loss``, ``loss_scale``, ``skipped``, ``grad_norm`` and,
on some steps, per-layer ``layers`` statistics). The page has no external assets: the
plots are PNG images embedded as base64, the style is inline. Plots are drawn with
matplotlib, which ``flake8-amp[runtime]`` installs; without it the page says so and still
carries the diagnosis and the events. A folder of a distributed run, with one ``rank-N``
subfolder per process (``ranks.py``), gets one page: which rank failed first and at which
step, then each rank's report.

Torch-free: it only reads the logs.
"""
from __future__ import annotations

import base64
import html
import io
import json
import linecache
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from flake8_amp.catalog import severity_rank

from .events import Event, Report
from .ranks import LOG_FOLDER, rank_dirs
from .thresholds import Thresholds

EVENTS_FILE = "events.jsonl"
METRICS_FILE = "metrics.jsonl"
REPORT_FILE = "report.html"
#: The events table lists at most this many events (the summary counts them all).
MAX_EVENT_ROWS = 1000
#: The heat map labels at most this many layers (and grows no taller).
MAX_HEATMAP_LABELS = 40
#: The underflow plot shows the layers with the highest peak underflow fraction.
MAX_UNDERFLOW_LINES = 8
#: Codes that mean "a value overflowed" for the diagnosis.
_OVERFLOW_CODES = ("AMP101", "AMP102", "AMP103", "AMP112", "AMP007")
_NONFINITE_LOSS = "AMP112"
#: Codes that name the op (forward or backward) that produced a non-finite value.
_OP_CODES = ("AMP101", "AMP102")


class ReportError(Exception):
    """A log folder that cannot be reported on; the message says why, in one line."""


@dataclass
class RunLog:
    """What one guarded run left in its log folder."""

    log_dir: Path
    #: The events, as the guard's report holds them: exact counts, a few occurrences in full.
    report: Report = field(default_factory=Report)
    #: One dict per step, sorted by step.
    steps: List[Dict[str, Any]] = field(default_factory=list)
    #: What the reader had to leave out, for the page.
    notes: List[str] = field(default_factory=list)
    #: The process's rank in a distributed run (its ``rank-N`` folder), else None.
    rank: Optional[int] = None

    @property
    def events(self) -> List[Event]:
        """The occurrences kept in full (``Report.events``)."""
        return self.report.events

    def series(self, key: str) -> Tuple[List[int], List[float]]:
        """Steps and finite values of one per-step number (missing values skipped)."""
        xs, ys = [], []
        for record in self.steps:
            value = record.get(key)
            number = _number(value)
            if number is not None and math.isfinite(number):
                xs.append(record["step"])
                ys.append(number)
        return xs, ys

    def skipped_steps(self) -> List[int]:
        return [r["step"] for r in self.steps if r.get("skipped")]

    def nonfinite_loss_steps(self) -> List[int]:
        """Steps whose loss was NaN/Inf: metrics.jsonl writes those losses as null, so
        the guard's AMP112 events say which they were."""
        steps = {e.step for e in self.events if e.code == _NONFINITE_LOSS and e.step is not None}
        steps.update(step for group in self.report.groups() if group.code == _NONFINITE_LOSS
                     for step in (group.first_step, group.last_step) if step is not None)
        steps.update(r["step"] for r in self.steps if _is_nonfinite(r.get("loss")))
        return sorted(steps)

    def layer_matrix(self, stat: str) -> Tuple[List[str], List[int], List[List[Optional[float]]]]:
        """Layers (in first-seen order) × steps that have per-layer stats, of ``stat``."""
        rows = [r for r in self.steps if isinstance(r.get("layers"), dict) and r["layers"]]
        names: Dict[str, None] = {}
        for record in rows:
            names.update(dict.fromkeys(record["layers"]))
        matrix = [[_number((r["layers"].get(name) or {}).get(stat)) for r in rows]
                  for name in names]
        return list(names), [r["step"] for r in rows], matrix


def _number(value) -> Optional[float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def load_run(log_dir: Union[str, Path]) -> RunLog:
    """Read a log folder; ReportError when it is missing, empty or not a guard's log."""
    folder = Path(log_dir)
    if not folder.is_dir():
        raise ReportError(f"{folder}: no such directory")
    events_path, metrics_path = folder / EVENTS_FILE, folder / METRICS_FILE
    if not events_path.exists() and not metrics_path.exists():
        raise ReportError(f"{folder}: neither {EVENTS_FILE} nor {METRICS_FILE} found "
                          "(is it a guard's log_dir?)")
    run = RunLog(folder)
    if events_path.exists():
        for record, where in _read_jsonl(events_path, "an event", run.notes):
            try:
                run.report.add_record(record)
            except ValueError as err:
                raise ReportError(f"{where}: not an amp_runtime event ({err})") from None
    if metrics_path.exists():
        run.steps = [_step_record(record, where)
                     for record, where in _read_jsonl(metrics_path, "a step", run.notes)]
        run.steps.sort(key=lambda r: r["step"])
    if not len(run.report) and not run.steps:
        raise ReportError(f"{folder}: the logs are empty (did the guarded run take any step?)")
    return run


def _read_jsonl(path: Path, what: str, notes: List[str]) -> Iterator[Tuple[Any, str]]:
    """``(record, "path:line")`` for each line. A last line cut off mid-write (a run that
    was killed) is skipped with a note in ``notes``; any other bad line is a ReportError."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    except UnicodeDecodeError:
        raise ReportError(f"{path}: not a text file") from None
    except OSError as err:
        raise ReportError(f"cannot read {path}: {err.strerror}") from None
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except ValueError as err:
            if number == len(lines) and not text.endswith("\n"):
                notes.append(f"The last line of {path.name} was cut off (the run was "
                             f"interrupted?); the report leaves out {what} it held.")
                continue
            raise ReportError(f"{path}:{number}: not JSON: {err}") from None
        yield record, f"{path}:{number}"


def _step_record(record, where: str) -> Dict[str, Any]:
    """A metrics line; malformed per-layer statistics are left out rather than refused."""
    if not isinstance(record, dict) or isinstance(record.get("step"), bool) \
            or not isinstance(record.get("step"), int):
        raise ReportError(f'{where}: a metrics line needs an integer "step"')
    layers = record.get("layers")
    if layers is not None:
        record["layers"] = ({name: stats for name, stats in layers.items()
                             if isinstance(stats, dict)} if isinstance(layers, dict) else None)
    return record


# ---------------------------------------------------------------------------
# Diagnosis in plain words


def diagnose(run: RunLog) -> List[str]:
    """Short sentences, most serious first, saying what went wrong and where."""
    findings = []
    scale = _loss_scale_story(run)
    overflow = _first_overflow(run)
    headline = "; ".join(part for part in (scale, overflow) if part)
    if headline:
        findings.append(f"{headline[0].upper()}{headline[1:]}.")
    skipped = run.skipped_steps()
    if skipped and run.steps:
        findings.append(
            f"{len(skipped)} of {len(run.steps)} steps skipped by the GradScaler "
            f"({len(skipped) / len(run.steps):.0%}), first at step {skipped[0]}.")
    bad_loss = run.nonfinite_loss_steps()
    if bad_loss:
        findings.append(f"The loss was NaN/Inf from step {bad_loss[0]} ({len(bad_loss)} step(s)).")
    norm_steps, norms = run.series("grad_norm")
    if norms and max(norms) > Thresholds().grad_explosion:
        peak = max(range(len(norms)), key=norms.__getitem__)
        findings.append(
            f"The total gradient norm peaked at {norms[peak]:.3g} at step {norm_steps[peak]}.")
    if len(run.report):
        counts = run.report.codes()
        worst = min(run.report.groups(), key=lambda group: severity_rank(group.severity)).first
        severities = run.report.severities()
        by_severity = ", ".join(f"{severities[s]} {s}" for s in sorted(severities))
        frequent = ", ".join(f"{c} ×{n}" for c, n in counts.most_common(3))
        findings.append(
            f"{len(run.report)} event(s) ({by_severity}); most frequent {frequent}; "
            f"worst: {worst.code} {worst.name}{_where(worst)}.")
    if not (overflow or bad_loss or len(run.report)):
        _, scales = run.series("loss_scale")
        ended = f", loss scale ended at {scales[-1]:g}" if scales else ""
        findings.insert(0, f"No problems found: {len(run.steps)} step(s), no events{ended}.")
    return findings


def _is_nonfinite(value) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def _loss_scale_story(run: RunLog) -> str:
    """'loss scale collapsed to 1 at step 37 after 12 consecutive overflows', or how far
    it fell; '' when it did not end below a hundredth of where it started."""
    steps, scales = run.series("loss_scale")
    if not scales:
        return ""
    if min(scales) <= 1.0:
        at = next(i for i, s in enumerate(scales) if s <= 1.0)
        skipped = set(run.skipped_steps())
        streak = 0
        for step in reversed(steps[: at + 1]):
            if step not in skipped:
                break
            streak += 1
        after = f" after {streak} consecutive overflows" if streak else ""
        return f"loss scale collapsed to {scales[at]:g} at step {steps[at]}{after}"
    if scales[-1] < scales[0] * Thresholds().scale_decline_fraction:
        return f"loss scale fell from {scales[0]:g} to {scales[-1]:g} by step {steps[-1]}"
    return ""


def _first_overflow(run: RunLog) -> str:
    """'first overflow in blocks.3.attn (matmul, model.py:88) at step 7 [AMP101]', naming
    the first event localized to an op when an unlocalized one (a NaN loss) came earlier."""
    overflows = sorted((e for e in run.events if e.code in _OVERFLOW_CODES),
                       key=lambda e: (e.step is None, e.step or 0))
    if not overflows:
        return ""
    first = overflows[0]
    localized = next((e for e in overflows if e.code in _OP_CODES), None)
    if localized is None:
        return (f"first overflow {_place(first)}; no op was pinned down: rerun with per-op "
                "tracing (run --trace always, or guard(trace=\"always\")) to find it")
    if localized is first:
        return f"first overflow {_place(first)}"
    return f"first non-finite value {_place(first)}; first localized overflow {_place(localized)}"


def _place(event: Event) -> str:
    inside = ", ".join(p for p in (event.op, _short_source(event.source)) if p)
    parts = [
        f"in {event.module}" if event.module else "",
        f"({inside})" if inside else "",
        "" if event.step is None else f"at step {event.step}",
        f"[{event.code}]",
    ]
    return " ".join(p for p in parts if p)


def _short_source(source: Optional[str]) -> Optional[str]:
    """``file:line`` relative to the working folder when the file is inside it."""
    if not source or not os.path.isabs(source):
        return source
    try:
        relative = os.path.relpath(source)
    except ValueError:  # another drive (Windows)
        return source
    return source if relative.startswith(os.pardir) else relative


def _where(event: Event) -> str:
    where = event.where()
    return f" {where}" if where else ""


# ---------------------------------------------------------------------------
# Plots


@dataclass
class Plot:
    key: str
    title: str
    #: base64 PNG, or None when there was nothing to draw.
    png: Optional[str]
    empty_reason: str = ""


#: Every plot is this wide with the same margins, so their step axes line up on the page;
#: the left margin fits the longest layer name, the right one holds legends and colour bar.
_FIGURE_WIDTH, _FIGURE_HEIGHT, _DPI = 12, 3.2, 90
_RIGHT = 0.86
#: Layer names longer than this are shortened from the left ("…attn.qkv.weight").
_MAX_NAME = 30


def _plots(run: RunLog) -> Optional[List[Plot]]:
    """Every plot of the page, or None when matplotlib is not installed."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return None
    span = _step_span(run)
    left = _left_margin(run)
    plots = []
    for key, title, draw in _PLOTS:
        figure = Figure(figsize=(_FIGURE_WIDTH, _FIGURE_HEIGHT), dpi=_DPI)
        axes = figure.add_subplot()
        axes.grid(True, alpha=0.3)
        empty_reason = draw(run, axes, figure)
        if empty_reason:
            plots.append(Plot(key, title, None, empty_reason))
            continue
        axes.set_title(title, fontsize=11, loc="left")
        axes.set_xlabel("step")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # no step 2.5
        if span:
            axes.set_xlim(*span)
        height = figure.get_figheight()
        figure.subplots_adjust(left=left, right=_RIGHT, bottom=0.55 / height, top=1 - 0.4 / height)
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png")
        plots.append(Plot(key, title, base64.b64encode(buffer.getvalue()).decode("ascii")))
    return plots


def _step_span(run: RunLog) -> Optional[Tuple[float, float]]:
    """The x range every plot shows: from the first to the last step of the run."""
    steps = [r["step"] for r in run.steps] + [e.step for e in run.events if e.step is not None]
    return (min(steps) - 0.5, max(steps) + 0.5) if steps else None


def _left_margin(run: RunLog) -> float:
    """Room for the longest tick label on the left (layer names, event codes)."""
    names = run.layer_matrix("norm")[0]
    chars = max([6, *(len(_short_name(n)) for n in names)])
    return (chars * 4.6 + 60) / (_FIGURE_WIDTH * _DPI)  # 7-point characters, ticks, y label


def _legend(axes) -> None:
    """A legend in the right margin, where it hides no data."""
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0, fontsize=8)


def _short_name(name: str) -> str:
    return name if len(name) <= _MAX_NAME else "…" + name[-(_MAX_NAME - 1):]


def _with_gaps(run: RunLog, key: str) -> Tuple[List[int], List[float]]:
    """Every step and its value of ``key``, NaN where it is missing or not finite, so a
    line breaks there instead of bridging the steps it has no value for."""
    values = [_number(r.get(key)) for r in run.steps]
    return ([r["step"] for r in run.steps],
            [v if v is not None and math.isfinite(v) else math.nan for v in values])


def _draw_loss(run, axes, figure) -> str:
    bad = run.nonfinite_loss_steps()
    steps, losses = _with_gaps(run, "loss")
    if all(math.isnan(v) for v in losses) and not bad:
        return "no loss values were recorded"
    axes.plot(steps, losses, color="tab:blue", lw=1.2, marker=".", ms=3)  # dots: lone values
    if all(math.isnan(v) for v in losses):
        axes.set_yticks([])  # no finite loss: a value axis would be made up
    if bad:  # along the bottom edge, whatever the loss values are
        axes.scatter(bad, [0.04] * len(bad), transform=axes.get_xaxis_transform(), marker="x",
                     color="red", label=f"NaN/Inf loss ({len(bad)})", zorder=3, clip_on=False)
        _legend(axes)
    axes.set_ylabel("loss")
    return ""


def _draw_loss_scale(run, axes, figure) -> str:
    steps, scales = run.series("loss_scale")
    if not scales:
        return "no GradScaler loss scale was recorded (bf16 or no scaler)"
    axes.step(steps, scales, where="post", color="tab:purple", lw=1.2)
    axes.set_yscale("log", base=2)
    by_step = dict(zip(steps, scales))
    skipped = [s for s in run.skipped_steps() if s in by_step]
    if skipped:
        axes.scatter(skipped, [by_step[s] for s in skipped], marker="x", color="red",
                     label=f"skipped step ({len(skipped)})", zorder=3)
        _legend(axes)
    axes.set_ylabel("loss scale")
    return ""


def _draw_grad_norm(run, axes, figure) -> str:
    steps, norms = _with_gaps(run, "grad_norm")
    positive = [n for n in norms if n > 0]
    if not positive:
        return "no gradient norm was recorded"
    axes.plot(steps, norms, color="tab:green", lw=1.2, marker=".", ms=3)
    if max(positive) > 30 * min(positive):  # a log axis only where it helps: wide ranges
        axes.set_yscale("log")
    axes.set_ylabel("L2 norm")
    return ""


def _draw_layer_heatmap(run, axes, figure) -> str:
    names, steps, matrix = run.layer_matrix("norm")
    if not names:
        return "no per-layer gradient statistics were recorded"
    values = [[math.log10(v) if v and v > 0 and math.isfinite(v) else math.nan for v in row]
              for row in matrix]
    if all(math.isnan(v) for row in values for v in row):
        return "no per-layer gradient norm was finite and nonzero"
    rows_shown = min(len(names), MAX_HEATMAP_LABELS)
    figure.set_size_inches(_FIGURE_WIDTH, max(2.5, 1.2 + 0.22 * rows_shown))
    # each column spans from halfway to the previous step with statistics to halfway to
    # the next, so it sits at its own step even when steps in between have none
    middles = [(a + b) / 2 for a, b in zip(steps, steps[1:])]
    first_gap = steps[1] - steps[0] if len(steps) > 1 else 1
    last_gap = steps[-1] - steps[-2] if len(steps) > 1 else 1
    x_edges = [steps[0] - first_gap / 2, *middles, steps[-1] + last_gap / 2]
    image = axes.pcolormesh(x_edges, [i - 0.5 for i in range(len(names) + 1)], values,
                            cmap="viridis")
    axes.invert_yaxis()  # first layer on top
    every = math.ceil(len(names) / MAX_HEATMAP_LABELS)  # label every n-th layer of a deep model
    axes.set_yticks(range(0, len(names), every),
                    labels=[_short_name(n) for n in names[::every]], fontsize=7)
    figure.colorbar(image, cax=axes.inset_axes((1.02, 0, 0.02, 1)), label="log10 grad norm")
    axes.grid(False)
    return ""


def _draw_underflow(run, axes, figure) -> str:
    names, steps, matrix = run.layer_matrix("underflow_fraction")
    rows = [(name, row) for name, row in zip(names, matrix) if any(v is not None for v in row)]
    if not rows:
        return "no underflow fractions were recorded (they need fp16 gradients under a GradScaler)"
    peaks = {name: max(v for v in row if v is not None) for name, row in rows}
    if not any(peaks.values()):
        return (f"no gradient underflowed: the fraction was 0 in all {len(rows)} layer(s) "
                f"at every step with statistics")
    rows = sorted((item for item in rows if peaks[item[0]] > 0),  # layers that never did: none
                  key=lambda item: peaks[item[0]], reverse=True)
    for name, row in rows[:MAX_UNDERFLOW_LINES]:
        axes.plot(steps, [math.nan if v is None else v for v in row], lw=1.1,
                  label=_short_name(name))
    axes.set_ylim(0, max(0.02, max(peaks.values()) * 1.1))  # a fraction: never below zero
    axes.set_ylabel("nonzero, flushed or subnormal in fp16")
    _legend(axes)
    return ""


_SEVERITY_COLORS = {"P0": "#c62828", "P1": "#ef6c00", "P2": "#1565c0"}


def _draw_timeline(run, axes, figure) -> str:
    timed = [e for e in run.events if e.step is not None]
    if not timed:
        return "no events with a step"
    codes = sorted({e.code for e in timed})
    for severity, color in _SEVERITY_COLORS.items():
        chosen = [e for e in timed if e.severity == severity]
        if chosen:
            axes.scatter([e.step for e in chosen], [codes.index(e.code) for e in chosen],
                         color=color, marker="|", s=200, label=severity)
    axes.set_yticks(range(len(codes)), labels=codes, fontsize=8)
    axes.set_ylim(-0.7, len(codes) - 0.3)
    _legend(axes)
    return ""


_PLOTS: Sequence[Tuple[str, str, Callable]] = (
    ("loss", "Loss", _draw_loss),
    ("loss-scale", "Loss scale (log2), skipped steps marked", _draw_loss_scale),
    ("grad-norm", "Total gradient norm (unscaled, as applied)", _draw_grad_norm),
    ("layer-heatmap", "Per-layer gradient norm (layers × steps)", _draw_layer_heatmap),
    ("underflow", "Gradient underflow fraction in fp16, per layer", _draw_underflow),
    ("timeline", "Events timeline", _draw_timeline),
)


# ---------------------------------------------------------------------------
# The page

_STYLE = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:24px auto;
  max-width:1100px;color:#222;padding:0 12px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd}
.meta{color:#666;margin-bottom:14px}
.note{background:#eceff1;border-left:4px solid #78909c;padding:6px 12px}
.diagnosis{background:#fff8e1;border-left:4px solid #f9a825;padding:8px 16px}
.diagnosis.ok{background:#e8f5e9;border-color:#43a047}
figure{margin:10px 0} figure img{max-width:100%}
.missing{color:#777;font-style:italic;border:1px dashed #ccc;padding:8px}
table{border-collapse:collapse;width:100%;font-size:12px}
th,td{border:1px solid #ddd;padding:3px 6px;vertical-align:top;text-align:left}
th{background:#f5f5f5} td code{white-space:pre-wrap}
.P0{color:#c62828;font-weight:600} .P1{color:#ef6c00} .P2{color:#1565c0}
summary{cursor:pointer;border-bottom:1px solid #ddd;margin:28px 0 8px}
summary h2{display:inline;border:0}
"""
_NO_MATPLOTLIB = (
    "Plots need matplotlib, which is not installed "
    '(<code>pip install "flake8-amp[runtime]"</code>); the diagnosis and events are below.'
)


def render(run: RunLog) -> str:
    """The HTML text of the report of one run (one process)."""
    counts = f"{len(run.steps)} step(s), {len(run.report)} event(s)"
    return _page(run.log_dir, counts, _run_body(run))


def render_ranks(log_dir: Path, runs: Sequence[RunLog], notes: Sequence[str] = ()) -> str:
    """The HTML text of one report over the ranks of a distributed run: which rank failed
    first and at which step, a table of the ranks, then each rank's own report."""
    esc = html.escape
    steps = max((len(run.steps) for run in runs), default=0)
    events = sum(len(run.report) for run in runs)
    parts = [*(f'<p class="note">{esc(note)}</p>' for note in notes)]
    first = first_failure(runs)
    healthy = first is None
    parts += [
        f'<section id="ranks" class="diagnosis{" ok" if healthy else ""}">',
        f"<h2>Ranks</h2><p>{esc(_ranks_headline(runs, first))}</p>",
        "<table><tr><th>rank</th><th>steps</th><th>events</th><th>worst</th>"
        "<th>first event</th></tr>",
    ]
    for run in runs:
        worst = run.report.worst()
        earliest = _earliest(run.events)
        parts.append(
            f'<tr><td><a href="#rank-{run.rank}">{run.rank}</a></td><td>{len(run.steps)}</td>'
            f"<td>{len(run.report)}</td><td>{_severity_cell(worst) if worst else ''}</td>"
            f"<td>{esc(_describe(earliest)) if earliest else ''}</td></tr>")
    parts.append("</table></section>")
    for run in runs:
        failing = first is not None and first[0] is run
        parts += [
            f'<section id="rank-{run.rank}"><details{" open" if failing else ""}>',
            f"<summary><h2>Rank {run.rank}</h2></summary>",
            *_run_body(run, prefix=f"rank-{run.rank}-", heading="h3"),
            "</details></section>",
        ]
    counts = f"{len(runs)} rank(s), up to {steps} step(s), {events} event(s)"
    return _page(log_dir, counts, parts)


def _page(log_dir: Path, counts: str, body: List[str]) -> str:
    esc = html.escape
    return "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>amp_runtime report — {esc(log_dir.name)}</title>",
        f"<style>{_STYLE}</style></head><body>",
        "<h1>amp_runtime report</h1>",
        f'<div class="meta">{esc(str(log_dir))} — {counts}</div>',
        *body,
        "</body></html>",
    ])


def _run_body(run: RunLog, prefix: str = "", heading: str = "h2") -> List[str]:
    """Notes, diagnosis, plots and event tables of one run; element ids start with ``prefix``."""
    esc = html.escape
    diagnosis = diagnose(run)
    healthy = diagnosis[0].startswith("No problems found")
    parts = [
        *(f'<p class="note">{esc(note)}</p>' for note in run.notes),
        f'<section id="{prefix}diagnosis" class="diagnosis{" ok" if healthy else ""}">',
        f"<{heading}>Diagnosis</{heading}><ul>",
        *(f"<li>{esc(sentence)}</li>" for sentence in diagnosis),
        "</ul></section>",
        f'<section id="{prefix}plots"><{heading}>Plots</{heading}>',
    ]
    plots = _plots(run)
    if plots is None:
        parts.append(f'<p class="missing" id="{prefix}no-matplotlib">{_NO_MATPLOTLIB}</p>')
    for plot in plots or ():
        figure_id = f"{prefix}plot-{plot.key}"
        if plot.png is None:
            parts.append(f'<figure class="plot missing" id="{figure_id}">'
                         f"{esc(plot.title)}: {esc(plot.empty_reason)}</figure>")
        else:
            parts.append(f'<figure class="plot" id="{figure_id}"><img alt="{esc(plot.title)}" '
                         f'src="data:image/png;base64,{plot.png}"></figure>')
    parts.append("</section>")
    parts += _section(f"{prefix}summary", "Events by code and place", _summary_rows(run), heading)
    parts += _section(f"{prefix}events", "Events", _event_rows(run), heading)
    shown = min(len(run.events), MAX_EVENT_ROWS)
    if len(run.report) > shown:
        more = len(run.report) - shown
        parts.append(f"<p>… and {more} more event(s), counted in the summary above; "
                     f"{EVENTS_FILE} holds the first of each and their totals.</p>")
    return parts


#: Where in a training step each runtime check fires, in the order the step runs: the
#: forward's ops, the loss when backward starts, the gradients at the optimizer step, the
#: loss scale at the scaler's update. Under DDP the ranks take their steps together, so a
#: rank whose loss was NaN failed before the ranks whose all-reduced gradients then were.
_STEP_PHASES = {"AMP112": 1, "AMP103": 2, "AMP104": 2, "AMP105": 2, "AMP106": 2,
                "AMP107": 3, "AMP108": 3, "AMP109": 3}


def _when(event: Event) -> Tuple[int, int]:
    """(step, phase in the step): events before any step come first."""
    return -1 if event.step is None else event.step, _STEP_PHASES.get(event.code, 0)


def _earliest(events: Sequence[Event]) -> Optional[Event]:
    """The event that happened first, the worst at a tie."""
    return min(events, default=None, key=lambda e: (*_when(e), severity_rank(e.severity)))


def first_failure(runs: Sequence[RunLog]) -> Optional[Tuple[RunLog, Event]]:
    """The rank whose first event came first (step, then phase in the step; the lowest rank
    at a tie), with that event; None when no rank had one."""
    firsts = [(run, _earliest(run.events)) for run in runs if run.events]
    return min(firsts, default=None, key=lambda item: (*_when(item[1]), item[0].rank))


def _describe(event: Event) -> str:
    step = "before the first step" if event.step is None else f"step {event.step}"
    return f"{step}: {event.code} ({event.severity}) {event.name}{_where(event)}"


def _ranks_headline(runs: Sequence[RunLog], first: Optional[Tuple[RunLog, Event]]) -> str:
    if first is None:
        return f"No problems found on any of the {len(runs)} rank(s)."
    run, event = first
    failing = sum(1 for r in runs if r.events)
    return (f"First failing rank: rank {run.rank} at {_describe(event)}. "
            f"{failing} of {len(runs)} rank(s) had events.")


Table = Tuple[Sequence[str], List[List[str]]]


def _section(section_id: str, title: str, table: Table, heading: str = "h2") -> List[str]:
    """A titled section holding one table (header names, rows of cell HTML), or "No events."."""
    header, rows = table
    lines = [f'<section id="{section_id}"><{heading}>{title}</{heading}>']
    if not rows:
        return lines + ["<p>No events.</p></section>"]
    lines.append("<table><tr>" + "".join(f"<th>{h}</th>" for h in header) + "</tr>")
    lines += ["<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows]
    return lines + ["</table></section>"]


def _severity_cell(severity: str) -> str:
    return f'<span class="{html.escape(severity)}">{html.escape(severity)}</span>'


def _summary_rows(run: RunLog) -> Table:
    """One row per (code, source, module), worst severity first, with exact counts."""
    esc = html.escape
    groups = sorted(run.report.groups(),
                    key=lambda group: (severity_rank(group.severity), group.code))
    rows = [
        [esc(group.code), _severity_cell(group.severity), str(group.count), group.steps(),
         esc(group.first.op or ""), esc(group.module or ""), esc(group.source or ""),
         esc(group.first.message)]
        for group in groups
    ]
    header = ("code", "severity", "count", "steps", "op", "module", "source", "message")
    return header, rows


def _event_rows(run: RunLog) -> Table:
    """The events kept in full (up to MAX_EVENT_ROWS) with the text of their source lines."""
    esc = html.escape
    rows = []
    for e in run.events[:MAX_EVENT_ROWS]:
        line = _source_text(e.source)
        source = esc(e.source or "") + (f"<br><code>{esc(line)}</code>" if line else "")
        rows.append([_step(e), esc(e.code), _severity_cell(e.severity), esc(e.op or ""),
                     esc(e.module or ""), source, esc(e.message)])
    return ("step", "code", "severity", "op", "module", "source", "message"), rows


def _step(event: Event) -> str:
    return "" if event.step is None else str(event.step)


def _source_text(source: Optional[str]) -> str:
    """The text of the user's source line ``file:line``, when the file is still there."""
    if not source or ":" not in source:
        return ""
    path, _, number = source.rpartition(":")
    return linecache.getline(path, int(number)).strip() if number.isdigit() else ""


def build_report(log_dir: Union[str, Path], out: Optional[Union[str, Path]] = None) -> Path:
    """Write ``report.html`` (default: inside ``log_dir``) and return its path. A folder
    whose logs are in ``rank-N`` subfolders (a distributed run) gets one page over all ranks."""
    folder = Path(log_dir)
    own_logs = (folder / EVENTS_FILE).exists() or (folder / METRICS_FILE).exists()
    ranks = [] if own_logs else rank_dirs(folder)
    if ranks:
        runs, notes = _load_ranks(folder, ranks)
        text = render_ranks(folder, runs, notes)
    elif not own_logs and (folder / LOG_FOLDER).is_dir():  # a trainer's output folder
        raise ReportError(f"{folder}: no logs here; the guard's are in {folder / LOG_FOLDER}")
    else:
        text = render(load_run(folder))
    target = Path(out) if out is not None else folder / REPORT_FILE
    try:
        target.write_text(text, encoding="utf-8")
    except OSError as err:
        raise ReportError(f"cannot write {target}: {err.strerror}") from None
    return target


def _load_ranks(folder: Path, ranks: Sequence[Tuple[int, Path]]) -> Tuple[List[RunLog], List[str]]:
    """Every rank's logs; a rank folder without usable logs is a note on the page (a rank
    that died early must not hide the others), unless no rank has any."""
    runs, notes = [], []
    for rank, path in ranks:
        try:
            run = load_run(path)
        except ReportError as err:
            notes.append(f"Rank {rank} is left out: {err}")
            continue
        run.rank = rank
        runs.append(run)
    if not runs:
        raise ReportError(f"{folder}: no rank folder holds usable logs ({notes[0]})")
    return runs, notes
