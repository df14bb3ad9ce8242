"""Numeric thresholds of the runtime checks (defaults from DESIGN.md section 2)."""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Thresholds:
    #: AMP102: an fp16 output with |x| above this is near overflow (fp16 max is 65504).
    near_overflow: float = 60000.0
    #: AMP104: total unscaled gradient norm above these is P1 / P0.
    grad_explosion: float = 100.0
    grad_explosion_p0: float = 1000.0
    #: AMP105: total norm below this, or a layer whose max |grad| is below layer value.
    grad_vanishing_total: float = 1e-6
    grad_vanishing_layer: float = 1e-10
    #: AMP106: fraction of a layer's nonzero gradients that flush to zero in fp16.
    grad_underflow_fraction: float = 0.01
    #: ...when they carried more than this share of the layer's gradient norm (an upper bound).
    grad_underflow_norm_share: float = 1e-3
    #: AMP107: loss scale at or below this and not rising.
    scale_collapse: float = 1.0
    #: AMP108: consecutive decreases; fraction of the initial scale; floor while falling.
    scale_decline_consecutive: int = 5
    scale_decline_fraction: float = 0.01
    scale_decline_floor: float = 128.0
    #: AMP109: skipped-step rate over a window of recent steps.
    overflow_rate: float = 0.01
    overflow_window: int = 100
    #: AMP111: magnitude ratio within a low-precision reduction.
    imbalanced_reduce_ratio: float = 1e4
    #: AMP110/AMP111 are sampled: check one call in this many.
    sample_every: int = 16
    #: trace="auto": steps without an anomaly before per-op tracing switches off again.
    auto_quiet_steps: int = 50
    #: metrics.jsonl: per-layer gradient statistics every this many steps.
    metrics_every: int = 1
    #: Watched steps, on which the code-pattern rules and AMP110/AMP111 see every torch call:
    #: the first ``watch_steps`` steps, then one in ``watch_every`` (1: every step), and every
    #: step while tracing. Step-level checks (loss, gradients, loss scale) run on every step.
    watch_steps: int = 8
    watch_every: int = 16

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(
                    f"Thresholds.{f.name} must be a non-negative number, got {value!r}")
        if self.grad_explosion_p0 < self.grad_explosion:
            raise ValueError("Thresholds.grad_explosion_p0 must be >= grad_explosion")
        counts = ("sample_every", "overflow_window", "metrics_every", "scale_decline_consecutive",
                  "watch_every")
        for name in counts:
            if getattr(self, name) < 1:
                raise ValueError(f"Thresholds.{name} must be >= 1")
