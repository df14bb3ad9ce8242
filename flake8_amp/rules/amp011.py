"""AMP011 tiny-epsilon: an epsilon below fp16's smallest subnormal guarding fp16 values.

Reported where the dtype flow knows the values are fp16: ``x + 1e-8``, ``x.add(1e-8)``,
``x.clamp(min=1e-8)`` / ``clamp_min``, ``F.normalize(x)`` computed in fp16 (its default eps is
1e-12; CUDA autocast runs it in fp32); and Adam-family optimizers whose ``eps`` (given
or default) is that small, built over ``model.parameters()`` of a model whose last cast
before it in the same function is to fp16. bf16 shares fp32's exponent range, so 1e-8 is
fine there.
"""

from __future__ import annotations

import re
from typing import Optional, Tuple

from astroid import nodes

from flake8_amp.analysis.constants import numeric_constant
from flake8_amp.analysis.dtypes import FP16
from flake8_amp.analysis.names import attribute_not_in, call_argument, method_call
from flake8_amp.analysis.scaler import calls_in_order, expression_key
from flake8_amp.catalog import FP16_TINY_SUBNORMAL
from flake8_amp.engine import Check

#: Default ``eps`` of the optimizers that divide by ``sqrt(v) + eps``.
OPTIMIZER_DEFAULT_EPS = {
    "torch.optim.Adam": 1e-8,
    "torch.optim.AdamW": 1e-8,
    "torch.optim.Adamax": 1e-8,
    "torch.optim.NAdam": 1e-8,
    "torch.optim.RAdam": 1e-8,
    "torch.optim.RMSprop": 1e-8,
    "torch.optim.Adagrad": 1e-10,
}
OPTIMIZER_NAMES = frozenset(qualname.rsplit(".", 1)[-1] for qualname in OPTIMIZER_DEFAULT_EPS)
NORMALIZE = "torch.nn.functional.normalize"
NORMALIZE_DEFAULT_EPS = 1e-12
#: Calls whose default eps is tiny: their files need no tiny literal to be checked.
DEFAULT_EPS_NAMES = OPTIMIZER_NAMES | {"normalize("}
ADD_METHODS = frozenset({"add", "add_"})
CLAMP_METHODS = frozenset({"clamp", "clamp_", "clip", "clip_", "clamp_min", "clamp_min_"})
CLAMP_FUNCTIONS = frozenset({"torch.clamp", "torch.clip", "torch.clamp_min"})
#: A literal of 1e-8 or smaller somewhere in the source (``1e-8``, ``1E-10``, ``1e-08``).
TINY_LITERAL = re.compile(r"\d[eE]-0?(?:[89]|[1-9]\d)")


def _is_tiny(value: Optional[float]) -> bool:
    return value is not None and 0 < value < FP16_TINY_SUBNORMAL


class TinyEpsilon(Check):
    """The epsilon rounds to exactly zero in fp16, so the guarded division or log is not guarded."""

    code = "AMP011"
    triggers = ("half", "float16", "autocast")

    @classmethod
    def applies(cls, source, options):
        """A tiny literal, or a call whose default eps is tiny (``Adam(params)``,
        ``F.normalize(x)``)."""
        return super().applies(source, options) and (
            TINY_LITERAL.search(source) is not None
            or any(name in source for name in DEFAULT_EPS_NAMES)
        )

    def visit_binop(self, node: nodes.BinOp) -> None:
        if node.op != "+":
            return
        for epsilon, tensor in ((node.right, node.left), (node.left, node.right)):
            value = numeric_constant(epsilon, self.context.names)
            if _is_tiny(value) and self.context.dtypes.of(tensor) == FP16:
                self.report(node, value=f"{value:g}")
                return

    def visit_call(self, node: nodes.Call) -> None:
        guarded = self._guarded_value(node)
        if guarded is not None:
            tensor, epsilon = guarded
            value = numeric_constant(epsilon, self.context.names)
            if _is_tiny(value) and self.context.dtypes.of(tensor) == FP16:
                self.report(node, value=f"{value:g}")
            return
        if not self._check_normalize(node):
            self._check_optimizer(node)

    def _check_normalize(self, node: nodes.Call) -> bool:
        """``F.normalize(x, eps=...)`` (default 1e-12) computed in fp16: outside autocast on
        an fp16 tensor (CUDA autocast runs it in fp32). True if ``node`` is a normalize."""
        if attribute_not_in(node.func, {"normalize"}):
            return False
        if self.context.names.qualname(node.func) != NORMALIZE:
            return False
        given = call_argument(node, 3, "eps")
        names = self.context.names
        value = NORMALIZE_DEFAULT_EPS if given is None else numeric_constant(given, names)
        tensor = call_argument(node, 0, "input")
        dtypes = self.context.dtypes
        if _is_tiny(value) and tensor is not None and dtypes.of(tensor) == dtypes.of(node) == FP16:
            label = f"{value:g}" if given is not None else f"{value:g} (the default eps)"
            self.report(node, value=label)
        return True

    def _guarded_value(
        self, node: nodes.Call
    ) -> Optional[Tuple[nodes.NodeNG, Optional[nodes.NodeNG]]]:
        """``(tensor, epsilon)`` of ``x.add(eps)``, ``x.clamp(min=eps)``, ``torch.clamp(x, eps)``"""
        if attribute_not_in(node.func, ADD_METHODS | CLAMP_METHODS):
            return None  # cheap test before name resolution
        qualname = self.context.names.qualname(node.func)
        if qualname is None:
            method, receiver = method_call(node)
            if method in ADD_METHODS:
                return receiver, node.args[0] if node.args else None
            if method in CLAMP_METHODS:
                return receiver, call_argument(node, 0, "min")
            return None
        if qualname == "torch.add" and len(node.args) == 2:
            return node.args[0], node.args[1]
        if qualname in CLAMP_FUNCTIONS and node.args:
            return node.args[0], call_argument(node, 1, "min")
        return None

    def _check_optimizer(self, node: nodes.Call) -> None:
        if attribute_not_in(node.func, OPTIMIZER_NAMES):
            return
        callee = self.context.names.callee(node)
        if callee is None or callee.instance or callee.qualname not in OPTIMIZER_DEFAULT_EPS:
            return
        given = callee.keyword("eps")
        value = (
            OPTIMIZER_DEFAULT_EPS[callee.qualname]
            if given is None
            else numeric_constant(given, self.context.names)
        )
        if not _is_tiny(value):
            return
        model = _parameters_owner(callee.argument(0, "params"), self.context.names)
        if model is not None and self._cast_to_fp16(node, model):
            label = f"{value:g}" if given is not None else f"{value:g} (the default eps)"
            self.report(node, value=label)

    def _cast_to_fp16(self, node: nodes.Call, model: nodes.NodeNG) -> bool:
        """``model`` holds an fp16 model here: bound to a cast, or cast in place earlier in
        this scope by the last cast before ``node`` (not one after it, e.g. a checkpoint
        compaction, nor one that ``model.float()`` undid)."""
        if self.context.dtypes.of(model) == FP16:
            return True
        key = expression_key(model)
        if key is None:
            return False
        last_cast = None
        for call in calls_in_order(node.scope()):
            if call is node:
                break
            receiver = method_call(call)[1]
            if receiver is not None and expression_key(receiver) == key:
                last_cast = self.context.dtypes.cast_target(call) or last_cast
        return last_cast == FP16


def _parameters_owner(params: Optional[nodes.NodeNG], names) -> Optional[nodes.NodeNG]:
    """``model`` in ``model.parameters()``, ``[p for p in model.parameters() if ...]``,
    ``filter(fn, model.parameters())``, ``list(model.parameters())``, or a name bound to one."""
    if isinstance(params, nodes.Name):
        values = names.assigned_values(params) or []
        return _parameters_owner(values[0], names) if len(values) == 1 else None
    if isinstance(params, (nodes.ListComp, nodes.GeneratorExp)):
        generator = params.generators[0]
        same = isinstance(params.elt, nodes.Name) and isinstance(generator.target, nodes.AssignName)
        if not same or params.elt.name != generator.target.name:
            return None  # ``[p.float() for p in ...]`` builds new (fp32 master) tensors
        return _parameters_owner(generator.iter, names)
    if not isinstance(params, nodes.Call):
        return None
    method, receiver = method_call(params)
    if method == "parameters":
        return receiver
    func = params.func
    if isinstance(func, nodes.Name) and func.name in ("filter", "list") and params.args:
        return _parameters_owner(params.args[-1], names)
    return None
