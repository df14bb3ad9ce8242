"""``amp_runtime.guard()``: the context manager that runs the runtime checks.

A guard owns a TorchFunctionMode (``mode.py``), a module tracker (``tracking.py``) and
a list of monitors (``monitors``), each contributed by a module listed in
``MONITOR_MODULES`` through a ``monitors(guard)`` function. It counts training steps,
turns per-op tracing on and off, and routes every finding through ``Guard.emit``.

Watched steps: the mode is on the stack for the first ``Thresholds.watch_steps`` steps,
then on one step in ``Thresholds.watch_every``, and on every step while per-op tracing is
on. A training loop runs the same code at every step, and crossing a Python mode costs
about a microsecond per torch call, which is what a host-bound (GPU) step would feel. So
the code-pattern rules and the sampled AMP110/AMP111 checks run on watched steps, while
the step-level checks (loss at backward, gradients, loss scale, step detection) run on
every step through the entry points (``entry_points.py``), the optimizer hooks and the
GradScaler methods (``monitors/scaler.py``).

Readings: device values (the loss, gradient statistics, the loss scale, per-op peaks) reach the
host through the guard's ``readings`` (``readings.py``): copied without a host sync once per step,
at the optimizer step pre-hook (what comes after it, the GradScaler's update, rides with the next
step's copy; a step with no optimizer step copies at its end), judged once the copy is known
complete (on the CPU at once, before the optimizer applies the step; on a GPU usually a step
later), and flushed at exit. A
judge that finds a failing step has it replayed right then (``request_replay``, ``replay.py``).

Threads: the mode is per thread, so only ops of the thread that entered the guard are
checked; the global optimizer hooks ignore calls from other threads. Inside
``optimizer.step()`` the mode is off: the optimizer's many small ops are not forward
computation and checking them would only cost time.

Fail-safe: every entry into the guard's code runs through ``Guard.containment``
(``containment.py``), the readings' judges (``Monitor.submit``), commits and flushes and the
replay included. A monitor that raises is switched off for the rest of the run, a failure of
the guard's own core (this module, the readings) switches the whole guard off, and either is
reported once as AMP100 guard-failure; the user's calls that the guard wraps run exactly once,
and their own exceptions reach the user unchanged. ``policy="raise"`` raises for findings only.

torch.compile: from the first compilation on, the mode stays off the stack (``compiled.py``).
"""
from __future__ import annotations

import functools
import importlib
import json
import os
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Union

import torch
from torch.compiler import is_compiling
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from flake8_amp.catalog import RULES, SEVERITIES, matches, severity_rank

from .compiled import stop_watching, watch_compilations
from .containment import Component, Containment, describe, failure_details
from .entry_points import observe_entry_points, stop_observing_entry_points
from .events import (
    FINDINGS, GUARD_FAILURE, KEPT_OCCURRENCES, AmpRuntimeWarning, Event, EventGroup, GuardError,
    Report,
)
from .mode import GuardMode
from .monitors import Monitor
from .readings import Readings
from .thresholds import Thresholds
from .tracking import Location, ModuleTracker, format_location, op_name, user_location

POLICIES = ("warn", "raise", "record")
TRACE_MODES = ("off", "auto", "always")

#: Modules contributing monitors, each through ``monitors(guard) -> Iterable[Monitor]``,
#: in attach order. Step detection comes last so that it sees the others installed.
MONITOR_MODULES = (
    *(f"amp_runtime.rules.{code}" for code in (
        "amp001", "amp002", "amp003", "amp004", "amp005",
        "amp006", "amp007", "amp008", "amp010", "amp011",
    )),
    "amp_runtime.monitors.forward",
    "amp_runtime.monitors.scaler",
    "amp_runtime.monitors.grads",
    "amp_runtime.replay",
    "amp_runtime.metrics",
    "amp_runtime.tensorboard",
    "amp_runtime.steps",
)

StepListener = Callable[[int, Dict[str, Any]], None]

#: Seconds between two ``events.jsonl`` records of the totals of an event that keeps repeating.
REPEATS_INTERVAL = 60.0


_local = threading.local()


def active_guards() -> List["Guard"]:
    """The guards entered in this thread, outermost first."""
    stack = getattr(_local, "guards", None)
    if stack is None:
        stack = _local.guards = []
    return stack


def current_guard() -> Optional["Guard"]:
    """The innermost guard active in this thread, or None."""
    stack = active_guards()
    return stack[-1] if stack else None


def _prefixes(value, argument: str) -> Optional[List[str]]:
    if value is None:
        return None
    if isinstance(value, str):
        value = [p.strip() for p in value.split(",") if p.strip()]
    elif not isinstance(value, Iterable):
        raise TypeError(
            f"guard({argument}=...) takes code prefixes such as ['AMP1'], got {value!r}")
    prefixes = list(value)
    for prefix in prefixes:
        if not isinstance(prefix, str) or not any(code.startswith(prefix) for code in RULES):
            raise ValueError(f"guard({argument}=...): {prefix!r} is not a prefix of any AMP code")
    return prefixes


def _choice(value, allowed: Sequence[str], argument: str) -> str:
    if value not in allowed:
        choices = ", ".join(map(repr, allowed))
        raise ValueError(f"guard({argument}=...) must be one of {choices}, got {value!r}")
    return value


class Guard(Component):
    """A runtime guard; use through ``amp_runtime.guard(...)`` as a context manager.

    As a ``Component`` it is the guard's core: when that fails, the whole guard switches off.
    """

    def __init__(
        self,
        policy: str = "warn",
        select=None,
        ignore=None,
        trace: str = "auto",
        thresholds: Optional[Thresholds] = None,
        log_dir: Union[str, os.PathLike, None] = None,
        model: Optional[torch.nn.Module] = None,
        tensorboard=None,
        raise_at: str = "P1",
    ):
        self.policy = _choice(policy, POLICIES, "policy")
        self.trace = _choice(trace, TRACE_MODES, "trace")
        self.raise_at = _choice(raise_at, SEVERITIES, "raise_at")
        self.select = _prefixes(select, "select")
        self.ignore = _prefixes(ignore, "ignore")
        if thresholds is not None and not isinstance(thresholds, Thresholds):
            raise TypeError("guard(thresholds=...) takes an amp_runtime.Thresholds, "
                            f"got {type(thresholds).__name__}")
        self.thresholds = thresholds or Thresholds()
        if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
            raise TypeError(f"guard(log_dir=...) takes a folder path, got {type(log_dir).__name__}")
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"guard(model=...) takes a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.tensorboard = tensorboard

        self.report = Report()
        #: Every entry into the guard's code runs through it (``containment.py``).
        self.containment = Containment(self._report_failure)
        #: Steps completed so far, i.e. the 0-based index of the current step.
        self.step_index = 0
        #: Steps ended under this guard (a resumed run's ``step_index`` starts elsewhere).
        self._steps_ended = 0
        #: The record of the step in progress, filled by the monitors (and their readings' judges).
        self.step_record: Dict[str, Any] = {"step": 0}
        #: Called as ``listener(step, record)`` once a step's record is complete: when its
        #: readings are judged (on the CPU at the next step's optimizer step, where its
        #: GradScaler update is read; on a GPU usually a step later).
        self.step_listeners: List[StepListener] = []
        #: Called as ``listener(event)`` for each event this guard records (its own and those of
        #: the guards nested in it).
        self.event_listeners: List[Callable[[Event], None]] = []
        #: Deferred device readings: the one path from device values to host numbers.
        self.readings = Readings()
        #: True while a guard nested inside this one (same thread) does the checking.
        self.suspended = False
        #: Set by the first ``step()`` call: the loop marks its steps by hand.
        self.manual_steps = False
        self.monitors: List[Monitor] = []
        self._step_ends: List[Callable[[int, Dict[str, Any]], None]] = []
        self.tracker = ModuleTracker(model)
        self._enabled_cache: Dict[str, bool] = {}
        self._warned = set()
        self._mode: Optional[GuardMode] = None
        #: Mode bookkeeping (``_sync_mode``): whether this step is watched, whether the mode
        #: is on the stack, and what keeps it off for now (unobserved regions, optimizer.step).
        self._watching = True
        self._mode_pushed = False
        self._hidden = 0
        self._in_optimizer = False
        #: optimizer.step() calls in progress: a subclass's step() calling super().step() is
        #: one step, and the mode stays off until the outermost one returns.
        self._optimizer_depth = 0
        self._unobserved = _Unobserved(self)
        self._observing_entry_points = False
        self._optimizer_hooks = []
        self._unobserved_optimizers = []
        self._events_log: Optional[EventsLog] = None
        self._watching_compilations = False
        #: Compilations in progress in this thread (torch.compile), and whether any ran.
        self._compiling = 0
        self.compiled = False
        self._tracing = self.trace == "always"
        #: The code that turned tracing on under trace="auto" (None when it is off).
        self.tracing_reason: Optional[str] = None
        self._quiet_steps = 0
        #: The monitor that replays a failing step (``replay.py``), None while not attached.
        self.replayer = None
        self._thread: Optional[int] = None
        self._active = False

    # -- public API -----------------------------------------------------------------

    @property
    def tracing(self) -> bool:
        """Whether per-op checks are currently on."""
        return self._tracing

    @property
    def watching(self) -> bool:
        """Whether the mode watches every torch call in this step (see the module doc)."""
        return self._watching

    def enabled(self, code: str) -> bool:
        """Whether ``code`` passes this guard's select/ignore."""
        known = self._enabled_cache.get(code)
        if known is None:
            known = self._enabled_cache[code] = matches(code, self.select, self.ignore)
        return known

    def request_tracing(self, reason: str) -> None:
        """An anomaly was seen: under ``trace="auto"`` turn per-op checks on (or keep them
        on) so the next occurrence is localized. ``reason`` names the anomaly (a code)."""
        self._quiet_steps = 0
        if self.trace == "auto" and not self._tracing:
            self._tracing = True
            self.tracing_reason = reason
            self._watching = True
            if self._mode is not None:
                self._mode.set_tracing(True)
            self._sync_mode()

    def request_replay(self, code: str, step: int):
        """A judge found ``code`` (AMP112, AMP103, or ``scaler.SKIPPED``) in ``step``: re-run that
        step's forward with per-op checks now, if it still can be (``replay.py``), once per
        anomaly episode. The ``replay.Outcome`` for the judge's event (it says why a replay was
        skipped), or None when there is none (an episode is open, no replay is attached, or the
        replay failed: contained as its own failure, the judge and the run go on)."""
        replayer = self.replayer
        if replayer is None or replayer.failure is not None:
            return None
        outcome = self.containment.call(replayer, replayer.request, code, step)
        return outcome if replayer.failure is None else None

    def replay_cause(self, step: int):
        """Where ``step``'s non-finite values came from, as its live trace or a replay found
        it (``replay.Origin``), or None."""
        replayer = self.replayer
        if replayer is None or replayer.failure is not None:
            return None
        return self.containment.call(replayer, replayer.cause_of, step)

    def explain_nonfinite_grads(self, step: int, kwargs: Dict[str, Any]) -> Dict[str, Any]:
        """AMP103's ``emit`` arguments for ``step``, whose gradients are non-finite: replayed
        first, they name where the NaN/Inf came from when the replay (or the step's live trace)
        found it; otherwise as given."""
        self.request_replay("AMP103", step)
        replayer = self.replayer
        if replayer is None or replayer.failure is not None:
            return kwargs
        explained = self.containment.call(replayer, replayer.explain_nonfinite_grads, step, kwargs)
        return kwargs if explained is None else explained

    def step(self) -> None:
        """End the current training step by hand (for loops without optimizer or scaler)."""
        self.manual_steps = True
        self._end_step()

    def number_step(self, step: int) -> None:
        """Number the step in progress ``step``, and the ones after it from there (a trainer
        resumed at its own step count, a replayed bundle's step): its events, its readings and
        its metrics record all carry it."""
        self.step_index = self.readings.step = step
        self.step_record["step"] = step

    def flush(self) -> None:
        """Judge every device reading not judged yet, waiting for the device (once) where its
        copy has not arrived. Called at exit; the pytest plugin calls it before judging a test.
        Under ``policy="raise"`` a finding judged now raises GuardError here."""
        if self._active and self.failure is None:
            with self.unobserved(), self.containment.guarding(self):
                self.readings.flush()

    @property
    def label(self) -> str:
        return "guard"

    def switch_off(self) -> None:
        """The guard's core failed: stop every check; the user's code runs as without a guard."""
        for monitor in self.monitors:
            if monitor.failure is None:
                monitor.failure = self.failure
                self.drop_monitor(monitor)
        self.readings.clear()
        if self._mode is not None:
            self._mode.set_passthrough(True)
            if self._mode_pushed and self._mode.pop():
                self._mode_pushed = False

    def drop_monitor(self, monitor: Monitor) -> None:
        """Switch a failed monitor off: drop its handlers and its step work. Its hooks and the
        judges of its readings do nothing from now on (``Containment``) and its hooks are removed
        at exit: torch may be iterating over them right now (a failure inside an optimizer hook),
        and removing one then would fail."""
        self._step_ends = [f for f in self._step_ends if f.__self__ is not monitor]
        self.step_listeners[:] = [listener for listener in self.step_listeners
                                  if getattr(listener, "__self__", None) is not monitor]
        if self._mode is not None:
            self._mode.drop(monitor)
        if monitor.essential and self.failure is None:  # the others cannot go on without it
            self.failure = monitor.failure
            self.switch_off()

    def _report_failure(self, component: Component, error: BaseException) -> None:
        """Containment's reporter: one AMP100 event for the part that failed."""
        what = "the guard is" if self.failure is not None else "its checks are"
        with self.unobserved():
            self.emit(GUARD_FAILURE, component=component.label, error=describe(error), what=what,
                      details=failure_details(component, error))

    def emit(
        self,
        code: str,
        *,
        severity: Optional[str] = None,
        op: Any = None,
        module: Optional[str] = None,
        source: Optional[str] = None,
        location: Optional[Location] = None,
        details: Optional[Dict[str, Any]] = None,
        step: Optional[int] = None,
        **message_fields: Any,
    ) -> Optional[Event]:
        """Record a finding and apply the policy; None when the code is deselected.

        ``op`` may be a torch function or a name. ``source`` and ``module`` default to the
        user's line and the running module; a framework's line that called torch for the user
        goes to ``details["library_source"]``. A judge of deferred readings passes ``step``, the
        step its values were taken in, and the ``location`` and ``module`` taken with them (the
        code running now is another step's). Under ``policy="raise"`` an event at or above
        ``raise_at`` raises GuardError here: inside the op or hook that judged it.
        """
        if self.suspended or not self.enabled(code):
            return None
        if self.failure is not None and code != GUARD_FAILURE:
            return None
        op = op if op is None or isinstance(op, str) else op_name(op)
        if step is None:
            step = self.step_index
            module = module if module is not None else self.tracker.current()
            if source is None and location is None:
                location = user_location()
        if source is None and location is not None:
            source, library_source = format_location(location)
            if library_source is not None:  # a framework's line (Lightning, transformers)
                details = {**(details or {}), "library_source": library_source}
        event = Event.create(
            code,
            severity=severity,
            op=op,
            module=module,
            step=step,
            source=source,
            rank=_rank(),
            details=details or {},
            **message_fields,
        )
        if self.replayer is not None:
            self.containment.call(self.replayer, self.replayer.observe, event)
        for guard in self._recorders():
            guard._record(event)
        self._apply_policy(event)
        return event

    # -- context manager --------------------------------------------------------------

    def __enter__(self) -> "Guard":
        if self._active:
            raise RuntimeError(
                "this guard is already active; create a new one with amp_runtime.guard()")
        self._active = True
        self._thread = threading.get_ident()
        outer = current_guard()
        active_guards().append(self)
        if outer is not None:
            outer._set_suspended(True)
        try:
            self._install()
        except BaseException:
            self._uninstall()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.flush()
        except FINDINGS:
            if exc_type is None:
                raise
            # what was in flight is recorded; the exception that ends the block goes on
        finally:
            self._uninstall()

    # -- internals --------------------------------------------------------------------

    def _install(self) -> None:
        # What the user configured fails here with a clear error (a log folder that cannot be
        # written, a tensorboard argument), before anything is installed and nothing is lost.
        if self.log_dir is not None:
            os.makedirs(self.log_dir, exist_ok=True)
            self._events_log = EventsLog(os.path.join(self.log_dir, "events.jsonl"))
        monitors = self._build_monitors()
        # A failure of the guard's own code from here on leaves the block running unguarded.
        with self.containment.guarding(self):
            self._install_checks(monitors)

    def _install_checks(self, monitors: List[Monitor]) -> None:
        contained = self.containment
        # The mode leaves before any other optimizer pre-hook runs and comes back after
        # every post-hook: the optimizer and the monitors' per-step work run unobserved.
        self._optimizer_hooks.append(register_optimizer_step_pre_hook(
            contained.wrap(self, self._optimizer_step_starts)))
        for monitor in monitors:
            self.monitors.append(monitor)
            contained.call(monitor, monitor.attach, self)
        # after the monitors' pre-hooks, which take the samples the optimizer is about to apply
        self._optimizer_hooks.append(register_optimizer_step_pre_hook(
            contained.wrap(self, self._judge_before_step)))
        working = [m for m in self.monitors if m.failure is None]
        # the step end calls only the monitors that do something there
        self._step_ends = _overridden(working, "on_step_end")
        handler_maps = [(m, contained.call(m, m.op_handlers) or {}) for m in working]
        self._mode = GuardMode(
            [(m, handlers) for m, handlers in handler_maps if m.failure is None],
            [(m, m.trace_handler) for m in working if m.trace_handler is not None],
            frozenset().union(*(m.untraced for m in working)),
            contained.failed,
            self,
        )
        self._mode.set_tracing(self._tracing)
        self._sync_mode()
        observe_entry_points(current_guard)
        self._observing_entry_points = True
        watch_compilations(current_guard)
        self._watching_compilations = True
        self._optimizer_hooks.append(register_optimizer_step_post_hook(
            contained.wrap(self, self._optimizer_step_ends)))
        self._look_for_modules()

    def _uninstall(self) -> None:
        """Remove everything ``_install`` put in place, whatever state it reached."""
        errors = []
        for handle in self._optimizer_hooks:
            handle.remove()
        self._optimizer_hooks = []
        for optimizer_ref, wrapper in self._unobserved_optimizers:
            optimizer = optimizer_ref()
            if optimizer is not None and vars(optimizer).get("zero_grad") is wrapper:
                del optimizer.zero_grad
        self._unobserved_optimizers = []
        if self._observing_entry_points:
            stop_observing_entry_points()
            self._observing_entry_points = False
        if self._watching_compilations:
            stop_watching()
            self._watching_compilations = False
        if self._mode is not None:
            if self._mode_pushed and not self._mode.pop():
                errors.append(RuntimeError(
                    "amp_runtime: a TorchFunctionMode entered inside the guard is still active; "
                    "the guard's mode could not be removed"))
            self._mode_pushed = self._in_optimizer = False
            self._optimizer_depth = 0
            self._mode = None
        for monitor in reversed(self.monitors):
            if monitor.failure is None:
                self.containment.call(monitor, monitor.detach)
            else:  # reported already: remove what it installed, as far as it still can
                try:
                    monitor.detach()
                except Exception:
                    pass
        self.monitors, self._step_ends = [], []
        self.readings.clear()
        if self._events_log is not None:
            self.containment.call(self._events_log, self._events_log.close)
            self._events_log = None
        stack = active_guards()
        if self in stack:
            stack.remove(self)
        if stack:
            stack[-1]._set_suspended(False)
        self._active = False
        if errors:
            raise errors[0]

    def _build_monitors(self) -> List[Monitor]:
        monitors = []
        for name in MONITOR_MODULES:
            for monitor in importlib.import_module(name).monitors(self):
                if not monitor.codes or any(self.enabled(code) for code in monitor.codes):
                    monitors.append(monitor)
        return monitors

    def _set_suspended(self, suspended: bool) -> None:
        self.suspended = suspended
        if self._mode is not None:
            self._mode.set_passthrough(suspended)  # for when it cannot leave the stack
            self._sync_mode()

    def _sync_mode(self) -> None:
        """Put the mode on the stack or take it off, as the step and the running code want."""
        mode = self._mode
        if mode is None or mode.dispatching:
            return
        wanted = (self._watching and not self.suspended and not self._hidden
                  and not self._in_optimizer and not self.compiled and self.failure is None)
        if wanted and not self._mode_pushed:
            self._mode_pushed = mode.push()
        elif not wanted and self._mode_pushed and mode.pop():
            # (a mode the user entered on top of ours keeps ours on the stack: checks go on)
            self._mode_pushed = False

    def passes_entry_points(self) -> bool:
        """Whether an entry point called now runs as it is: inside the guard's own work, the
        optimizer's step, a compilation, or once the guard is off."""
        return bool(self._hidden or self._in_optimizer or self._compiling
                    or self.failure is not None)

    def run_entry_point(self, call, args, kwargs):
        """An entry point (``entry_points.py``) was called in this guard's thread: run it
        through the mode's handlers, with the mode off, as the mode runs a handled call.
        ``call`` calls the original (``call.original``) once (``Containment.around``)."""
        mode = self._mode
        if (mode is None or self.passes_entry_points() or is_compiling()
                or not torch._C._is_torch_function_enabled()):
            return call(*args, **kwargs)
        with self._unobserved:
            return mode.dispatch(call.original, call, args, kwargs)

    def compilation_starts(self) -> None:
        """torch.compile starts compiling in this thread (``compiled.py``): take the mode off the
        stack before dynamo records it, for good, and step aside until it ends."""
        with self.containment.guarding(self):
            self._compiling += 1
            for guard in active_guards():
                guard.compiled = True
                guard._sync_mode()
            self.tracker.sight()  # the compiled model is running

    def compilation_ends(self) -> None:
        with self.containment.guarding(self):
            self._compiling = max(0, self._compiling - 1)

    def _look_for_modules(self) -> None:
        """On the first watched steps, remember the root module the first op inside a module
        runs in (one stack walk per op until one is found: ``tracking.py``)."""
        if self._mode is not None and self._steps_ended < self.thresholds.watch_steps:
            self._mode.look_for_modules(self.tracker.sight)

    def _optimizer_step_starts(self, optimizer, args, kwargs):
        if threading.get_ident() != self._thread:
            return None
        if self._optimizer_depth:  # a step() nested in the one running
            self._optimizer_depth += 1
            return None
        if self._mode is None or self._in_optimizer or self.suspended or self.failure is not None:
            return None
        # before the mode leaves: a closure is the user's forward and backward. If it runs here,
        # what follows is the guard's own work and must not make the optimizer run it again
        arguments = _observed_closure(self, optimizer, args, kwargs)
        with self.containment.guarding(self):
            self._optimizer_depth = 1
            self._in_optimizer = True
            self._sync_mode()
            if "zero_grad" not in vars(optimizer):
                self._zero_grad_unobserved(optimizer)
        return arguments

    def _zero_grad_unobserved(self, optimizer) -> None:
        """Let ``optimizer.zero_grad()`` run without the mode: it reads and writes ``.grad``
        of every parameter, two mode calls each, which no check needs (in a small model's
        step that is half of all calls the mode sees). An instance attribute, removed on
        exit; numerics are untouched."""
        zero_grad = optimizer.zero_grad

        @functools.wraps(zero_grad)
        def unobserved_zero_grad(*args, **kwargs):
            with self.unobserved():
                return zero_grad(*args, **kwargs)

        optimizer.zero_grad = unobserved_zero_grad
        self._unobserved_optimizers.append((weakref.ref(optimizer), unobserved_zero_grad))

    def _judge_before_step(self, optimizer, args, kwargs) -> None:
        """Start the copy of what this step applies, and judge what has arrived: on the CPU all
        of it, before the optimizer changes the weights (GuardError stops it under "raise")."""
        if self._active and not self.suspended and threading.get_ident() == self._thread:
            self.readings.commit()
            self.readings.poll()

    def _optimizer_step_ends(self, optimizer, args, kwargs) -> None:
        if not self._optimizer_depth or threading.get_ident() != self._thread:
            return
        self._optimizer_depth -= 1
        if self._optimizer_depth == 0 and self._in_optimizer:
            self._in_optimizer = False
            self._sync_mode()

    def _closure_runs(self, running: bool) -> None:
        """A closure the optimizer calls (``_ObservedClosure``) starts or ends running: observed
        as the user's code outside the optimizer's step while it runs."""
        with self.containment.guarding(self):
            self._in_optimizer = not running
            self._sync_mode()

    def unobserved(self) -> "_Unobserved":
        """Run the guard's own bookkeeping (tensor reads in hooks, step-end work) without
        its mode: otherwise every ``.grad`` or ``.dtype`` read would pass through it."""
        return self._unobserved

    def _end_step(self) -> None:
        if self.failure is None:
            with self.unobserved(), self.containment.guarding(self):
                self._finish_step()

    def _finish_step(self) -> None:
        step, record = self.step_index, self.step_record
        self.containment.notify(self._step_ends, step, record, default=self)
        readings = self.readings
        readings.end_step()
        readings.after(functools.partial(self._step_judged, step, record))
        self.tracker.release_frames()  # the step's module calls are over: their inputs may go
        self.step_index = readings.step = step + 1
        self.step_record = {"step": step + 1}
        self._quiet_steps += 1
        self._steps_ended += 1
        quiet = self._quiet_steps >= self.thresholds.auto_quiet_steps
        if self.trace == "auto" and self._tracing and quiet:
            self._tracing = False
            self.tracing_reason = None
            if self._mode is not None:
                self._mode.set_tracing(False)
        limits = self.thresholds
        self._watching = (self._tracing or self._steps_ended < limits.watch_steps
                          or self._steps_ended % limits.watch_every == 0)
        if self._watching:
            self._look_for_modules()
        if self._events_log is not None:
            self.containment.call(self._events_log, self._events_log.write_due)
        self._sync_mode()
        readings.poll()  # last: a finding it raises (policy="raise") finds the step ended

    def _step_judged(self, step: int, record: Dict[str, Any]) -> None:
        """Every reading of ``step`` has been judged: its record is complete."""
        self.containment.notify(self.step_listeners, step, record, default=self)

    def _recorders(self) -> List["Guard"]:
        """This guard and the guards it is nested in, which record its events too."""
        stack = active_guards()
        return stack[: stack.index(self) + 1] if self in stack else [self]

    def _record(self, event: Event) -> None:
        group = self.report.add(event)
        if self._events_log is not None:
            self.containment.call(self._events_log, self._events_log.write, event, group)
        self.containment.notify(self.event_listeners, event, default=self)

    def _apply_policy(self, event: Event) -> None:
        failure = event.code == GUARD_FAILURE
        ranked = severity_rank(event.severity) <= severity_rank(self.raise_at)
        if self.policy == "raise" and ranked and not failure:
            raise GuardError(event)
        if self.policy == "record":
            return
        key = (event.code, event.source)
        if key in self._warned:
            return
        self._warned.add(key)
        filename, _, line = (event.source or "").rpartition(":")
        if filename and line.isdigit():
            warnings.warn_explicit(str(event), AmpRuntimeWarning, filename, int(line))
        else:
            warnings.warn(str(event), AmpRuntimeWarning, stacklevel=3)


class _Unobserved:
    """``Guard.unobserved()``: keeps the mode off the stack while entered (re-entrant). It wraps
    the user's calls too (``zero_grad``, GradScaler's methods, backward): it never raises."""

    __slots__ = ("_guard", "_contained")

    def __init__(self, guard: Guard):
        self._guard = guard
        self._contained = guard.containment.guarding(guard)

    def __enter__(self) -> None:
        guard = self._guard
        guard._hidden += 1
        if guard._mode_pushed and guard.failure is None:  # else nothing to take off the stack
            with self._contained:
                guard._sync_mode()

    def __exit__(self, *exc_info) -> None:
        guard = self._guard
        guard._hidden -= 1
        if not guard._hidden and guard._watching and guard.failure is None:
            with self._contained:  # back on the stack, if the step is watched
                guard._sync_mode()


class EventsLog(Component):
    """``events.jsonl``: each event kept in full (``KEPT_OCCURRENCES`` per code and place) as one
    line, and for one that keeps repeating a record of its totals (``EventGroup.repeats_record``)
    when its count doubles, at most every ``REPEATS_INTERVAL`` seconds while it goes on, and at
    exit. A full disk switches it off (AMP100); the events stay in ``guard.report``."""

    label = "events.jsonl"

    def __init__(self, path: str):
        self._file = open(path, "w", encoding="utf-8")
        #: Groups with occurrences not yet in a totals record: key -> (group, when last written).
        self._unwritten: Dict[tuple, tuple] = {}
        self._written_at: Dict[tuple, float] = {}

    def write(self, event: Event, group: EventGroup) -> None:
        if group.count <= KEPT_OCCURRENCES:
            self._line(event.to_json())
            return
        now = time.monotonic()
        key = group.key
        last = self._written_at.get(key)
        doubled = group.count & (group.count - 1) == 0
        if doubled or last is None or now - last >= REPEATS_INTERVAL:
            self._write_totals(group, now)
        else:
            self._unwritten[key] = group

    def write_due(self) -> None:
        """At a step end: the totals of the groups that stopped repeating a while ago."""
        if not self._unwritten:
            return
        now = time.monotonic()
        for key, group in list(self._unwritten.items()):
            if now - self._written_at.get(key, 0.0) >= REPEATS_INTERVAL:
                self._write_totals(group, now)

    def _write_totals(self, group: EventGroup, now: float) -> None:
        self._unwritten.pop(group.key, None)
        self._written_at[group.key] = now
        self._line(group.repeats_record())

    def _line(self, record: Dict[str, Any]) -> None:
        # default=str: a monitor's detail that JSON cannot hold must not fail the op
        self._file.write(json.dumps(record, default=str) + "\n")
        self._file.flush()

    def close(self) -> None:
        now = time.monotonic()
        try:
            for group in list(self._unwritten.values()):
                self._write_totals(group, now)
        finally:
            self._file.close()

    def switch_off(self) -> None:
        self._unwritten.clear()
        try:
            self._file.close()
        except OSError:  # a full disk fails the flush of the close too
            pass


def _observed_closure(guard: Guard, optimizer, args, kwargs):
    """``optimizer.step(closure)`` (Lightning's bf16 and fp32 steps, LBFGS, SAM) runs the user's
    forward and backward inside the step, where the guard does not look. torch.optim's optimizers
    call the closure first thing, before they touch a parameter: there the closure runs here,
    before the step's checks (this guard's pre-hook comes before the monitors'), so that they see
    this step's gradients; the optimizer's first call gets its result, later calls (LBFGS's line
    search) run it again. Other optimizers may change the parameters before they call it (SAM
    perturbs them): their closure runs where they call it, observed. The step's new arguments, or
    None when there is no closure."""
    # the hook's ``args`` are step()'s, the optimizer first: a positional closure is args[1]
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if closure is None or isinstance(closure, (_FirstCallCached, _ObservedClosure)) \
            or not callable(closure):
        return None
    if _calls_closure_first(optimizer):
        result = error = None
        try:
            with torch.enable_grad():
                result = closure()
        except Exception as raised:  # the user's own: raised where the optimizer calls the closure
            error = raised
        closure = _FirstCallCached(closure, result, error)
    else:
        closure = _ObservedClosure(guard, closure)
    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure}
    return (args[0], closure, *args[2:]), kwargs


def _calls_closure_first(optimizer) -> bool:
    """Whether ``optimizer``'s step is torch.optim's own (a subclass that keeps it included):
    those call the closure before they change anything."""
    return getattr(type(optimizer).step, "__module__", "").startswith("torch.optim.")


class _ObservedClosure:
    """A closure run where the optimizer calls it, observed as the user's code outside the step."""

    __slots__ = ("_guard", "_closure")

    def __init__(self, guard: Guard, closure):
        self._guard, self._closure = guard, closure

    def __call__(self):
        self._guard._closure_runs(True)
        try:
            return self._closure()
        finally:
            self._guard._closure_runs(False)


class _FirstCallCached:
    """A closure whose first call returns the result it already produced (or raises the
    exception it raised)."""

    __slots__ = ("_closure", "_result", "_error", "_called")

    def __init__(self, closure, result, error=None):
        self._closure, self._result, self._error, self._called = closure, result, error, False

    def __call__(self):
        if self._called:
            return self._closure()
        self._called = True
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        result, self._result = self._result, None
        return result


def _overridden(monitors: List[Monitor], method: str) -> List[Callable]:
    """The bound ``method`` of each monitor whose class overrides the base class's."""
    base = getattr(Monitor, method)
    return [getattr(m, method) for m in monitors if getattr(type(m), method) is not base]


def _rank() -> Optional[int]:
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized():
        return distributed.get_rank()
    return None


def guard(
    policy: str = "warn",
    select=None,
    ignore=None,
    trace: str = "auto",
    thresholds: Optional[Thresholds] = None,
    log_dir: Union[str, os.PathLike, None] = None,
    model: Optional[torch.nn.Module] = None,
    tensorboard=None,
    raise_at: str = "P1",
) -> Guard:
    """Run AMP checks over the ``with`` block; see DESIGN.md section 4.

    ``policy``: "warn" (one warning per code and source line), "raise" (GuardError at the
    first event at or above ``raise_at``; a failure of the guard's own code, AMP100, only warns)
    or "record". ``select``/``ignore``: code prefixes. ``trace``: "off" (cheap checks only),
    "always" (per-op checks) or "auto" (cheap until an anomaly, then per-op until
    ``thresholds.auto_quiet_steps`` quiet steps). ``log_dir``: write ``events.jsonl`` (and the
    monitors' logs) there. ``model``: names modules in reports.
    """
    return Guard(policy, select, ignore, trace, thresholds, log_dir, model, tensorboard, raise_at)
