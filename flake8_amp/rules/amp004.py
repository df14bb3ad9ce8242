"""AMP004 low-precision-reduce: a reduction over a tensor known to be fp16/bf16."""

from __future__ import annotations

import functools
from typing import Optional

from astroid import nodes

from flake8_amp.analysis.context import named_for_loss
from flake8_amp.analysis.dtypes import (
    PRESERVING,
    SAME_DTYPE_ATTRIBUTES,
    autocast_fp32_op,
    is_low,
)
from flake8_amp.analysis.names import (
    assigned_value,
    code_frame,
    method_call,
    returned_values,
)
from flake8_amp.analysis.regions import BF16, FP16
from flake8_amp.engine import Check

REDUCTIONS = frozenset(
    {"sum", "mean", "cumsum", "cumprod", "prod", "norm", "var", "std", "nansum", "nanmean"}
)
DTYPE_NAMES = {FP16: "float16", BF16: "bfloat16"}


class LowPrecisionReduce(Check):
    """Reductions accumulate rounding error (and overflow in fp16) unless upcast.

    Not reported in inference / evaluation code, where computing in fp16 on purpose is
    common and endorsed; ``no_grad`` alone is not that (DINO's center update, a memory
    queue's statistics: training state computed without gradients).
    """

    code = "AMP004"
    triggers = ("half", "float16", "bfloat16", "autocast")

    def visit_call(self, node: nodes.Call) -> None:
        op_input = self._reduction_input(node)
        if op_input is None or any(kw.arg == "dtype" for kw in node.keywords or ()):
            return
        op = node.func.attrname if isinstance(node.func, nodes.Attribute) else ""
        kind = self.context.dtypes.of(op_input)
        if not is_low(kind) or (kind == BF16 and self._chosen_bf16(op_input)):
            return
        region = self.context.dtypes.region_at(node)  # the training run's, as for ``kind``
        if region is not None and autocast_fp32_op(op, region):
            return
        if region is None and self._in_loss_definition(node):
            return  # a loss called after the autocast block on its outputs: AMP002's finding
        grad = self.context.grad
        if grad.inference_at(node) or grad.inference_mode_at(node) or grad.checking_at(node):
            return  # pure low-precision inference/evaluation is a legitimate choice
        self.report(node, op=op, dtype=DTYPE_NAMES.get(kind, "float16/bfloat16"))

    def _in_loss_definition(self, node: nodes.NodeNG) -> bool:
        """``node`` is in a function named for a loss, or a method of a class named for one
        (``FocalLoss.forward``), that opens no autocast region itself: its low-precision
        inputs come from its callers."""
        frame = code_frame(node)
        if not isinstance(frame, nodes.FunctionDef):
            return False
        owner = frame.parent
        if not (
            named_for_loss(frame.name)
            or isinstance(owner, nodes.ClassDef) and named_for_loss(owner.name)
        ):
            return False
        regions = self.context.regions
        return not any(
            regions.opened_by(block) is not None
            for block in frame.nodes_of_class(nodes.With, skip_klass=nodes.FunctionDef)
        )

    def _chosen_bf16(self, expr: Optional[nodes.NodeNG], depth: int = 12) -> bool:
        """The code cast these values to bf16 itself (``X = G.bfloat16()`` in a Newton-Schulz
        iteration, ``[e.norm() for e in ema]`` over bf16 copies of the weights), directly or
        through names, loops, sequences, parameters, returns and dtype-preserving ops. bf16
        keeps fp32's range and PyTorch accumulates its reductions in fp32: reducing values
        cast to bf16 on purpose is that choice, not a slip (autocast's bf16 outputs are still
        judged)."""
        if expr is None or depth <= 0:
            return False
        names = self.context.names
        chosen = functools.partial(self._all_chosen, depth=depth - 1)
        if isinstance(expr, (nodes.List, nodes.Tuple)):
            return chosen(expr.elts)
        if isinstance(expr, (nodes.ListComp, nodes.GeneratorExp)):
            return chosen([expr.elt])
        if isinstance(expr, nodes.Call):
            if self.context.dtypes.cast_target(expr) == BF16:
                return True
            method, receiver = method_call(expr)
            if (method in PRESERVING or method in REDUCTIONS) and not names.qualname(expr.func):
                return chosen([receiver])
            if method in ("stack", "cat") and expr.args:
                return chosen([expr.args[0]])
            function = names.local_function(expr)
            return function is not None and chosen(returned_values(function) or [])
        if isinstance(expr, nodes.Attribute) and expr.attrname in SAME_DTYPE_ATTRIBUTES:
            return chosen([expr.expr])
        if isinstance(expr, nodes.Name):
            values = []
            for binding in names.earlier_bindings(expr):
                if isinstance(binding.parent, nodes.Arguments):
                    passed = names.argument_values(binding)  # what every call site passes
                    if not passed:
                        return False
                    values += passed
                else:
                    values.append(assigned_value(binding) or names.iterated(binding))
            return chosen(values)
        return False

    def _all_chosen(self, values, depth: int) -> bool:
        return bool(values) and all(self._chosen_bf16(value, depth) for value in values)

    def _reduction_input(self, node: nodes.Call) -> Optional[nodes.NodeNG]:
        """``x`` in ``x.sum()`` or ``torch.sum(x)``; None if this is not a torch reduction."""
        func = node.func
        if not isinstance(func, nodes.Attribute) or func.attrname not in REDUCTIONS:
            return None
        qualname = self.context.names.qualname(func)
        if qualname is None:
            return func.expr  # a method call on a value
        if qualname == f"torch.{func.attrname}" and node.args:
            return node.args[0]
        return None
