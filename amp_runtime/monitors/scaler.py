"""GradScaler state: loss-scale history (AMP107-AMP109) and the bookkeeping the scaler rules share.

While a guard is active, ``GradScaler``'s ``unscale_``, ``_check_inf_per_device``, ``step`` and
``update`` run with the guard's mode suspended: they read ``.grad``, ``.dtype``, ``.device`` of
every parameter, each read a crossing into the mode, which made GradScaler's bookkeeping most of
the mode's work in an fp16 step. What they did is read from the scaler's own state around them
(the per-optimizer ``found_inf_per_device``, ``_scale`` before and after ``update``). The methods
are replaced on the class, not on the scaler (which stays picklable and copyable), only while a
guard is active; in other threads and for subclasses that override them they run as before.

Scalers whose methods are not those (subclasses) are observed where they run
``torch._amp_foreach_non_finite_check_and_unscale_`` and ``torch._amp_update_scale_`` (through
the mode, or on unwatched steps the entry points, ``entry_points.py``); the ``GradScaler``
running them is the ``self`` of the calling frame. A loss scaled by a scaler not seen
yet (``scaler.scale(loss).backward()`` in the first step) is matched to its scaler by the scale
tensor it was multiplied with.
"""
from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Tuple

import torch
from torch.amp.grad_scaler import GradScaler, OptState
from torch.compiler import is_compiling

from amp_runtime.entry_points import SharedPatch
from amp_runtime.monitors import Monitor, OpHandler, live_instances
from amp_runtime.thresholds import Thresholds
from amp_runtime.tracking import Location, user_location

#: The trigger of a replay requested because a GradScaler skipped a step (``replay.py``).
SKIPPED = "skipped"
#: GradScaler's default init_scale; a higher initial scale calibrates down to about this.
CALIBRATED_SCALE = 2.0 ** 16

#: Frames searched upwards from a handler or hook for the GradScaler method that called it.
_FRAME_DEPTH = 10


class LossScaleHistory:
    """Judges one scaler's scale after each ``update()``; findings are ``(code, emit kwargs)``.

    A decline episode starts at the first decrease and ends when the scale rises again; each AMP108
    reason and AMP107 is reported once per episode. AMP109 judges a full window of steps and ignores
    the skips of the first steps, while the scale calibrates down from its initial value. An initial
    scale above GradScaler's default (2**16, about fp16's largest value) is expected to fall to it:
    those decreases are calibration, and the default is the reference for AMP108's fraction.
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
            self.decreases += previous <= CALIBRATED_SCALE  # falling from above it is calibration
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


#: GradScaler methods that run the scaler kernels (their frames hold ``self`` and ``optimizer``).
_SCALER_METHODS = frozenset({"_unscale_grads_", "unscale_", "_check_inf_per_device", "update"})
#: GradScaler methods that call ``optimizer.step``.
_STEPPING_METHODS = frozenset({"step", "_maybe_opt_step"})


def scaler_call() -> Tuple[Optional[GradScaler], Optional[torch.optim.Optimizer], bool]:
    """From inside a scaler kernel's handler: the GradScaler running it, the optimizer whose
    gradients it processes, and whether they stay scaled (``_check_inf_per_device`` only checks)."""
    optimizer = None
    frame = sys._getframe(1)
    for _ in range(_FRAME_DEPTH):
        if frame is None:
            break
        name = frame.f_code.co_name
        if name in _SCALER_METHODS:  # f_locals only here: building it costs time
            local = frame.f_locals
            scaler = local.get("self")
            if isinstance(scaler, GradScaler):
                if name != "_unscale_grads_":  # its caller tells whether it unscales
                    return scaler, optimizer, name == "_check_inf_per_device"
                optimizer = local.get("optimizer")
        frame = frame.f_back
    return None, None, False


def inside_scaler_step() -> bool:
    """Whether an enabled ``GradScaler.step`` called the running code (from an optimizer hook)."""
    frame = sys._getframe(1)
    for _ in range(_FRAME_DEPTH):
        if frame is None:
            return False
        if frame.f_code.co_name in _STEPPING_METHODS:
            scaler = frame.f_locals.get("self")
            if isinstance(scaler, GradScaler):
                return scaler.is_enabled()
        frame = frame.f_back
    return False


def scaler_owning(scale: torch.Tensor) -> Optional[GradScaler]:
    """The live GradScaler whose ``_scale`` is ``scale`` (a heap search: call rarely)."""
    pointer = scale.data_ptr()
    for obj in live_instances(GradScaler):
        if getattr(obj, "_scale", None) is not None and obj._scale.data_ptr() == pointer:
            return obj
    return None


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

#: GradScaler methods run with the guard's mode suspended while a guard is active.
_UNOBSERVED_METHODS = ("unscale_", "_check_inf_per_device", "step", "update")
#: A scaler class overriding any of these (or of the above) is observed through the mode.
_HELPER_METHODS = ("_unscale_grads_", "_maybe_opt_step")
_TORCH_METHODS = {name: vars(GradScaler)[name] for name in _UNOBSERVED_METHODS + _HELPER_METHODS}

#: Per thread: the ScalerWatches of the active guards (``.stack``, innermost last).
_watches = threading.local()
_plain_classes: Dict[type, bool] = {}


def _watch_for(scaler: GradScaler) -> Optional["ScalerWatch"]:
    """The ScalerWatch observing ``scaler``'s methods directly: the innermost guard's in this
    thread, unless the scaler's class overrides them or torch.compile is tracing."""
    stack = getattr(_watches, "stack", None)
    if not stack or is_compiling():
        return None
    cls = type(scaler)
    plain = _plain_classes.get(cls)
    if plain is None:
        plain = _plain_classes[cls] = all(
            getattr(cls, name) is getattr(GradScaler, name) for name in _TORCH_METHODS)
    return stack[-1] if plain else None


def _unobserved_method(name: str):
    original = _TORCH_METHODS[name]

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        watch = _watch_for(self)
        if watch is None:
            return original(self, *args, **kwargs)
        return watch.run_scaler_method(name, original, self, args, kwargs)

    return method


#: GradScaler's methods replaced while a guard is active.
_SCALER_PATCH = SharedPatch(
    (GradScaler, name, _unobserved_method(name)) for name in _UNOBSERVED_METHODS)


#: ``listener(scaler, optimizer, still_scaled, grads)`` after a scaler checked an optimizer's
#: gradients for inf/NaN (unscaling them unless ``still_scaled``); ``grads`` None means all of them.
CheckListener = Callable[[GradScaler, torch.optim.Optimizer, bool, Optional[list]], None]


class ScalerState:
    """What the guard knows about one GradScaler during a run."""

    def __init__(self, scaler: GradScaler, limits: Thresholds):
        self.ref = weakref.ref(scaler)
        self.history = LossScaleHistory(float(scaler._init_scale), limits)
        #: A backward started from a loss this scaler scaled, and no update() followed yet.
        self.scaled_backward = False
        #: The optimizers this scaler unscaled so far.
        self.optimizers: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()

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


class ScalerWatch(Monitor):
    """Finds the GradScalers a loop uses, follows their state, judges the scale at each update.

    Always attached (the scaler rules and step detection rely on it); its own findings are
    AMP107-AMP109.
    """

    codes = ()

    def __init__(self):
        super().__init__()
        self.states: Dict[int, ScalerState] = {}
        self._searched: set = set()
        self._scale_before: Optional[torch.Tensor] = None
        self._last_root = None
        #: Called after a scaler checked an optimizer's gradients (see ``CheckListener``).
        self.check_listeners: List[CheckListener] = []
        #: Called as ``listener(scaler)`` after a scaler updated its scale.
        self.update_listeners: List[Callable[[GradScaler], None]] = []
        #: How many enabled ``GradScaler.step`` calls are running (run_scaler_method's).
        self.stepping = 0
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
            if found is None and pointer not in self._searched:
                self._searched.add(pointer)
                owner = scaler_owning(factor)
                found = None if owner is None else self.state_of(owner)
        self._last_root = (weakref.ref(root), found)
        return found

    def scaler_stepping(self) -> bool:
        """Whether an enabled ``GradScaler.step`` runs the optimizer step in progress: known
        without a frame walk for the scalers this watch runs, and in loops without a scaler."""
        return self.stepping > 0 or bool(self.states) and inside_scaler_step()

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
        handlers = {
            torch._amp_foreach_non_finite_check_and_unscale_: OpHandler(after=self._unscaled),
            torch._amp_update_scale_: OpHandler(before=self._before_update, after=self._updated),
        }
        for func in BACKWARD_FUNCTIONS:
            handlers[func] = OpHandler(before=self._backward_starts)
        return handlers

    def _backward_starts(self, func, args, kwargs):
        root = backward_root(func, args, kwargs)
        state = None if root is None else self.scaler_of_loss(root)
        if state is not None:
            state.scaled_backward = True

    def _unscaled(self, func, args, kwargs, out):
        scaler, optimizer, still_scaled = scaler_call()
        if scaler is not None and optimizer is not None:
            self._checked(scaler, optimizer, still_scaled, args[0])

    def _before_update(self, func, args, kwargs):
        self._scale_before = args[0].detach().clone()

    def _updated(self, func, args, kwargs, out):
        scaler, _, _ = scaler_call()
        if scaler is not None:
            self._scale_updated(scaler, self._scale_before, args[0], args[2])

    # -- GradScaler's methods, run unobserved -------------------------------------------

    def run_scaler_method(self, name, original, scaler, args, kwargs):
        """Run ``original`` (GradScaler's method ``name``) without the mode, then report what it
        did as the mode would have seen it in the scaler kernels."""
        with self.guard.unobserved():
            if name == "update":
                return self._update(original, scaler, *args, **kwargs)
            if name == "step" and scaler.is_enabled():
                self.stepping += 1
                try:
                    return original(scaler, *args, **kwargs)
                finally:
                    self.stepping -= 1
            out = original(scaler, *args, **kwargs)
            if name != "step":  # unscale_ or _check_inf_per_device
                optimizer = args[0] if args else kwargs.get("optimizer")
                state = scaler._per_optimizer_states.get(id(optimizer))
                if state and state["found_inf_per_device"]:  # the check kernel ran
                    self._checked(scaler, optimizer, name == "_check_inf_per_device", None)
            return out

    def _update(self, original, scaler, new_scale=None):
        found = []
        if new_scale is None and scaler.is_enabled() and scaler._scale is not None:
            found = [found_inf for state in scaler._per_optimizer_states.values()
                     for found_inf in state["found_inf_per_device"].values()]
        if not found:  # no scale update kernel runs
            return original(scaler, new_scale)
        scale = scaler._scale
        before = scale.clone()
        # as update() combines them (it adds into the first one in place: sum before)
        found_inf = found[0] if len(found) == 1 else torch.stack(
            [t.to(scale.device) for t in found]).sum()
        original(scaler, new_scale)
        self._scale_updated(scaler, before, scale, found_inf)

    def _checked(self, scaler, optimizer, still_scaled: bool, grads) -> None:
        self.state_of(scaler).optimizers.add(optimizer)
        for listener in self.check_listeners:
            listener(scaler, optimizer, still_scaled, grads)

    def _scale_updated(self, scaler, used: torch.Tensor, new: torch.Tensor,
                       found_inf: torch.Tensor) -> None:
        """``scaler`` updated its scale from ``used`` to ``new`` (device tensors; ``found_inf``
        > 0: it skipped the step). Judged when the readings arrive, into this step's record."""
        state = self.state_of(scaler)
        state.scaled_backward = False
        judge = functools.partial(self._judge_update, state, self.guard.step_record,
                                  user_location())
        self.guard.readings.submit([used, new, found_inf], judge)
        for listener in self.update_listeners:
            listener(scaler)

    def _judge_update(self, state: ScalerState, record, location: Location, values, step) -> None:
        used, new, inf = values
        skipped = inf > 0
        record.update(loss_scale=used, skipped=skipped)
        if skipped:
            self.guard.request_replay(SKIPPED, step)
        for code, kwargs_ in state.history.observe(new, skipped):
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
