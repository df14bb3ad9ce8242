"""AMP007 fix: a fill literal beyond fp16's range to ``torch.finfo(<tensor>.dtype).min/max``.

``scores.masked_fill(mask, -1e9)`` becomes ``scores.masked_fill(mask,
torch.finfo(scores.dtype).min)``: the most negative value of whatever dtype the tensor
has, -65504 in fp16 and -3.4e38 in fp32 and bf16 (``.max`` for positive literals). The
fill shapes are the rule's own (``Fp16OverflowLiteral._fill``), so every fill the rule
reports can be fixed; ``torch.full(..., dtype=d)`` and fills given ``dtype=`` use
``torch.finfo(d)``. The module's own name for torch is used (``import torch as th``).

Left alone: a tensor or dtype that is not a name or attribute chain (``x.float()``:
naming it twice would compute it twice), a value that is not written at the fill (a
constant such as ``NEG_INF = -1e9`` may be used elsewhere), integer literals (the
tensor may hold integers, where ``finfo`` raises), and modules that do not import torch.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import libcst as cst
from astroid import nodes

from flake8_amp.engine import Finding
from flake8_amp.fix.base import Edit, Plan, SourceFile, dotted
from flake8_amp.analysis.constants import numeric_constant
from flake8_amp.rules.amp007 import Fp16OverflowLiteral


def plan(source: SourceFile, findings: Sequence[Finding]) -> Plan:
    result = Plan()
    rule = Fp16OverflowLiteral(source.context, [])
    for finding in findings:
        fix = _fix(source, rule, finding)
        if isinstance(fix, str):
            result.leave(finding, fix)
        else:
            result.edits.append(fix)
            result.fixed.append(finding)
    return result


def _fix(source: SourceFile, rule: Fp16OverflowLiteral, finding: Finding) -> Union[Edit, str]:
    fills = [fill for fill in (_fill(rule, node) for node in _reported(source, finding)) if fill]
    if len(fills) != 1:
        return "the reported fill could not be located in the source"
    target, value, dtype = fills[0]
    number = numeric_constant(value, source.names)
    written = source.cst_for(value, (cst.BaseExpression,))
    torch = source.torch_name(written) if written is not None else None
    if torch is None:
        return "the module does not import torch under a name usable here"
    if number is None or not _written_float(written, torch):
        return (
            "the value is not a float written at the fill; change it where it is "
            "defined (an integer may fill an integer tensor, where finfo fails)"
        )
    described = _chain_text(source, dtype if dtype is not None else target)
    if described is None:
        return (
            "the filled tensor (or its dtype=) is not a name or attribute chain: naming it "
            "twice could compute it twice"
        )
    finfo_of = described if dtype is not None else f"{described}.dtype"
    limit = "min" if number < 0 else "max"
    replacement = cst.parse_expression(f"{torch}.finfo({finfo_of}).{limit}")
    return Edit(written, lambda _: replacement)


def _chain_text(source: SourceFile, expr: Optional[nodes.NodeNG]) -> Optional[str]:
    """``x`` / ``self.scores`` / ``torch.float16`` as written; None for other expressions."""
    written = source.cst_for(expr, (cst.BaseExpression,)) if expr is not None else None
    return (dotted(written) or None) if written is not None else None


def _reported(source: SourceFile, finding: Finding):
    return source.astroid_at(finding, (nodes.Call, nodes.Assign))


def _fill(
    rule: Fp16OverflowLiteral, node: nodes.NodeNG
) -> Optional[Tuple[Optional[nodes.NodeNG], nodes.NodeNG, Optional[nodes.NodeNG]]]:
    """``(tensor, value, dtype=)`` of a fill the rule judges: a call, or ``t[i] = value``."""
    if isinstance(node, nodes.Call):
        fill = rule._fill(node)
        if fill is None or fill[2] is None:
            return None
        _, target, value, dtype = fill
        return target, value, dtype
    if len(node.targets) == 1 and isinstance(node.targets[0], nodes.Subscript):
        return node.targets[0].value, node.value, None
    return None


def _written_float(expr: cst.BaseExpression, torch: str) -> bool:
    """A float written out at the fill: ``-1e9``, ``float("-1e9")``, ``float(-1e9)`` or
    ``torch.finfo(torch.float32).min`` (no names, no integers, no arithmetic)."""
    if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, (cst.Minus, cst.Plus)):
        return _written_float(expr.expression, torch)
    if isinstance(expr, cst.Call) and dotted(expr.func) == "float" and len(expr.args) == 1:
        argument = expr.args[0].value
        return isinstance(argument, cst.SimpleString) or _written_float(argument, torch)
    if isinstance(expr, cst.Attribute) and isinstance(expr.value, cst.Call):
        return dotted(expr.value.func) == f"{torch}.finfo" and expr.attr.value in ("min", "max")
    return isinstance(expr, cst.Float)
