"""AMP011 tiny-epsilon: an epsilon below fp16's smallest subnormal guarding fp16 values.

Reported where the dtype flow knows the values are fp16: ``x + 1e-8``, ``x.add(1e-8)``,
``x.clamp(min=1e-8)`` / ``clamp_min``, ``F.normalize(x)`` computed in fp16 (its default eps is
1e-12; CUDA autocast runs it in fp32); and Adam-family optimizers whose ``eps`` (given
or default) is that small, built over parameters that are fp16 there: every module the
optimizer is known to step (``GradContext.optimized_modules``) holds fp16 parameters by the
cast in force (``Dtypes.module_kind_at``; a fp32 head beside an fp16 body is not known to
be fine, so it is not reported). bf16 shares fp32's exponent range, so 1e-8 is fine there.
"""

from __future__ import annotations

import re
from typing import Optional, Tuple

from astroid import nodes

from flake8_amp.analysis.constants import numeric_constant
from flake8_amp.analysis.dtypes import FP16
from flake8_amp.analysis.names import attribute_not_in, call_argument, method_call
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
        dtypes, grad = self.context.dtypes, self.context.grad
        modules = grad.optimized_modules(node)
        decided = [dtypes.module_kind_at(module, node) for module in modules]
        if not modules or any(kind != FP16 for kind, _ in decided):
            return
        if any(cast is not None and grad.grads_turned_off(cast) for _, cast in decided):
            return  # what it picks from a frozen model was added since (LoRA adapters)
        label = f"{value:g}" if given is not None else f"{value:g} (the default eps)"
        self.report(node, value=label)
