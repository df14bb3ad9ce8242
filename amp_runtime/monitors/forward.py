"""Numeric health of the forward pass: AMP101, AMP102, AMP110, AMP111, AMP112.

Per-op tracing (AMP101 non-finite output from finite inputs, AMP102 fp16 near-overflow)
costs one reduction per checked output: its peak (max |x|, from ``extremes``) propagates NaN,
so one number answers NaN, Inf and headroom to 65504. Tracing checks fp16/bf16 outputs, and
fp32 outputs while autocast is on: there autocast runs softmax, norms and losses in fp32 on
low-precision inputs, and a NaN born there is still the first cause. fp32 ops outside
autocast are not mixed precision's business, and checking them would double the cost of
tracing an fp32 model.

No host synchronisation per op: ``OpTrace`` keeps each checked op's output peak and its
inputs' peaks on the device, in op order, with where the op ran; the guard's readings
(``readings.py``) copy them at the next commit point and the step's ops are judged
together: the first op whose output is non-finite while its inputs were finite is AMP101.
The replay of a failing step (``replay.py``) traces with an ``OpTrace`` of its own, judged the
same way (``report_trace``) as soon as it has run.

The cheap tier checks the loss when backward starts (AMP112) on every step and, on watched
steps (``guard.py``), a sample of calls (one in ``Thresholds.sample_every``) of low-precision
adds (AMP110) and reductions (AMP111). Their values go through the same readings. A non-finite
loss is judged with the step it was computed in, and asks for that step's replay first.
"""
from __future__ import annotations

import functools
import math
import weakref
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..monitors import (
    LOW_PRECISION,
    Monitor,
    OpHandler,
    autocast_on,
    dtype_name,
    extremes,
    peak,
    readable,
    tensors_in,
)
from ..tracking import Location


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


#: Checked ops a trace holds before they are handed to the readings (a loop without steps).
MAX_TRACED_OPS = 4096


def writes_in_place(func, kwargs) -> bool:
    """Whether an op that returns one of its arguments wrote new values into it (``mul_``,
    ``+=``, ``out=``) rather than handing it back unchanged (``x.float()`` of a float tensor,
    ``contiguous()``, ``dropout`` with ``p=0``)."""
    return "out" in kwargs or getattr(func, "__name__", "").endswith("_")


def nonfinite_kind(value: float) -> str:
    return "NaN" if math.isnan(value) else "-inf" if value < 0 else "inf"


class TracedOp(NamedTuple):
    """One checked op, as host values; ``output`` and ``inputs`` index the trace's peaks."""

    func: Any
    dtype: torch.dtype
    output: int
    inputs: List[int]
    input_dtypes: List[torch.dtype]
    #: The largest magnitude among the op's float arguments (a ``-inf`` mask fill: inf).
    constant: float
    #: Whether the op had tensor arguments at all (a factory's output is what was asked for).
    has_tensors: bool
    module: Optional[str]
    location: Location


class OpTrace:
    """Per-op checks of a stretch of ops, kept on the device in op order and judged together.

    For each checked op: the output's peak, its floating-point inputs' magnitudes and, as host
    values, the op, its float constants and where it ran. An input that a checked op of the
    stretch produced reuses that peak, as does a view of it (its values are a subset of the
    base's), while neither has changed in place since (the version counter says so). Parameters
    are measured once per stretch, all together when it is handed over (``take``), by their
    largest magnitude: one fused kernel that keeps NaN and Inf (an L2 norm, which grows with the
    size, would take a large weight of small values for one near overflow). Other inputs
    (batches, buffers, copies, tensors of earlier steps) get a peak of their own. A peak is
    kept as the pair :func:`~amp_runtime.monitors.extremes` measures, in one list per dtype
    and device, stacked and combined into one tensor of peaks when handed over.

    Indices: the i-th peak of the stretch is ``i``; parameter ``j`` is ``~j`` (negative), which
    the position list ``take`` returns (peaks, then parameters in reverse) resolves by Python's
    indexing from the end.
    """

    def __init__(self, tracker):
        self._tracker = tracker
        self.ops: List[TracedOp] = []
        self.parameters: List[torch.Tensor] = []
        #: The extremes pairs (two device scalars per peak) by (dtype, device index);
        #: ``_slots[i]`` is where the i-th peak is kept: its group's key and its pair's position.
        self._groups: Dict[Tuple[torch.dtype, int], List[torch.Tensor]] = {}
        self._slots: List[Tuple[Tuple[torch.dtype, int], int]] = []
        #: id(tensor) -> (weak reference, version, index) of the tensors measured so far.
        self._known: Dict[int, Tuple[weakref.ref, int, int]] = {}
        #: id(parameter) -> its index (``~j`` for ``parameters[j]``).
        self._parameter_index: Dict[int, int] = {}

    def check(self, func, args, kwargs, out) -> None:
        """Trace handler: record each checked output of an op (see the module doc)."""
        # runs after every op while tracing: a single tensor output skips the generator
        for tensor in (out,) if type(out) is torch.Tensor else tensors_in(out):
            dtype = tensor.dtype
            if dtype not in LOW_PRECISION and dtype != torch.float32 or not readable(tensor):
                continue
            if dtype == torch.float32 and not autocast_on(tensor.device.type):
                continue
            self.record(func, args, kwargs, tensor)

    def record(self, func, args, kwargs, out: torch.Tensor) -> None:
        # runs for every checked op: the known-input case is inlined
        known = self._known
        constant, has_tensors, returns_input = 0.0, False, False
        inputs, dtypes = [], []
        for value in (*args, *kwargs.values()) if kwargs else args:
            if isinstance(value, torch.Tensor):
                tensors = (value,)
            elif isinstance(value, (list, tuple)):
                tensors = [item for item in value if isinstance(item, torch.Tensor)]
            else:
                if isinstance(value, float):
                    constant = max(constant, abs(value)) if abs(value) < math.inf else math.inf
                continue
            has_tensors = True
            for tensor in tensors:
                if tensor is out:
                    returns_input = True
                    continue
                dtype = tensor.dtype
                if not dtype.is_floating_point:
                    continue
                entry = known.get(id(tensor))
                if entry is not None and entry[0]() is tensor and entry[1] == tensor._version:
                    index = entry[2]
                else:
                    index = self._measure(tensor)
                    if index is None:
                        continue
                inputs.append(index)
                dtypes.append(dtype)
        if returns_input and not writes_in_place(func, kwargs):
            return  # ``x.float()`` of a float x, dropout(p=0): the input itself, nothing new
        index = self._add(out)
        self._remember(out, index)
        module, location = self._tracker.site()
        self.ops.append(TracedOp(func, out.dtype, index, inputs, dtypes, constant, has_tensors,
                                 module, location))

    def take(self) -> Tuple[List[torch.Tensor], List[int], List[TracedOp]]:
        """What the stretch recorded, and a fresh start: the peaks as one float32 tensor per
        device (the parameters' peaks last), where each index's value lands among the values
        read from them, and the ops. The guard's own tensor work: no mode sees it."""
        stacked, starts, size = [], {}, 0
        # no autograd graph over the parameters' peaks: it would cost a quarter of their time
        with torch._C.DisableTorchFunction(), torch.no_grad():
            for key, pairs in self._groups.items():
                starts[key] = size
                size += len(pairs) // 2
                stacked.append(torch.stack(pairs).view(-1, 2).abs().amax(1).float())
            positions = [starts[key] + position for key, position in self._slots]
            if self.parameters:
                norms = torch._foreach_norm(self.parameters, math.inf)
                try:
                    stacked.append(torch.stack(norms).float())
                except RuntimeError:  # parameters on several devices: the readings group them
                    stacked += [norm.float() for norm in norms]
                positions += range(size + len(norms) - 1, size - 1, -1)  # parameter j at ~j
        ops = self.ops
        self.ops, self.parameters, self._groups, self._slots, self._known = [], [], {}, [], {}
        self._parameter_index = {}
        self._tracker.release_frames()
        return stacked, positions, ops

    def _add(self, tensor: torch.Tensor) -> int:
        """Measure ``tensor`` (its extremes, combined into its peak by ``take``); its index in
        the stretch."""
        key = (tensor.dtype, tensor.get_device())
        pairs = self._groups.get(key)
        if pairs is None:
            pairs = self._groups[key] = []
        slots = self._slots
        slots.append((key, len(pairs) >> 1))
        pairs += extremes(tensor)
        return len(slots) - 1

    def _measure(self, tensor: torch.Tensor) -> Optional[int]:
        """The index of an input no traced op produced (None for one without values)."""
        if isinstance(tensor, torch.nn.Parameter):  # held until ``take``: its id is its key
            index = self._parameter_index.get(id(tensor))
            if index is None:
                index = self._parameter_index[id(tensor)] = ~len(self.parameters)
                self.parameters.append(tensor)
            return index
        base = tensor._base
        index = None if base is None else self._known_index(base)
        if index is None:
            if not readable(tensor):
                return None
            index = self._add(tensor)
        self._remember(tensor, index)
        return index

    def _known_index(self, tensor: torch.Tensor) -> Optional[int]:
        known = self._known.get(id(tensor))
        if known is None or known[0]() is not tensor or known[1] != tensor._version:
            return None
        return known[2]

    def _remember(self, tensor: torch.Tensor, index: int) -> None:
        """Let later inputs reuse ``tensor``'s measure, and its base's when it covers all of
        it (an op's output is often a reshaped view of the buffer it was computed in)."""
        try:
            version = tensor._version
        except RuntimeError:  # an inference tensor has no version counter: not reused
            return
        self._known[id(tensor)] = (weakref.ref(tensor), version, index)
        base = tensor._base
        if base is not None and base.numel() == tensor.numel():
            self._known[id(base)] = (weakref.ref(base), version, index)


def judge_trace(ops: Sequence[TracedOp], positions: Sequence[int], values: Sequence[float],
                near_overflow: float) -> Tuple[List[Tuple[str, dict]], bool]:
    """A traced stretch's findings as ``(code, emit keyword arguments)``, and whether any output
    was non-finite. ``values`` were read from ``OpTrace.take()``'s tensors, ``positions`` place
    each index among them. The ops in order: one whose output is non-finite while its inputs
    (and float arguments) were finite is a first cause, AMP101; later ones propagate it. An fp16
    output above ``near_overflow`` from inputs below it is AMP102."""
    findings: List[Tuple[str, dict]] = []
    nonfinite = False
    for op in ops:
        out_max = values[positions[op.output]]
        if out_max <= near_overflow:  # almost every op (False for NaN)
            continue
        finite = math.isfinite(out_max)
        nonfinite = nonfinite or not finite
        bound = near_overflow if finite else math.inf
        maxima = [values[positions[i]] for i in op.inputs]
        if not op.has_tensors or not op.constant < bound or not all(m < bound for m in maxima):
            continue  # asked for (a factory, a constant) or caused before
        if finite and op.dtype != torch.float16:
            continue  # a bf16/fp32 value this large is far from overflow
        kwargs = dict(op=op.func, module=op.module, location=op.location, details={
            "dtype": dtype_name(op.dtype), "output_max": out_max,
            "input_dtypes": [dtype_name(dtype) for dtype in op.input_dtypes],
            "input_max": max(maxima, default=None)})
        if finite:
            findings.append(("AMP102", dict(kwargs, value=out_max)))
        else:
            findings.append(("AMP101", dict(kwargs, kind=nonfinite_kind(out_max))))
    return findings, nonfinite


def report_trace(guard, ops: Sequence[TracedOp], positions: Sequence[int],
                 values: Sequence[float], step: int) -> None:
    """Emit ``judge_trace``'s findings for ``step``; a non-finite output keeps tracing on."""
    findings, nonfinite = judge_trace(ops, positions, values, guard.thresholds.near_overflow)
    for code, kwargs in findings:
        guard.emit(code, step=step, **kwargs)
    if nonfinite:
        guard.request_tracing("AMP101")


class ForwardMonitor(Monitor):
    codes = ("AMP101", "AMP102", "AMP110", "AMP111", "AMP112")
    untraced = UNTRACED_FUNCTIONS

    def attach(self, guard) -> None:
        super().attach(guard)
        self.limits = guard.thresholds
        self.readings = guard.readings
        self.trace = OpTrace(guard.tracker)
        self._sample_counter = 0
        #: The step whose backward calls ``_backwards`` counts (``_check_loss``).
        self._backwards_step, self._backwards = -1, 0
        self._collector = None
        if guard.enabled("AMP101") or guard.enabled("AMP102"):
            self.trace_handler = self._check_output
            # each commit point hands the ops traced so far to the readings
            self._collector = guard.containment.wrap(self, self._submit_trace)
            self.readings.collectors.append(self._collector)

    def op_handlers(self) -> Dict[Any, OpHandler]:
        handlers: Dict[Any, OpHandler] = {}
        if self.guard.enabled("AMP112") or self.trace_handler is not None:
            handlers.update({f: OpHandler(before=self._backward_starts)
                             for f in BACKWARD_FUNCTIONS})
        if self.guard.enabled("AMP110"):
            handlers.update({f: OpHandler(before=self._check_absorption) for f in ADD_FUNCTIONS})
        if self.guard.enabled("AMP111"):
            handlers.update({f: OpHandler(after=self._check_reduction) for f in REDUCE_FUNCTIONS})
        return handlers

    def detach(self) -> None:
        if self._collector in self.readings.collectors:
            self.readings.collectors.remove(self._collector)
        self.trace.take()
        super().detach()

    def _sampled(self) -> bool:
        self._sample_counter += 1
        return self._sample_counter % self.limits.sample_every == 0

    def _where(self) -> Tuple[Optional[str], Location]:
        """The running module and the user's code, for a judge that runs later."""
        return self.guard.tracker.site()

    # -- AMP101 / AMP102: every output while tracing ------------------------------------

    def _check_output(self, func, args, kwargs, out) -> None:
        self.trace.check(func, args, kwargs, out)
        if len(self.trace.ops) >= MAX_TRACED_OPS:
            self.readings.commit()
            self.readings.poll()

    def _submit_trace(self) -> None:
        """Hand the ops traced so far to the readings: their peaks, a few stacked tensors."""
        if not self.trace.ops:
            return
        stacked, positions, ops = self.trace.take()
        self.submit(stacked, functools.partial(self._judge_trace, ops, positions))

    def _judge_trace(self, ops: List[TracedOp], positions: List[int], values: List[float],
                     step: int) -> None:
        report_trace(self.guard, ops, positions, values, step)

    # -- AMP112: the loss when backward starts -------------------------------------------

    def _backward_starts(self, func, args, kwargs) -> None:
        # the forward's ops are judged before its loss and its gradients: the replay of a
        # failing step needs to know whether they found its cause
        self._submit_trace()
        if self.guard.enabled("AMP112"):
            self._check_loss(args, kwargs)

    def _check_loss(self, args, kwargs) -> None:
        roots = args[0] if args else kwargs.get("tensors", ())
        losses = [loss.detach() if loss.numel() == 1 else peak(loss) for loss in tensors_in(roots)
                  if loss.is_floating_point() and readable(loss)]
        if losses:
            guard = self.guard
            if self._backwards_step != guard.step_index:
                self._backwards_step, self._backwards = guard.step_index, 0
            self._backwards += 1  # the how-many-th backward of the step: where the loop calls it
            location = guard.tracker.loop_location(("backward", self._backwards))
            self.submit(losses, functools.partial(self._judge_loss, location))

    def _judge_loss(self, location: Location, losses: List[float], step: int) -> None:
        nonfinite = [value for value in losses if not math.isfinite(value)]
        if nonfinite:
            replay = self.guard.request_replay("AMP112", step)  # its AMP101 comes first
            origin = None if replay is None else replay.cause()
            if origin is not None:
                cause = f"; {origin.clause()}"
            elif replay is not None and replay.episode is not None:
                cause = f"; not replayed: {replay.skipped}"
            elif replay is not None and replay.skipped:
                cause = f"; not replayed: {replay.skipped} (trace='always' checks every op live)"
            else:
                cause = ""
            self.guard.emit("AMP112", op="backward", kind=nonfinite_kind(nonfinite[0]),
                            cause=cause,
                            location=location, step=step,
                            details={} if replay is None else {"replay": replay.to_json()})
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
        self.submit([torch.stack([(a_lost | b_lost).float(), ratio])], functools.partial(
            self._judge_absorption, func, a.dtype, self._where()))

    def _judge_absorption(self, func, dtype, where, values, step) -> None:
        absorbed, ratio = values
        if absorbed and math.isfinite(ratio):  # an inf/NaN operand: AMP101's, not absorption
            module, location = where
            self.guard.emit("AMP110", op=func, ratio=ratio, dtype=dtype_name(dtype),
                            details={"ratio": ratio}, module=module,
                            location=location, step=step)

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
        self.submit([ratio], functools.partial(
            self._judge_reduction, func, source.dtype, self._where()))

    def _judge_reduction(self, func, dtype, where, values, step) -> None:
        ratio = values[0]
        if math.isfinite(ratio) and ratio > self.limits.imbalanced_reduce_ratio:
            module, location = where
            self.guard.emit("AMP111", op=func, ratio=ratio, dtype=dtype_name(dtype),
                            details={"ratio": ratio}, module=module,
                            location=location, step=step)


def monitors(guard):
    return [ForwardMonitor()]
