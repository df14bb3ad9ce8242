"""AMP010 scaler-dtype-mismatch, runtime half: an fp16 backward with no GradScaler; a GradScaler
scaling a bf16 backward.

The static half is ``flake8_amp/rules/amp010.py``. At the start of a backward, the autograd graph
behind the loss is searched (breadth first, a bounded number of nodes) for the first node whose
gradient is float16 or bfloat16 (``node._input_metadata``): that is the low-precision dtype the
forward ran in, whether through autocast or a cast model. Whether a scaler scaled the loss comes
from the scaler watch. Only the first few backward passes are searched; each finding is reported
once per guard.
"""
from __future__ import annotations

from typing import Optional

import torch

from amp_runtime.monitors import Monitor, OpHandler, autograd_nodes
from amp_runtime.monitors.scaler import BACKWARD_FUNCTIONS, backward_root, watch_of

#: Autograd nodes visited per backward at most.
GRAPH_NODES = 256
#: Backward passes searched; the loop's dtype and scaler use are settled by then.
PROBED_BACKWARDS = 8

_LOW = (torch.float16, torch.bfloat16)


def low_precision_dtype(root: torch.Tensor, limit: int = GRAPH_NODES) -> Optional[torch.dtype]:
    """float16 or bfloat16 if the graph behind ``root`` computes in it (fp16 wins), else None."""
    found = None
    for node in autograd_nodes([root.grad_fn], limit):
        for meta in getattr(node, "_input_metadata", ()):
            if meta.dtype == torch.float16:
                return torch.float16
            if meta.dtype == torch.bfloat16:
                found = torch.bfloat16
    return found


class ScalerDtypeMismatch(Monitor):
    codes = ("AMP010",)

    def __init__(self):
        super().__init__()
        self._probes = 0
        self._reported = set()

    def op_handlers(self):
        return {func: OpHandler(before=self._backward_starts) for func in BACKWARD_FUNCTIONS}

    def _backward_starts(self, func, args, kwargs):
        if self._probes >= PROBED_BACKWARDS:
            return
        root = backward_root(func, args, kwargs)
        if root is None:
            return
        self._probes += 1
        watch = watch_of(self.guard)
        scaled = watch is not None and watch.scaler_of_loss(root) is not None
        dtype = low_precision_dtype(root)
        if dtype == torch.float16 and not scaled:
            self._report("fp16", "backward through float16 ops with no GradScaler; "
                                 "gradients below 6e-8 flush to zero")
        elif dtype == torch.bfloat16 and scaled:
            self._report("bf16", "GradScaler scales a bfloat16 backward; "
                                 "bf16 has fp32's range and needs no loss scaling")

    def _report(self, kind: str, detail: str) -> None:
        if kind not in self._reported:
            self._reported.add(kind)
            self.guard.emit("AMP010", op="backward", detail=detail)


def monitors(guard):
    return [ScalerDtypeMismatch()]
