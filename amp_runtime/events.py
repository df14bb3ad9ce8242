"""What a guard records: events, the report that collects them, and GuardError.

Torch-free on purpose: the CLI's ``report`` command and the pytest plugin read
events without importing torch.
"""
from __future__ import annotations

import json
import os
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

from flake8_amp.catalog import STATIC, rule, severity_rank

#: Version tag of ``Report.to_json()`` (2: events kept, exact counts and groups; the log holds
#: totals records for repeated events, ``REPEATS``).
SCHEMA = "amp_runtime.events/2"


@dataclass
class Event:
    """One finding of the runtime guard.

    ``step`` is the 0-based index of the training step the event happened in (steps
    completed before it), ``None`` before any step; ``source`` is ``file:line`` of the
    user's code that called the op.
    """

    code: str
    name: str
    severity: str
    message: str
    op: Optional[str] = None
    module: Optional[str] = None
    step: Optional[int] = None
    source: Optional[str] = None
    rank: Optional[int] = None
    details: Dict[str, Any] = field(default_factory=dict)

    @classmethod
    def create(cls, code: str, *, severity: Optional[str] = None, **fields: Any) -> "Event":
        """An event whose name, default severity and message come from the catalog.

        ``fields`` fills the catalog's message template; those that are Event fields
        (``op``, ``module``, ``step``, ``source``, ``rank``, ``details``) are also set.
        """
        entry = rule(code)
        own = {k: fields[k] for k in _LOCATION_FIELDS if k in fields}
        return cls(
            code=code,
            name=entry.name,
            severity=severity or entry.severity,
            message=entry.format(**fields),
            **own,
        )

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> "Event":
        """An event from ``to_json()``'s dict; ValueError says what makes ``data`` none."""
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        for key in ("code", "name", "severity", "message"):
            if key not in data:
                raise ValueError(f"no {key!r}")
        for key, types in _JSON_TYPES.items():
            value = data.get(key, {} if key == "details" else None)
            if not isinstance(value, types) or isinstance(value, bool):
                raise ValueError(f"{key!r} is {value!r}")
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})

    def where(self) -> str:
        """Module, call and source in one phrase, for messages."""
        parts = (self.module and f"in {self.module}",
                 "calls" in self.details and which_call(self.details),
                 self.source and f"at {self.source}")
        return " ".join(p for p in parts if p)

    def __str__(self) -> str:
        step = "" if self.step is None else f" [step {self.step}]"
        op = f" {self.op}:" if self.op else ""
        where = self.where()
        text = f"{self.code} ({self.severity}){step}{op} {self.message}"
        return f"{text} {where}" if where else text


_LOCATION_FIELDS = ("op", "module", "step", "source", "rank", "details")
_OPTIONAL_STR, _OPTIONAL_INT = (str, type(None)), (int, type(None))
#: Event fields and the types a valid JSON record gives them.
_JSON_TYPES = {"code": str, "name": str, "severity": str, "message": str, "op": _OPTIONAL_STR,
               "module": _OPTIONAL_STR, "step": _OPTIONAL_INT, "source": _OPTIONAL_STR,
               "rank": _OPTIONAL_INT, "details": dict}


def _seen_on_watched_steps(code: str) -> bool:
    """The guard checks ``code`` on watched steps only (``Thresholds.watch_steps``/``watch_every``):
    a code pattern other than those attached to the step-level checks (where backward starts,
    the optimizer and clip calls, the scaler: AMP005, AMP006, AMP008, AMP010), or a sampled
    numeric check."""
    if code in ("AMP005", "AMP006", "AMP008", "AMP010"):
        return False
    return STATIC in rule(code).enforcers or code in ("AMP110", "AMP111")


def which_call(details: Dict[str, Any]) -> str:
    """``(forward call 3 of 4)``: which of a step's calls of the model a replay found it in."""
    return f"(forward call {details.get('call')} of {details.get('calls')})"


class GuardError(RuntimeError):
    """Raised under ``policy="raise"``; ``.event`` is the event that stopped the run."""

    def __init__(self, event: Event):
        super().__init__(str(event))
        self.event = event

    def end_at_users_line(self) -> None:
        """Cut the traceback after the user's last frame before the guard's: the guard's own
        frames that raised it, and torch's between them (``optimizer.step`` running the guard's
        hook), only push the user's line off the screen. Leading frames of amp_runtime
        (``python -m amp_runtime run`` running the script) stay."""
        torch = sys.modules.get("torch")
        torch_dir = os.path.dirname(torch.__file__) + os.sep if torch is not None else PACKAGE_DIR
        tb = self.__traceback__
        while tb is not None and _in_package(tb):
            tb = tb.tb_next
        users = None
        while tb is not None and not _in_package(tb):
            if not tb.tb_frame.f_code.co_filename.startswith(torch_dir):
                users = tb
            tb = tb.tb_next
        if users is not None:
            users.tb_next = None


def _in_package(tb) -> bool:
    return tb.tb_frame.f_code.co_filename.startswith(PACKAGE_DIR)


#: amp_runtime's own folder: frames in it are the guard's, not the user's.
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


class AmpRuntimeWarning(UserWarning):
    """Category of the warnings a guard issues under ``policy="warn"``."""


#: The code of a failure of the guard's own code (``containment.py``): never raised, never a
#: finding that fails a test.
GUARD_FAILURE = "AMP100"

#: What the guard raises on purpose: a finding under ``policy="raise"``, or its warning turned
#: into an error by a warnings filter. They pass through the guard's containment of its own
#: failures (``containment.py``); everything else its code raises is a failure of the guard.
FINDINGS = (GuardError, AmpRuntimeWarning)

#: How many occurrences of one code at one place (source, module) a report keeps in full: the
#: first ones. Beyond them it keeps the latest occurrence and exact counts (``EventGroup``).
KEPT_OCCURRENCES = 10


class EventGroup:
    """Every occurrence of one code at one place: exact count, severities and first/last step;
    the first ``KEPT_OCCURRENCES`` occurrences and the latest one kept in full."""

    __slots__ = ("code", "source", "module", "count", "severities", "first_step", "last_step",
                 "kept", "latest")

    def __init__(self, code: str, source: Optional[str], module: Optional[str]):
        self.code, self.source, self.module = code, source, module
        self.count = 0
        self.severities: Counter = Counter()
        self.first_step: Optional[int] = None
        self.last_step: Optional[int] = None
        #: ``(sequence number in the report, event)`` of the first occurrences.
        self.kept: List[Tuple[int, Event]] = []
        #: The latest occurrence, once there are more than the kept ones.
        self.latest: Optional[Tuple[int, Event]] = None

    @property
    def key(self) -> Tuple[str, Optional[str], Optional[str]]:
        return self.code, self.source, self.module

    @property
    def first(self) -> Event:
        return self.kept[0][1]

    @property
    def last(self) -> Event:
        return (self.latest or self.kept[-1])[1]

    @property
    def severity(self) -> str:
        """The worst severity among the occurrences."""
        return min(self.severities, key=severity_rank)

    def occurrences(self) -> List[Event]:
        """The occurrences kept in full, oldest first."""
        return [event for _, event in self._numbered()]

    def _numbered(self) -> List[Tuple[int, Event]]:
        return self.kept + ([self.latest] if self.latest else [])

    def add(self, number: int, event: Event, count: int = 1) -> None:
        self.count += count
        self.severities[event.severity] += count
        if event.step is not None:
            self.first_step = event.step if self.first_step is None else min(self.first_step,
                                                                             event.step)
            self.last_step = event.step if self.last_step is None else max(self.last_step,
                                                                           event.step)
        if len(self.kept) < KEPT_OCCURRENCES:
            self.kept.append((number, event))
        else:
            self.latest = (number, event)

    def steps(self) -> str:
        """``"7"``, ``"7-9120"`` or ``"-"``: the steps of the first and the last occurrence."""
        if self.first_step is None:
            return "-"
        if self.first_step == self.last_step:
            return str(self.first_step)
        return f"{self.first_step}-{self.last_step}"

    def to_json(self) -> Dict[str, Any]:
        return {
            "code": self.code, "source": self.source, "module": self.module,
            "severity": self.severity, "count": self.count,
            "severities": dict(sorted(self.severities.items())),
            "first_step": self.first_step, "last_step": self.last_step,
        }

    def repeats_record(self) -> Dict[str, Any]:
        """The ``events.jsonl`` line holding this group's exact totals and latest occurrence."""
        return {"record": REPEATS, **self.to_json(), "latest": self.last.to_json()}


#: ``"record"`` of an ``events.jsonl`` line with a group's totals (other lines are events).
REPEATS = "repeats"


class Report:
    """The events of one guard: every occurrence counted, a bounded number kept in full.

    ``events`` lists the occurrences kept, in the order they happened: per code and place
    (source, module) the first ``KEPT_OCCURRENCES`` and the latest one. Counts, severities and
    first/last steps (``codes()``, ``len()``, ``groups()``, ``summary()``, ``to_json()``) are exact
    for all. A month-long run with an event at every step keeps a few events per place.
    """

    def __init__(self, events: Iterable[Event] = ()):
        self._groups: Dict[tuple, EventGroup] = {}
        self._added = 0
        self._events: Optional[List[Event]] = []
        for event in events:
            self.add(event)

    def add(self, event: Event) -> EventGroup:
        """Count ``event`` (keeping it in full while its group keeps occurrences); its group."""
        return self._add(event, 1)

    def _add(self, event: Event, count: int) -> EventGroup:
        key = (event.code, event.source, event.module)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = EventGroup(*key)
        self._added += 1
        if len(group.kept) < KEPT_OCCURRENCES and self._events is not None:
            self._events.append(event)  # kept in full: the list stays valid
        else:
            self._events = None  # rebuilt on demand: the latest occurrence replaced one
        group.add(self._added, event, count)
        return group

    @property
    def events(self) -> List[Event]:
        """The occurrences kept in full, in the order they happened."""
        if self._events is None:
            numbered = [item for group in self._groups.values() for item in group._numbered()]
            self._events = [event for _, event in sorted(numbered, key=lambda item: item[0])]
        return self._events

    def groups(self) -> List[EventGroup]:
        """One group per (code, source, module), in order of first occurrence."""
        return list(self._groups.values())

    def __len__(self) -> int:
        """Every occurrence, also those not kept in full."""
        return sum(group.count for group in self._groups.values())

    def __iter__(self):
        return iter(self.events)

    def codes(self) -> Counter:
        """Occurrences per code (exact)."""
        counts: Counter = Counter()
        for group in self._groups.values():
            counts[group.code] += group.count
        return counts

    def severities(self) -> Counter:
        """Occurrences per severity (exact)."""
        counts: Counter = Counter()
        for group in self._groups.values():
            counts.update(group.severities)
        return counts

    def by_code(self, code_prefix: str) -> List[Event]:
        """The kept occurrences of the codes starting with ``code_prefix``."""
        return [e for e in self.events if e.code.startswith(code_prefix)]

    def worst(self) -> Optional[str]:
        return min(self.severities(), key=severity_rank, default=None)

    def grouped(self) -> List[List[Event]]:
        """The kept occurrences of each group (``groups()``), in order of first occurrence."""
        return [group.occurrences() for group in self._groups.values()]

    def select(self, keep: Callable[[EventGroup], bool]) -> "Report":
        """A report of the groups ``keep`` accepts, counts and kept occurrences as they are."""
        selected = Report()
        for key, group in self._groups.items():
            if keep(group):
                selected._groups[key] = group
        selected._added, selected._events = self._added, None
        return selected

    def summary(self, width: Optional[int] = None) -> str:
        """A text table: one row per (code, source, module) with its exact count and the steps
        of its first and last occurrence.

        Messages (of the first occurrence) are cut to fit ``width`` columns (a terminal's); by
        default they are whole, since the message holds the fix.
        """
        if not self._groups:
            return "amp_runtime: no events"
        header = ("code", "sev", "count", "steps", "op", "module", "source", "message")
        rows = []
        for group in self._groups.values():
            first = group.first
            rows.append((
                group.code, group.severity, str(group.count), group.steps(),
                first.op or "-", group.module or "-", group.source or "-", first.message,
            ))
        rows.sort(key=lambda r: (severity_rank(r[1]), r[0]))
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header[:-1])]
        fixed = sum(widths) + 2 * len(widths)
        msg_width = max(20, width - fixed) if width else None

        def line(cells):
            head = "  ".join(c.ljust(w) for c, w in zip(cells, widths))
            text = cells[-1]
            if msg_width is not None and len(text) > msg_width:
                text = text[: msg_width - 1] + "…"
            return f"{head}  {text}"

        lines = [line(header), line(tuple("-" * w for w in widths) + ("-" * 7,))]
        lines += [line(r) for r in rows]
        if any(_seen_on_watched_steps(group.code) for group in self._groups.values()):
            lines.append("(AMP001-AMP004, AMP007, AMP009, AMP011, AMP110 and AMP111 are checked "
                         "on watched steps, by default the first 8 and then one in 16: their steps "
                         "are the ones they were seen on)")
        total = self.severities()
        counts = ", ".join(f"{total[s]} {s}" for s in sorted(total))
        lines.append(f"{sum(total.values())} event(s): {counts}")
        return "\n".join(lines)

    def to_json(self) -> Dict[str, Any]:
        """Schema ``amp_runtime.events/2``: ``{"schema", "events": [Event...] (the kept
        occurrences), "counts": {code: n}, "groups": [EventGroup.to_json()...]}``."""
        return {
            "schema": SCHEMA,
            "events": [e.to_json() for e in self.events],
            "counts": dict(sorted(self.codes().items())),
            "groups": [group.to_json() for group in self._groups.values()],
        }

    def add_record(self, record: Any) -> None:
        """Add one ``events.jsonl`` line's JSON: an event, or a group's repeats record (its
        totals, which replace those counted so far). ValueError says what makes it neither."""
        if isinstance(record, dict) and record.get("record") == REPEATS:
            self._add_repeats(record)
        else:
            self.add(Event.from_json(record))

    def _add_repeats(self, record: Dict[str, Any]) -> None:
        latest = Event.from_json(record.get("latest"))
        count, severities = record.get("count"), record.get("severities")
        if not (isinstance(count, int) and isinstance(severities, dict)
                and all(isinstance(n, int) for n in severities.values())):
            raise ValueError("a repeats record needs an integer count and severities")
        group = self._groups.get((latest.code, latest.source, latest.module))
        seen = 0 if group is None else group.count
        if count <= seen:  # an older total: the events after it were read already
            return
        group = self._add(latest, count - seen)
        group.severities = Counter(severities)
        for key in ("first_step", "last_step"):
            value = record.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(group, key, value)

    @classmethod
    def from_jsonl(cls, path: Union[str, Path]) -> "Report":
        """Read an ``events.jsonl`` file written by a guard's ``log_dir``."""
        report = cls()
        with open(path, encoding="utf-8") as fh:
            for number, text in enumerate(fh, 1):
                if not text.strip():
                    continue
                try:
                    report.add_record(json.loads(text))
                except ValueError as err:
                    raise ValueError(f"{path}:{number}: not an amp_runtime event ({err})") from None
        return report
