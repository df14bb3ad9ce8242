"""The guard's TorchFunctionMode: one dict look-up per op, handlers only where needed.

Every monitor's ``op_handlers`` are merged into one table mapping a torch function to a
small closure that runs the ``before`` handlers, the op and the ``after`` handlers.
Functions absent from the table go straight through. When per-op tracing is on, a
tracer (an ``after`` handler) is added to every entry and used for every other function.

The guard keeps the mode on the stack on watched steps only (``guard.py``); a few functions
that step-level checks need on every step reach the same handlers through
``entry_points.py``. The mode stack is per thread: ops run by other threads are not
seen. Code compiled with ``torch.compile`` runs unchecked: while dynamo traces, the handlers
step aside so that they neither enter the graph nor break it.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional

from torch.compiler import is_compiling
from torch.overrides import (
    TorchFunctionMode,
    _get_current_function_mode_stack,
    _pop_mode,
    _push_mode,
)

from .monitors import After, Before, OpHandler

Entry = Callable[[Any, tuple, dict], Any]


def _entry(mode: "GuardMode", befores: List[Before], afters: List[After]) -> Entry:
    """One closure running the op between its handlers."""
    befores, afters = tuple(befores), tuple(afters)

    def run(func, args, kwargs):
        if is_compiling():  # torch.compile traces this mode: stay out of its graph
            return func(*args, **kwargs)
        mode.dispatching += 1
        try:
            for before in befores:
                before(func, args, kwargs)
            out = func(*args, **kwargs)
            for after in afters:
                after(func, args, kwargs, out)
            return out
        finally:
            mode.dispatching -= 1

    return run


class GuardMode(TorchFunctionMode):
    """Dispatches torch functions to the merged handler table.

    ``dispatching`` counts handled calls in progress: while torch runs ``__torch_function__``
    it has taken the mode off the stack and puts it back afterwards, so the guard must not
    push or pop it then.
    """

    def __init__(
        self,
        handler_maps: Iterable[Dict[Any, OpHandler]],
        tracers: Iterable[After] = (),
        untraced: Iterable[Any] = (),
    ):
        super().__init__()
        merged: Dict[Any, tuple] = {}
        for handlers in handler_maps:
            for func, handler in handlers.items():
                befores, afters = merged.setdefault(func, ([], []))
                if handler.before is not None:
                    befores.append(handler.before)
                if handler.after is not None:
                    afters.append(handler.after)
        self.dispatching = 0
        self._cheap = {func: _entry(self, b, a) for func, (b, a) in merged.items()}
        tracers = list(tracers)
        if tracers:
            # An untraced function keeps its cheap entry, or None: straight through.
            self._traced = {func: self._cheap.get(func) for func in untraced}
            for func, (befores, afters) in merged.items():
                if func not in untraced:
                    self._traced[func] = _entry(self, befores, afters + tracers)
            self._trace_default = _entry(self, [], tracers)
        else:
            self._traced, self._trace_default = self._cheap, None
        self._table: Dict[Any, Entry] = self._cheap
        self._default: Optional[Entry] = None
        self._tracing = False
        self._passthrough = False
        #: (stack depth, mode below) when this mode last left the stack.
        self._left_at: Optional[tuple] = None

    def set_tracing(self, on: bool) -> None:
        self._tracing = on
        self._refresh()

    def set_passthrough(self, on: bool) -> None:
        """Let every op through unchecked (while a nested guard does the checking)."""
        self._passthrough = on
        self._refresh()

    def _refresh(self) -> None:
        if self._passthrough:
            self._table, self._default = {}, None
        elif self._tracing:
            self._table, self._default = self._traced, self._trace_default
        else:
            self._table, self._default = self._cheap, None

    def push(self) -> bool:
        """Go back on the stack where ``pop`` left it; False (and stay off) while a mode
        entered since then is still on it: that mode's exit pops whatever is on top."""
        if self._left_at is not None:
            stack = _get_current_function_mode_stack()
            top = stack[-1] if stack else None
            if (len(stack), top) != self._left_at:
                return False
        _push_mode(self)
        return True

    def pop(self) -> bool:
        """Leave the mode stack if this mode is on top of it; True when it left."""
        stack = _get_current_function_mode_stack()
        if not stack or stack[-1] is not self:
            return False
        _pop_mode()
        self._left_at = (len(stack) - 1, stack[-2] if len(stack) > 1 else None)
        return True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        entry = self._table.get(func, self._default)
        if entry is None:  # most ops: as little Python as possible
            return func(*args, **kwargs) if kwargs else func(*args)
        return entry(func, args, kwargs or {})
