"""Numeric health of the forward pass: AMP101, AMP102, AMP110, AMP111, AMP112.

Per-op tracing (AMP101 non-finite output from finite inputs, AMP102 fp16 near-overflow)
costs one reduction per checked output: ``vector_norm(out, inf)`` is max |x| and
propagates NaN, so one number answers NaN, Inf and headroom to 65504. Tracing checks
fp16/bf16 outputs, and fp32 outputs while autocast is on: there autocast runs softmax,
norms and losses in fp32 on low-precision inputs, and a NaN born there is still the
first cause. fp32 ops outside autocast are not mixed precision's business, and
checking them would double the cost of tracing an fp32 model.

The cheap tier checks the loss when backward starts (AMP112) on every step and, on watched
steps (``guard.py``), a sample of calls (one in ``Thresholds.sample_every``) of low-precision
adds (AMP110) and reductions (AMP111).

No host synchronisation per op: values computed on an accelerator are kept on the
device and read together when the step ends (``flush``). CPU values are read at once,
which costs nothing and lets an event point at the op while it runs. Deferred readings
cannot look back at an op's inputs, so there the first non-finite output of the step
is taken as the first cause.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Tuple

import torch

from ..monitors import (
    LOW_PRECISION,
    Monitor,
    OpHandler,
    autocast_on,
    dtype_name,
    peak,
    readable,
    tensors_in,
)
from ..tracking import user_source


Judge = Callable[[List[float], Dict[str, Any]], None]

#: ``a + b`` and ``a += b`` reach a mode as ``Tensor.add`` and ``Tensor.add_``.
ADD_FUNCTIONS = (torch.add, torch.Tensor.add, torch.Tensor.add_)
REDUCE_FUNCTIONS = (torch.sum, torch.Tensor.sum, torch.mean, torch.Tensor.mean,
                    torch.cumsum, torch.Tensor.cumsum, torch.nansum, torch.Tensor.nansum)
BACKWARD_FUNCTIONS = (torch.Tensor.backward, torch.autograd.backward)

_T = torch.Tensor
#: Views, copies and metadata: they cannot turn finite values into NaN/Inf.
UNTRACED_FUNCTIONS = frozenset((
    _T.__getitem__, _T.view, _T.view_as, _T.reshape, _T.reshape_as, _T.transpose, _T.permute,
    _T.contiguous, _T.detach, _T.expand, _T.expand_as, _T.unsqueeze, _T.squeeze, _T.flatten,
    _T.unflatten, _T.narrow, _T.select, _T.t, _T.split, _T.chunk, _T.unbind, _T.clone,
    _T.size, _T.dim, _T.numel, _T.__len__, _T.zero_,
    _T.dtype.__get__, _T.shape.__get__, _T.device.__get__, _T.T.__get__, _T.mT.__get__,
    _T.grad.__get__, _T.data.__get__, _T.requires_grad.__get__, _T.is_leaf.__get__,
    torch.reshape, torch.transpose, torch.permute, torch.flatten, torch.unsqueeze, torch.squeeze,
    torch.split, torch.chunk, torch.unbind, torch.narrow, torch.cat, torch.stack, torch.clone,
    # uninitialised memory may hold anything
    torch.empty, torch.empty_like, torch.empty_strided, _T.new_empty,
))


def nonfinite_kind(value: float) -> str:
    return "NaN" if math.isnan(value) else "inf"


class DeviceReadings:
    """Checks whose values stay on the device until the step synchronises."""

    def __init__(self, tracker):
        self._tracker = tracker
        self._pending: List[Tuple[torch.Tensor, Judge, Dict[str, Any]]] = []

    def submit(self, values: torch.Tensor, judge: Judge) -> None:
        """Call ``judge(list_of_floats, where)``: now for CPU values, else at ``flush``.

        ``where`` is empty when judged at once (emit fills module and source itself),
        else the module and source captured now.
        """
        if values.device.type == "cpu":
            read = values.tolist()
            judge(read if isinstance(read, list) else [read], {})
        else:
            where = {"module": self._tracker.current(), "source": user_source()}
            self._pending.append((values.reshape(-1).float(), judge, where))

    def flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        readings = torch.cat([values for values, _, _ in pending]).tolist()  # the one sync
        start = 0
        for values, judge, where in pending:
            judge(readings[start:start + values.numel()], where)
            start += values.numel()

    def clear(self) -> None:
        self._pending = []


class ForwardMonitor(Monitor):
    codes = ("AMP101", "AMP102", "AMP110", "AMP111", "AMP112")
    untraced = UNTRACED_FUNCTIONS

    def attach(self, guard) -> None:
        super().attach(guard)
        self.limits = guard.thresholds
        self.readings = DeviceReadings(guard.tracker)
        self._sample_counter = 0
        #: Deferred readings: a non-finite output was already seen this step.
        self._nonfinite_seen = False
        if guard.enabled("AMP101") or guard.enabled("AMP102"):
            self.trace_handler = self._check_output

    def op_handlers(self) -> Dict[Any, OpHandler]:
        handlers: Dict[Any, OpHandler] = {}
        if self.guard.enabled("AMP112"):
            handlers.update({f: OpHandler(before=self._check_loss) for f in BACKWARD_FUNCTIONS})
        if self.guard.enabled("AMP110"):
            handlers.update({f: OpHandler(before=self._check_absorption) for f in ADD_FUNCTIONS})
        if self.guard.enabled("AMP111"):
            handlers.update({f: OpHandler(after=self._check_reduction) for f in REDUCE_FUNCTIONS})
        return handlers

    def flush(self) -> None:
        self.readings.flush()
        self._nonfinite_seen = False

    def detach(self) -> None:
        self.readings.clear()
        super().detach()

    def _sampled(self) -> bool:
        self._sample_counter += 1
        return self._sample_counter % self.limits.sample_every == 0

    # -- AMP101 / AMP102: every output while tracing ------------------------------------

    def _check_output(self, func, args, kwargs, out) -> None:
        # runs after every op while tracing: a single tensor output skips the generator
        for tensor in (out,) if type(out) is torch.Tensor else tensors_in(out):
            dtype = tensor.dtype
            if dtype not in LOW_PRECISION and dtype != torch.float32 or not readable(tensor):
                continue
            if dtype == torch.float32 and not autocast_on(tensor.device.type):
                continue
            out_max = peak(tensor)
            if not out_max.is_cpu:
                # Keep only the dtype: holding the output until the step ends would keep
                # every activation alive.
                self.readings.submit(out_max, lambda values, where, dtype=dtype:
                                     self._judge_deferred(func, dtype, values[0], where))
                continue
            value = out_max.item()
            if not value <= self.limits.near_overflow:  # also true for NaN
                self._judge_now(func, args, kwargs, tensor, value)

    def _judge_now(self, func, args, kwargs, out, out_max: float) -> None:
        details = {"dtype": dtype_name(out.dtype), "output_max": out_max}
        if math.isfinite(out_max):
            near = out.dtype == torch.float16  # a bf16 value this large is far from overflow
            if near and self._record_inputs(args, kwargs, out, details, self.limits.near_overflow):
                self._check_near_overflow(func, out.dtype, out_max, details, {})
            return
        if self._record_inputs(args, kwargs, out, details):
            self.guard.emit("AMP101", op=func, kind=nonfinite_kind(out_max), details=details)
        self.guard.request_tracing("AMP101")

    def _judge_deferred(self, func, dtype, out_max: float, where) -> None:
        """Judged at the step end: the inputs are gone, the order decides the first cause."""
        details = {"dtype": dtype_name(dtype), "output_max": out_max, "deferred": True}
        if math.isfinite(out_max):
            self._check_near_overflow(func, dtype, out_max, details, where)
            return
        if not self._nonfinite_seen:
            self._nonfinite_seen = True
            self.guard.emit("AMP101", op=func, kind=nonfinite_kind(out_max), details=details,
                            **where)
        self.guard.request_tracing("AMP101")

    def _check_near_overflow(self, func, dtype, out_max: float, details, where) -> None:
        if dtype == torch.float16 and out_max > self.limits.near_overflow:
            self.guard.emit("AMP102", op=func, value=out_max, details=details, **where)

    @staticmethod
    def _record_inputs(args, kwargs, out, details, limit: float = math.inf) -> bool:
        """Add the inputs' dtypes and max |x| to ``details``; True if the op had tensor
        inputs and all of them, and its float constants, stay below ``limit`` in magnitude
        (finite, by default). Otherwise the op is not the first cause: a factory's output, a
        constant the user passed (``masked_fill(mask, float("-inf"))``, or
        ``torch.finfo(torch.float16).min`` for AMP102) or an input already that large is what
        the user asked for or was caused before.

        An in-place op's output is its own input and holds the new values, so it is left
        out: its old values were checked when they were produced.
        """
        values = (*args, *kwargs.values())
        if any(isinstance(v, float) and not abs(v) < limit for v in values):
            return False
        tensors = [t for v in values for t in tensors_in(v)]
        inputs = [t for t in tensors if t is not out and t.is_floating_point()]
        maxima = [peak(t).item() for t in inputs]
        details["input_dtypes"] = [dtype_name(t.dtype) for t in inputs]
        details["input_max"] = max(maxima, default=None)
        return bool(tensors) and all(m < limit for m in maxima)

    # -- AMP112: the loss when backward starts -------------------------------------------

    def _check_loss(self, func, args, kwargs) -> None:
        roots = args[0] if args else kwargs.get("tensors", ())
        for loss in tensors_in(roots):
            if not (loss.is_floating_point() and readable(loss)):
                continue
            if loss.numel() == 1 and loss.device.type == "cpu":  # the usual loss: no reduction
                self._judge_loss(loss.item(), {})
            else:
                self.readings.submit(peak(loss),
                                     lambda values, where: self._judge_loss(values[0], where))

    def _judge_loss(self, loss_max: float, where) -> None:
        if not math.isfinite(loss_max):
            self.guard.request_replay("AMP112")  # under policy="raise" it runs before this raises
            self.guard.emit("AMP112", op="backward", kind=nonfinite_kind(loss_max), **where)
            self.guard.request_tracing("AMP112")

    # -- AMP110: absorption in low-precision adds (sampled) ------------------------------

    def _check_absorption(self, func, args, kwargs) -> None:
        if len(args) < 2 or "alpha" in kwargs or not self._sampled():
            return
        a, b = args[0], args[1]
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return
        if a.dtype not in LOW_PRECISION or b.dtype != a.dtype or not (readable(a) and readable(b)):
            return
        a, b = a.detach(), b.detach()
        total = torch.add(a, b)
        b_lost = ((total == a) | (b == 0)).all() & (b != 0).any()
        a_lost = ((total == b) | (a == 0)).all() & (a != 0).any()
        a_max, b_max = peak(a).float(), peak(b).float()
        ratio = torch.maximum(a_max, b_max) / torch.minimum(a_max, b_max)
        dtype = a.dtype
        self.readings.submit(torch.stack([(a_lost | b_lost).float(), ratio]),
                             lambda values, where: self._judge_absorption(
                                 func, dtype, values, where))

    def _judge_absorption(self, func, dtype, values, where) -> None:
        absorbed, ratio = values
        if absorbed:
            self.guard.emit("AMP110", op=func, ratio=ratio, dtype=dtype_name(dtype),
                            details={"ratio": ratio}, **where)

    # -- AMP111: magnitude spread inside low-precision reductions (sampled) -------------

    def _check_reduction(self, func, args, kwargs, out) -> None:
        if not args or not isinstance(out, torch.Tensor) or out.dtype not in LOW_PRECISION:
            return
        source = args[0]
        if not isinstance(source, torch.Tensor) or source.dtype not in LOW_PRECISION:
            return
        if not readable(source):
            return
        if not self._sampled():
            return
        # Spread = largest magnitude over the typical one (geometric mean of the nonzero
        # magnitudes, which a few outliers cannot drag up as they would the mean).
        magnitude = source.detach().abs().float()
        nonzero = magnitude != 0
        count = nonzero.sum()
        mean_log = torch.where(nonzero, magnitude.log2(), 0.0).sum() / count.clamp(min=1)
        ratio = torch.where(count > 0, magnitude.amax() / torch.exp2(mean_log), 0.0)
        dtype = source.dtype
        self.readings.submit(ratio, lambda values, where: self._judge_reduction(
            func, dtype, values[0], where))

    def _judge_reduction(self, func, dtype, ratio: float, where) -> None:
        if ratio > self.limits.imbalanced_reduce_ratio:
            self.guard.emit("AMP111", op=func, ratio=ratio, dtype=dtype_name(dtype),
                            details={"ratio": ratio}, **where)


def monitors(guard):
    return [ForwardMonitor()]
