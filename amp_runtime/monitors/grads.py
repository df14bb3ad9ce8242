"""Gradient health once per training step: AMP103, AMP104, AMP105, AMP106.

Where the gradients are read:

* with a GradScaler, right after the scaler unscaled them (reported by the scaler watch,
  ``monitors/scaler.py``): the values are unscaled, and the scaler's own ``found_inf`` already says
  whether the step will be skipped, so no separate finiteness pass is needed;
* otherwise in a global optimizer step pre-hook (the gradients the optimizer is about to apply; if a
  scaler scaled them and nobody unscaled them, they are divided by the scale before judging);
* for loops with neither, at ``guard.step()`` over the ``model=`` parameters.

The statistics of one set of gradients are ``torch._foreach_*`` kernels (fused over all parameters)
producing one small tensor: every step only the per-parameter L2 norms (one pass: non-finite values,
total norm, vanishing layers), every ``DETAIL_EVERY`` steps and on logged steps also
max |g|, nonzero counts and fp16 underflow counts. They stay on the device until the step ends,
where all of a step's samples are read with one host transfer. Gradient accumulation is judged once
per step because samples are taken where the optimizer consumes the gradients, not at backward.
"""
from __future__ import annotations

import itertools
import math
import operator
import threading
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch.amp.grad_scaler import OptState
from torch.optim.optimizer import register_optimizer_step_pre_hook

from flake8_amp.catalog import FP16_TINY_SUBNORMAL
from amp_runtime.monitors import Monitor, OpHandler
from amp_runtime.monitors.scaler import watch_of
from amp_runtime.rules.amp011 import flushes_to_zero
from amp_runtime.thresholds import Thresholds
from amp_runtime.tracking import ModuleTracker, clean_path

#: A value whose magnitude is at most this rounds to zero in float16 (round-to-nearest-even).
FP16_FLUSH_LIMIT = FP16_TINY_SUBNORMAL / 2
#: float16's smallest normal number (2**-14); below it values lose precision, then flush.
FP16_MIN_NORMAL = 2.0 ** -14

#: Steps between detailed statistics (max |g|, zeros, fp16 underflow: AMP106), which take about
#: ten more passes over the gradients; steps logged to metrics.jsonl are always detailed.
DETAIL_EVERY = 32

#: How many layer names a message lists before "…".
_NAMES_IN_MESSAGE = 5
#: Parameter lists whose names are kept (one per optimizer and device in most loops).
_NAME_LISTS = 64

_GRAD, _DEVICE, _SHAPE = (operator.attrgetter(name) for name in ("grad", "device", "shape"))
_IS_SPARSE = operator.attrgetter("is_sparse")
_PARAMS = operator.itemgetter("params")

#: Rows of the statistics tensor.
NORM, MAX, NONZERO, SURVIVES, NORMAL = range(5)


def l2_norms(grads: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Each gradient's L2 norm as a 0-dim float32 tensor, one fused pass (NaN/Inf propagate)."""
    with torch.no_grad():
        return list(torch._foreach_norm(list(grads), 2, dtype=torch.float32))


def gradient_stats(grads: Sequence[torch.Tensor], loss_scale: Optional[torch.Tensor] = None,
                   detailed: bool = True,
                   counted: Optional[Sequence[bool]] = None) -> torch.Tensor:
    """Per-gradient statistics of same-device ``grads`` as one float32 tensor, without a host sync.

    Row ``NORM``: the L2 norm (NaN/Inf propagate), one fused pass. When ``detailed``, also ``MAX``
    (max |g|), ``NONZERO`` (number of nonzero elements), and given ``loss_scale`` — the factor the
    gradients would be multiplied by in an fp16 backward, a device tensor — ``SURVIVES`` and
    ``NORMAL``: the number of elements whose value times ``loss_scale`` survives the cast to
    float16, and is a normal (not subnormal) float16 (NaN without a scale, and for the gradients
    ``counted`` marks False). Shape ``(5, n)`` when detailed, else ``(1, n)``.
    """
    grads = list(grads)
    with torch.no_grad():
        columns = l2_norms(grads)
        if detailed:
            columns += torch._foreach_norm(grads, math.inf, dtype=torch.float32)
            columns += torch._foreach_norm(grads, 0, dtype=torch.float32)
            nan = torch.full((), math.nan, device=grads[0].device)
            if counted is None:
                counted = [loss_scale is not None] * len(grads)
            chosen = [g for g, count in zip(grads, counted) if count]
            if not chosen:
                columns += [nan] * (2 * len(grads))
            else:
                # |g * scale| - limit > 0 <=> the scaled value is above limit; L0 norms count them
                scale = loss_scale.to(grads[0].device)
                magnitude = torch._foreach_mul([g.float() for g in chosen], scale)
                torch._foreach_abs_(magnitude)
                normal = torch._foreach_sub(magnitude, FP16_MIN_NORMAL)
                torch._foreach_clamp_min_(normal, 0.0)
                torch._foreach_sub_(magnitude, FP16_FLUSH_LIMIT)
                torch._foreach_clamp_min_(magnitude, 0.0)
                for counts in (torch._foreach_norm(magnitude, 0, dtype=torch.float32),
                               torch._foreach_norm(normal, 0, dtype=torch.float32)):
                    found = iter(counts)
                    columns += [next(found) if count else nan for count in counted]
        return torch.stack(columns).reshape(-1, len(grads))


@dataclass
class GradSample:
    """Statistics of one set of gradients: device-side ``stats`` waiting for the step's single host
    read, or their ``values`` already read (CPU gradients' norms, where reading costs nothing)."""

    names: List[str]
    shapes: List[torch.Size]
    stats: Optional[torch.Tensor]
    #: The gradients were still multiplied by this loss scale when sampled (None: unscaled).
    scaled_by: Optional[torch.Tensor] = None
    #: The loss scale in effect (AMP106 reference), None when no scaler is involved.
    loss_scale: Optional[torch.Tensor] = None
    #: ``stats`` flattened, when already read.
    values: Optional[List[float]] = None

    @property
    def rows(self) -> int:
        """How many statistics per gradient: 1 (norms only) or 5 (detailed)."""
        return self.stats.shape[0] if self.values is None else len(self.values) // len(self.names)

    def nonfinite_on_host(self) -> bool:
        """Whether the norms show a NaN/Inf gradient, where they are known without a device read
        (values read already, or statistics on the CPU); False while they wait on a device."""
        if self.values is not None:
            return not math.isfinite(sum(self.values[:len(self.names)]))
        return self.stats.is_cpu and not bool(torch.isfinite(self.stats[NORM]).all())


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
    #: Fraction of the elements that are zero or flush to zero in fp16 at the loss scale.
    underflow_fraction: Optional[float]
    #: Fraction of the elements that are fp16 subnormals at the loss scale (precision already lost).
    subnormal_fraction: Optional[float] = None

    def to_json(self) -> Dict[str, Optional[float]]:
        return {
            "max": self.max,
            "norm": self.norm,
            "zero_fraction": self.zero_fraction,
            "underflow_fraction": self.underflow_fraction,
        }


def read_samples(samples: Sequence[GradSample]) -> Tuple[List[LayerGrad], Optional[float]]:
    """A step's samples as layer statistics (one host read) and the loss scale they had."""
    if not samples:
        return [], None
    return layer_stats(samples, *read_host(samples))


def read_host(samples: Sequence[GradSample]) -> Tuple[List[float], List[float], List[float]]:
    """The samples' statistics as one flat host list (one transfer), and per sample the factor its
    gradients were still scaled by (1.0 for none) and its loss scale (NaN for none)."""
    # the scale tensors are usually one and the same (the scaler's): read each once
    scale_tensors = {id(t): t for sample in samples
                     for t in (sample.scaled_by, sample.loss_scale) if t is not None}
    unread = [s.stats.flatten() for s in samples if s.values is None]
    unread += [t.detach().float().reshape(1) for t in scale_tensors.values()]
    if all(t.device.type == "cpu" for t in unread):
        values = iter([value for t in unread for value in t.tolist()])
    else:
        values = iter(torch.cat([t.cpu() for t in unread]).tolist())
    host = []
    for sample in samples:
        if sample.values is not None:
            host += sample.values
        else:
            host += itertools.islice(values, sample.stats.numel())
    scale_values = list(values)
    host += scale_values
    read = dict(zip(scale_tensors, scale_values))
    factors = [1.0 if s.scaled_by is None else read[id(s.scaled_by)] for s in samples]
    scales = [math.nan if s.loss_scale is None else read[id(s.loss_scale)] for s in samples]
    return host, factors, scales


def layer_stats(samples: Sequence[GradSample], host: List[float], factors: List[float],
                scales: List[float]) -> Tuple[List[LayerGrad], Optional[float]]:
    """The per-layer statistics in ``read_host``'s values, and the loss scale they had."""
    layers: List[LayerGrad] = []
    offset = 0
    for sample, factor, scale in zip(samples, factors, scales):
        n = len(sample.names)
        rows = [host[offset + r * n: offset + (r + 1) * n] for r in range(sample.rows)]
        offset += len(rows) * n
        for i, (name, shape) in enumerate(zip(sample.names, sample.shapes)):
            numel = shape.numel()
            largest = zero_fraction = underflow = subnormal = None
            if len(rows) > 1 and numel:
                largest = rows[MAX][i] / factor
                survives, normal = rows[SURVIVES][i], rows[NORMAL][i]
                zero_fraction = 1.0 - rows[NONZERO][i] / numel
                if not math.isnan(survives):
                    underflow = 1.0 - survives / numel
                    subnormal = (survives - normal) / numel
            layers.append(LayerGrad(
                name=name,
                numel=numel,
                ndim=len(shape),
                norm=rows[NORM][i] / factor,
                max=largest,
                zero_fraction=zero_fraction,
                underflow_fraction=underflow,
                subnormal_fraction=subnormal,
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


def judge_gradients(
    layers: Sequence[LayerGrad], loss_scale: Optional[float], limits: Thresholds
) -> List[Tuple[str, dict]]:
    """One step's findings as ``(code, emit keyword arguments)``, layers earliest first."""
    if not layers:
        return []
    findings: List[Tuple[str, dict]] = []
    total = total_norm(layers)
    if not math.isfinite(total):
        names = list(dict.fromkeys(layer_of(g.name) for g in layers if not math.isfinite(g.norm)))
        findings.append(("AMP103", dict(
            where=listing(names), module=names[0], details={"layers": names},
        )))
        return findings  # norms of non-finite gradients mean nothing

    if total > limits.grad_explosion:
        largest = max(layers, key=lambda g: g.norm)
        p0 = total > limits.grad_explosion_p0
        limit = limits.grad_explosion_p0 if p0 else limits.grad_explosion
        findings.append(("AMP104", dict(
            severity="P0" if p0 else "P1", norm=total, limit=limit, module=layer_of(largest.name),
            details={"total_norm": total, "largest": largest.name, "largest_norm": largest.norm},
        )))

    if total < limits.grad_vanishing_total:
        findings.append(("AMP105", dict(
            detail=f"total gradient norm {total:.3g} is below {limits.grad_vanishing_total:g}",
            details={"total_norm": total},
        )))
    elif min(g.norm for g in layers) < limits.grad_vanishing_layer:
        # A layer's L2 norm bounds every |g| in it: norm < limit implies max |g| < limit.
        layer_norm: Dict[str, float] = {}
        for g in layers:
            key = layer_of(g.name)
            layer_norm[key] = math.hypot(layer_norm.get(key, 0.0), g.norm)
        limit = limits.grad_vanishing_layer
        vanished = [name for name, value in layer_norm.items() if value < limit]
        if vanished:
            findings.append(("AMP105", dict(
                detail=f"gradients vanished (max |g| < {limits.grad_vanishing_layer:g}) in "
                       f"{len(vanished)} layer(s): {listing(vanished)}",
                module=vanished[0],
                details={"layers": vanished, "total_norm": total},
            )))

    if loss_scale is not None and layers[0].max is not None:  # detailed step
        for g in layers:
            # Judged on weight matrices and kernels, whose gradients an fp16 matmul/conv computes;
            # 1-D parameters get sums over the batch, and their zeros are mostly structural (an
            # attention key bias has no gradient by construction). Zeros count only where the
            # gradients reach fp16's subnormal floor at this scale: elsewhere (dead units, unused
            # embedding rows) they are structural too.
            fraction, limit = g.underflow_fraction, limits.grad_underflow_fraction
            if g.ndim < 2 or fraction is None:
                continue
            if fraction > limit and g.subnormal_fraction > limit:
                findings.append(("AMP106", dict(
                    fraction=fraction, layer=g.name, scale=loss_scale, module=layer_of(g.name),
                    details={"parameter": g.name, "loss_scale": loss_scale,
                             "zero_fraction": g.zero_fraction},
                )))
    return findings


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


class GradHealth(Monitor):
    """Samples the gradients where the optimizer consumes them and judges them once per step."""

    codes = ("AMP103", "AMP104", "AMP105", "AMP106")

    def __init__(self, guard):
        super().__init__()
        self.names = ParameterNames(guard.tracker)
        self.pending: List[GradSample] = []
        self.sampled_optimizers: set = set()
        #: Optimizers whose gradients are sampled at their step: id -> (scaled_by, loss_scale).
        self.deferred: Dict[int, tuple] = {}
        #: Per-gradient L2 norms ``clip_grad_norm_`` computed after the unscale (id(grad) -> norm).
        self.clip_norms: Dict[int, torch.Tensor] = {}
        self._previous_keys: set = set()

    def attach(self, guard):
        super().attach(guard)
        self.keep(register_optimizer_step_pre_hook(self._optimizer_step_starts))
        self._watch = watch_of(guard)
        self._watch.check_listeners.append(self._unscaled)

    def op_handlers(self):
        return {torch._foreach_norm: OpHandler(after=self._norms_computed)}

    # -- sampling ----------------------------------------------------------------------

    def _sample(self, params: List[torch.Tensor], scaled_by=None, loss_scale=None) -> None:
        # Once per step over every parameter: the usual case (dense gradients on one device) is
        # recognised without a Python loop.
        grads = list(map(_GRAD, params))
        if any(map(operator.is_, grads, itertools.repeat(None))) or any(map(_IS_SPARSE, grads)):
            params = [p for p, g in zip(params, grads) if g is not None and not g.is_sparse]
            grads = list(map(_GRAD, params))
        if not grads:
            return
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
                    stats, values = gradient_stats(grads, flush_factor, counted=counted), None
                else:
                    norms = self._norms_reusing_clip(grads)
                    if grads[0].device.type == "cpu":  # read now: no stacking, no copy
                        stats, values = None, [norm.item() for norm in norms]
                    else:
                        stats, values = torch.stack(norms).reshape(1, -1), None
            self.pending.append(GradSample(
                names=self.names.names(device_params),
                shapes=list(map(_SHAPE, grads)),
                stats=stats,
                scaled_by=scaled_by,
                loss_scale=loss_scale,
                values=values,
            ))

    def _norms_reusing_clip(self, grads: List[torch.Tensor]) -> List[torch.Tensor]:
        """The L2 norms (float32): those clip_grad_norm_ already computed, and the rest."""
        if not self.clip_norms:
            return l2_norms(grads)
        known = [self.clip_norms.get(id(g)) for g in grads]
        missing = [g for g, norm in zip(grads, known) if norm is None]
        computed = iter(l2_norms(missing) if missing else ())
        return [norm.float() if norm is not None else next(computed) for norm in known]

    def _unscaled(self, scaler, optimizer, still_scaled, grads):
        """GradScaler checked (usually unscaled) an optimizer's gradients (``grads``, or all)."""
        scaled_by = scaler._scale if still_scaled else None
        if not self._detailed_step():
            # norms are taken at the optimizer step, reusing those of a clip_grad_norm_ in between
            self.deferred[id(optimizer)] = (scaled_by, scaler._scale)
            return
        ids = None if grads is None else {id(g) for g in grads}
        params = [p for group in optimizer.param_groups for p in group["params"]
                  if p.grad is not None and (ids is None or id(p.grad) in ids)]
        self._sample(params, scaled_by=scaled_by, loss_scale=scaler._scale)
        self.sampled_optimizers.add(id(optimizer))

    def _norms_computed(self, func, args, kwargs, out):
        order = args[1] if len(args) > 1 else kwargs.get("ord", 2)
        if not self.deferred or order != 2:
            return
        for tensor, norm in zip(args[0], out):
            # an fp16 norm may overflow where the fp32 one does not
            if tensor.dtype in (torch.float32, torch.float64):
                self.clip_norms[id(tensor)] = norm

    def _optimizer_step_starts(self, optimizer, args, kwargs):
        if self.guard is None or self.guard.suspended or id(optimizer) in self.sampled_optimizers:
            return
        if threading.get_ident() != self.guard._thread:
            return
        if id(optimizer) in self.deferred:
            scaled_by, loss_scale = self.deferred.pop(id(optimizer))
        else:
            scaled_by = None
            for state in self._watch.scaled_pending():
                if state.stage(optimizer) is OptState.READY:
                    # stepping on scaled gradients (AMP006): judge them unscaled
                    scaled_by = state.scaler._scale
            loss_scale = scaled_by
        params = list(itertools.chain.from_iterable(map(_PARAMS, optimizer.param_groups)))
        sampled = len(self.pending)
        self._sample(params, scaled_by=scaled_by, loss_scale=loss_scale)
        self.sampled_optimizers.add(id(optimizer))
        if any(sample.nonfinite_on_host() for sample in self.pending[sampled:]):
            self.guard.request_replay("AMP103")  # replayed before this optimizer applies them

    def _logged_step(self) -> bool:
        """Whether this step's per-layer statistics go to metrics.jsonl."""
        guard = self.guard
        return guard.log_dir is not None and guard.step_index % guard.thresholds.metrics_every == 0

    def _detailed_step(self) -> bool:
        """Whether this step also counts zeros and fp16 underflow (AMP106, metrics.jsonl layers)."""
        return self._logged_step() or self.guard.step_index % DETAIL_EVERY == 0

    # -- judgement ---------------------------------------------------------------------

    def on_step_end(self, step, record):
        if not self.pending and self.guard.manual_steps and self.guard.model is not None:
            self._sample(list(self.guard.model.parameters()))
        samples = self.pending
        self.pending, self.sampled_optimizers = [], set()
        self.deferred.clear()
        self.clip_norms.clear()
        record.setdefault("grad_norm", None)
        if not samples or record.get("skipped"):
            return  # a scaler caught inf/NaN and skipped the step: AMP107-AMP109's business
        host, factors, scales = read_host(samples)
        total = quiet_norm(samples, host, factors, self.guard.thresholds)
        if total is not None:  # nothing to report; AMP106 conditions last until a detailed step
            self._previous_keys = {key for key in self._previous_keys if key[0] == "AMP106"}
            record["grad_norm"] = total
            return
        layers, loss_scale = layer_stats(samples, host, factors, scales)
        findings = judge_gradients(layers, loss_scale, self.guard.thresholds)
        detailed = layers[0].max is not None
        # AMP105-AMP106 conditions last; report them when they start or change, not at every step
        keys = {key for key in self._previous_keys if key[0] == "AMP106" and not detailed}
        for code, kwargs in findings:
            layers_named = tuple(kwargs.get("details", {}).get("layers", ()))
            key = (code, kwargs.get("severity"), kwargs.get("layer"), layers_named)
            keys.add(key)
            if key not in self._previous_keys:
                if code == "AMP103" and self.guard.replayer is not None:
                    self.guard.request_replay(code, step)
                    kwargs = self.guard.replayer.explain_nonfinite_grads(step, kwargs)
                self.guard.emit(code, **{"op": "optimizer.step", **kwargs})
        self._previous_keys = keys
        record["grad_norm"] = total_norm(layers)
        if detailed and step % self.guard.thresholds.metrics_every == 0:
            record["layers"] = {g.name: g.to_json() for g in layers}


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
