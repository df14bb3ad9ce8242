"""The monitor protocol every runtime check implements.

A guard builds its monitors when it is entered, skips those whose codes are all
deselected, calls ``attach`` in order and ``detach`` in reverse order on exit (also
when the guarded block raised). Per-op checks are declared by ``op_handlers``: the
guard's TorchFunctionMode merges every monitor's handlers into one table keyed by
torch function, so an op no check cares about costs one dict look-up.
"""
from __future__ import annotations

import gc
import warnings
from collections import deque
from typing import Any, Callable, Dict, FrozenSet, Iterator, NamedTuple, Optional, Tuple

import torch

#: ``before(func, args, kwargs)`` runs before the op; it may call ``guard.emit``.
Before = Callable[[Any, tuple, dict], None]
#: ``after(func, args, kwargs, out)`` runs after the op with its result.
After = Callable[[Any, tuple, dict, Any], None]


class OpHandler(NamedTuple):
    """What a monitor does around one torch function (either part may be None)."""

    before: Optional[Before] = None
    after: Optional[After] = None


class Monitor:
    """Base class: a group of related runtime checks sharing state and hooks."""

    #: Codes this monitor can emit; the guard skips it when none of them is enabled.
    codes: Tuple[str, ...] = ()
    #: An ``after`` handler the mode runs after every op while per-op tracing is on.
    trace_handler: Optional[After] = None
    #: Functions the trace handlers need not see (views and copies cannot create NaN/Inf).
    untraced: FrozenSet[Any] = frozenset()

    def __init__(self):
        self.guard = None
        self._handles = []

    def attach(self, guard) -> None:
        """Install hooks. Subclasses call ``super().attach(guard)`` and ``keep`` handles."""
        self.guard = guard

    def keep(self, handle) -> None:
        """Remember a removable hook handle so that ``detach`` removes it."""
        self._handles.append(handle)

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


def autograd_nodes(root: torch.Tensor, limit: int) -> Iterator[Any]:
    """The autograd nodes behind ``root``, breadth first, at most ``limit`` of them (a bounded
    walk: the checks that use it look for something near the root)."""
    queue, seen = deque([root.grad_fn]), set()
    while queue and len(seen) < limit:
        node = queue.popleft()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        queue.extend(next_node for next_node, _ in node.next_functions)


def live_instances(cls) -> list:
    """Every live object of ``cls`` (a full heap walk, for rare one-off look-ups)."""
    with warnings.catch_warnings():
        # isinstance() on some lazily deprecated module attributes warns
        warnings.simplefilter("ignore")
        return [obj for obj in gc.get_objects() if isinstance(obj, cls)]


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
