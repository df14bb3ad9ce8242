"""The guard's TorchFunctionMode: one dict look-up per op, handlers only where needed.

Every monitor's ``op_handlers`` are merged into one table mapping a torch function to a
small closure that runs the ``before`` handlers, the op and the ``after`` handlers.
Functions absent from the table go straight through. When per-op tracing is on, a
tracer (an ``after`` handler) is added to every entry and used for every other function.

The guard keeps the mode on the stack on watched steps only (``guard.py``); a few functions
that step-level checks need on every step reach the same handlers through
``entry_points.py``. The mode stack is per thread: ops run by other threads are not
seen. Code compiled with ``torch.compile`` runs unchecked: while dynamo traces, the handlers
step aside so that they neither enter the graph nor break it (and the guard keeps the mode off
the stack from the first compilation on, ``compiled.py``).

Each handler runs contained as part of its monitor (``containment.py``): one that raises
switches its monitor off, and the table is rebuilt without it (``drop``). The op itself runs
exactly once, outside the containment, so its own exceptions reach the caller unchanged.
While the guard looks for the model's root modules, ``sight`` runs before the ops no handler
takes (``tracking.ModuleTracker.sight``).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Optional, Sequence, Tuple

from torch.compiler import is_compiling
from torch.overrides import (
    TorchFunctionMode,
    _get_current_function_mode_stack,
    _pop_mode,
    _push_mode,
)

from .containment import Component
from .events import FINDINGS
from .monitors import After, Before, OpHandler

Entry = Callable[[Any, tuple, dict], Any]
#: ``failed(component, error)``: the guard's ``Containment.failed``.
Failed = Callable[[Component, BaseException], None]


def _entry(mode: "GuardMode", befores: Sequence[Tuple[Component, Before]],
           afters: Sequence[Tuple[Component, After]]) -> Entry:
    """One closure running the op between its handlers, each contained as part of its owner."""
    befores, afters, failed = tuple(befores), tuple(afters), mode.failed

    def run(func, args, kwargs, call=None):
        call = call or func  # ``dispatch`` calls the function through a wrapper of its own
        if is_compiling():  # torch.compile traces this mode: stay out of its graph
            return call(*args, **kwargs)
        mode.dispatching += 1
        try:
            lost = False
            for owner, before in befores:
                try:
                    before(func, args, kwargs)
                except FINDINGS:
                    raise
                except Exception as error:
                    failed(owner, error)
                    lost = True
            out = call(*args, **kwargs)
            for owner, after in afters:
                if lost and owner.failure is not None:  # its before failed in this very call
                    continue
                try:
                    after(func, args, kwargs, out)
                except FINDINGS:
                    raise
                except Exception as error:
                    failed(owner, error)
            return out
        finally:
            mode.dispatching -= 1

    return run


def _sighting(mode: "GuardMode") -> Entry:
    """The default entry while the guard looks for root modules: ``mode.sight()`` before the op
    (contained as part of the guard's core, ``mode.core``) until it reports a find."""

    def run(func, args, kwargs, call=None):
        if not is_compiling():
            try:
                found = mode.sight()
            except Exception as error:
                mode.failed(mode.core, error)
                found = True
            if found:
                mode.sight = None
                mode._refresh()
        fallback = mode._plain_default
        if fallback is not None:
            return fallback(func, args, kwargs, call)
        return (call or func)(*args, **kwargs)

    return run


class GuardMode(TorchFunctionMode):
    """Dispatches torch functions to the merged handler table.

    ``dispatching`` counts handled calls in progress: while torch runs ``__torch_function__``
    it has taken the mode off the stack and puts it back afterwards, so the guard must not
    push or pop it then.
    """

    def __init__(
        self,
        handler_maps: Iterable[Tuple[Component, Dict[Any, OpHandler]]],
        tracers: Iterable[Tuple[Component, After]],
        untraced: Iterable[Any],
        failed: Failed,
        core: Component,
    ):
        super().__init__()
        #: Contains the handlers' failures; ``core`` is the owner of the mode's own code.
        self.failed, self.core = failed, core
        self._handler_maps = list(handler_maps)
        self._tracers = list(tracers)
        self._untraced = frozenset(untraced)
        self.dispatching = 0
        #: ``sight() -> bool`` while the guard looks for root modules (True: found, stop).
        self.sight: Optional[Callable[[], bool]] = None
        self._tracing = False
        self._passthrough = False
        #: (stack depth, mode below) when this mode last left the stack.
        self._left_at: Optional[tuple] = None
        self._build()

    def _build(self) -> None:
        merged: Dict[Any, tuple] = {}
        for owner, handlers in self._handler_maps:
            for func, handler in handlers.items():
                befores, afters = merged.setdefault(func, ([], []))
                if handler.before is not None:
                    befores.append((owner, handler.before))
                if handler.after is not None:
                    afters.append((owner, handler.after))
        self._cheap = {func: _entry(self, b, a) for func, (b, a) in merged.items()}
        tracers, untraced = self._tracers, self._untraced
        if tracers:
            # An untraced function keeps its cheap entry, or None: straight through.
            self._traced = {func: self._cheap.get(func) for func in untraced}
            for func, (befores, afters) in merged.items():
                if func not in untraced:
                    self._traced[func] = _entry(self, befores, afters + tracers)
            self._trace_default = _entry(self, [], tracers)
        else:
            self._traced, self._trace_default = self._cheap, None
        self._refresh()

    def drop(self, owner: Component) -> None:
        """Run no handler of ``owner`` (a failed monitor) from now on."""
        self._handler_maps = [(o, handlers) for o, handlers in self._handler_maps if o is not owner]
        self._tracers = [(o, tracer) for o, tracer in self._tracers if o is not owner]
        self._build()

    def look_for_modules(self, sight: Callable[[], bool]) -> None:
        """Call ``sight()`` before each op without handlers until it returns True."""
        self.sight = sight
        self._refresh()

    def set_tracing(self, on: bool) -> None:
        self._tracing = on
        self._refresh()

    def set_passthrough(self, on: bool) -> None:
        """Let every op through unchecked (while a nested guard does the checking)."""
        self._passthrough = on
        self._refresh()

    def _refresh(self) -> None:
        if self._passthrough:
            self._table, self._plain_default = {}, None
        elif self._tracing:
            self._table, self._plain_default = self._traced, self._trace_default
        else:
            self._table, self._plain_default = self._cheap, None
        looking = self.sight is not None and not self._passthrough
        self._default = _sighting(self) if looking else self._plain_default

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

    def dispatch(self, func, call, args, kwargs):
        """Run ``func``'s handlers around ``call(*args, **kwargs)`` as for a call of ``func``
        (the entry points: ``call`` is the original function, run exactly once)."""
        entry = self._table.get(func, self._default)
        if entry is None:
            return call(*args, **kwargs)
        return entry(func, args, kwargs, call)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        entry = self._table.get(func, self._default)
        if entry is None:  # most ops: as little Python as possible
            return func(*args, **kwargs) if kwargs else func(*args)
        return entry(func, args, kwargs or {})
