"""The rule catalog, the runtime event model and the thresholds."""
import json
import re
from pathlib import Path

import pytest

from amp_runtime.events import Event, GuardError, Report
from amp_runtime.thresholds import Thresholds
from flake8_amp.catalog import RULES, RUNTIME, SEVERITIES, STATIC, matches, rule

DESIGN = Path(__file__).resolve().parents[2] / "shared" / "DESIGN.md"


def design_rows():
    """(code, name, severity, static?, runtime?) from DESIGN.md's two rule tables."""
    rows = []
    for line in DESIGN.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if cells and re.fullmatch(r"AMP\d{3}", cells[0]):
            if len(cells) == 5:  # code-pattern table: code, name, static, runtime, severity
                static, runtime = cells[2] != "—", cells[3] != "—"
                rows.append((cells[0], cells[1], cells[4], static, runtime))
            else:  # numeric health table: runtime only
                rows.append((cells[0], cells[1], cells[3], False, True))
    return rows


@pytest.mark.skipif(not DESIGN.exists(), reason="../shared/DESIGN.md is not beside this checkout")
def test_catalog_matches_design_contract():
    rows = design_rows()
    assert len(rows) == 23
    for code, name, severity, static, runtime in rows:
        entry = rule(code)
        assert entry.name == name
        # DESIGN gives AMP104 as "P0/P1": P0 is the worst case, which the catalog holds.
        assert entry.severity == severity.split("/")[0]
        assert (STATIC in entry.enforcers, RUNTIME in entry.enforcers) == (static, runtime)
    # Codes that report the tools' own trouble, not the user's: AMP000 (the linter could not
    # analyse a file) and AMP100 (the guard's own code failed; added with issue 11, beside the
    # contract's tables, which list findings).
    assert set(RULES) == {r[0] for r in rows} | {"AMP000", "AMP100"}


@pytest.mark.parametrize("code", sorted(RULES))
def test_every_rule_is_complete(code):
    entry = RULES[code]
    assert entry.code == code
    assert entry.severity in SEVERITIES
    assert entry.enforcers and entry.enforcers <= {STATIC, RUNTIME}
    for text in (entry.title, entry.rationale, entry.fix, entry.message):
        assert text.strip()
    fields = set(re.findall(r"{(\w+)", entry.message + entry.hint))
    rendered = entry.format(**{f: 1.5 for f in fields})
    assert "{" not in rendered
    if entry.hint:
        assert rendered.endswith(")")


def test_format_names_the_missing_field():
    with pytest.raises(KeyError, match="AMP104 message needs field 'limit'"):
        rule("AMP104").format(norm=3.0)


def test_unknown_code_is_a_clear_error():
    with pytest.raises(KeyError, match="unknown flake8-amp code 'AMP999'"):
        rule("AMP999")


@pytest.mark.parametrize(
    "code, select, ignore, expected",
    [
        ("AMP101", None, None, True),
        ("AMP101", ["AMP1"], None, True),
        ("AMP001", ["AMP1"], None, False),
        ("AMP102", ["AMP1"], ["AMP102"], False),
        ("AMP102", ["AMP102"], ["AMP1"], True),
        ("AMP101", None, ["AMP"], False),
    ],
)
def test_prefix_selection_longest_prefix_wins(code, select, ignore, expected):
    assert matches(code, select, ignore) is expected


def test_event_create_fills_name_severity_and_message_from_catalog():
    event = Event.create("AMP104", severity="P1", norm=250.0, limit=100.0, op="step", step=3)
    assert (event.name, event.severity, event.step, event.op) == ("grad-explosion", "P1", 3, "step")
    assert event.message.startswith("total gradient norm 250 (unscaled) exceeds 100")
    assert "AMP104 (P1) [step 3] step:" in str(event)


def test_report_json_round_trip_through_events_jsonl(tmp_path):
    events = [
        Event.create("AMP101", op="linear", module="blocks.2.fc2", source="m.py:9", step=4,
                     kind="inf"),
        Event.create("AMP102", op="linear", module="blocks.2.fc2", source="m.py:9", step=5,
                     value=61000.0),
        Event.create("AMP102", op="linear", module="blocks.2.fc2", source="m.py:9", step=6,
                     value=62000.0),
    ]
    log = tmp_path / "events.jsonl"
    log.write_text("".join(json.dumps(e.to_json()) + "\n" for e in events), encoding="utf-8")
    report = Report.from_jsonl(log)
    assert report.to_json() == Report(events).to_json()
    assert report.to_json()["counts"] == {"AMP101": 1, "AMP102": 2}
    assert report.worst() == "P0"


def test_report_summary_groups_by_code_and_source_with_counts():
    report = Report([
        Event.create("AMP102", op="linear", source="m.py:9", value=61000.0),
        Event.create("AMP102", op="linear", source="m.py:9", value=62000.0),
        Event.create("AMP112", source="train.py:30", kind="nan", cause=""),
    ])
    lines = report.summary().splitlines()
    assert lines[0].split()[:4] == ["code", "sev", "count", "steps"]
    body = [line.split() for line in lines[2:-1]]
    assert [(row[0], row[2]) for row in body] == [("AMP112", "1"), ("AMP102", "2")]
    assert lines[-1] == "3 event(s): 1 P0, 2 P1"
    assert Report().summary() == "amp_runtime: no events"


def test_report_summary_says_code_patterns_are_seen_on_watched_steps_only():
    step_level = Report([Event.create("AMP112", source="train.py:30", kind="nan", cause=""),
                         Event.create("AMP008", source="train.py:31")])
    assert "watched steps" not in step_level.summary()
    pattern = Report([Event.create("AMP002", source="train.py:31", loss="mse_loss",
                                   arg="logits", step=16)])
    assert "AMP110 and AMP111 are checked on watched steps" in pattern.summary()


def test_report_summary_keeps_whole_messages_unless_given_a_width():
    report = Report([Event.create("AMP112", source="train.py:30", kind="nan", cause="")])
    message = report.events[0].message
    assert message in report.summary()
    narrow = report.summary(width=80)
    assert message not in narrow and max(len(line) for line in narrow.splitlines()) <= 80


def test_corrupt_events_file_names_the_line(tmp_path):
    log = tmp_path / "events.jsonl"
    log.write_text('{"code": "AMP101"}\nnot json\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"events.jsonl:1: not an amp_runtime event"):
        Report.from_jsonl(log)


def test_guard_error_carries_the_event():
    event = Event.create("AMP112", kind="nan", cause="")
    error = GuardError(event)
    assert error.event is event and "AMP112" in str(error)


def test_thresholds_validate():
    assert Thresholds().near_overflow == 60000.0
    with pytest.raises(ValueError, match="grad_explosion_p0 must be >= grad_explosion"):
        Thresholds(grad_explosion=500.0, grad_explosion_p0=100.0)
    with pytest.raises(ValueError, match="sample_every must be >= 1"):
        Thresholds(sample_every=0)
    with pytest.raises(ValueError, match="near_overflow must be a non-negative number"):
        Thresholds(near_overflow="big")
