"""AMP001 manual-cast: ``.half()`` / ``.bfloat16()`` / ``.to(torch.float16)`` in training code."""

from __future__ import annotations

from typing import Optional

from astroid import nodes

from flake8_amp.analysis.context import name_words
from flake8_amp.analysis.dtypes import CAST_METHODS, FP32
from flake8_amp.analysis.names import is_self, simple_name
from flake8_amp.analysis.regions import BF16, FP16
from flake8_amp.engine import Check

DTYPE_NAMES = {FP16: "float16", BF16: "bfloat16"}
#: A cast inside ``if args.fp16:`` / ``x.half() if half else x`` is a deliberate precision mode.
FLAG_WORDS = frozenset(
    {"fp16", "half", "bf16", "bfloat16", "float16", "pure", "precision", "dtype"}
)
#: Methods whose definitions legitimately call the cast (``Module.half`` overrides).
CAST_DEFINITIONS = frozenset({"half", "bfloat16", "to", "type", "_apply"})


class ManualCast(Check):
    """Pure low-precision training: fp32 master weights and per-op precision are lost."""

    code = "AMP001"
    triggers = ("half", "bfloat16", "float16", "HalfTensor")

    def visit_call(self, node: nodes.Call) -> None:
        func = node.func
        if not isinstance(func, nodes.Attribute):
            return
        kind = self._cast_kind(node, func)
        if kind is None or self._legitimate(node, func):
            return
        self.report(node, target=self.source_text(func.expr), dtype=DTYPE_NAMES[kind])

    def _cast_kind(self, node: nodes.Call, func: nodes.Attribute) -> Optional[str]:
        method = func.attrname
        if method in ("half", "bfloat16"):
            return CAST_METHODS[method] if not node.args and not node.keywords else None
        if method not in ("to", "type"):
            return None
        candidates = list(node.args) + [
            kw.value for kw in node.keywords or () if kw.arg in ("dtype", "dst_type")
        ]
        for arg in candidates:
            if isinstance(arg, nodes.Const):
                continue  # strings here are devices (``.to("cuda")``), not dtypes
            kind = self.context.dtypes.constant(arg)
            if kind in DTYPE_NAMES:
                return kind
        return None

    def _legitimate(self, node: nodes.Call, func: nodes.Attribute) -> bool:
        grad = self.context.grad
        return (
            _round_trip(node)
            or _in_cast_definition(node)
            or _self_cast(func)
            or self._user_method(func)
            or self._behind_precision_flag(node)
            or self._checkpoint_copy(node, func)
            or grad.frozen(node)
            or grad.not_training_at(node)
            or not grad.training_at(node)
        )

    def _user_method(self, func: nodes.Attribute) -> bool:
        """The receiver is an object of a class defined here that has this method itself."""
        cls = self.context.names.local_class(func.expr)
        return cls is not None and func.attrname in cls.locals

    def _behind_precision_flag(self, node: nodes.NodeNG) -> bool:
        child, parent = node, node.parent
        while parent is not None and not isinstance(
            parent, (nodes.FunctionDef, nodes.ClassDef, nodes.Module)
        ):
            if isinstance(parent, (nodes.If, nodes.IfExp)) and child is not parent.test:
                if any(word in FLAG_WORDS for word in _identifier_words(parent.test)):
                    return True
            child, parent = parent, parent.parent
        return False

    def _checkpoint_copy(self, node: nodes.Call, func: nodes.Attribute) -> bool:
        """``deepcopy(model).half()`` or a cast in a scope that saves a checkpoint."""
        receiver = func.expr
        if isinstance(receiver, nodes.Call) and simple_name(receiver.func) == "deepcopy":
            return True
        return "save" in self.context.grad.called_names(node.frame())


def _round_trip(node: nodes.Call) -> bool:
    """``x.half().float()``: the cast is undone immediately (a rounding simulation)."""
    parent = node.parent
    return (
        isinstance(parent, nodes.Attribute)
        and parent.attrname in ("float", "double", "to", "type")
        and isinstance(parent.parent, nodes.Call)
        and CAST_METHODS.get(parent.attrname, FP32) == FP32
    )


def _in_cast_definition(node: nodes.NodeNG) -> bool:
    scope = node.frame()
    return isinstance(scope, nodes.FunctionDef) and scope.name in CAST_DEFINITIONS


def _self_cast(func: nodes.Attribute) -> bool:
    """``self.half()`` / ``super().half()`` inside a class: the object's own method."""
    receiver = func.expr
    if isinstance(receiver, nodes.Call) and simple_name(receiver.func) == "super":
        return True
    return is_self(receiver)


def _identifier_words(expr: nodes.NodeNG):
    for sub in expr.nodes_of_class((nodes.Name, nodes.Attribute, nodes.Const)):
        if isinstance(sub, nodes.Const):
            if isinstance(sub.value, str):
                yield from name_words(sub.value)
        else:
            yield from name_words(sub.name if isinstance(sub, nodes.Name) else sub.attrname)
