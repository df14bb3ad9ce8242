"""The monitor protocol every runtime check implements.

A guard builds its monitors when it is entered, skips those whose codes are all
deselected, calls ``attach`` in order and ``detach`` in reverse order on exit (also
when the guarded block raised). Per-op checks are declared by ``op_handlers``: the
guard's TorchFunctionMode merges every monitor's handlers into one table keyed by
torch function, so an op no check cares about costs one dict look-up.

A monitor is a ``Component`` of the guard's containment (``containment.py``): its handlers, the
hooks it ``keep``s, the judges of the readings it ``submit``s, its step-end work and its listeners
run contained, and at its first exception it is switched off (its handlers dropped, its hooks and
judges inert) for the rest of the run.
"""
from __future__ import annotations

import functools
import math
from collections import deque
from typing import Any, Callable, Dict, FrozenSet, Iterable, Iterator, NamedTuple, Optional, Tuple

import torch

from amp_runtime.containment import Component

#: ``before(func, args, kwargs)`` runs before the op; it may call ``guard.emit``.
Before = Callable[[Any, tuple, dict], None]
#: ``after(func, args, kwargs, out)`` runs after the op with its result.
After = Callable[[Any, tuple, dict, Any], None]


class OpHandler(NamedTuple):
    """What a monitor does around one torch function (either part may be None)."""

    before: Optional[Before] = None
    after: Optional[After] = None


class Monitor(Component):
    """Base class: a group of related runtime checks sharing state and hooks."""

    #: Codes this monitor can emit; the guard skips it when none of them is enabled.
    codes: Tuple[str, ...] = ()
    #: An ``after`` handler the mode runs after every op while per-op tracing is on.
    trace_handler: Optional[After] = None
    #: Functions the trace handlers need not see (views and copies cannot create NaN/Inf).
    untraced: FrozenSet[Any] = frozenset()
    #: The other monitors cannot go on without it: its failure switches the whole guard off.
    essential = False

    def __init__(self):
        self.guard = None
        self._handles = []

    def attach(self, guard) -> None:
        """Install hooks. Subclasses call ``super().attach(guard)`` and ``keep`` handles."""
        self.guard = guard

    def keep(self, handle) -> None:
        """Remember a removable hook handle so that ``detach`` removes it, and run the hook it
        registered contained (``containment.py``): a hook that raises switches this monitor off.
        Register every hook through here (after ``attach`` set ``self.guard``)."""
        _contain_hooks(handle, lambda hook: self.guard.containment.wrap(self, hook))
        self._handles.append(handle)

    def submit(self, tensors, judge: Callable[[list, int], None]) -> None:
        """Have ``judge(values, step)`` judge ``tensors`` once their values reach the host through
        the guard's readings (``readings.py``), contained as this monitor's code. Submit every
        device value a check needs this way: no check reads one itself."""
        guard = self.guard
        guard.readings.submit(tensors, functools.partial(guard.containment.call, self, judge))

    def switch_off(self) -> None:
        """The monitor failed: the guard drops its handlers; its hooks do nothing from now on."""
        self.guard.drop_monitor(self)

    def op_handlers(self) -> Dict[Any, OpHandler]:
        """Torch function -> OpHandler, merged into the guard's mode table."""
        return {}

    def on_step_end(self, step: int, record: Dict[str, Any]) -> None:
        """Called once per training step; add this monitor's per-step values to ``record`` (or
        submit readings whose judges add them: ``guard.readings``)."""

    def detach(self) -> None:
        """Remove every hook this monitor installed."""
        while self._handles:
            self._handles.pop().remove()


def _contain_hooks(handle, contain: Callable[[Callable], Callable]) -> None:
    """Replace the hook ``handle`` removes by ``contain(hook)`` where torch keeps it: the dict a
    ``torch.utils.hooks.RemovableHandle`` points to (optimizer, module and tensor hooks), or each
    of the handles of ``torch.autograd.graph.register_multi_grad_hook``."""
    hooks_ref = getattr(handle, "hooks_dict_ref", None)
    hooks = hooks_ref() if callable(hooks_ref) else None
    hook_id = getattr(handle, "id", None)
    if hooks is not None and hook_id in hooks:
        hooks[hook_id] = contain(hooks[hook_id])
    for inner in getattr(handle, "handles", ()) or ():
        _contain_hooks(inner, contain)


# -- helpers shared by the checks -------------------------------------------------------

LOW_PRECISION = (torch.float16, torch.bfloat16)


def tensors_in(value) -> Iterator[torch.Tensor]:
    """Tensors in an op's argument or result, one level into lists and tuples."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, torch.Tensor):
                yield item


def peak(tensor: torch.Tensor) -> torch.Tensor:
    """max |x| as a device scalar (NaN if any element is NaN): one reduction that answers
    NaN, Inf and headroom to the dtype's largest value.

    On CPU ``abs().amax()`` (amax propagates NaN too): CPU's ``vector_norm(x, inf)`` is a scalar
    loop, ~10x slower on activations of ten thousand elements, which made per-op tracing of a
    CPU model cost more than its matmuls.
    """
    tensor = tensor.detach()
    if tensor.is_cpu:
        return tensor.abs().amax()
    return torch.linalg.vector_norm(tensor, float("inf"))


def extremes(tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Two device scalars whose larger magnitude is max |x|, NaN kept: what per-op tracing
    measures of every checked output, batched into peaks once per stretch (``OpTrace.take``).
    On the CPU, fp16/bf16 take one ``aminmax`` pass (its ``(min, max)`` as it comes), about
    twice as fast there as ``abs().amax()`` (which allocates the absolute values and reads them
    again); elsewhere :func:`peak` answers for both."""
    tensor = tensor.detach()
    if tensor.is_cpu and tensor.dtype in LOW_PRECISION:
        return torch.aminmax(tensor)
    value = peak(tensor)
    return value, value


def autograd_nodes(starts: Iterable[Any], limit: float = math.inf) -> Iterator[Any]:
    """The autograd nodes reachable from the nodes ``starts`` (a tensor's ``grad_fn``), breadth
    first, at most ``limit`` of them (the checks that look for something near a root bound
    the walk)."""
    queue, seen = deque(starts), set()
    while queue and len(seen) < limit:
        node = queue.popleft()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        queue.extend(next_node for next_node, _ in node.next_functions)


def autocast_on(device_type: str) -> bool:
    """Whether autocast is enabled for the device type (False where autocast does not
    exist, e.g. ``meta``, instead of torch's error)."""
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def readable(tensor: torch.Tensor) -> bool:
    """A tensor with values a check can reduce (not empty, sparse, nested or meta)."""
    return tensor.numel() > 0 and not (tensor.is_sparse or tensor.is_nested or tensor.is_meta)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def argument(args: tuple, kwargs: dict, position: int, name: str, default: Any = None) -> Any:
    """An op's argument given by position or keyword."""
    if len(args) > position:
        return args[position]
    return kwargs.get(name, default)
