"""Where the guard's own failures stop: nothing the guard's code raises reaches the user's loop.

Every entry into guard code from torch or the user's code passes through one ``Containment``
(``guard.containment``): the mode's handlers (``mode.py``), the patched entry points and GradScaler
methods, the hooks a monitor keeps (``Monitor.keep`` wraps them), the listeners, the step
bookkeeping and the logs. An exception there switches its ``Component`` off for the rest of the
run: a monitor (its handlers are dropped, its hooks do nothing until the guard removes them at
exit), a log file, or the guard's core (then the whole guard). The training goes on with
unchanged numerics, and the failure is reported once as AMP100 guard-failure, with the
exception and its traceback in ``details``.

Two kinds of exception pass through, because they are not failures: the findings themselves
(``GuardError`` under ``policy="raise"``, ``AmpRuntimeWarning`` turned into an error by a warnings
filter) and what is not an ``Exception`` (``KeyboardInterrupt``). Where the guard wraps a call of
the user's (``GradScaler.step``, ``backward``), ``Containment.around`` runs the user's call exactly
once whatever the guard's code around it does, and the call's own exceptions reach the user
unchanged.

Torch-free, like ``events.py``.
"""
from __future__ import annotations

import functools
import traceback
import warnings
from typing import Any, Callable, Iterable, Optional, TypeVar

from .events import FINDINGS

F = TypeVar("F", bound=Callable[..., Any])


class Component:
    """A part of the guard that fails alone: switched off at its first failure."""

    #: The first exception this part raised; once set, the part is off for the rest of the run.
    failure: Optional[BaseException] = None

    @property
    def label(self) -> str:
        """How AMP100 names this part."""
        return type(self).__name__

    def switch_off(self) -> None:
        """Stop everything this part does (remove its hooks, close its files); called once."""


#: ``report(component, error)``: record the failure as an event (the guard's AMP100).
Reporter = Callable[[Component, BaseException], None]


class Containment:
    """Runs the guard's code so that its exceptions switch the failing part off, and reports
    each failure once."""

    def __init__(self, report: Reporter):
        self._report = report
        self._reporting = False

    def failed(self, component: Component, error: BaseException) -> None:
        """``component`` raised ``error``: switch it off and report it (once per component).
        Call it from an ``except`` clause that let ``FINDINGS`` through."""
        if component.failure is not None:
            return
        component.failure = error
        try:
            component.switch_off()
        except Exception:  # it is off for the guard whatever its own clean-up did
            pass
        if self._reporting:  # the report itself failed: say it where it cannot fail again
            warnings.warn(f"amp_runtime: {component.label} failed while reporting a failure: "
                          f"{_describe(error)}", RuntimeWarning, stacklevel=2)
            return
        self._reporting = True
        try:
            self._report(component, error)
        except FINDINGS:  # the report of a failure never stops the run
            pass
        except Exception as report_error:
            warnings.warn(f"amp_runtime: {component.label} failed ({_describe(error)}) and so did "
                          f"its report ({_describe(report_error)})", RuntimeWarning, stacklevel=2)
        finally:
            self._reporting = False

    def call(self, component: Component, function: Callable[..., Any], *args: Any) -> Any:
        """``function(*args)``, or None when ``component`` is off or fails now."""
        if component.failure is not None:
            return None
        try:
            return function(*args)
        except FINDINGS:
            raise
        except Exception as error:
            self.failed(component, error)
            return None

    def wrap(self, component: Component, function: F) -> F:
        """``function`` run through ``call``: for hooks and callbacks torch calls. A hook of a
        failed part returns None, which torch takes as "no change"."""
        failed = self.failed

        @functools.wraps(function)
        def contained(*args, **kwargs):
            if component.failure is not None:
                return None
            try:
                return function(*args, **kwargs)
            except FINDINGS:
                raise
            except Exception as error:
                failed(component, error)
                return None

        return contained  # type: ignore[return-value]

    def notify(self, listeners: Iterable[Callable[..., Any]], *args: Any,
               default: Component) -> None:
        """Call each listener, each contained as part of its owner (the component whose bound
        method it is; else ``default``)."""
        for listener in list(listeners):
            owner = getattr(listener, "__self__", None)
            self.call(owner if isinstance(owner, Component) else default, listener, *args)

    def around(self, component: Component, original: Callable[..., Any], args: tuple,
               kwargs: dict, run: Callable[..., Any]) -> Any:
        """A call of the user's ``original`` through the guard's code ``run(call, args, kwargs)``,
        which calls ``call`` (``original`` itself is ``call.original``) once and returns its
        result: whatever ``run`` does,
        ``original`` runs exactly once, its result is returned and its exceptions propagate
        unchanged, while ``run``'s own failures switch ``component`` off."""
        if component.failure is not None:
            return original(*args, **kwargs)
        call = _Once(original)
        try:
            return run(call, args, kwargs)
        except FINDINGS:
            raise
        except Exception as error:
            if call.error is not None:  # the user's own exception
                if error is call.error:
                    raise
                raise call.error
            self.failed(component, error)
        if call.returned:
            return call.result
        return original(*args, **kwargs)  # the guard failed before the call

    def guarding(self, component: Component) -> "_Guarding":
        """``with containment.guarding(component):`` a block whose exceptions (but findings)
        switch ``component`` off instead of leaving the block."""
        return _Guarding(self, component)


class _Once:
    """The user's call inside ``Containment.around``: remembers whether it ran and how it ended."""

    __slots__ = ("original", "returned", "result", "error")

    def __init__(self, original: Callable[..., Any]):
        self.original = original
        self.returned, self.result, self.error = False, None, None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            self.result = self.original(*args, **kwargs)
        except BaseException as error:
            self.error = error
            raise
        self.returned = True
        return self.result


class _Guarding:
    __slots__ = ("_containment", "_component")

    def __init__(self, containment: Containment, component: Component):
        self._containment, self._component = containment, component

    def __enter__(self) -> None:
        pass

    def __exit__(self, kind, error, tb) -> bool:
        if kind is None or not issubclass(kind, Exception) or issubclass(kind, FINDINGS):
            return False
        self._containment.failed(self._component, error)
        return True


def describe(error: BaseException, limit: int = 200) -> str:
    """``"ValueError: what it said"``, cut to ``limit`` characters."""
    text = _describe(error)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def failure_details(component: Component, error: BaseException) -> dict:
    """AMP100's ``details``: which part failed, the exception and its traceback."""
    return {
        "component": component.label,
        "exception": _describe(error),
        "traceback": "".join(traceback.format_exception(type(error), error, error.__traceback__)),
    }


def _describe(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
