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
from typing import Any, Dict, Iterable, List, Optional, Union

from flake8_amp.catalog import rule, severity_rank

#: Version tag of ``Report.to_json()`` and of each ``events.jsonl`` line.
SCHEMA = "amp_runtime.events/1"


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
        """Module and source in one phrase, for messages."""
        parts = (self.module and f"in {self.module}", self.source and f"at {self.source}")
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


class Report:
    """The events of one guard, in the order they happened."""

    def __init__(self, events: Iterable[Event] = ()):
        self.events: List[Event] = list(events)

    def add(self, event: Event) -> None:
        self.events.append(event)

    def __len__(self) -> int:
        return len(self.events)

    def __iter__(self):
        return iter(self.events)

    def codes(self) -> Counter:
        return Counter(e.code for e in self.events)

    def by_code(self, code_prefix: str) -> List[Event]:
        return [e for e in self.events if e.code.startswith(code_prefix)]

    def worst(self) -> Optional[str]:
        return min((e.severity for e in self.events), key=severity_rank, default=None)

    def grouped(self) -> List[List[Event]]:
        """Events grouped by (code, source, module), in order of first occurrence."""
        groups: Dict[tuple, List[Event]] = {}
        for e in self.events:
            groups.setdefault((e.code, e.source, e.module), []).append(e)
        return list(groups.values())

    def summary(self, width: Optional[int] = None) -> str:
        """A text table: one row per (code, source, module) with a count.

        Messages are cut to fit ``width`` columns (a terminal's); by default they are whole,
        since the message holds the fix.
        """
        if not self.events:
            return "amp_runtime: no events"
        header = ("code", "sev", "count", "step", "op", "module", "source", "message")
        rows = []
        for group in self.grouped():
            first = group[0]
            rows.append((
                first.code, first.severity, str(len(group)),
                "-" if first.step is None else str(first.step),
                first.op or "-", first.module or "-", first.source or "-", first.message,
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
        total = Counter(e.severity for e in self.events)
        counts = ", ".join(f"{total[s]} {s}" for s in sorted(total))
        lines.append(f"{len(self.events)} event(s): {counts}")
        return "\n".join(lines)

    def to_json(self) -> Dict[str, Any]:
        """Stable schema: ``{"schema", "events": [Event...], "counts": {code: n}}``."""
        return {
            "schema": SCHEMA,
            "events": [e.to_json() for e in self.events],
            "counts": dict(sorted(self.codes().items())),
        }

    @classmethod
    def from_jsonl(cls, path: Union[str, Path]) -> "Report":
        """Read an ``events.jsonl`` file written by a guard's ``log_dir``."""
        events = []
        with open(path, encoding="utf-8") as fh:
            for number, text in enumerate(fh, 1):
                if not text.strip():
                    continue
                try:
                    events.append(Event.from_json(json.loads(text)))
                except ValueError as err:
                    raise ValueError(f"{path}:{number}: not an amp_runtime event ({err})") from None
        return cls(events)
