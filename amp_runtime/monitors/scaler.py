"""GradScaler state: loss-scale history (AMP107-AMP109) and the bookkeeping the scaler rules share.

Every GradScaler a loop can have is watched through its own methods: ``scale``, ``unscale_``,
``_check_inf_per_device``, ``step`` and ``update`` are replaced, while a guard is active, on
``torch.amp.GradScaler`` and on every subclass that overrides them (FSDP's ``ShardedGradScaler``,
``torch.cuda.amp.GradScaler``, a user's subclass, also one defined while the guard is active). They
are replaced on the classes, not on the scalers (which stay picklable and copyable), and run as
before in other threads, while torch.compile traces, and inside one another (a subclass's method
calling ``super()``'s runs the watch once).

A scaler is known to the guard from its first ``scale()`` (a weak reference: no heap search);
a loss the backward starts from is matched to its scaler by the scale tensor it was multiplied
with. The methods run with the guard's mode suspended (they read ``.grad``, ``.dtype``,
``.device`` of every parameter, each read a crossing into the mode), and what they did is read
from the scaler's own state around them (the per-optimizer ``found_inf_per_device``, ``_scale``
before and after ``update``): device tensors, submitted to the guard's readings
(``readings.py``) and judged, with the step they belong to, once they reach the host. A step the
scaler skipped is replayed (``replay.py``, trigger ``SKIPPED``). A disabled scaler
(``GradScaler(enabled=False)``, or ``torch.cuda.amp.GradScaler()`` without CUDA) scales nothing:
its methods run untouched, the checks that need loss scaling stay quiet and the step ends at
``optimizer.step()``.

The watch's own work runs contained (``containment.py``): the user's call runs exactly once
whether the watch fails before or after it, and the user's own exceptions reach the loop
unchanged.
"""
from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import torch
from torch.amp.grad_scaler import GradScaler, OptState
from torch.compiler import is_compiling

from amp_runtime.entry_points import Shared, restore
from amp_runtime.monitors import Monitor, OpHandler
from amp_runtime.thresholds import Thresholds
from amp_runtime.tracking import Location

#: The trigger of a replay requested because a GradScaler skipped a step (``replay.py``).
SKIPPED = "skipped"
#: GradScaler's default init_scale; a higher initial scale calibrates down to about this.
CALIBRATED_SCALE = 2.0 ** 16


class LossScaleHistory:
    """Judges one scaler's scale after each ``update()``; findings are ``(code, emit kwargs)``.

    A decline episode starts at the first decrease and ends when the scale rises again; each AMP108
    reason and AMP107 is reported once per episode. AMP109 judges a full window of steps and ignores
    the skips of the first steps, while the scale calibrates down from its initial value, and so
    does AMP108's count of consecutive decreases (its fraction and floor still apply: a scale that
    never lets a step through still declines). An initial scale above GradScaler's default
    (2**16, about fp16's largest value) is expected to fall to it: those decreases are
    calibration, and the default is the reference for AMP108's fraction.
    """

    def __init__(self, init_scale: float, limits: Thresholds):
        self.init_scale = init_scale
        self.reference = min(init_scale, CALIBRATED_SCALE)
        self.limits = limits
        self.previous: Optional[float] = None
        self.decreases = 0
        self.reported: set = set()
        self.calibrating = True
        self.skips: Deque[bool] = deque(maxlen=limits.overflow_window)
        self.overflow_reported = False

    def observe(self, scale: float, skipped: bool) -> List[Tuple[str, dict]]:
        """Record the scale in effect after an update and whether that step was skipped."""
        previous = self.init_scale if self.previous is None else self.previous
        self.previous = scale
        findings: List[Tuple[str, dict]] = []
        if scale > previous:
            self.decreases = 0
            self.reported.clear()
        elif scale < previous:
            # falling from above the default, or before any step was taken, is calibration
            self.decreases += previous <= CALIBRATED_SCALE and not self.calibrating
        else:
            self.decreases = 0

        limits = self.limits
        details = {"loss_scale": scale, "previous": previous, "init_scale": self.init_scale}
        if scale <= limits.scale_collapse and scale <= previous:
            self._once(findings, "AMP107", "collapse", dict(scale=scale, details=details))
        reasons = []
        if self.decreases >= limits.scale_decline_consecutive:
            reasons.append(("consecutive", f"{self.decreases} consecutive decreases"))
        if scale < self.reference * limits.scale_decline_fraction:
            reasons.append(("fraction", f"below {limits.scale_decline_fraction:g} "
                                        f"of the initial {self.reference:g}"))
        if scale < limits.scale_decline_floor and scale < previous:
            reasons.append(("floor", f"below {limits.scale_decline_floor:g} and falling"))
        for key, reason in reasons:
            self._once(findings, "AMP108", key, dict(scale=scale, reason=reason, details=details))

        findings += self._overflow_rate(skipped)
        return findings

    def _once(self, findings, code, key, kwargs):
        if (code, key) not in self.reported:
            self.reported.add((code, key))
            findings.append((code, kwargs))

    def _overflow_rate(self, skipped: bool) -> List[Tuple[str, dict]]:
        if self.calibrating:
            if skipped:
                return []
            self.calibrating = False
        self.skips.append(skipped)
        if len(self.skips) < self.limits.overflow_window:
            return []
        count = sum(self.skips)
        if count <= self.limits.overflow_rate * len(self.skips):
            self.overflow_reported = False
            return []
        if not skipped or self.overflow_reported:
            return []
        self.overflow_reported = True
        window = len(self.skips)
        details = {"skipped": count, "window": window}
        return [("AMP109", dict(skipped=count, window=window, details=details))]


#: Frames ``called_from`` searches upwards.
_FRAME_DEPTH = 10


def scale_factor_of(root: torch.Tensor) -> Optional[torch.Tensor]:
    """The 0-dim float32 tensor ``root`` was last multiplied by, as in ``scaler.scale(loss)``."""
    node = root.grad_fn
    if node is None or node.name() != "MulBackward0":
        return None
    for attribute in ("_saved_other", "_saved_self"):
        saved = getattr(node, attribute, None)
        if isinstance(saved, torch.Tensor) and saved.dim() == 0 and saved.dtype == torch.float32:
            return saved
    return None


def backward_root(func, args, kwargs) -> Optional[torch.Tensor]:
    """The (first) tensor a ``Tensor.backward`` / ``torch.autograd.backward`` call starts from."""
    root = args[0] if args else kwargs.get("tensors", kwargs.get("self"))
    if isinstance(root, (list, tuple)):
        root = root[0] if root else None
    return root if isinstance(root, torch.Tensor) else None


#: The torch functions a backward pass starts from.
BACKWARD_FUNCTIONS = (torch.Tensor.backward, torch.autograd.backward)

#: GradScaler's methods the watch runs (on GradScaler and on the subclasses overriding them).
WATCHED_METHODS = ("scale", "unscale_", "_check_inf_per_device", "step", "update")

#: Per thread: the ScalerWatches of the active guards (``.stack``, innermost last).
_watches = threading.local()


def _current_watch() -> Optional["ScalerWatch"]:
    """The ScalerWatch that runs a GradScaler's methods: the innermost guard's in this thread,
    unless torch.compile is tracing."""
    stack = getattr(_watches, "stack", None)
    if not stack or is_compiling():
        return None
    return stack[-1]


def _watched(name: str, original: Callable) -> Callable:
    @functools.wraps(original)
    def method(self, *args, **kwargs):
        watch = _current_watch()
        if watch is None:
            return original(self, *args, **kwargs)
        # the user's call runs once whatever the watch does around it
        return watch.guard.containment.around(watch, original, (self, *args), kwargs,
                                              watch.runners[name])

    method.__amp_runtime_original__ = original
    return method


class ScalerPatch(Shared):
    """The watched methods, replaced on GradScaler and its subclasses while at least one guard is
    active. Subclasses defined meanwhile are patched as they are created
    (``GradScaler.__init_subclass__``)."""

    def __init__(self):
        super().__init__()
        self._replaced: List[Tuple[type, str, Any, Callable]] = []

    def start(self) -> None:
        for cls in _scaler_classes():
            self._patch(cls)
        GradScaler.__init_subclass__ = classmethod(_subclass_defined)

    def stop(self) -> None:
        hook = vars(GradScaler).get("__init_subclass__")
        if getattr(hook, "__func__", None) is _subclass_defined:
            del GradScaler.__init_subclass__
        for cls, name, original, new in reversed(self._replaced):
            restore(cls, name, original, new)
        self._replaced = []

    def _patch(self, cls: type) -> None:
        with self.lock:
            if not self.active:
                return
            for name in WATCHED_METHODS:
                original = vars(cls).get(name)
                if callable(original) and not hasattr(original, "__amp_runtime_original__"):
                    new = _watched(name, original)
                    setattr(cls, name, new)
                    self._replaced.append((cls, name, original, new))


def _scaler_classes() -> List[type]:
    """GradScaler and its subclasses (a walk of the class hierarchy, not of the heap)."""
    classes, queue = [], [GradScaler]
    while queue:
        cls = queue.pop()
        if cls not in classes:
            classes.append(cls)
            queue.extend(cls.__subclasses__())
    return classes


def _subclass_defined(cls, **kwargs) -> None:
    """``GradScaler.__init_subclass__`` while a guard is active: watch the new class too."""
    super(GradScaler, cls).__init_subclass__(**kwargs)
    _SCALER_PATCH._patch(cls)


_SCALER_PATCH = ScalerPatch()


#: ``listener(scaler, optimizer, still_scaled, grads)`` after a scaler checked an optimizer's
#: gradients for inf/NaN (unscaling them unless ``still_scaled``); ``grads`` None means all of them.
CheckListener = Callable[[GradScaler, torch.optim.Optimizer, bool, Optional[list]], None]


class ScalerState:
    """What the guard knows about one (enabled) GradScaler during a run."""

    def __init__(self, scaler: GradScaler, limits: Thresholds):
        self.ref = weakref.ref(scaler)
        self.history = LossScaleHistory(float(scaler._init_scale), limits)
        #: A backward started from a loss this scaler scaled, and no update() followed yet.
        self.scaled_backward = False
        #: The optimizers this scaler unscaled so far.
        self.optimizers: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
        #: Where the replay of the latest skipped step it explained found the non-finite values
        #: (``replay.Origin``).
        self.overflow_origin = None

    @property
    def scaler(self) -> Optional[GradScaler]:
        return self.ref()

    def stage(self, optimizer) -> OptState:
        """The scaler's stage for ``optimizer``, without adding an entry to its defaultdict."""
        scaler = self.scaler
        state = None if scaler is None else scaler._per_optimizer_states.get(id(optimizer))
        return state["stage"] if state else OptState.READY

    def stages(self) -> List[OptState]:
        scaler = self.scaler
        if scaler is None:
            return []
        return [state["stage"] for state in scaler._per_optimizer_states.values()]


def _overflow_cause(origin, details: dict) -> dict:
    """AMP107/AMP108's ``cause`` field (and ``details["origin"]``): the op a replay of a
    skipped step found, the only event naming it for a backward-only fault."""
    if origin is None:
        return {"cause": ""}
    where = f" at {origin.source}" if origin.source else ""
    happens = "start from" if origin.before_forward else "overflow in"
    return {"cause": f"; skipped steps {happens} {origin.describe()}{where}",
            "details": {**details, "origin": origin.to_json()}}


class ScalerWatch(Monitor):
    """Finds the GradScalers a loop uses, follows their state, judges the scale at each update.

    Always attached (the scaler rules, the gradient checks and step detection rely on it: its
    failure switches the guard off); its own findings are AMP107-AMP109.
    """

    codes = ()
    essential = True

    def __init__(self):
        super().__init__()
        #: The enabled scalers seen scaling a loss, by id.
        self.states: Dict[int, ScalerState] = {}
        self._last_root = None
        #: Called after a scaler checked an optimizer's gradients (see ``CheckListener``).
        self.check_listeners: List[CheckListener] = []
        #: Called as ``listener(scaler)`` after a scaler updated its scale.
        self.update_listeners: List[Callable[[GradScaler], None]] = []
        #: How many enabled ``GradScaler.step`` calls are running.
        self.stepping = 0
        #: Watched methods running, by name: a ``super()`` call inside one runs unwatched.
        self._running: Dict[str, int] = {}
        #: ``run_scaler_method`` for each watched method, as ``Containment.around`` calls it.
        self.runners = {name: functools.partial(self.run_scaler_method, name=name)
                        for name in WATCHED_METHODS}
        self._patched = False

    def attach(self, guard):
        super().attach(guard)
        stack = getattr(_watches, "stack", None)
        if stack is None:
            stack = _watches.stack = []
        stack.append(self)
        _SCALER_PATCH.acquire()
        self._patched = True

    # -- lookups for the other monitors ------------------------------------------------

    def state_of(self, scaler: GradScaler) -> ScalerState:
        state = self.states.get(id(scaler))
        if state is None or state.scaler is not scaler:
            state = self.states[id(scaler)] = ScalerState(scaler, self.guard.thresholds)
        return state

    def scaler_of_loss(self, root: torch.Tensor) -> Optional[ScalerState]:
        """The scaler that scaled the tensor a backward starts from (memoized per backward)."""
        if self._last_root is not None and self._last_root[0]() is root:
            return self._last_root[1]
        found = None
        factor = scale_factor_of(root)
        if factor is not None:
            pointer = factor.data_ptr()
            found = next((s for s in self.states.values()
                          if s.scaler is not None and s.scaler._scale is not None
                          and s.scaler._scale.data_ptr() == pointer), None)
        self._last_root = (weakref.ref(root), found)
        return found

    def scaler_stepping(self) -> bool:
        """Whether an enabled ``GradScaler.step`` runs the optimizer step in progress."""
        return self.stepping > 0

    def scaled_pending(self) -> List[ScalerState]:
        """Scalers that scaled a backward in this step and have not been updated since."""
        return [s for s in self.states.values() if s.scaled_backward and s.scaler is not None]

    def found_inf(self, optimizer) -> List[torch.Tensor]:
        """The inf/NaN flags (one per device) the scalers' check of ``optimizer``'s gradients
        left in this step, on the device: nonzero means ``GradScaler.step`` skips the step (or
        has a fused optimizer ignore it)."""
        flags = []
        for state in self.states.values():
            scaler = state.scaler
            per_optimizer = None if scaler is None else scaler._per_optimizer_states.get(
                id(optimizer))
            if per_optimizer:
                flags += per_optimizer["found_inf_per_device"].values()
        return flags

    # -- handlers ------------------------------------------------------------------------

    def op_handlers(self):
        return {func: OpHandler(before=self._backward_starts) for func in BACKWARD_FUNCTIONS}

    def _backward_starts(self, func, args, kwargs):
        root = backward_root(func, args, kwargs)
        state = None if root is None else self.scaler_of_loss(root)
        if state is not None:
            state.scaled_backward = True

    # -- GradScaler's methods, run unobserved -------------------------------------------

    def run_scaler_method(self, call, args, kwargs, name):
        """Run the scaler's method ``name`` (``call``, once: ``Containment.around``) without the
        mode, between the watch's own work before and after it, which runs contained."""
        if self._running.get(name):  # a subclass's method calling super()'s
            return call(*args, **kwargs)
        scaler, method_args = args[0], args[1:]
        contained = self.guard.containment
        # (enabled, what the result is judged against), or None if the watch failed
        before = contained.call(self, self._before, name, scaler, method_args, kwargs)
        enabled = before is not None and before[0]
        stepping = enabled and name == "step"
        self._running[name] = 1
        self.stepping += stepping
        try:
            with self.guard.unobserved():
                out = call(*args, **kwargs)
        finally:
            self._running[name] = 0
            self.stepping -= stepping
        if enabled:
            contained.call(self, self._after, name, scaler, method_args, kwargs, before[1])
        return out

    def _before(self, name, scaler, args, kwargs) -> Tuple[bool, Any]:
        """Whether the scaler is enabled (a disabled one is left alone), and for ``update`` what
        it reads."""
        if not scaler.is_enabled():
            return False, None
        if name == "update":
            new_scale = args[0] if args else kwargs.get("new_scale")
            return True, self._update_starts(scaler, new_scale)
        return True, None

    def _after(self, name, scaler, args, kwargs, before) -> None:
        if name == "scale":
            self.state_of(scaler)
        elif name in ("unscale_", "_check_inf_per_device"):
            optimizer = args[0] if args else kwargs.get("optimizer")
            state = scaler._per_optimizer_states.get(id(optimizer))
            if state and state["found_inf_per_device"]:  # the check kernel ran
                self._checked(scaler, optimizer, name == "_check_inf_per_device", None)
        elif name == "update" and before is not None:
            self._scale_updated(scaler, before[0], scaler._scale, before[1])

    def _update_starts(self, scaler, new_scale) -> Optional[tuple]:
        """The scale before ``update()`` and the sum of the found-inf flags it consumes (device
        tensors); None when no scale update from inf checks runs (a new scale given, or no check
        since the last)."""
        if new_scale is not None or scaler._scale is None:
            return None
        found = [found_inf for state in scaler._per_optimizer_states.values()
                 for found_inf in state["found_inf_per_device"].values()]
        if not found:
            return None
        scale = scaler._scale
        # as update() combines them (it adds into the first one in place: sum before)
        found_inf = found[0] if len(found) == 1 else torch.stack(
            [t.to(scale.device) for t in found]).sum()
        return scale.clone(), found_inf

    def _checked(self, scaler, optimizer, still_scaled: bool, grads) -> None:
        self.state_of(scaler).optimizers.add(optimizer)
        self.guard.containment.notify(self.check_listeners, scaler, optimizer, still_scaled,
                                      grads, default=self)

    def _scale_updated(self, scaler, used: torch.Tensor, new: torch.Tensor,
                       found_inf: torch.Tensor) -> None:
        """``scaler`` updated its scale from ``used`` to ``new`` (device tensors; ``found_inf``
        > 0: it skipped the step). Judged when the readings arrive, into this step's record."""
        state = self.state_of(scaler)
        state.scaled_backward = False
        guard = self.guard
        judge = functools.partial(self._judge_update, state, guard.step_record,
                                  guard.tracker.loop_location(("GradScaler.update", id(scaler))))
        self.submit([used, new, found_inf], judge)
        guard.containment.notify(self.update_listeners, scaler, default=self)

    def _judge_update(self, state: ScalerState, record, location: Location, values, step) -> None:
        used, new, inf = values
        skipped = inf > 0
        record.update(loss_scale=used, skipped=skipped)
        if skipped:
            self.guard.request_replay(SKIPPED, step)
            # also what a replay asked for by AMP112 or AMP103 in this step found
            origin = self.guard.replay_cause(step)
            if origin is not None:
                state.overflow_origin = origin
        for code, kwargs_ in state.history.observe(new, skipped):
            if code in ("AMP107", "AMP108"):
                kwargs_ = {**kwargs_, **_overflow_cause(state.overflow_origin, kwargs_["details"])}
            self.guard.emit(code, op="GradScaler.update", location=location,
                            step=step, **kwargs_)

    def on_step_end(self, step, record):
        record.setdefault("loss_scale", None)
        record.setdefault("skipped", False)

    def detach(self):
        super().detach()
        stack = getattr(_watches, "stack", [])
        if self in stack:
            stack.remove(self)
        if self._patched:
            self._patched = False
            _SCALER_PATCH.release()
        self.check_listeners.clear()
        self.update_listeners.clear()
        self.states.clear()
        self.stepping = 0
        self._last_root = None


def monitors(guard):
    return [ScalerWatch()]


def watch_of(guard) -> Optional[ScalerWatch]:
    """The guard's ScalerWatch (attached by every guard)."""
    return next((m for m in guard.monitors if isinstance(m, ScalerWatch)), None)


def called_from(names, filename_suffix: str, depth: int = _FRAME_DEPTH) -> Optional[str]:
    """The name of the innermost calling function among ``names`` defined in a file ending with
    ``filename_suffix``, or None (a short frame walk, for handlers that fire rarely)."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        code = frame.f_code
        if code.co_name in names and code.co_filename.endswith(filename_suffix):
            return code.co_name
        frame = frame.f_back
    return None
