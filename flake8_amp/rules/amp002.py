"""AMP002 loss-outside-autocast: a loss computed after the autocast block on its outputs."""

from __future__ import annotations

from typing import Optional

from astroid import nodes

from flake8_amp.analysis.dtypes import CAST_METHODS, FP32, INT, PRESERVING, is_low
from flake8_amp.analysis.names import (
    assigned_value,
    call_argument,
    last_part,
    method_call,
    simple_name,
)
from flake8_amp.analysis.regions import returned_values
from flake8_amp.engine import Check, Options, mentions_autocast

#: Functional losses whose names do not end in ``_loss``.
LOSS_FUNCTIONS = frozenset(
    {
        "cross_entropy",
        "binary_cross_entropy",
        "binary_cross_entropy_with_logits",
        "kl_div",
        "nll_loss",
    }
)
#: Methods returning models whose forward casts outputs to fp32 (accelerate, Lightning Fabric).
FP32_OUTPUT_WRAPPERS = frozenset({"prepare", "prepare_model", "setup", "setup_module"})
#: How many reshaping re-assignments (``out = out.view(...)``) are followed back.
_MAX_HOPS = 4
#: Tensor methods that move or convert data; their results are not forward outputs.
DATA_METHODS = frozenset(
    {"to", "cuda", "cpu", "type", "numpy", "item", "tolist", "new_tensor"}
) | set(CAST_METHODS)


class LossOutsideAutocast(Check):
    """Outside the region, autocast's fp32 handling of the loss is lost."""

    code = "AMP002"
    triggers = ("loss", "Loss", "cross_entropy", "kl_div")

    @classmethod
    def applies(cls, source: str, options: Options) -> bool:
        loss_words = cls.triggers + tuple(last_part(name) for name in options.loss_functions)
        return mentions_autocast(source, options) and any(word in source for word in loss_words)

    def visit_call(self, node: nodes.Call) -> None:
        if not self._is_loss(node) or self.context.regions.region_at(node) is not None:
            return
        # Only the prediction is judged: targets made in the region (``target =
        # scheduler.get_velocity(...)``) are data, and an upcast prediction is enough.
        arg = call_argument(node, 0, "input")
        produced = self._autocast_output_name(arg) if arg is not None else None
        if produced is not None:
            self.report(node, loss=self.source_text(node.func), arg=produced)

    def _is_loss(self, node: nodes.Call) -> bool:
        options = self.context.options.loss_functions
        if simple_name(node.func) in {last_part(name) for name in options}:
            return True
        callee = self.context.names.callee(node)
        if callee is None:
            return False
        if callee.qualname in options:
            return True
        if callee.instance:
            return callee.qualname.startswith("torch.nn.") and callee.name.endswith("Loss")
        if (
            callee.qualname.startswith(("torch.nn.functional.", "torch."))
            and callee.qualname.count(".") <= 3
        ):
            return callee.name.endswith("_loss") or callee.name in LOSS_FUNCTIONS
        return False

    def _autocast_output_name(self, arg: nodes.NodeNG) -> Optional[str]:
        """The name of ``arg``'s variable if it holds a forward output made inside an
        autocast region that does not enclose the loss, with no upcast since."""
        root = _strip(arg)
        if not isinstance(root, nodes.Name) or self.context.dtypes.of(arg) in (FP32, INT):
            return None
        return root.name if self._made_under_autocast(root, _MAX_HOPS) else None

    def _made_under_autocast(self, name: nodes.Name, hops: int) -> bool:
        """Some assignment reaching ``name`` stores a forward output made in an autocast
        region, directly or through reshaping re-assignments (``out = out.view(-1, C)``)."""
        dtypes = self.context.dtypes
        statement = name.statement()
        for binding in self.context.names.reaching_bindings(name):
            value = _bound_value(binding)
            if value is None or binding.statement() is statement or dtypes.of(value) in (FP32, INT):
                continue
            if self._forward_output(value):
                if self._under_autocast(binding, value):
                    return True
                continue
            source = _strip(value)
            if hops > 0 and isinstance(source, nodes.Name):
                if self._made_under_autocast(source, hops - 1):
                    return True
        return False

    def _under_autocast(self, binding: nodes.NodeNG, value: nodes.NodeNG) -> bool:
        """The assignment runs in an autocast region, or calls a function of this module
        that runs wholly under autocast (``@torch.autocast(...)`` on its ``def``) and does
        not upcast what it returns."""
        regions = self.context.regions
        if regions.autocast_at(binding) is not None:
            return True
        core = _strip(value)
        if not isinstance(core, nodes.Call) or regions.called_region(core) is None:
            return False
        returns = returned_values(self.context.names.local_function(core)) or []
        return any(self.context.dtypes.of(v) not in (FP32, INT) for v in returns)

    def _forward_output(self, value: nodes.NodeNG) -> bool:
        """``model(x)``, ``self.net(x)[0]``, ``ddp_model(x)``, ``x @ w``: low precision, or
        a call of a model (not a data move, not a library function or a loss)."""
        if is_low(self.context.dtypes.of(value)):
            return True
        core = _strip(value)
        if not isinstance(core, nodes.Call) or self._returns_fp32(core.func):
            return False
        callee = self.context.names.callee(core)
        if callee is None:
            return simple_name(core.func) not in DATA_METHODS
        # Library objects wrapping a model (``DDP(net)``, ``torch.compile(net)``) run its
        # forward; library functions and loss modules do not.
        return callee.instance and not callee.name.endswith("Loss")

    def _returns_fp32(self, model: nodes.NodeNG) -> bool:
        """``model`` comes from ``accelerator.prepare(...)`` or ``fabric.setup(...)``,
        which wrap its forward so that it returns fp32 outputs (accelerate's
        ``convert_outputs_to_fp32``, Fabric's ``convert_output``)."""
        if not isinstance(model, nodes.Name):
            return False
        for binding in self.context.names.reaching_bindings(model):
            value = _bound_value(binding)
            if isinstance(value, nodes.Call) and method_call(value)[0] in FP32_OUTPUT_WRAPPERS:
                return True
        return False


def _strip(expr: nodes.NodeNG) -> nodes.NodeNG:
    """Remove indexing, attribute access and dtype-preserving method calls."""
    while True:
        if isinstance(expr, nodes.Subscript):
            expr = expr.value
        elif isinstance(expr, nodes.Attribute):
            expr = expr.expr
        elif (
            isinstance(expr, nodes.Call)
            and isinstance(expr.func, nodes.Attribute)
            and expr.func.attrname in PRESERVING
        ):
            expr = expr.func.expr
        else:
            return expr


def _bound_value(binding: nodes.NodeNG) -> Optional[nodes.NodeNG]:
    """The value assigned to ``binding``, also through tuple unpacking (``a, b = f()``)."""
    value = assigned_value(binding)
    if value is not None:
        return value
    parent = binding.parent
    while isinstance(parent, (nodes.Tuple, nodes.List, nodes.Starred)):
        parent = parent.parent
    if isinstance(parent, nodes.Assign):
        return parent.value
    return None
