"""Numbers an expression always evaluates to: fill values, epsilons, Python scalars.

``-1e9``, ``-2 ** 32 + 1``, ``float("-1e9")``, ``torch.finfo(torch.float32).min``, a 0-dim
``torch.tensor(-1e9)`` (it takes the dtype of the tensor it meets, as a Python number does),
and names or ``self`` attributes bound only to such numbers. Used for the values AMP007 and
AMP011 judge, and by the dtype flow to tell Python numbers from tensors.
"""

from __future__ import annotations

from typing import Optional

from astroid import nodes


#: ``torch.finfo`` of these is far beyond fp16's range (fp32's max is used for all of them).
WIDE_DTYPES = frozenset({"torch.float32", "torch.float", "torch.float64", "torch.double"})
#: Calls that wrap one number in a 0-dim tensor.
SCALAR_TENSORS = frozenset({"torch.tensor", "torch.as_tensor", "torch.scalar_tensor"})
FP32_MAX = 3.4028234663852886e38
_MAX_DEPTH = 6
_MAX_EXPONENT = 1024


def numeric_constant(expr: Optional[nodes.NodeNG], names, _depth: int = 0) -> Optional[float]:
    """The number ``expr`` always evaluates to (see the module docstring); None otherwise."""
    if expr is None or _depth > _MAX_DEPTH:
        return None
    if isinstance(expr, nodes.Const):
        value = expr.value
        return (
            float(value)
            if isinstance(value, (int, float)) and not isinstance(value, bool)
            else None
        )
    if isinstance(expr, nodes.UnaryOp) and expr.op in ("-", "+"):
        operand = numeric_constant(expr.operand, names, _depth + 1)
        return None if operand is None else (-operand if expr.op == "-" else operand)
    if isinstance(expr, nodes.Call):
        return _call_value(expr, names, _depth)
    if isinstance(expr, nodes.Attribute) and expr.attrname in ("min", "max"):
        limit = _fp32_finfo_limit(expr.expr, names)
        if limit is not None:
            return -limit if expr.attrname == "min" else limit
    if isinstance(expr, nodes.BinOp):
        return _fold(
            expr.op,
            numeric_constant(expr.left, names, _depth + 1),
            numeric_constant(expr.right, names, _depth + 1),
        )
    values = names.bound_values(expr)
    found = {numeric_constant(value, names, _depth + 1) for value in values or ()}
    return found.pop() if len(found) == 1 else None


def _call_value(call: nodes.Call, names, depth: int) -> Optional[float]:
    """``float(-1e9)``, ``float("-1e9")`` (``float("-inf")`` is not finite: callers skip it),
    and ``torch.tensor(-1e9)`` (one number, any ``device=``/``dtype=``)."""
    if len(call.args) != 1:
        return None
    arg = call.args[0]
    if isinstance(call.func, nodes.Name) and call.func.name == "float":
        if call.keywords or names.bindings(call.func):
            return None  # not the builtin
        if isinstance(arg, nodes.Const) and isinstance(arg.value, str):
            try:
                return float(arg.value)
            except ValueError:
                return None
        return numeric_constant(arg, names, depth + 1)
    if names.qualname(call.func) in SCALAR_TENSORS:
        return numeric_constant(arg, names, depth + 1)
    return None


def _fp32_finfo_limit(expr: nodes.NodeNG, names) -> Optional[float]:
    """fp32's largest value for ``torch.finfo(torch.float32)`` (or wider dtypes: no less)."""
    if (
        not isinstance(expr, nodes.Call)
        or len(expr.args) != 1
        or names.qualname(expr.func) != "torch.finfo"
    ):
        return None
    return FP32_MAX if names.qualname(expr.args[0]) in WIDE_DTYPES else None


def _fold(op: str, left: Optional[float], right: Optional[float]) -> Optional[float]:
    if left is None or right is None:
        return None
    try:
        if op == "+":
            return left + right
        if op == "-":
            return left - right
        if op == "*":
            return left * right
        if op == "/":
            return left / right
        if op == "**" and abs(right) <= _MAX_EXPONENT:
            return float(left**right)
    except (ArithmeticError, TypeError):
        return None
    return None
