"""AMP004 low-precision-reduce: a reduction over a tensor known to be fp16/bf16."""

from __future__ import annotations

from typing import Optional

from astroid import nodes

from flake8_amp.analysis.dtypes import autocast_fp32_op, is_low
from flake8_amp.analysis.regions import BF16, FP16
from flake8_amp.engine import Check

REDUCTIONS = frozenset(
    {"sum", "mean", "cumsum", "cumprod", "prod", "norm", "var", "std", "nansum", "nanmean"}
)
DTYPE_NAMES = {FP16: "float16", BF16: "bfloat16"}


class LowPrecisionReduce(Check):
    """Reductions accumulate rounding error (and overflow in fp16) unless upcast.

    Not reported in no_grad / inference / evaluation code, where casting to fp16 on
    purpose is common and endorsed.
    """

    code = "AMP004"
    triggers = ("half", "float16", "bfloat16", "autocast")

    def visit_call(self, node: nodes.Call) -> None:
        op_input = self._reduction_input(node)
        if op_input is None or any(kw.arg == "dtype" for kw in node.keywords or ()):
            return
        op = node.func.attrname if isinstance(node.func, nodes.Attribute) else ""
        kind = self.context.dtypes.of(op_input)
        if not is_low(kind):
            return
        region = self.context.regions.autocast_at(node)
        if region is not None and autocast_fp32_op(op, region):
            return
        if self.context.grad.not_training_at(node):
            return  # pure low-precision inference/evaluation is a legitimate choice
        self.report(node, op=op, dtype=DTYPE_NAMES.get(kind, "float16/bfloat16"))

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
