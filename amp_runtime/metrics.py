"""``metrics.jsonl``: one JSON object per training step, written when the guard has a ``log_dir``.

Schema (one line per step, in step order)::

    {"step": int,                  # 0-based step index
     "loss": float | null,         # mean loss backward started from in this step, unscaled
     "loss_scale": float | null,   # the GradScaler's scale used in this step; null without a scaler
     "skipped": bool,              # the scaler skipped the optimizer step (inf/NaN gradients)
     "grad_norm": float | null,    # total unscaled norm of the gradients applied (after any
                                   # clipping); null if not measured/finite
     "layers": {"<parameter name>": {"max": float, "norm": float, "zero_fraction": float,
                                     "underflow_fraction": float | null}}}

``layers`` (unscaled per-parameter max |g|, L2 norm, fraction of exact zeros, and the estimated
fraction of the nonzero values that flush to zero in fp16 at the loss scale, AMP106's measure) is
present on steps where per-layer statistics were collected: every ``Thresholds.metrics_every``
steps that were not skipped. A step's line is written once its device values are read
(``readings.py``): at the next step's optimizer step on the CPU, usually a step later on a GPU,
and at the latest when the guard exits.
"""
from __future__ import annotations

import functools
import json
import math
import os
from typing import Any, Dict, List

import torch

from amp_runtime.monitors import Monitor, OpHandler
from amp_runtime.monitors.scaler import BACKWARD_FUNCTIONS, backward_root, scale_factor_of

FILENAME = "metrics.jsonl"
#: The per-step values every line carries (``layers`` comes on top when collected).
SCALARS = ("step", "loss", "loss_scale", "skipped", "grad_norm")


def _mean_loss(record: Dict[str, Any], losses: List[float], step: int) -> None:
    record["loss"] = sum(losses) / len(losses)


def _finite_or_none(value):
    """NaN/Inf as JSON null (``json.dumps`` would write the non-standard ``NaN``)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    return value


class MetricsLog(Monitor):
    """Records the loss of each backward and writes each step's record as one line."""

    codes = ()

    def __init__(self, log_dir: str):
        super().__init__()
        self.path = os.path.join(log_dir, FILENAME)
        self._file = None
        self._losses: List[torch.Tensor] = []

    def attach(self, guard):
        super().attach(guard)
        self._file = open(self.path, "w", encoding="utf-8")
        guard.step_listeners.append(self.write)

    def op_handlers(self):
        return {func: OpHandler(before=self._backward_starts) for func in BACKWARD_FUNCTIONS}

    def _backward_starts(self, func, args, kwargs):
        root = backward_root(func, args, kwargs)
        if root is None or root.numel() != 1 or not root.is_floating_point():
            return
        factor = scale_factor_of(root)
        loss = root.detach().float()
        self._losses.append(loss if factor is None else loss / factor.to(loss.device))

    def on_step_end(self, step, record):
        losses, self._losses = self._losses, []
        record["loss"] = None
        if losses:
            self.submit(losses, functools.partial(_mean_loss, record))

    def write(self, step: int, record: Dict[str, Any]) -> None:
        if self._file is None:
            return
        line = {key: record.get(key) for key in SCALARS}
        line["skipped"] = bool(line["skipped"])
        if "layers" in record:
            line["layers"] = record["layers"]
        self._file.write(json.dumps(_finite_or_none(line)) + "\n")
        self._file.flush()

    def detach(self):
        super().detach()
        if self.write in self.guard.step_listeners:
            self.guard.step_listeners.remove(self.write)
        if self._file is not None:
            self._file.close()
            self._file = None


def monitors(guard):
    return [MetricsLog(guard.log_dir)] if guard.log_dir is not None else []
