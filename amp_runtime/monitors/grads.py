"""Gradient health once per training step: AMP103, AMP104, AMP105, AMP106.

Where the gradients are sampled:

* with a GradScaler, right after the scaler unscaled them (reported by the scaler watch,
  ``monitors/scaler.py``) on detailed steps, else at the optimizer step that applies them; the
  scaler's own ``found_inf`` says whether the step is skipped (AMP107-AMP109's business), so no
  separate finiteness pass is needed;
* otherwise in a global optimizer step pre-hook (the gradients the optimizer is about to apply; if a
  scaler scaled them and nobody unscaled them, they are divided by the scale before judging);
* for loops with neither, at ``guard.step()`` over the ``model=`` parameters.

Norms are those of the gradients the optimizer applies, after any ``clip_grad_norm_``, in every
precision: a norm the loop's clipping contains is not an explosion (AMP104). The other detailed
statistics are taken at the unscale, before clipping, which would shrink the magnitudes AMP106
compares with fp16's range; their norms are taken again at the step.

The statistics of one set of gradients are ``torch._foreach_*`` kernels (fused over all parameters)
producing one small tensor: every step only the per-parameter L2 norms (one pass: non-finite values,
total norm, vanishing layers), every ``DETAIL_EVERY`` steps and on logged steps also max |g|,
nonzero counts and fp16 underflow counts. They go to the guard's readings (``readings.py``) when the
optimizer is about to step on them, and are judged once their copy has reached the host: on the CPU
right away, before the step is applied, on a GPU usually a step later, the events still carrying the
step of the gradients. Gradient accumulation is judged once per step because samples are taken
where the optimizer consumes the gradients, not at backward. Non-finite gradients (AMP103) have
their step replayed first (``replay.py``), so that the event names where they came from.
"""
from __future__ import annotations

import functools
import itertools
import math
import operator
import threading
import weakref
from dataclasses import dataclass
from typing import (
    Any, Collection, Dict, FrozenSet, Iterable, List, Optional, Sequence, Set, Tuple,
)

import torch
from torch.amp.grad_scaler import OptState
from torch.optim.optimizer import register_optimizer_step_pre_hook

from flake8_amp.catalog import FP16_TINY_SUBNORMAL
from amp_runtime.monitors import Monitor
from amp_runtime.monitors.scaler import watch_of
from amp_runtime.rules.amp011 import flushes_to_zero
from amp_runtime.thresholds import Thresholds
from amp_runtime.tracking import ModuleTracker, clean_path

#: Scaled magnitudes below this flush to zero in float16 (below 2**-25) or round to its smallest
#: subnormal, 2**-24: the lowest bin of values it can hold, next to those it loses.
FP16_LOWEST_BIN = 1.5 * FP16_TINY_SUBNORMAL

#: Steps between detailed statistics (max |g|, zeros, fp16 underflow: AMP106), which take about
#: ten more passes over the gradients; steps logged to metrics.jsonl are always detailed.
DETAIL_EVERY = 32

#: How many layer names a message lists before "…".
_NAMES_IN_MESSAGE = 5
#: Parameter lists whose names are kept (one per optimizer and device in most loops).
_NAME_LISTS = 64
#: Parameters watched at most for whether a backward reaches them (``ReachedParameters``).
_WATCHED = 4096

_GRAD, _DEVICE, _SHAPE = (operator.attrgetter(name) for name in ("grad", "device", "shape"))
_IS_SPARSE = operator.attrgetter("is_sparse")
_PARAMS = operator.itemgetter("params")

#: Rows of the statistics tensor.
NORM, MAX, NONZERO, CLEAR = range(4)


def l2_norms(grads: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Each gradient's L2 norm as a 0-dim float32 tensor, one fused pass (NaN/Inf propagate)."""
    with torch.no_grad():
        return list(torch._foreach_norm(list(grads), 2, dtype=torch.float32))


def gradient_stats(grads: Sequence[torch.Tensor], loss_scale: Optional[torch.Tensor] = None,
                   detailed: bool = True,
                   counted: Optional[Sequence[bool]] = None) -> torch.Tensor:
    """Per-gradient statistics of same-device ``grads`` as one float32 tensor, without a host sync.

    Row ``NORM``: the L2 norm (NaN/Inf propagate), one fused pass. When ``detailed``, also ``MAX``
    (max |g|), ``NONZERO`` (number of nonzero elements) and, given ``loss_scale`` — the factor the
    gradients would be multiplied by in an fp16 backward, a device tensor — ``CLEAR``: the number
    of elements whose value times ``loss_scale`` is clear of fp16's lowest bin
    (``FP16_LOWEST_BIN``), NaN without a scale and for the gradients ``counted`` marks False; the
    other nonzero elements flush to zero or sit at fp16's smallest subnormal (``underflow``).
    Shape ``(4, n)`` when detailed, else ``(1, n)``.
    """
    grads = list(grads)
    with torch.no_grad():
        columns = l2_norms(grads)
        if detailed:
            columns += torch._foreach_norm(grads, math.inf, dtype=torch.float32)
            columns += torch._foreach_norm(grads, 0, dtype=torch.float32)
            if counted is None:
                counted = [loss_scale is not None] * len(grads)
            chosen = [g for g, count in zip(grads, counted) if count]
            if not chosen:
                columns += [torch.full((), math.nan, device=grads[0].device)] * len(grads)
            else:
                # |g * scale| - limit > 0 <=> the scaled value is above limit; L0 norms count them
                scale = loss_scale.to(grads[0].device)
                magnitude = torch._foreach_mul([g.float() for g in chosen], scale)
                torch._foreach_abs_(magnitude)
                torch._foreach_sub_(magnitude, FP16_LOWEST_BIN)
                torch._foreach_clamp_min_(magnitude, 0.0)
                found = iter(torch._foreach_norm(magnitude, 0, dtype=torch.float32))
                nan = torch.full((), math.nan, device=grads[0].device)
                columns += [next(found) if count else nan for count in counted]
        return torch.stack(columns).reshape(-1, len(grads))


@dataclass
class GradSample:
    """Statistics of one set of gradients, ``stats`` on the device until the readings copy them."""

    names: List[str]
    shapes: List[torch.Size]
    stats: torch.Tensor
    #: The gradients were still multiplied by this loss scale when sampled (None: unscaled).
    scaled_by: Optional[torch.Tensor] = None
    #: The loss scale in effect (AMP106 reference), None when no scaler is involved.
    loss_scale: Optional[torch.Tensor] = None
    #: The parameters (kept until judged, to watch those found at zero: ``ReachedParameters``),
    #: the ids of their gradient tensors, and which of them were watched and reached by the
    #: step's backward.
    params: Sequence[torch.Tensor] = ()
    grad_ids: Tuple[int, ...] = ()
    watched: FrozenSet[int] = frozenset()
    reached: FrozenSet[int] = frozenset()

    @property
    def rows(self) -> int:
        """How many statistics per gradient: 1 (norms only) or 4 (detailed)."""
        return self.stats.shape[0]


@dataclass(slots=True)
class LayerGrad:
    """Host-side statistics of one parameter's gradient, on unscaled values."""

    name: str
    numel: int
    ndim: int
    norm: float
    #: These three are None on steps without detailed statistics.
    max: Optional[float]
    #: Fraction of exact zeros.
    zero_fraction: Optional[float]
    #: Fraction of the nonzero elements that flush to zero in fp16 at the loss scale, estimated
    #: (``underflow``; None where not counted).
    underflow_fraction: Optional[float]

    def to_json(self) -> Dict[str, Optional[float]]:
        return {
            "max": self.max,
            "norm": self.norm,
            "zero_fraction": self.zero_fraction,
            "underflow_fraction": self.underflow_fraction,
        }


def reading_tensors(samples: Sequence[GradSample]) -> List[torch.Tensor]:
    """What to read of ``samples``: their statistics, then each scale tensor they refer to once
    (usually one and the same, the scaler's); ``host_values`` takes the values apart again."""
    return [s.stats for s in samples] + list(_scale_tensors(samples).values())


def _scale_tensors(samples: Sequence[GradSample]) -> Dict[int, torch.Tensor]:
    return {id(t): t for sample in samples for t in (sample.scaled_by, sample.loss_scale)
            if t is not None}


def host_values(samples: Sequence[GradSample], values: Sequence[float]
                ) -> Tuple[List[float], List[float], List[float]]:
    """``reading_tensors(samples)``'s values as the samples' statistics (one flat list), and per
    sample the factor its gradients were still scaled by (1.0 for none) and its loss scale (NaN
    for none)."""
    size = sum(s.stats.numel() for s in samples)
    host = list(values[:size])
    read = dict(zip(_scale_tensors(samples), values[size:]))
    factors = [1.0 if s.scaled_by is None else read[id(s.scaled_by)] for s in samples]
    scales = [math.nan if s.loss_scale is None else read[id(s.loss_scale)] for s in samples]
    return host, factors, scales


def underflow_fraction(nonzero: float, clear: float) -> float:
    """The fraction of a gradient's nonzero values that flush to zero in fp16 at the loss scale,
    from its ``NONZERO`` and ``CLEAR`` counts.

    Exact zeros are not counted: an embedding row not in the batch, a dead unit, a masked position
    is sparsity. What an fp16 backward flushed is exactly zero by now too, though, so the flushed
    values are estimated from their neighbours: the scaled values that rounded to fp16's smallest
    subnormal (2**-24) lie in a bin twice as wide as the one that rounds to zero, so half their
    number flushed, where the gradients reach down there. Not the share of subnormals: a healthy
    layer's gradients have 1-3 % of them, near zero, at the default scale.
    """
    if not nonzero:
        return 0.0
    return (nonzero - clear) / 2 / nonzero


def lost_norm_share(layer: LayerGrad, loss_scale: float) -> float:
    """At most how much of ``layer``'s gradient norm its flushed values carried, each being below
    fp16's lowest bin at ``loss_scale``. The smallest values of a gradient spanning many orders
    of magnitude (a tied embedding's rarest tokens under a peaked softmax) can be 1-3 % of its
    values and 1e-10 of its norm: their loss costs the layer nothing."""
    if not layer.norm or not math.isfinite(layer.norm) or loss_scale <= 0:
        return math.inf
    flushed = layer.underflow_fraction * layer.numel * (1.0 - layer.zero_fraction)
    return math.sqrt(flushed) * FP16_LOWEST_BIN / loss_scale / layer.norm


def layer_stats(samples: Sequence[GradSample], host: List[float], factors: List[float],
                scales: List[float]) -> Tuple[List[LayerGrad], Optional[float]]:
    """The per-layer statistics in ``host_values``' values, and the loss scale they had."""
    layers: List[LayerGrad] = []
    offset = 0
    for sample, factor, scale in zip(samples, factors, scales):
        n = len(sample.names)
        rows = [host[offset + r * n: offset + (r + 1) * n] for r in range(sample.rows)]
        offset += len(rows) * n
        for i, (name, shape) in enumerate(zip(sample.names, sample.shapes)):
            numel = shape.numel()
            largest = zero_fraction = underflow = None
            if len(rows) > 1 and numel:
                largest = rows[MAX][i] / factor
                nonzero, clear = rows[NONZERO][i], rows[CLEAR][i]
                zero_fraction = 1.0 - nonzero / numel
                if not math.isnan(clear):
                    underflow = underflow_fraction(nonzero, clear)
            layers.append(LayerGrad(
                name=name,
                numel=numel,
                ndim=len(shape),
                norm=rows[NORM][i] / factor,
                max=largest,
                zero_fraction=zero_fraction,
                underflow_fraction=underflow,
            ))
    known_scales = [s for s in scales if not math.isnan(s)]
    return layers, (known_scales[-1] if known_scales else None)


def total_norm(layers: Sequence[LayerGrad]) -> float:
    """The L2 norm over all gradients (NaN/Inf when any gradient is non-finite)."""
    return math.hypot(*(g.norm for g in layers))


def quiet_norm(samples: Sequence[GradSample], host: List[float], factors: List[float],
               limits: Thresholds) -> Optional[float]:
    """The total norm of a norms-only step in which ``judge_gradients`` can find nothing, else
    None: most steps are judged on these norms alone, without per-layer statistics."""
    norms: List[float] = []
    offset = 0
    for sample, factor in zip(samples, factors):
        count = len(sample.names)
        if sample.rows > 1:  # a detailed step
            return None
        values = host[offset:offset + count]
        norms += values if factor == 1.0 else [value / factor for value in values]
        offset += count
    if not norms:
        return None
    total = math.hypot(*norms)
    quiet = limits.grad_vanishing_total <= total <= limits.grad_explosion  # also False for NaN
    return total if quiet and min(norms) >= limits.grad_vanishing_layer else None


def layer_of(param_name: str) -> str:
    """The module path of a parameter name (``blocks.0.fc.weight`` -> ``blocks.0.fc``)."""
    return param_name.rpartition(".")[0] or param_name


def listing(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_NAMES_IN_MESSAGE])
    hidden = len(names) - _NAMES_IN_MESSAGE
    return shown + (f" and {hidden} more" if hidden > 0 else "")


def nonfinite_gradients(parameter_names: Iterable[str]) -> dict:
    """AMP103's emit arguments for the parameters (earliest first) whose gradients are
    non-finite, named by their layers."""
    names = list(dict.fromkeys(layer_of(name) for name in parameter_names))
    return dict(where=listing(names), module=names[0], details={"layers": names})


def judge_gradients(
    layers: Sequence[LayerGrad], loss_scale: Optional[float], limits: Thresholds,
    unreached: Collection[str] = frozenset(),
) -> List[Tuple[str, dict]]:
    """One step's findings as ``(code, emit keyword arguments)``, layers earliest first.

    ``unreached``: parameters whose zero gradients the step's backward did not write (a head it
    did not use): not vanishing (AMP105)."""
    if not layers:
        return []
    findings: List[Tuple[str, dict]] = []
    total = total_norm(layers)
    if not math.isfinite(total):
        nonfinite = (g.name for g in layers if not math.isfinite(g.norm))
        findings.append(("AMP103", nonfinite_gradients(nonfinite)))
        return findings  # norms of non-finite gradients mean nothing

    if total > limits.grad_explosion:
        largest = max(layers, key=lambda g: g.norm)
        p0 = total > limits.grad_explosion_p0
        limit = limits.grad_explosion_p0 if p0 else limits.grad_explosion
        findings.append(("AMP104", dict(
            severity="P0" if p0 else "P1", norm=total, limit=limit, module=layer_of(largest.name),
            details={"total_norm": total, "largest": largest.name, "largest_norm": largest.norm},
        )))

    reached = [g for g in layers if g.name not in unreached] if unreached else layers
    findings += _vanishing(reached, total if reached is layers else total_norm(reached), total,
                           limits)

    if loss_scale is not None and layers[0].max is not None:  # detailed step
        for g in layers:
            # Judged on weight matrices and kernels, whose gradients an fp16 matmul/conv computes
            # (1-D parameters get sums over the batch), over their nonzero values
            # (``underflow_fraction``: exact zeros are sparsity, not underflow).
            fraction = g.underflow_fraction
            if g.ndim < 2 or fraction is None or fraction <= limits.grad_underflow_fraction:
                continue
            share = lost_norm_share(g, loss_scale)
            if share > limits.grad_underflow_norm_share:
                findings.append(("AMP106", dict(
                    fraction=fraction, layer=g.name, scale=loss_scale, module=layer_of(g.name),
                    details={"parameter": g.name, "loss_scale": loss_scale,
                             "zero_fraction": g.zero_fraction, "norm_share": share},
                )))
    return findings


def _vanishing(reached: Sequence[LayerGrad], reached_total: float, total: float,
               limits: Thresholds) -> List[Tuple[str, dict]]:
    """AMP105 over the gradients the step's backward wrote (``reached_total``: their norm;
    ``total``: the norm of all)."""
    if not reached:
        return []
    if reached_total < limits.grad_vanishing_total:
        return [("AMP105", dict(
            detail=f"total gradient norm {reached_total:.3g} is below "
                   f"{limits.grad_vanishing_total:g}",
            details={"total_norm": reached_total},
        ))]
    if min(g.norm for g in reached) >= limits.grad_vanishing_layer:
        return []
    # A layer's L2 norm bounds every |g| in it: norm < limit implies max |g| < limit.
    layer_norm: Dict[str, float] = {}
    for g in reached:
        key = layer_of(g.name)
        layer_norm[key] = math.hypot(layer_norm.get(key, 0.0), g.norm)
    vanished = [name for name, value in layer_norm.items()
                if value < limits.grad_vanishing_layer]
    return [("AMP105", dict(
        detail=f"gradients vanished (max |g| < {limits.grad_vanishing_layer:g}) in "
               f"{len(vanished)} layer(s): {listing(vanished)}",
        module=vanished[0],
        details={"layers": vanished, "total_norm": total},
    ))] if vanished else []


class ParameterNames:
    """Names parameters ``module.path.weight`` for reports.

    From the root modules the guard has seen (``guard(model=...)``, modules seen running:
    ``ModuleTracker.roots``), searched when an unnamed parameter is met and again once a new root
    was seen (never per step, never on the heap); else ``param<i>[shape]``.
    """

    def __init__(self, tracker: ModuleTracker):
        self._tracker = tracker
        self._names: Dict[int, str] = {}
        #: The roots' generation last searched.
        self._searched = -1
        #: The name lists of the parameter lists met so far, by their ids (with whether all of
        #: their parameters were found in a root).
        self._lists: Dict[Tuple[int, ...], Tuple[List[str], bool]] = {}

    def _search_roots(self) -> None:
        self._searched = self._tracker.generation
        for module in self._tracker.roots():
            for name, param in module.named_parameters(remove_duplicate=False):
                self._names.setdefault(id(param), clean_path(name))

    def names(self, params: Sequence[torch.Tensor]) -> List[str]:
        key = tuple(map(id, params))  # the same parameters every step: one look-up
        known = self._lists.get(key)
        if known is None or not known[1] and self._searched != self._tracker.generation:
            if any(id(p) not in self._names for p in params):
                self._search_roots()
            found = all(id(p) in self._names for p in params)
            names = [self._names.get(id(p)) or f"param{index}{list(p.shape)}"
                     for index, p in enumerate(params)]
            if len(self._lists) >= _NAME_LISTS:
                self._lists.clear()
            known = self._lists[key] = (names, found)
        return known[0]


class ReachedParameters:
    """Whether a backward reached the parameters watched: those whose kept gradient was found all
    zero. After ``zero_grad(set_to_none=False)`` a head the step did not use keeps zeros just as a
    dead layer does; only the backward tells them apart. One post-accumulate-grad hook per watched
    parameter: a run whose kept gradients are never all zero watches none."""

    def __init__(self, monitor: Monitor):
        self._monitor = monitor
        self._watched: Dict[int, weakref.ref] = {}
        #: Watched parameters a backward of this step accumulated into.
        self._reached: Set[int] = set()

    def watch(self, params: Iterable[torch.Tensor]) -> None:
        for param in params:
            known = self._watched.get(id(param))
            if known is not None and known() is param or len(self._watched) >= _WATCHED:
                continue
            if param.is_leaf and param.requires_grad:
                self._watched[id(param)] = weakref.ref(param)
                self._monitor.keep(param.register_post_accumulate_grad_hook(self._accumulated))

    def _accumulated(self, param: torch.Tensor) -> None:
        self._reached.add(id(param))

    def step_ended(self) -> None:
        """Forget the reaches of a step no optimizer sampled (a step the GradScaler skipped)."""
        self._reached.clear()

    def take(self, params: Sequence[torch.Tensor]) -> Tuple[FrozenSet[int], FrozenSet[int]]:
        """Which of ``params`` are watched, and which of those this step's backward reached."""
        if not self._watched:
            return frozenset(), frozenset()
        watched = frozenset(id(p) for p in params if id(p) in self._watched)
        reached = watched & self._reached
        self._reached -= reached
        return watched, reached


def unreached_parameters(samples: Sequence[GradSample], layers: Sequence[LayerGrad],
                         previous: Optional[List[Tuple[List[str], Tuple[int, ...]]]],
                         fresh: bool,
                         reported: Collection[str]) -> Tuple[Set[str], List[torch.Tensor]]:
    """The parameters of ``samples`` whose all-zero gradients no backward wrote since their last
    sample, and those whose zeros are of unknown origin (to be watched).

    The gradients of the guard's first step (``fresh``) were made by it. Later, a gradient tensor
    other than the one sampled last time (``previous``: the names and gradient ids of the last
    samples, None when there were none) was made by this step's backward. One that was not
    there at the last sample may have been made by a step the GradScaler skipped, and is kept
    like the others. A kept one was reached if a watch saw the backward accumulate into it;
    unwatched, it is undecided and counts as it did before (its layer among those
    ``reported``) until the next step tells."""
    zero = {g.name for g in layers if g.norm == 0.0}
    unreached: Set[str] = set()
    unknown: List[torch.Tensor] = []
    if not zero or fresh:
        return unreached, unknown
    before = None if previous is None else {
        name: grad_id for names, ids in previous for name, grad_id in zip(names, ids)}
    for sample in samples:
        for name, param, grad_id in zip(sample.names, sample.params, sample.grad_ids):
            if name not in zero or id(param) in sample.reached:
                continue
            if before is not None and before.get(name, grad_id) != grad_id:
                continue  # made anew by this step's backward
            if id(param) not in sample.watched:
                unknown.append(param)
                if layer_of(name) in reported:
                    continue
            unreached.add(name)
    return unreached, unknown


def _with_applied_norms(sample: GradSample) -> GradSample:
    """``sample``, taken at the unscale, with the norms of its gradients as the optimizer is about
    to apply them (after any clipping)."""
    grads = list(map(_GRAD, sample.params))
    if any(map(operator.is_, grads, itertools.repeat(None))):
        return sample
    with torch._C.DisableTorchFunction():
        norms = torch.stack(l2_norms(grads)).reshape(1, -1)
        sample.stats = torch.cat((norms, sample.stats[1:]))
    return sample


class GradHealth(Monitor):
    """Samples the gradients where the optimizer consumes them and judges them once per step."""

    codes = ("AMP103", "AMP104", "AMP105", "AMP106")

    def __init__(self, guard):
        super().__init__()
        self.names = ParameterNames(guard.tracker)
        #: Samples taken when a scaler unscaled an optimizer's gradients (id -> samples), submitted
        #: when it steps on them; dropped at the step end if it does not (the scaler skipped).
        self.unscaled: Dict[int, List[GradSample]] = {}
        self.sampled_optimizers: set = set()
        #: Optimizers whose gradients are sampled at their step: id -> (scaled_by, loss_scale).
        self.deferred: Dict[int, tuple] = {}
        #: The lasting conditions (AMP105, AMP106) reported at the last judgement, per optimizer
        #: (None: ``guard.step()``), so that each is reported when it starts or changes.
        self._previous_keys: Dict[Optional[int], set] = {}
        #: Per optimizer, the names and gradient ids of its last sample (``unreached_parameters``).
        self._previous_grads: Dict[Optional[int], List[Tuple[List[str], Tuple[int, ...]]]] = {}
        self.reached = ReachedParameters(self)

    def attach(self, guard):
        super().attach(guard)
        self.keep(register_optimizer_step_pre_hook(self._optimizer_step_starts))
        self._watch = watch_of(guard)
        self._watch.check_listeners.append(self._unscaled)

    # -- sampling ----------------------------------------------------------------------

    def _sample(self, params: List[torch.Tensor], scaled_by=None,
                loss_scale=None) -> List[GradSample]:
        # Once per step over every parameter: the usual case (dense gradients on one device) is
        # recognised without a Python loop.
        grads = list(map(_GRAD, params))
        if any(map(operator.is_, grads, itertools.repeat(None))) or any(map(_IS_SPARSE, grads)):
            params = [p for p, g in zip(params, grads) if g is not None and not g.is_sparse]
            grads = list(map(_GRAD, params))
        if not grads:
            return []
        logged = self._logged_step()
        detailed = logged or self._detailed_step()
        groups = [(params, grads)]
        if len(set(map(_DEVICE, grads))) > 1:
            by_device: Dict[torch.device, Tuple[list, list]] = {}
            for param, grad in zip(params, grads):
                device_params, device_grads = by_device.setdefault(grad.device, ([], []))
                device_params.append(param)
                device_grads.append(grad)
            groups = list(by_device.values())
        samples = []
        for device_params, grads in groups:
            flush_factor = None
            if loss_scale is not None:
                # scaled gradients are compared as they are; unscaled ones times the scale
                flush_factor = loss_scale
                if scaled_by is not None:
                    flush_factor = torch.ones((), device=grads[0].device)
            with torch._C.DisableTorchFunction():
                if detailed:
                    # AMP106 judges weight matrices only; logged steps count every layer
                    counted = None if logged or flush_factor is None else [
                        g.dim() >= 2 for g in grads]
                    stats = gradient_stats(grads, flush_factor, counted=counted)
                else:
                    stats = torch.stack(l2_norms(grads)).reshape(1, -1)
            watched, reached = self.reached.take(device_params)
            samples.append(GradSample(
                names=self.names.names(device_params),
                shapes=list(map(_SHAPE, grads)),
                stats=stats,
                scaled_by=scaled_by,
                loss_scale=loss_scale,
                params=device_params,
                grad_ids=tuple(map(id, grads)),
                watched=watched,
                reached=reached,
            ))
        return samples

    def _unscaled(self, scaler, optimizer, still_scaled, grads):
        """GradScaler checked (usually unscaled) an optimizer's gradients (``grads``, or all)."""
        scaled_by = scaler._scale if still_scaled else None
        if not self._detailed_step():
            # sampled at the optimizer step, after any clipping
            self.deferred[id(optimizer)] = (scaled_by, scaler._scale)
            return
        ids = None if grads is None else {id(g) for g in grads}
        params = [p for group in optimizer.param_groups for p in group["params"]
                  if p.grad is not None and (ids is None or id(p.grad) in ids)]
        samples = self._sample(params, scaled_by=scaled_by, loss_scale=scaler._scale)
        self.unscaled.setdefault(id(optimizer), []).extend(samples)
        self.sampled_optimizers.add(id(optimizer))

    def _optimizer_step_starts(self, optimizer, args, kwargs):
        guard = self.guard
        if guard is None or guard.suspended or threading.get_ident() != guard._thread:
            return
        key = id(optimizer)
        samples = list(map(_with_applied_norms, self.unscaled.pop(key, [])))
        if key not in self.sampled_optimizers:
            if key in self.deferred:
                scaled_by, loss_scale = self.deferred.pop(key)
            else:
                scaled_by = None
                for state in self._watch.scaled_pending():
                    if state.stage(optimizer) is OptState.READY:
                        # stepping on scaled gradients (AMP006): judge them unscaled
                        scaled_by = state.scaler._scale
                loss_scale = scaled_by
            params = list(itertools.chain.from_iterable(map(_PARAMS, optimizer.param_groups)))
            samples += self._sample(params, scaled_by=scaled_by, loss_scale=loss_scale)
            self.sampled_optimizers.add(key)
        # inside GradScaler.step a found inf/NaN skips the step (a fused optimizer, stepping
        # anyway, ignores it); stepped directly, the optimizer applies whatever it has
        skipped_if = self._watch.found_inf(optimizer) if self._watch.scaler_stepping() else []
        self._submit(key, samples, skipped_if)

    def _submit(self, key: Optional[int], samples: List[GradSample],
                skipped_if: List[torch.Tensor]) -> None:
        """Hand ``samples`` to the readings, judged as one set of gradients unless one of the
        ``skipped_if`` flags is set."""
        if not samples:
            return
        guard = self.guard
        judge = functools.partial(self._judge, key, samples, len(skipped_if), guard.step_record,
                                  guard.tracker.loop_location(("optimizer.step", key)),
                                  guard._steps_ended == 0)
        self.submit(reading_tensors(samples) + skipped_if, judge)

    def _logged_step(self) -> bool:
        """Whether this step's per-layer statistics go to metrics.jsonl."""
        guard = self.guard
        return guard.log_dir is not None and guard.step_index % guard.thresholds.metrics_every == 0

    def _detailed_step(self) -> bool:
        """Whether this step also counts zeros and fp16 underflow (AMP106, metrics.jsonl layers)."""
        return self._logged_step() or self.guard.step_index % DETAIL_EVERY == 0

    def on_step_end(self, step, record):
        if not self.sampled_optimizers and self.guard.manual_steps and self.guard.model is not None:
            self._submit(None, self._sample(list(self.guard.model.parameters())), [])
        self.unscaled.clear()  # no optimizer stepped on them: the scaler skipped the step
        self.reached.step_ended()
        self.sampled_optimizers = set()
        self.deferred.clear()
        record.setdefault("grad_norm", None)

    # -- judgement ---------------------------------------------------------------------

    def _judge(self, key, samples, flags, record, location, first_step, values, step) -> None:
        """One optimizer's gradients of ``step``, read: findings, and the step record's norm.
        ``first_step``: the guard's first, whose gradients its backward made."""
        previous_grads = self._previous_grads.get(key)
        if len(self._previous_grads) >= _NAME_LISTS:
            self._previous_grads.clear()
        self._previous_grads[key] = [(s.names, s.grad_ids) for s in samples]
        if flags and any(values[-flags:]):
            return  # a scaler caught inf/NaN and skips the step: AMP107-AMP109's business
        host, factors, scales = host_values(samples, values)
        limits = self.guard.thresholds
        previous = self._previous_keys.get(key, set())
        if len(self._previous_keys) >= _NAME_LISTS:
            self._previous_keys.clear()
        total = quiet_norm(samples, host, factors, limits)
        if total is not None:  # nothing to report; AMP106 conditions last until a detailed step
            self._previous_keys[key] = {k for k in previous if k[0] == "AMP106"}
            _add_norm(record, total)
            return
        layers, loss_scale = layer_stats(samples, host, factors, scales)
        reported = {layer for condition in previous if condition[0] == "AMP105"
                    for layer in condition[3]}
        unreached, unknown = unreached_parameters(samples, layers, previous_grads, first_step,
                                                  reported)
        self.reached.watch(unknown)
        findings = judge_gradients(layers, loss_scale, limits, unreached)
        detailed = layers[0].max is not None
        # AMP105-AMP106 conditions last; report them when they start or change, not at every step
        keys = {k for k in previous if k[0] == "AMP106" and not detailed}
        for code, kwargs in findings:
            layers_named = tuple(kwargs.get("details", {}).get("layers", ()))
            condition = (code, kwargs.get("severity"), kwargs.get("layer"), layers_named)
            keys.add(condition)
            if code == "AMP105" and layers_named:
                new = not reported.issuperset(layers_named)  # layers recovering are no news
            else:
                new = condition not in previous
            if new:
                if code == "AMP103":  # replayed before the optimizer applies them
                    kwargs = self.guard.explain_nonfinite_grads(step, kwargs)
                self.guard.emit(code, **{"op": "optimizer.step", "location": location,
                                         "step": step, **kwargs})
        self._previous_keys[key] = keys
        _add_norm(record, total_norm(layers))
        if detailed and step % limits.metrics_every == 0:
            record.setdefault("layers", {}).update((g.name, g.to_json()) for g in layers)


def _add_norm(record: Dict[str, Any], norm: float) -> None:
    """Add one optimizer's total gradient norm to the step's (several optimizers: their hypot)."""
    previous = record.get("grad_norm")
    record["grad_norm"] = norm if previous is None else math.hypot(previous, norm)


class OptimizerEpsilon(Monitor):
    """AMP011's optimizer half: an ``eps`` (Adam, AdamW, RMSprop, ...) that flushes to zero in the
    fp16 optimizer state of fp16 parameters. Checked once per optimizer, at its first step."""

    codes = ("AMP011",)

    def __init__(self):
        super().__init__()
        self._checked: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()

    def attach(self, guard):
        super().attach(guard)
        self.keep(register_optimizer_step_pre_hook(self._optimizer_step_starts))

    def _optimizer_step_starts(self, optimizer, args, kwargs):
        guard = self.guard
        if optimizer in self._checked or guard.suspended or threading.get_ident() != guard._thread:
            return
        self._checked.add(optimizer)
        for index, group in enumerate(optimizer.param_groups):
            eps = group.get("eps")
            if flushes_to_zero(eps) and any(p.dtype == torch.float16 for p in group["params"]):
                guard.emit("AMP011", op=f"{type(optimizer).__name__}.step", value=f"{eps:g}",
                           details={"param_group": index})


def monitors(guard):
    return [GradHealth(guard), OptimizerEpsilon()]
