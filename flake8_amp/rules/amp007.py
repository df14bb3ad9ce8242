"""AMP007 fp16-overflow-literal: a fill beyond +-65504 on a tensor that can be fp16.

Fills: ``masked_fill``/``index_fill``/``fill_``/``new_full``, ``torch.full``/``full_like``,
``torch.where`` with one number (a 0-dim ``torch.tensor(-1e9)`` is one too: it takes the
other tensor's dtype), ``F.pad(x, pad, value=...)`` and indexed assignment (``x[m] = -1e9``);
also arithmetic whose result is known fp16 (``(1.0 - mask.to(scores.dtype)) * -1e9``,
``-9e15 * torch.ones_like(e)``): the number becomes inf there.

The fill is judged by the tensor it lands on: known fp16 (or fp16/bf16) is a finding;
known fp32, bf16 or integer is fine; unknown is a finding inside an autocast region
(not bf16; a tensor an op on CUDA autocast's fp32 list made is fp32 there unless the region
is CPU autocast's) and in model code (methods of ``nn.Module`` classes and the functions of a
module that defines them), where the tensor is whatever dtype the caller runs in.
Literals are followed through names (``NEG_INF = -1e9``, ``self.mask_value``); a
dtype-conditional value (``-1e9 if x.dtype == torch.float32 else -1e4``) is fine, and so is
an integer written into a tensor named for indices (``input_ids.masked_fill(m, 128001)``).
"""

from __future__ import annotations

import math
import re
from typing import Optional, Tuple

from astroid import nodes

from flake8_amp.analysis.constants import numeric_constant
from flake8_amp.analysis.context import name_words
from flake8_amp.analysis.dtypes import BF16, CUDA_FP32_OPS, FP16, FP32, INT, LOW
from flake8_amp.analysis.names import (
    attribute_not_in,
    call_argument,
    is_model_class,
    method_call,
)
from flake8_amp.analysis.regions import CPU
from flake8_amp.analysis.scaler import expression_key
from flake8_amp.catalog import FP16_MAX
from flake8_amp.engine import Check

#: Tensor methods that fill: ``(position, keyword)`` of the fill value.
FILL_METHODS = {
    "masked_fill": (1, "value"),
    "masked_fill_": (1, "value"),
    "index_fill": (2, "value"),
    "index_fill_": (2, "value"),
    "fill_": (0, "value"),
    "fill_diagonal_": (0, "fill_value"),
    "new_full": (1, "fill_value"),
}
#: torch functions filling their first argument: ``(op, position, keyword)`` of the value.
TORCH_FILLS = {
    "torch.full_like": ("torch.full_like", 1, "fill_value"),
    "torch.masked_fill": ("torch.masked_fill", 2, "value"),
    "torch.nn.functional.pad": ("F.pad", 3, "value"),
}
#: Last names of every fill this rule knows (methods above, ``torch.full``/``full_like``/``where``,
#: ``F.pad(x, pad, value=...)``).
FILL_NAMES = frozenset(FILL_METHODS) | {"full", "full_like", "where", "pad"}
#: A value that may exceed 65504 somewhere in the source: ``1e5``+, ``70000``, ``100_000``,
#: ``2 ** 32``, ``torch.finfo(torch.float32)``. Digits after a decimal point, in names or in
#: paths (``0.7978845608``, ``issues/70627``) are not integers. The leading lookahead lets the
#: regex engine skip the characters no alternative starts with (3x faster over a large file).
_BIG_EXPONENT = r"[eE]\+?0?(?:[5-9]|[1-9]\d)"  # ``e5`` and up
BIG_LITERAL = re.compile(
    r"(?=[\d*f])(?:"
    rf"\d{_BIG_EXPONENT}"
    r"|(?<![\w./#])(?:\d{6}|[6-9]\d{4}\b|\d+(?:_\d{3})+)"
    r"|\*\*\s*\d\d|finfo\(torch\.(?:float|double))"
)
#: A big literal in arithmetic (``* -1e9``, ``-9e15 *``, ``= -1e9`` for a named constant).
BIG_ARITHMETIC = re.compile(rf"[-+*]\s*\d[\d.]*{_BIG_EXPONENT}|\d{_BIG_EXPONENT}\s*[*+-]")
#: Arithmetic in which a number becomes inf when the result is fp16, as the message names it.
ARITHMETIC_OPS = {"*": "a multiplication", "+": "an addition", "-": "a subtraction"}
CONTAINER_NODES = (
    nodes.List,
    nodes.Dict,
    nodes.Set,
    nodes.ListComp,
    nodes.DictComp,
    nodes.SetComp,
    nodes.Tuple,
)
BUILTIN_CONTAINERS = frozenset({"list", "dict", "set"})
#: Last words of names of integer tensors: token ids, indices, positions.
INDEX_NAME_WORDS = frozenset(
    {"id", "ids", "idx", "idxs", "index", "indices", "token", "tokens", "position", "positions"}
)
#: Tensor methods whose result is a numpy array or a Python list.
TO_PYTHON_METHODS = frozenset({"numpy", "tolist"})
CONTAINER_FACTORIES = frozenset({"collections.defaultdict", "collections.OrderedDict"})


class Fp16OverflowLiteral(Check):
    """fp16 cannot hold the value: the fill raises, or becomes inf and softmax turns NaN."""

    code = "AMP007"
    triggers = ("fill", "full(", "full_like(", "where(", "] =", "pad(")

    @classmethod
    def applies(cls, source, options):
        if super().applies(source, options):
            return BIG_LITERAL.search(source) is not None
        return BIG_ARITHMETIC.search(source) is not None

    def visit_call(self, node: nodes.Call) -> None:
        fill = self._fill(node)
        if fill is None:
            return
        op, target, value_node, dtype_node = fill
        value = numeric_constant(value_node, self.context.names)
        if value is None or not math.isfinite(value) or abs(value) <= FP16_MAX:
            return
        if self._index_fill(target, value_node):
            return
        if self._can_be_fp16(node, target, dtype_node):
            self.report(node, value=f"{value:g}", op=op)

    def visit_binop(self, node: nodes.BinOp) -> None:
        """``t * -1e9`` where ``t`` is known fp16: the product is inf (an additive mask of
        -inf turns a fully masked softmax row into NaN)."""
        if node.op not in ARITHMETIC_OPS:
            return
        for number, tensor in ((node.left, node.right), (node.right, node.left)):
            value = numeric_constant(number, self.context.names)
            if value is None or not math.isfinite(value) or abs(value) <= FP16_MAX:
                continue
            if numeric_constant(tensor, self.context.names) is None and (
                self.context.dtypes.of(node) in (FP16, LOW)
            ):
                self.report(node, value=f"{value:g}", op=ARITHMETIC_OPS[node.op])
            return

    def visit_assign(self, node: nodes.Assign) -> None:
        value = numeric_constant(node.value, self.context.names)
        if value is None or not math.isfinite(value) or abs(value) <= FP16_MAX:
            return
        for target in node.targets:
            if not isinstance(target, nodes.Subscript) or _keyed_by_string(target):
                continue
            if self._python_container(target.value) or self._index_fill(target.value, node.value):
                continue
            if self._can_be_fp16(node, target.value, None):
                self.report(node, value=f"{value:g}", op="an indexed assignment")
                return

    def _index_fill(self, target: Optional[nodes.NodeNG], value: Optional[nodes.NodeNG]) -> bool:
        """An integer written into a tensor named for indices (``input_ids.masked_fill(m,
        128001)``, ``token_idx.new_full(n, 100000)``): a token id or index, not a float."""
        key = expression_key(target) if target is not None else None
        words = name_words(key.rsplit(".", 1)[-1]) if key is not None else []
        if not words or words[-1] not in INDEX_NAME_WORDS:
            return False
        while isinstance(value, nodes.UnaryOp) and value.op in ("-", "+"):
            value = value.operand
        if isinstance(value, nodes.Name):
            values = self.context.names.assigned_values(value) or []
            value = values[0] if len(values) == 1 else None
        return (
            isinstance(value, nodes.Const)
            and isinstance(value.value, int)
            and not isinstance(value.value, bool)
        )

    def _python_container(self, expr: nodes.NodeNG) -> bool:
        """``expr`` is bound to a list, dict, set or numpy array (``t.cpu().numpy()``), not a
        tensor."""
        names = self.context.names
        for value in names.bound_values(expr) or ():
            if isinstance(value, nodes.BinOp):  # ``[0.0] * n``, ``np.ones(n) * 5``
                value = value.right if isinstance(value.right, CONTAINER_NODES) else value.left
            if isinstance(value, CONTAINER_NODES):
                return True
            if not isinstance(value, nodes.Call):
                continue
            func = value.func
            if method_call(value)[0] in TO_PYTHON_METHODS:
                return True
            if isinstance(func, nodes.Name) and func.name in BUILTIN_CONTAINERS:
                return names.builtin_name(func) is not None
            qualname = names.callee_qualname(value) or ""
            if qualname in CONTAINER_FACTORIES or qualname.startswith("numpy."):
                return True
        return False

    def _fill(
        self, node: nodes.Call
    ) -> Optional[
        Tuple[str, Optional[nodes.NodeNG], Optional[nodes.NodeNG], Optional[nodes.NodeNG]]
    ]:
        """``(op, tensor filled, fill value, dtype=)`` of a fill call; None for other calls."""
        if attribute_not_in(node.func, FILL_NAMES):
            return None  # cheap test before name resolution
        callee = self.context.names.callee(node)
        qualname = callee.qualname if callee is not None and not callee.instance else None
        dtype = next((kw.value for kw in node.keywords or () if kw.arg == "dtype"), None)
        if qualname is None:
            method, receiver = method_call(node)
            if method not in FILL_METHODS:
                return None
            position, keyword = FILL_METHODS[method]
            return method, receiver, call_argument(node, position, keyword), dtype
        if qualname == "torch.full":
            return "torch.full", None, call_argument(node, 1, "fill_value"), dtype
        if qualname in TORCH_FILLS:
            op, position, keyword = TORCH_FILLS[qualname]
            filled = call_argument(node, 0, "input")
            return op, filled, call_argument(node, position, keyword), dtype
        if qualname == "torch.where" and len(node.args) == 3:
            numbers = [numeric_constant(arg, self.context.names) for arg in node.args[1:]]
            if numbers.count(None) == 1:  # two numbers make a default-dtype (fp32) tensor
                value, other = node.args[1:] if numbers[0] is not None else node.args[:0:-1]
                return "torch.where", other, value, None
        return None

    def _can_be_fp16(
        self, node: nodes.NodeNG, target: Optional[nodes.NodeNG], dtype_node: Optional[nodes.NodeNG]
    ) -> bool:
        dtypes = self.context.dtypes
        if dtype_node is not None:
            kind = dtypes.named_kind(dtype_node)
        elif target is None:
            kind = FP32  # ``torch.full`` without ``dtype=`` uses the default dtype
        else:
            kind = dtypes.of(target)
        if kind in (FP16, LOW):
            return True
        if kind in (FP32, BF16, INT):
            return False
        typed = target if dtype_node is None else _dtype_owner(dtype_node)
        possible = dtypes.kinds(typed) if typed is not None else None
        if possible is not None and not possible & {FP16, LOW}:
            return False  # fp32 on one path, bf16 on another: never fp16
        region = self.context.regions.autocast_at(node)
        no_grad = self.context.grad.no_grad_at(node)
        if region is not None:
            if region.dtype == BF16 or self._made_fp32(typed, region):
                return False
            # in a function the region's code calls, under no_grad: as outside a region
            return not (no_grad and not region.node.parent_of(node))
        # Unknown dtype outside a region: model code's activations may arrive in fp16 from the
        # caller's autocast; under no_grad there are none (targets, matching costs, masks).
        return _in_model_code(node, self.context.grad) and not no_grad

    def _made_fp32(self, tensor: Optional[nodes.NodeNG], region) -> bool:
        """Every value ``tensor`` holds comes from an op CUDA autocast runs in fp32
        (``logp = F.log_softmax(...)``) in a region that is not CPU autocast's (an unknown
        device counts as CUDA, as for AMP004); the dtype flow leaves it unknown where only
        evaluation code, without gradients, runs it."""
        if tensor is None or region.device == CPU:
            return False
        values = (self.context.names.assigned_values(tensor) if isinstance(tensor, nodes.Name)
                  else [tensor])
        return bool(values) and all(
            self.context.dtypes.op_name(value) in CUDA_FP32_OPS for value in values)


def _dtype_owner(dtype_node: nodes.NodeNG) -> Optional[nodes.NodeNG]:
    """``q`` for ``dtype=q.dtype``."""
    if isinstance(dtype_node, nodes.Attribute) and dtype_node.attrname == "dtype":
        return dtype_node.expr
    return None


def _keyed_by_string(subscript: nodes.Subscript) -> bool:
    """``stats["best"] = ...``: tensors are not indexed by strings, mappings are."""
    key = subscript.slice
    return isinstance(key, nodes.Const) and isinstance(key.value, str)


def _in_model_code(node: nodes.NodeNG, grad) -> bool:
    """In the forward pass of a model class (``GradContext.in_forward_pass``), or in a function
    of a module that defines one. A model's other methods -- target assignment
    (``areas[outside] = INF`` before ``areas.min()``), beam search, initialisation --
    work on tensors of their own dtype, not on whatever the caller's autocast produces."""
    parent = node.parent
    in_function = False
    method = None
    while parent is not None:
        if isinstance(parent, nodes.ClassDef):
            return grad.in_forward_pass(method)
        if isinstance(parent, nodes.FunctionDef):
            in_function = True
            method = parent
        parent = parent.parent
    module = node.root()
    return in_function and any(
        is_model_class(statement)
        for statement in module.body
        if isinstance(statement, nodes.ClassDef)
    )
