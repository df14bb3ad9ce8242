"""GradScaler state: loss-scale history (AMP107, AMP108, AMP109) and the bookkeeping the scaler rules share.

Nothing here wraps or patches a scaler. Scalers are found where they show themselves: the guard's mode
sees ``torch._amp_foreach_non_finite_check_and_unscale_`` (called by ``unscale_``/``step``) and
``torch._amp_update_scale_`` (called by ``update``); the ``GradScaler`` running them is the ``self`` of the
calling frame. A loss scaled by a scaler not seen yet (``scaler.scale(loss).backward()`` in the first
step) is matched to its scaler by the scale tensor it was multiplied with.
"""
from __future__ import annotations

import gc
import sys
import weakref
from collections import deque
from typing import Deque, List, Optional, Tuple

import torch
from torch.amp.grad_scaler import GradScaler, OptState

from amp_runtime.thresholds import Thresholds

#: Frames searched upwards from a scaler kernel for the GradScaler method that called it.
_FRAMES_TO_SCALER = 4


class LossScaleHistory:
    """Judges one scaler's scale after each ``update()``; findings are ``(code, emit keyword arguments)``.

    A decline episode starts at the first decrease and ends when the scale rises again; each AMP108 reason
    and AMP107 is reported once per episode. AMP109 judges a full window of steps and ignores the skips of
    the first steps, while the scale calibrates down from its initial value.
    """

    def __init__(self, init_scale: float, limits: Thresholds):
        self.init_scale = init_scale
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
            self.decreases += 1
        else:
            self.decreases = 0

        limits = self.limits
        details = {"loss_scale": scale, "previous": previous, "init_scale": self.init_scale}
        if scale <= limits.scale_collapse and scale <= previous:
            self._once(findings, "AMP107", "collapse", dict(scale=scale, details=details))
        reasons = []
        if self.decreases >= limits.scale_decline_consecutive:
            reasons.append(("consecutive", f"{self.decreases} consecutive decreases"))
        if scale < self.init_scale * limits.scale_decline_fraction:
            reasons.append(("fraction", f"below {limits.scale_decline_fraction:g} of the initial {self.init_scale:g}"))
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
        return [("AMP109", dict(skipped=count, window=window, details={"skipped": count, "window": window}))]


def scaler_in_frames() -> Optional[GradScaler]:
    """The GradScaler whose method is running a scaler kernel right now (looked up from the handler)."""
    frame = sys._getframe(1)
    for _ in range(_FRAMES_TO_SCALER + 4):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, GradScaler):
            return candidate
        frame = frame.f_back
    return None


def scaler_owning(scale: torch.Tensor) -> Optional[GradScaler]:
    """The live GradScaler whose ``_scale`` is ``scale`` (a heap search: call rarely)."""
    pointer = scale.data_ptr()
    for obj in gc.get_objects():
        if isinstance(obj, GradScaler) and getattr(obj, "_scale", None) is not None:
            if obj._scale.data_ptr() == pointer:
                return obj
    return None


def scale_factor_of(root: torch.Tensor) -> Optional[torch.Tensor]:
    """The 0-dim float32 tensor ``root`` was multiplied by last, as ``scaler.scale(loss)`` does; else None."""
    node = root.grad_fn
    if node is None or node.name() != "MulBackward0":
        return None
    for attribute in ("_saved_other", "_saved_self"):
        saved = getattr(node, attribute, None)
        if isinstance(saved, torch.Tensor) and saved.dim() == 0 and saved.dtype == torch.float32:
            return saved
    return None


class ScalerState:
    """What the guard knows about one GradScaler during a run."""

    def __init__(self, scaler: GradScaler, limits: Thresholds):
        self.ref = weakref.ref(scaler)
        self.history = LossScaleHistory(float(scaler._init_scale), limits)
        #: A backward started from a loss this scaler scaled, and no update() followed yet.
        self.scaled_backward = False
        #: The optimizers this scaler unscaled (weak, by id).
        self.optimizers = weakref.WeakSet()

    @property
    def scaler(self) -> Optional[GradScaler]:
        return self.ref()

    def stage(self, optimizer) -> OptState:
        """The scaler's stage for ``optimizer`` without creating an entry in its defaultdict."""
        scaler = self.scaler
        states = getattr(scaler, "_per_optimizer_states", None) or {}
        state = states.get(id(optimizer)) if scaler is not None else None
        return state["stage"] if state else OptState.READY

    def scale_tensor(self) -> Optional[torch.Tensor]:
        scaler = self.scaler
        return None if scaler is None else scaler._scale
