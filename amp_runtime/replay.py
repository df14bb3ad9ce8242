"""Replay of a failing training step: the first anomaly localized in the step it happened in.

Per-op tracing finds the op that first produces NaN/Inf (AMP101), but it costs up to ~2x, so
``trace="auto"`` turns it on only after something went wrong and localizes the *next*
occurrence. The first one, often the only one (a single bad batch; a step that writes NaN into
every weight), goes unexplained. Instead, the step is re-run:

* Capture. The root modules a step calls (the modules called from outside any module: the model,
  its compiled or DDP wrapper, a loss module) are learned in the first steps by a global module
  hook, until a step finds none it had not seen, then followed by a forward pre-hook on each.
  Each grad-enabled call keeps, by reference, its inputs, the RNG state (CPU, and the current
  CUDA device's), the autocast state and the tensor versions of its inputs; nothing is copied.
  A step's calls are kept until every reading of that step has been judged (the guard's step
  listeners): on the CPU until the next step's optimizer step (the step's GradScaler update is
  read with that step's copy), on a GPU as long as its readings are in flight,
  usually a step longer.
* Request. The judges of the step's readings (``readings.py``), which know the step, call
  ``guard.request_replay(code, step)``: a non-finite loss at backward (AMP112), non-finite
  gradients reaching an optimizer (AMP103), a GradScaler skipping the step (``SKIPPED``).
* Replay, at once, inside the judge, before it reports its finding. Only while that replays the
  step: no optimizer step since its forward changed the parameters of a module it calls (the
  calls of modules a second optimizer stepped are left out), and its inputs unchanged. A
  problem judged at the optimizer step pre-hook (always on the CPU; on a GPU once the copy has
  arrived) is replayed before the optimizer applies the step; one judged later is replayed if
  the GradScaler skipped its step (the parameters are unchanged), and otherwise skipped, its
  outcome saying why. The
  step's calls run again in order on the eager module (``_orig_mod`` of a compiled model,
  ``.module`` of DDP) from the same inputs, parameters, RNG and autocast state, traced by an
  ``OpTrace`` of its own (``monitors/forward.py``) that is read at once, so AMP101 names op,
  module and source line for that step. When the gradients are non-finite but the forward is
  finite, the replay also runs a backward with a hook on every autograd node (see
  ``_Localizer``), and AMP103 names the layer whose backward first turned finite gradients
  non-finite (for a step a GradScaler skipped, AMP107/AMP108 name it: nothing else would).
  Before all that, one pass over the trained parameters: one already NaN/Inf (a checkpoint saved
  after an overflow, weights an unscaled step wrote NaN into) is where every op's NaN comes
  from, and no op of the step can be blamed; it is the origin then. After them, where no op and
  no parameter made it, one pass over the calls' floating-point inputs: a batch already holding
  NaN/Inf (a missing value in the data) is the origin.
* Restore. RNG states, buffers (BatchNorm statistics) and training flags are put back; ``.grad``
  is never touched (the replayed backward uses ``torch.autograd.grad``). The user's run goes on
  bit-identical.

One replay per anomaly episode: requests while an episode is open (until
``Thresholds.auto_quiet_steps`` steps pass without one) extend it and are answered with the
step that was replayed for it. A replay that found nothing for a skipped step (the scale
settling at start-up overflows only the scaled backward), or whose backward localized nothing
for non-finite gradients (a norm that overflowed fp32 though each gradient is finite),
opens no episode: the next requests are replayed too, the first few at once, then 2, 4, 8 ...
steps apart (at most ``auto_quiet_steps``), so a real fault that starts just after is still
localized and a run that fails every step unexplained pays a replay rarely.
Healthy steps pay a forward pre-hook and a few state reads per root call, and two counters per
optimizer step.
With ``log_dir``, the first replayed step is saved as a repro bundle (``repro-step<N>.pt``) that
``python -m amp_runtime replay`` re-runs offline.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import threading
import warnings
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch.compiler import is_compiling
from torch.nn.modules import module as module_globals
from torch.optim.optimizer import register_optimizer_step_post_hook

from .events import FINDINGS, AmpRuntimeWarning, which_call
from .mode import GuardMode
from .monitors import Monitor, autograd_nodes, dtype_name, readable, tensors_in
from .monitors.forward import UNTRACED_FUNCTIONS, OpTrace, nonfinite_kind, report_trace
from .monitors.grads import l2_norms, listing, nonfinite_gradients
from .monitors.scaler import SKIPPED
from .readings import Readings
from .tracking import (
    CALL_IMPL_CODE, NOWHERE, Location, format_location, op_name, replay_calls_from,
    unwrap_compiled,
)

#: The codes whose findings name where a replayed step's gradients turned non-finite, by what
#: asked for the replay: AMP103 itself, or a skipped step's loss-scale codes.
_LOCALIZED_FOR = {"AMP103": ("AMP103",), SKIPPED: ("AMP107", "AMP108")}

#: Replays in a row that found nothing before the next requests back off.
_UNEXPLAINED_REPLAYED = 4
#: Optimizer steps remembered for telling which parameters changed since a call.
_OPTIMIZER_STEPS_KEPT = 64
#: Root-module calls kept per step (gradient accumulation calls the model once per micro-step);
#: beyond it the oldest are dropped.
MAX_CALLS_PER_STEP = 64
#: Autograd nodes attributed to one op of the replay (those it created between its inputs and its
#: output: an autocast cast, the op's own node).
_NODES_PER_OP = 64
#: Device types whose autocast state a call records.
AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")
BUNDLE_FORMAT = "amp_runtime.repro/1"
#: torch.distributed functions that must not run in a local replay (one rank replays alone).
_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
    "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast", "broadcast_object_list",
    "gather", "irecv", "isend", "recv", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "scatter", "send",
)
#: The warning torch.compile gives when a compiled module is called while global module hooks
#: exist (the learning hooks): they are removed before the compiled code runs.
_COMPILE_HOOK_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks"


class ReplayError(Exception):
    """A replay could not run (the reason is its message); the user's run is not affected."""


# -- what a step keeps ------------------------------------------------------------------------


@dataclass
class RootCall:
    """One call of a root module, as the replay needs it again (inputs by reference)."""

    module: torch.nn.Module
    args: tuple
    kwargs: dict
    #: RNG states at the call: ``"cpu"`` and ``"cuda:<index>"`` -> ``get_rng_state()``.
    rng: Dict[str, torch.Tensor]
    #: ``(device_type, dtype)`` of every device type whose autocast was on.
    autocast: Tuple[Tuple[str, torch.dtype], ...]
    training: bool
    #: The guard's per-op checks saw this call's ops (no need to trace them again).
    traced: bool = False
    #: ``_version`` of the input tensors: a changed one was modified in place after the call.
    versions: Tuple[int, ...] = ()
    #: Optimizer steps applied before the call: a later step changed the parameters.
    optimizer_steps: int = 0
    #: Where the loop called the module (read once per module and remembered).
    location: Location = NOWHERE
    #: The how-many-th root-module call of its step (1-based; counted past those not kept).
    number: int = 1


@dataclass
class Origin:
    """Where a replay found a step's first non-finite value."""

    #: "forward" (AMP101 found it), "backward" (the first autograd node with non-finite grads),
    #: "parameter" (a trained parameter already non-finite before the forward) or "input" (a
    #: floating-point input of the model call already non-finite, where no op made the NaN).
    phase: str
    op: Optional[str]
    module: Optional[str]
    source: Optional[str]
    details: Dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> Dict[str, Any]:
        return {"phase": self.phase, "op": self.op, "module": self.module, "source": self.source,
                **self.details}

    @property
    def before_forward(self) -> bool:
        """Already non-finite when the forward started (a parameter, an input): no op made it."""
        return self.phase in ("parameter", "input")

    def clause(self) -> str:
        """What a step-level finding (AMP112) adds about where the step's NaN/Inf came from."""
        if self.before_forward:
            return f"the forward started from {self.describe()}"
        where = f" at {self.source}" if self.source else ""
        if self.phase == "forward":
            return f"first non-finite output: {self.describe()}{where}, AMP101"
        return f"first non-finite in {self.describe()}{where}"

    def describe(self) -> str:
        """``linear in blocks.2.fc2``; ``the backward of sqrt in head``; a node that no op of
        the replay created (a custom autograd Function's) by its own name."""
        details = self.details
        if self.phase == "parameter":
            return f"the parameter {details['parameter']} ({details['kind']} before the forward)"
        if self.phase == "input":
            call = f" {which_call(details)}" if "calls" in details else ""
            return (f"input {details['input']} of {self.module}{call}, already "
                    f"{details['kind']} (the batch, not an op)")
        if self.phase == "backward" and self.op == self.details.get("node"):
            return f"autograd node {self.op}" + (f" in {self.module}" if self.module else "")
        what = f"the backward of {self.op}" if self.phase == "backward" else str(self.op)
        what = f"{what} in {self.module}" if self.module else what
        return f"{what} {which_call(self.details)}" if "calls" in self.details else what


@dataclass
class Outcome:
    """What the replay of one step did (``StepReplay.outcomes``)."""

    step: int
    triggers: Tuple[str, ...]
    origin: Optional[Origin] = None
    #: Why it did not run or did not finish (None: it ran).
    skipped: Optional[str] = None
    #: The replayed backward reproduced exactly the parameters whose gradients were non-finite.
    reproduced: Optional[bool] = None
    bundle: Optional[str] = None
    #: Not replayed: the step replayed for the anomaly episode this step is part of.
    episode: Optional[int] = None

    def cause(self) -> Optional[Origin]:
        """Where the step's non-finite values came from, where the replay established it: a
        forward op AMP101 named, or a backward that reproduced which gradients were
        non-finite."""
        origin = self.origin
        if origin is None or (origin.phase == "backward" and not self.reproduced):
            return None
        return origin

    def to_json(self) -> Dict[str, Any]:
        found = {"step": self.step, "triggers": list(self.triggers),
                 "origin": None if self.origin is None else self.origin.to_json(),
                 "skipped": self.skipped, "reproduced": self.reproduced, "bundle": self.bundle}
        return found if self.episode is None else {**found, "episode": self.episode}


def input_tensors(args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    """Tensors among a call's arguments, one level into lists, tuples and dicts."""
    for _, tensor in named_inputs(args, kwargs):
        yield tensor


def named_inputs(args: tuple, kwargs: dict) -> Iterator[Tuple[str, torch.Tensor]]:
    """``input_tensors`` with how the call passed each: ``argument 0``, ``mask``,
    ``argument 1[2]``, ``batch['x']``."""
    arguments = [(f"argument {i}", value) for i, value in enumerate(args)]
    for name, value in [*arguments, *kwargs.items()]:
        if isinstance(value, torch.Tensor):
            yield name, value
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                yield from ((f"{name}[{index}]", t) for t in tensors_in(item))
        elif isinstance(value, dict):
            yield from ((f"{name}[{key!r}]", v) for key, v in value.items()
                        if isinstance(v, torch.Tensor))


def autocast_state() -> Tuple[Tuple[str, torch.dtype], ...]:
    return tuple((device, torch.get_autocast_dtype(device)) for device in AUTOCAST_DEVICES
                 if torch.is_autocast_enabled(device))


def rng_state() -> Dict[str, torch.Tensor]:
    """The CPU generator's state and the current CUDA device's (where CUDA is in use)."""
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_initialized():
        index = torch.cuda.current_device()
        states[f"cuda:{index}"] = torch.cuda.get_rng_state(index)
    return states


def set_rng_state(states: Dict[str, torch.Tensor]) -> None:
    for device, state in states.items():
        if device == "cpu":
            torch.set_rng_state(state)
        elif torch.cuda.is_available():
            torch.cuda.set_rng_state(state, int(device.partition(":")[2]))


def eager_module(module: torch.nn.Module) -> torch.nn.Module:
    """The module a wrapper runs: ``_orig_mod`` of ``torch.compile``, ``.module`` of DDP and
    DataParallel (their forward would communicate or scatter; the replay is local)."""
    parallel = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    while True:
        inner = unwrap_compiled(module)
        if inner is not module:
            module = inner
        elif isinstance(module, parallel):
            module = module.module
        else:
            return module


def _sharded(module: torch.nn.Module) -> Optional[str]:
    """Why ``module`` cannot run on one rank alone (FSDP gathers its parameters in forward)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    from torch.distributed.fsdp import FullyShardedDataParallel

    sharded = [FullyShardedDataParallel]
    if hasattr(torch.distributed.fsdp, "FSDPModule"):
        sharded.append(torch.distributed.fsdp.FSDPModule)
    for sub in module.modules():
        if isinstance(sub, tuple(sharded)):
            return f"{type(sub).__name__} shards its parameters (a replay would gather them)"
    return None


def _map_tensors(value, function: Callable[[torch.Tensor], torch.Tensor]):
    """A call argument with ``function`` applied to the tensors in it and in its plain lists,
    tuples and dicts; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return function(value)
    if type(value) in (list, tuple):
        return type(value)(_map_tensors(item, function) for item in value)
    if type(value) is dict:
        return {key: _map_tensors(item, function) for key, item in value.items()}
    return value


def _detached(value):
    """A call argument with its autograd history cut: an input that came out of the original
    step's graph (freed by its backward) must not join the replay's."""
    return _map_tensors(value, lambda tensor: tensor.detach() if tensor.grad_fn is not None
                        else tensor)


def _finiteness_probe(grads) -> Optional[torch.Tensor]:
    """A float32 device scalar that is non-finite if and only if (short of a sum beyond 3e38)
    one of the gradients an autograd node produced holds NaN/Inf: the sum of all their
    elements, the cheapest full pass (no host read here); None if it produced none.

    Only what a node produces is probed: a sum of finite gradients that overflows where
    several consumers' gradients meet shows in the node that receives it."""
    sums = [g.sum(dtype=torch.float32) for g in grads
            if isinstance(g, torch.Tensor) and readable(g)]
    if not sums:
        return None
    if len(sums) == 1:
        return sums[0]
    return torch.stack([s.to(sums[0].device) for s in sums]).sum()


# -- state put back after a replay -----------------------------------------------------------


@contextlib.contextmanager
def _autocast(state: Tuple[Tuple[str, torch.dtype], ...]):
    """Autocast as it was at the call (its cache off: the replay must leave no cast behind)."""
    wanted = dict(state)
    with contextlib.ExitStack() as stack:
        for device in AUTOCAST_DEVICES:
            if device in wanted:
                stack.enter_context(
                    torch.autocast(device, dtype=wanted[device], cache_enabled=False))
            elif torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


def _eager():
    """Run code that ``torch.compile`` compiled (a compiled submodule) eagerly: the replay's ops
    must reach its TorchFunctionMode, and a new mode on the stack would recompile it. Without
    dynamo imported, nothing is compiled (and importing it would take seconds)."""
    if "torch._dynamo" not in sys.modules:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")


@contextlib.contextmanager
def _training(module: torch.nn.Module, training: bool):
    if module.training == training:
        yield
        return
    flags = [(sub, sub.training) for sub in module.modules()]
    module.train(training)
    try:
        yield
    finally:
        for sub, flag in flags:
            sub.training = flag


@contextlib.contextmanager
def _preserved(modules: Sequence[torch.nn.Module]):
    """Put back what a forward may change: RNG states and the modules' buffers (BatchNorm's
    running statistics and counter, spectral norm's vectors), by value and by identity."""
    rng = rng_state()
    buffers = []
    with torch.no_grad():
        for module in modules:
            for owner in module.modules():
                for name, buffer in owner._buffers.items():
                    if buffer is not None:
                        buffers.append((owner, name, buffer, buffer.clone()))
    try:
        yield
    finally:
        with torch.no_grad():
            for owner, name, buffer, saved in buffers:
                if owner._buffers.get(name) is not buffer:
                    owner._buffers[name] = buffer
                buffer.copy_(saved)
        set_rng_state(rng)


@contextlib.contextmanager
def _local_only():
    """Under torch.distributed with several ranks, make collectives called by the replaying
    thread raise instead of waiting for ranks that are not replaying (SyncBatchNorm,
    tensor-parallel layers)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        yield
        return
    from torch.distributed import distributed_c10d

    replaying_thread = threading.get_ident()

    def refusing(name, original):
        @functools.wraps(original)
        def collective(*args, **kwargs):
            if threading.get_ident() != replaying_thread:
                return original(*args, **kwargs)
            raise ReplayError(
                f"the forward calls torch.distributed.{name}; a replay runs on one rank alone")
        return collective

    patched = []
    for owner in (dist, distributed_c10d):
        for name in _COLLECTIVES:
            original = vars(owner).get(name)
            if original is not None:
                patched.append((owner, name, original))
                setattr(owner, name, refusing(name, original))
    try:
        yield
    finally:
        for owner, name, original in patched:
            setattr(owner, name, original)


# -- backward localization ----------------------------------------------------------------


class _Localizer:
    """Attributes the autograd nodes a replayed forward creates to their op, module and line,
    then finds the first node whose gradients are non-finite in a replayed backward.

    What the backward starts from: the loss, when a replayed call returns one (a scalar that
    requires grad: ``logits, loss = model(x, y)``, Hugging Face's ``outputs.loss``); otherwise
    the loss was computed outside the replayed modules and is gone with the original graph, so
    the backward starts from every floating output with the gradient of a per-sample sum
    averaged over the batch (1/batch per element). A derivative that is infinite at the point
    (sqrt or log at 0, a division by 0, pow with a negative exponent) is non-finite under any
    such gradient; an overflow that depends on the loss's gradient magnitude may not be. The
    localization is therefore accepted only when the replayed backward reproduces exactly the
    set of parameters whose gradients were non-finite in the step.
    """

    def __init__(self, replay: "StepReplay"):
        self._replay = replay
        self._guard = replay.guard
        #: autograd node -> (op, module path, location) of the op that created it.
        self.where: Dict[Any, Tuple[str, Optional[str], Location]] = {}

    def record(self, func, args, kwargs, out) -> None:
        """Trace handler: attribute the nodes between ``out`` and the op's inputs to the op."""
        new = [t.grad_fn for t in tensors_in(out) if t.grad_fn is not None]
        new = [node for node in new if node not in self.where]
        if not new:
            return
        stops = {t.grad_fn for v in (*args, *kwargs.values()) for t in tensors_in(v)}
        created_by = (op_name(func), *self._guard.tracker.site())
        queue, count = deque(new), 0
        while queue and count < _NODES_PER_OP:
            node = queue.popleft()
            if node is None or node in stops or node in self.where or _is_leaf_node(node):
                continue
            self.where[node] = created_by
            count += 1
            queue.extend(next_node for next_node, _ in node.next_functions)

    def module_output(self, module, args, out) -> None:
        """Forward hook while replaying: a node no traced op created that a module returns (a
        custom autograd Function's, whose ``apply`` no mode sees) is that module's."""
        for tensor in tensors_in(out):
            node = tensor.grad_fn
            if node is not None and node not in self.where and not _is_leaf_node(node):
                self.where[node] = (node.name(), *self._guard.tracker.site())

    def backward(self, out, params: List[torch.nn.Parameter]) -> Tuple[Optional[Origin], Set[int]]:
        """Run the replayed backward from ``out``: the first non-finite node's origin, and the ids
        of the parameters whose replayed gradients are non-finite. ``.grad`` is not touched."""
        roots, seeds, start = backward_start(out)
        if not roots:
            return None, set()
        # (node, probe of the gradients it produced), in the order the backward ran them
        probed: List[Tuple[Any, torch.Tensor]] = []

        def seen(node, grad_inputs, grad_outputs):
            probe = _finiteness_probe(grad_inputs)
            if probe is not None:
                probed.append((node, probe))

        # every node of the replayed graph, also those no replayed op created (a custom
        # autograd Function's): the inputs were detached, so the walk stays in this graph
        contain = self._guard.containment.wrap
        handles = [node.register_hook(contain(self._replay, functools.partial(seen, node)))
                   for node in autograd_nodes(root.grad_fn for root in roots)
                   if not _is_leaf_node(node)]
        wanted = [p for p in params if p.requires_grad]
        try:
            grads = _users_code("backward", torch.autograd.grad, roots, wanted, seeds,
                                allow_unused=True) if wanted else ()
        finally:
            for handle in handles:
                handle.remove()
        present = [(p, g) for p, g in zip(wanted, grads) if g is not None]
        norms = l2_norms([g for _, g in present]) if present else []
        values = self._guard.readings.read_now([probe for _, probe in probed] + norms)
        probes, norm_values = values[:len(probed)], values[len(probed):]
        nonfinite = {id(p) for (p, _), norm in zip(present, norm_values) if not math.isfinite(norm)}
        for (node, _), value in zip(probed, probes):
            if not math.isfinite(value):
                # a node no replayed op created (a custom Function's) is named by itself
                op, module, location = self.where.get(node, (node.name(), None, NOWHERE))
                origin = Origin("backward", op, module, format_location(location)[0],
                                {"node": node.name(), "backward_from": start})
                return origin, nonfinite
        return None, nonfinite


@contextlib.contextmanager
def _module_outputs_to(localizer: Optional[_Localizer], replay: "StepReplay"):
    """Hand every module's output to ``localizer`` (a global forward hook, for the replay's
    forward only: a steady step installs none)."""
    if localizer is None:
        yield
        return
    hook = replay.guard.containment.wrap(replay, localizer.module_output)
    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def _called_from(location: Location):
    """Ops the replayed forward runs are placed where the loop made the original call, not
    where the guard judged the step."""
    replay_calls_from(_users_code.__code__, location)
    try:
        yield
    finally:
        replay_calls_from(None, NOWHERE)


def _users_code(what: str, function: Callable, *args, **kwargs):
    """``function(*args, **kwargs)``, the user's forward or backward run again by a replay: what
    it raises makes the replay stop (``ReplayError``), the user's run goes on. (The replay's own
    code raising is a failure of the guard's: contained where the replay was asked for.)"""
    try:
        return function(*args, **kwargs)
    except (ReplayError, *FINDINGS):
        raise
    except Exception as err:
        raise ReplayError(f"the replayed {what} raised {type(err).__name__}: {err}") from None


def _nonfinite_parameter(modules: Sequence[torch.nn.Module],
                         readings: Readings) -> Optional[Origin]:
    """The first trained parameter of ``modules`` holding NaN/Inf, as an origin: then every op
    of the forward only propagates it. One fused pass (each one's largest magnitude, in its own
    dtype: finite stays finite), one read. Buffers and frozen parameters are left out: a
    ``-inf`` attention mask is often kept as one."""
    named = [(name, param) for module in modules for name, param in module.named_parameters()
             if param.requires_grad and readable(param)]
    found = _first_nonfinite([param for _, param in named], readings)
    if found is None:
        return None
    index, value = found
    name = named[index][0]
    return Origin("parameter", None, name.rpartition(".")[0] or None, None,
                  {"parameter": name, "kind": nonfinite_kind(value)})


def _first_nonfinite(tensors: Sequence[torch.Tensor],
                     readings: Readings) -> Optional[Tuple[int, float]]:
    """The index of the first of ``tensors`` holding NaN/Inf and its largest magnitude (in its
    own dtype: finite stays finite): one fused pass, one read."""
    if not tensors:
        return None
    with torch.no_grad():
        peaks = torch._foreach_norm([tensor.detach() for tensor in tensors], math.inf)
    return next(((index, value) for index, value in enumerate(readings.read_now(peaks))
                 if not math.isfinite(value)), None)


def _nonfinite_input(calls: Sequence[RootCall], readings: Readings,
                     tracker) -> Optional[Origin]:
    """The first floating-point input of the step's model calls holding NaN/Inf, as an origin:
    for a step whose replay found no op and no parameter that made it (a batch with a missing
    value). One fused pass, one read."""
    inputs = [(call, name, tensor) for call in calls
              for name, tensor in named_inputs(call.args, call.kwargs)
              if tensor.is_floating_point() and readable(tensor)]
    found = _first_nonfinite([tensor for *_, tensor in inputs], readings)
    if found is None:
        return None
    index, value = found
    call, name, _ = inputs[index]
    details = {"input": name, "kind": nonfinite_kind(value)}
    if calls[-1].number > 1:
        details.update(call=call.number, calls=calls[-1].number)
    return Origin("input", None, tracker.name_of(call.module),
                  format_location(call.location)[0], details)


def _eager_modules(calls: Sequence[RootCall]) -> List[torch.nn.Module]:
    """The eager modules ``calls`` ran, each once, in order."""
    return list(dict.fromkeys(eager_module(call.module) for call in calls))


def _recomputing() -> bool:
    """A module runs inside a backward: activation checkpointing recomputing its forward (on
    the CPU in the caller's thread), not a call of the step's forward."""
    return torch._C._current_graph_task_id() != -1


def _is_leaf_node(node) -> bool:
    """A parameter's or input's gradient accumulator: not created by any op."""
    return not node.next_functions and node.name().endswith("AccumulateGrad")


def _nonfinite_grads(params: Sequence[torch.Tensor], readings: Readings) -> Set[int]:
    """The ids of the parameters whose ``.grad`` holds NaN/Inf (one fused pass, one read)."""
    present = [p for p in params if p.grad is not None and readable(p.grad)]
    if not present:
        return set()
    norms = readings.read_now(l2_norms([p.grad for p in present]))
    return {id(p) for p, norm in zip(present, norms) if not math.isfinite(norm)}


def backward_start(out) -> Tuple[List[torch.Tensor], List[torch.Tensor], str]:
    """The tensors a replayed backward starts from, their gradients and which start it is."""
    found: List[torch.Tensor] = []
    _collect(out, found, depth=0)
    trainable = [t for t in found if t.requires_grad and t.is_floating_point()]
    losses = [t for t in trainable if t.numel() == 1]
    if losses:
        return losses, [torch.ones_like(t) for t in losses], "loss"
    seeds = [torch.full_like(t, 1.0 / t.shape[0] if t.dim() else 1.0) for t in trainable]
    return trainable, seeds, "outputs (1/batch per element)"


def _collect(value, found: List[torch.Tensor], depth: int) -> None:
    """Tensors in a module's output: tensors, sequences, dicts (ModelOutput), a few levels deep."""
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif depth < 3 and isinstance(value, (list, tuple)):
        for item in value:
            _collect(item, found, depth + 1)
    elif depth < 3 and isinstance(value, dict):
        for item in value.values():
            _collect(item, found, depth + 1)


# -- learning the root modules ------------------------------------------------------------------


class _RootLearning:
    """Finds the root modules (called from outside any module) with global module hooks, in the
    first steps only: every module call pays for them while they are installed.

    A compiled module ends the learning at its first call, before dynamo traces its inside:
    global hooks are part of what dynamo guards on, so removing them after it compiled would
    recompile. torch.compile's warning about global hooks is silenced meanwhile. Where dynamo
    did trace them (the whole training step compiled), they stay, inert, until the guard exits.
    """

    def __init__(self, on_root: Callable[[torch.nn.Module, tuple, Optional[dict]], None],
                 on_stop: Callable[[], None]):
        self._on_root = on_root
        self._on_stop = on_stop
        self._handles: list = []
        self._depth = 0
        self._traced = False
        self._filter = None
        self._thread: Optional[int] = None
        self.active = False

    def start(self, contain: Callable[[Callable], Callable]) -> None:
        """Learn from the module calls of the calling thread (the guard's); ``contain`` wraps
        the hooks as the guard's containment does (``Containment.wrap``)."""
        self.active = True
        self._thread = threading.get_ident()
        warnings.filterwarnings("ignore", message=_COMPILE_HOOK_WARNING, category=UserWarning)
        self._filter = warnings.filters[0]
        self._handles = [
            module_globals.register_module_forward_pre_hook(contain(self._pre)),
            module_globals.register_module_forward_hook(contain(self._post), always_call=True),
        ]

    def stop(self) -> None:
        """End the learning (the hooks stay where dynamo traced them)."""
        if self.active:
            self.active = False
            self._depth = 0
            if not self._traced:
                self.remove()
            self._on_stop()

    def remove(self) -> None:
        """Remove the hooks and the warning filter (at the latest when the guard exits)."""
        self.active = False
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._filter in warnings.filters:
            warnings.filters.remove(self._filter)
        self._filter = None

    def _pre(self, module, args) -> None:
        if is_compiling():
            self._traced = True
            return
        if not self.active or threading.get_ident() != self._thread:
            return
        if self._depth == 0:
            self._on_root(module, args, _call_kwargs(sys._getframe(1)))
        self._depth += 1
        if unwrap_compiled(module) is not module:
            self.stop()

    def _post(self, module, args, out) -> None:
        if self.active and not is_compiling() and threading.get_ident() == self._thread:
            self._depth = max(0, self._depth - 1)


def _call_kwargs(frame) -> Optional[dict]:
    """The keyword arguments of the module call a global pre-hook runs in (global pre-hooks get
    only the positional ones), read off ``Module._call_impl``'s frame; None if not found."""
    for _ in range(3):
        if frame is None:
            return None
        if frame.f_code.co_filename == CALL_IMPL_CODE.co_filename and "kwargs" in frame.f_locals:
            kwargs = frame.f_locals["kwargs"]
            return kwargs if isinstance(kwargs, dict) else None
        frame = frame.f_back
    return None


# -- the monitor ------------------------------------------------------------------------------


class StepReplay(Monitor):
    """Keeps each step's root-module calls and replays a failing step (see the module doc)."""

    codes = ("AMP101", "AMP103")

    def __init__(self):
        super().__init__()
        #: The root-module calls of each step whose readings are not all judged yet.
        self._calls: Dict[int, Deque[RootCall]] = {}
        self._roots: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
        self._learning = _RootLearning(self._root_seen, self._follow_roots)
        self._learning_steps = 0
        #: The step ending now found a root module the ones before had not.
        self._new_root = False
        #: Requests up to this step belong to an open episode; requests up to the other are not
        #: replayed (the replays before found nothing), and how many in a row found nothing.
        self._episode_until = -1
        self._episode_step = -1
        #: A parameter found non-finite in the open episode, and the optimizer steps applied
        #: when its parameters were last checked (``_in_episode``).
        self._episode_parameter: Optional[Origin] = None
        self._episode_checked_at = 0
        self._backoff_until = -1
        self._unexplained = 0
        self._optimizer_steps = 0
        #: ``(steps so far, optimizer)`` of the latest optimizer steps, to tell which parameters
        #: a step changed (read only by a replay).
        self._stepped: Deque[Tuple[int, "weakref.ref[torch.optim.Optimizer]"]] = deque(
            maxlen=_OPTIMIZER_STEPS_KEPT)
        #: The forward cause (an AMP101, found live or by a replay) of the steps not judged yet.
        self._forward_causes: Dict[int, Origin] = {}
        #: What each replay did, newest last (bounded).
        self.outcomes: Deque[Outcome] = deque(maxlen=32)
        self.replaying = False
        #: ``(number, of how many)`` of the root-module call being replayed.
        self._replayed_call = (1, 1)
        self._bundle_written = False
        self._warned: Set[str] = set()

    # -- lifecycle ---------------------------------------------------------------------------

    def attach(self, guard) -> None:
        super().attach(guard)
        guard.replayer = self
        guard.step_listeners.append(self._step_judged)
        self.keep(register_optimizer_step_post_hook(self._optimizer_step_ends))
        self._learning.start(lambda hook: guard.containment.wrap(self, hook))

    def detach(self) -> None:
        self._learning.remove()
        super().detach()
        guard = self.guard
        if guard.replayer is self:
            guard.replayer = None
        if self._step_judged in guard.step_listeners:
            guard.step_listeners.remove(self._step_judged)
        self._calls.clear()
        self._forward_causes.clear()

    # -- capture -------------------------------------------------------------------------------

    def _root_seen(self, module, args, kwargs) -> None:
        """The learning hooks saw a root module called: follow it, and keep this call."""
        if self.replaying or _recomputing():
            return
        self._new_root = self._new_root or module not in self._roots
        self._roots.add(module)
        if kwargs is not None:
            self._capture(module, tuple(args), kwargs)

    def _follow_roots(self) -> None:
        for module in list(self._roots):
            self.keep(module.register_forward_pre_hook(self._root_called, with_kwargs=True))

    def _root_called(self, module, args, kwargs) -> None:
        if not is_compiling():
            self._capture(module, args, kwargs)

    def _capture(self, module, args, kwargs) -> None:
        guard = self.guard
        if (self.replaying or guard.suspended or threading.get_ident() != guard._thread
                or not torch.is_grad_enabled() or torch.is_inference_mode_enabled()
                or _recomputing()):
            return
        calls = self._calls.get(guard.step_index)
        if calls is None:
            calls = self._calls[guard.step_index] = deque(maxlen=MAX_CALLS_PER_STEP)
        number = calls[-1].number + 1 if calls else 1
        calls.append(RootCall(
            module=module, args=args, kwargs=kwargs, rng=rng_state(), autocast=autocast_state(),
            training=module.training, traced=guard.tracing,
            versions=tuple(t._version for t in input_tensors(args, kwargs)),
            optimizer_steps=self._optimizer_steps,
            location=guard.tracker.loop_location(("root call", id(module))),
            number=number,
        ))

    def _optimizer_step_ends(self, optimizer, args, kwargs) -> None:
        self._optimizer_steps += 1
        self._stepped.append((self._optimizer_steps, weakref.ref(optimizer)))

    # -- requests ------------------------------------------------------------------------------

    def request(self, code: str, step: int) -> Optional[Outcome]:
        """A judge found ``code`` in ``step``: replay that step now, unless it was replayed
        already, an episode is open (an outcome saying which step was replayed for it) or the
        skips are backing off (None). Its outcome; ``skipped`` says why it did not run."""
        if self.replaying or self.guard.suspended:
            return None
        outcome = self.outcome_of(step)
        if outcome is not None:
            return outcome
        quiet = self.guard.thresholds.auto_quiet_steps
        if step <= self._episode_until:
            self._episode_until = max(self._episode_until, step + quiet)
            return self._in_episode(step, code)
        if step <= self._backoff_until:
            return None
        outcome = Outcome(step, (code,))
        try:
            self._replay_step(outcome, self._calls_of(step))
        except ReplayError as reason:
            outcome.skipped = str(reason)
        finally:  # also when a finding raises under policy="raise"
            self._close(outcome)
        return outcome

    def _in_episode(self, step: int, code: str) -> Outcome:
        """A step of an open episode, not replayed. Its trained parameters are checked (one
        pass, one read) when an optimizer step was applied since they last were: an update
        that wrote NaN/Inf into them is why every later step fails, and is then its origin."""
        outcome = Outcome(step, (code,), skipped=f"step {self._episode_step} was replayed for "
                          "this episode", episode=self._episode_step)
        calls = self._calls.get(step)
        if (self._episode_parameter is None and code != SKIPPED and calls
                and self._episode_checked_at != self._optimizer_steps):
            self._episode_checked_at = self._optimizer_steps
            self._episode_parameter = _nonfinite_parameter(_eager_modules(calls),
                                                           self.guard.readings)
        outcome.origin = self._episode_parameter
        return outcome

    def observe(self, event) -> None:
        """Every event the guard emits passes here: the replay's own are marked, and an AMP101
        is remembered as its step's forward cause."""
        if self.replaying:
            event.details["replayed"] = True
            number, calls = self._replayed_call
            if calls > 1:  # gradient accumulation, two views: which call failed
                event.details.update(call=number, calls=calls)
        if event.code == "AMP101":  # the step's first one
            which = {key: event.details[key] for key in ("call", "calls") if key in event.details}
            self._forward_causes.setdefault(event.step, Origin(
                "forward", event.op, event.module, event.source, {"code": "AMP101", **which}))

    def _step_judged(self, step: int, record) -> None:
        """Every reading of ``step`` has been judged: no request for it can come any more."""
        for kept in [s for s in (*self._calls, *self._forward_causes) if s <= step]:
            self._calls.pop(kept, None)
            self._forward_causes.pop(kept, None)

    def on_step_end(self, step, record) -> None:
        if self._learning.active:
            # until a step finds no new root: a loop of two networks with a GradScaler each
            # counts its first iteration as two steps, the second network's in the second
            self._learning_steps += 1
            if (self._roots and not self._new_root
                    or self._learning_steps >= self.guard.thresholds.watch_steps):
                self._learning.stop()
            self._new_root = False

    # -- AMP103's origin ---------------------------------------------------------------------

    def outcome_of(self, step: int) -> Optional[Outcome]:
        return next((o for o in reversed(self.outcomes) if o.step == step), None)

    def cause_of(self, step: int) -> Optional[Origin]:
        """Where ``step``'s non-finite values came from: the op its live trace or replay
        named (AMP101), or the backward a replay reproduced."""
        origin = self._forward_causes.get(step)
        outcome = self.outcome_of(step)
        if origin is None and outcome is not None:
            origin = outcome.cause()
        return origin

    def explain_nonfinite_grads(self, step: int, kwargs: dict) -> dict:
        """AMP103's emit arguments naming where the step's non-finite gradients came from, when
        the step's live trace or its replay found it (otherwise as given)."""
        outcome = self.outcome_of(step)
        origin = self.cause_of(step)
        details = dict(kwargs.get("details") or {})
        if outcome is not None:
            details["replay"] = outcome.to_json()
        if origin is None:
            return {**kwargs, "details": details}
        if origin.phase == "forward":
            cause = f"caused by the non-finite output of {origin.describe()}, AMP101"
        elif origin.before_forward:
            cause = f"caused by {origin.describe()}"
        else:
            cause = f"first non-finite in {origin.describe()}"
        details["origin"] = origin.to_json()
        return {**kwargs, "where": f"{kwargs['where']} ({cause})", "op": origin.op,
                "module": origin.module, "source": origin.source, "details": details}

    # -- the replay -----------------------------------------------------------------------------

    def _calls_of(self, step: int) -> List[RootCall]:
        """``step``'s calls, if replaying them now would replay that step: the parameters and
        the inputs must be those its forward saw. A call of a module whose parameters an
        optimizer stepped since is left out (a GAN's discriminator, stepped before its
        generator's step is judged): the others still replay as they ran, taking its outputs as
        the inputs they were."""
        calls = list(self._calls.get(step, ()))
        if not calls:
            raise ReplayError("no root module call was recorded in it")
        changed = self._stepped_since(min(call.optimizer_steps for call in calls))
        if changed is None:
            raise ReplayError("an optimizer step changed the parameters before it was judged")
        if changed:
            calls = [call for call in calls if not any(
                id(p) in changed for p in eager_module(call.module).parameters())]
            if not calls:
                raise ReplayError("an optimizer step changed the parameters before it was judged")
        for call in calls:
            if tuple(t._version for t in input_tensors(call.args, call.kwargs)) != call.versions:
                raise ReplayError("an input was modified in place after its forward")
        return calls

    def _stepped_since(self, steps: int) -> Optional[Set[int]]:
        """The ids of the parameters the optimizer steps after the first ``steps`` changed;
        None when that is no longer known (more steps than are kept, an optimizer gone)."""
        if steps == self._optimizer_steps:
            return set()
        later = [entry for entry in self._stepped if entry[0] > steps]
        if len(later) != self._optimizer_steps - steps:
            return None
        changed: Set[int] = set()
        for _, reference in later:
            optimizer = reference()
            if optimizer is None:
                return None
            changed.update(id(p) for group in optimizer.param_groups for p in group["params"])
        return changed

    def _close(self, outcome: Outcome) -> None:
        """Open the episode the replay belongs to, keep its outcome, say why it did not run."""
        if outcome.origin is None:  # an AMP101 found before the replay stopped
            outcome.origin = self._forward_causes.get(outcome.step)
        quiet = self.guard.thresholds.auto_quiet_steps
        # a replay that found nothing opens an episode for a NaN loss (its later steps fail the
        # same way), not where its backward localized nothing (a gradient norm that overflowed
        # fp32 while each gradient was finite; a NaN the loop wrote into a gradient itself)
        localized_nothing = outcome.origin is None and outcome.reproduced is not None
        if outcome.origin is not None or (
            set(outcome.triggers) - {SKIPPED} and not localized_nothing
        ):
            self._episode_until = outcome.step + quiet
            self._episode_step = outcome.step
            self._episode_parameter = None
            self._episode_checked_at = self._optimizer_steps
            self._unexplained = 0
        else:  # nothing found: look again at the next requests, then less and less often
            self._unexplained += 1
            backoff = self._unexplained - _UNEXPLAINED_REPLAYED
            gap = 0 if backoff < 0 else min(2 ** (backoff + 1), quiet)
            self._backoff_until = outcome.step + gap
        self.outcomes.append(outcome)
        if outcome.skipped:
            self._warn_once(outcome.skipped, f"step {outcome.step} was not replayed: "
                                             f"{outcome.skipped}")

    def _replay_step(self, outcome: Outcome, calls: List[RootCall],
                     observed: Optional[Set[int]] = None) -> None:
        """Replay ``calls`` (the step's, in order) traced; with AMP103 among the triggers and a
        finite forward, also localize in backward. ``observed``: the ids of the parameters with
        non-finite gradients (default: read from their ``.grad``)."""
        guard = self.guard
        if outcome.step in self._forward_causes:  # traced live: the forward cause is known
            outcome.origin = self._forward_causes[outcome.step]
            return
        trace = guard.enabled("AMP101") and any(not call.traced for call in calls)
        # a skipped step's gradients are non-finite too: their origin explains the scale's fall
        localize = any(guard.enabled(code) for trigger in outcome.triggers
                       for code in _LOCALIZED_FOR.get(trigger, ()))
        if not trace and not localize:
            return
        modules = _eager_modules(calls)
        for module in modules:
            reason = _sharded(module)
            if reason:
                raise ReplayError(reason)
        params = list(dict.fromkeys(p for module in modules for p in module.parameters()))
        for module in modules:
            guard.tracker.saw_root(module)
        self.replaying = True
        with _local_only(), guard.unobserved():
            try:
                with _preserved(modules), _eager():
                    if localize and observed is None:
                        observed = _nonfinite_grads(params, guard.readings)
                    outcome.origin = _nonfinite_parameter(modules, guard.readings)
                    if outcome.origin is None:
                        self._run(outcome, calls, trace, localize, params, observed)
                    if (outcome.origin is None and outcome.step not in self._forward_causes
                            and self.failure is None):
                        outcome.origin = _nonfinite_input(calls, guard.readings, guard.tracker)
            finally:  # also when a finding or the guard's own code raises: the run stops there
                self.replaying = False
                self._save_once(outcome, calls, modules, observed)

    def _run(self, outcome, calls, trace, localize, params, observed) -> None:
        """Each call in order, traced; stop at the first forward cause."""
        guard = self.guard
        op_trace = OpTrace(guard.tracker) if trace else None
        replayed_nonfinite: Set[int] = set()
        for call in calls:
            self._replayed_call = (call.number, calls[-1].number)
            localizer = _Localizer(self) if localize else None
            # (owner, handler): the replay's mode runs them contained, as the guard's does
            handlers = [] if op_trace is None else [(self, op_trace.check)]
            if localizer is not None:
                handlers.append((self, localizer.record))
            # views and copies create autograd nodes too: the localizer sees every op
            mode = GuardMode((), handlers, frozenset() if localizer else UNTRACED_FUNCTIONS,
                             guard.containment.failed, guard)
            mode.set_tracing(True)
            module = eager_module(call.module)
            set_rng_state(call.rng)
            with _autocast(call.autocast), torch.enable_grad(), _training(module, call.training):
                with mode, _module_outputs_to(localizer, self), _called_from(call.location):
                    out = _users_code("forward", module, *_detached(call.args),
                                      **_detached(call.kwargs))
            if self.failure is not None:  # a handler of the replay's failed (AMP100): stop
                return
            if op_trace is not None:
                self._judge_trace(op_trace, outcome.step)
            if outcome.step in self._forward_causes:
                outcome.origin = self._forward_causes[outcome.step]
                return
            if localizer is not None:
                origin, nonfinite = localizer.backward(out, params)
                if self.failure is not None:
                    return
                replayed_nonfinite |= nonfinite
                outcome.origin = outcome.origin or origin
            del out
        if localize:
            outcome.reproduced = bool(observed) and replayed_nonfinite == observed

    def _judge_trace(self, op_trace: OpTrace, step: int) -> None:
        """Judge the replayed ops as the live trace's are judged, reading their peaks at once
        (the one wait of a replay's forward): an AMP101 becomes ``step``'s forward cause."""
        stacked, positions, ops = op_trace.take()
        if ops:
            values = self.guard.readings.read_now(stacked)
            report_trace(self.guard, ops, positions, values, step)

    def _save_once(self, outcome, calls, modules, observed) -> None:
        """Write the first anomalous replayed step as a repro bundle into the log folder (after
        the replay put the buffers back: the step as it was)."""
        anomaly = (outcome.origin is not None or outcome.step in self._forward_causes
                   or set(outcome.triggers) - {SKIPPED})
        if self.guard.log_dir is None or not anomaly or self._bundle_written:
            return
        self._bundle_written = True
        observed = observed or set()
        nonfinite = [(index, name) for index, module in enumerate(modules)
                     for name, parameter in module.named_parameters() if id(parameter) in observed]
        path = os.path.join(self.guard.log_dir, f"repro-step{outcome.step}.pt")
        try:
            save_bundle(path, outcome, calls, modules, nonfinite)
        except (TypeError, OSError, RuntimeError) as err:
            self._warn_once("bundle", f"the repro bundle of step {outcome.step} was not "
                                      f"written: {err}")
            return
        outcome.bundle = path

    def _warn_once(self, reason: str, message: str) -> None:
        """Say why a replay or a bundle failed, once per reason (the run goes on)."""
        if reason not in self._warned and self.guard.policy == "warn":
            self._warned.add(reason)
            warnings.warn(f"amp_runtime: {message}", AmpRuntimeWarning, stacklevel=2)

    # -- offline (python -m amp_runtime replay) ----------------------------------------------

    def replay_offline(self, calls: List[RootCall], triggers: Sequence[str],
                       nonfinite: Sequence[Tuple[int, str]]) -> Outcome:
        """Replay a bundle's calls in this guard's current step; ``nonfinite``: the (module index,
        parameter name) of the gradients the step found non-finite. Emits AMP101 and AMP103."""
        self._learning.remove()  # the replay calls the modules itself
        self._bundle_written = True
        guard = self.guard
        modules = _eager_modules(calls)
        named = [dict(module.named_parameters()) for module in modules]
        observed = {id(named[index][name]) for index, name in nonfinite
                    if index < len(named) and name in named[index]}
        outcome = Outcome(guard.step_index, tuple(sorted(triggers)))
        try:
            self._replay_step(outcome, calls, observed)
        except ReplayError as reason:
            outcome.skipped = str(reason)
        self.outcomes.append(outcome)
        if "AMP103" in outcome.triggers and nonfinite:
            found = nonfinite_gradients(name for _, name in nonfinite)
            guard.emit("AMP103", **{"op": "optimizer.step",
                                    **self.explain_nonfinite_grads(guard.step_index, found)})
        return outcome


def monitors(guard):
    return [] if guard.trace == "off" else [StepReplay()]


# -- repro bundles ------------------------------------------------------------------------------


class BundleError(Exception):
    """A repro bundle that cannot be read, or a model that does not match it (says which)."""


def _portable(value, kind: str):
    """A call argument as a bundle stores it: tensors on the CPU in plain containers (what
    ``torch.load(weights_only=True)`` reads back); TypeError for anything else."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if value is None or isinstance(value, (bool, int, float, complex, str)):
        return value
    if type(value) in (list, tuple):
        return type(value)(_portable(item, kind) for item in value)
    if type(value) is dict and all(isinstance(key, str) for key in value):
        return {key: _portable(item, kind) for key, item in value.items()}
    raise TypeError(f"a {kind} argument of type {type(value).__name__} cannot be stored")


def _device_of(module: torch.nn.Module) -> str:
    return str(next(iter(module.parameters()), torch.empty(0)).device)


def save_bundle(path: str, outcome: Outcome, calls: Sequence[RootCall],
                modules: Sequence[torch.nn.Module], nonfinite: Sequence[Tuple[int, str]]) -> None:
    """Write a step's calls with the modules' parameters and buffers, RNG and autocast state
    (copied to the host: once per run, for the first replayed anomaly); ``nonfinite``: the
    (module index, parameter name) of the gradients the step found non-finite."""
    index = {id(module): i for i, module in enumerate(modules)}
    bundle = {
        "format": BUNDLE_FORMAT,
        "torch": str(torch.__version__),
        "step": outcome.step,
        "triggers": list(outcome.triggers),
        "nonfinite_grads": [list(pair) for pair in nonfinite],
        "modules": [{
            "class": f"{type(module).__module__}.{type(module).__qualname__}",
            "device": _device_of(module),
            "parameters": {name: p.detach().cpu() for name, p in module.named_parameters()},
            "buffers": {name: b.detach().cpu() for name, b in module.named_buffers()},
        } for module in modules],
        "calls": [{
            "module": index[id(eager_module(call.module))],
            "args": _portable(tuple(call.args), "positional"),
            "kwargs": _portable(dict(call.kwargs), "keyword"),
            "rng": dict(call.rng),
            "autocast": [[device, dtype_name(dtype)]
                         for device, dtype in call.autocast],
            "training": call.training,
        } for call in calls],
    }
    partial = f"{path}.partial"
    torch.save(bundle, partial)
    os.replace(partial, path)


def load_bundle(path) -> Dict[str, Any]:
    try:
        bundle = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # pickle, zip and torch's own errors alike
        reason = (str(err).strip().splitlines() or [""])[0]
        raise BundleError(f"{path} is not a repro bundle ({type(err).__name__}: {reason})") \
            from None
    if not isinstance(bundle, dict) or bundle.get("format") != BUNDLE_FORMAT:
        raise BundleError(f"{path} is not an amp_runtime repro bundle (format {BUNDLE_FORMAT})")
    return bundle


def _load_state(module: torch.nn.Module, saved: Dict[str, Any]) -> None:
    """Copy a bundle's parameters and buffers into ``module``; BundleError lists mismatches."""
    problems = []
    pairs = []
    for kind, stored, own in (("parameter", saved["parameters"], dict(module.named_parameters())),
                              ("buffer", saved["buffers"], dict(module.named_buffers()))):
        missing, extra = sorted(set(stored) - set(own)), sorted(set(own) - set(stored))
        if missing:
            problems.append(f"{kind}s in the bundle but not in the model: {listing(missing)}")
        if extra:
            problems.append(f"{kind}s in the model but not in the bundle: {listing(extra)}")
        for name in sorted(set(stored) & set(own)):
            theirs, ours = stored[name], own[name]
            if theirs.shape != ours.shape or theirs.dtype != ours.dtype:
                problems.append(f"{kind} {name} is {_dtype_and_shape(ours)} in the model, "
                                f"{_dtype_and_shape(theirs)} in the bundle")
            else:
                pairs.append((ours, theirs))
    if problems:
        raise BundleError(f"the model does not match the bundle's {saved['class']}: "
                          + "; ".join(problems[:4]) + ("; ..." if len(problems) > 4 else ""))
    with torch.no_grad():
        for ours, theirs in pairs:
            ours.copy_(theirs)


def _dtype_and_shape(tensor: torch.Tensor) -> str:
    return f"{dtype_name(tensor.dtype)}{list(tensor.shape)}"


def replay_bundle(bundle: Dict[str, Any], modules: Sequence[torch.nn.Module],
                  device: Optional[str] = None):
    """Re-run a bundle's step on ``modules`` (built by the user's factory, in the bundle's
    order) with per-op checks: ``(report, outcome)``. The modules get the bundle's weights."""
    modules = [eager_module(module) for module in modules]  # a factory may compile or wrap
    saved = bundle["modules"]
    if len(modules) != len(saved):
        raise BundleError(f"the factory returned {len(modules)} module(s); the bundle holds "
                          f"{len(saved)}: {', '.join(s['class'] for s in saved)}")
    for module, state in zip(modules, saved):
        _load_state(module, state)
    if device is None:
        recorded = saved[0]["device"] if saved else "cpu"
        device = recorded if recorded.startswith("cuda") and torch.cuda.is_available() else "cpu"
    target = torch.device(device)
    if target.type == "cuda" and not torch.cuda.is_available():
        raise BundleError(f"--device {device}: CUDA is not available here (use --device cpu)")
    for module in modules:
        module.to(target)
    from .guard import guard as new_guard

    with new_guard(policy="record", trace="auto") as g:
        g.number_step(bundle["step"])
        replayer = g.replayer
        calls = []
        for call in bundle["calls"]:
            args, kwargs = (_map_tensors(call[part], lambda tensor: tensor.to(target))
                            for part in ("args", "kwargs"))
            rng = {"cpu": call["rng"]["cpu"]}
            cuda = [state for name, state in call["rng"].items() if name.startswith("cuda")]
            if cuda and target.type == "cuda":
                rng[f"cuda:{target.index or torch.cuda.current_device()}"] = cuda[0]
            autocast = tuple((target.type, getattr(torch, dtype)) for _, dtype in call["autocast"])
            calls.append(RootCall(
                module=modules[call["module"]], args=args, kwargs=kwargs, rng=rng,
                autocast=autocast, training=call["training"],
                optimizer_steps=replayer._optimizer_steps,
            ))
        outcome = replayer.replay_offline(
            calls, bundle["triggers"], [tuple(item) for item in bundle["nonfinite_grads"]])
    return g.report, outcome
