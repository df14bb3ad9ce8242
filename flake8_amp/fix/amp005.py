"""AMP005 fix: ``scaler.unscale_(optimizer)`` right before the clip that needs it (the clip
function, FSDP's ``model.clip_grad_norm_()``, or the call of a helper of the file that clips).

Inserted only where the right call is certain, from the linter's scaler flow of the
function: it uses one GradScaler, which steps one optimizer; every path to the clip ran
a scaled backward (or none did: the backward is in another method); nothing in the
function unscales already (a second ``unscale_`` in one step raises); the clip is a
statement of its own, and a later statement of the same block runs ``scaler.step`` with
that optimizer, so the new line runs once per step, before the step; neither name is
rebound in between. Several clips before one step get one ``unscale_``, before the first.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Union

import libcst as cst
from astroid import nodes

from flake8_amp.analysis.names import method_call
from flake8_amp.analysis.scaler import (
    SCALED,
    ScalerFlow,
    calls_in_order,
    expression_key,
    scaler_analysis,
)
from flake8_amp.engine import Finding
from flake8_amp.fix.base import Insertion, Plan, SourceFile
from flake8_amp.rules.amp005 import clip_kind

#: Statements that may hold the clip as their whole value.
CLIP_STATEMENTS = (cst.Expr, cst.Assign, cst.AnnAssign)
#: Compound statements whose body runs at most once each time the statement runs.
ONCE_PER_PASS = (cst.If, cst.Else, cst.With, cst.Try)


def plan(source: SourceFile, findings: Sequence[Finding]) -> Plan:
    result = Plan()
    # One insertion per (block, scaler, optimizer, step it precedes), before its first clip.
    groups: Dict[Tuple, List[Tuple[Finding, cst.SimpleStatementLine, str]]] = {}
    for finding in findings:
        found = _clip(source, finding)
        if isinstance(found, str):
            result.leave(finding, found)
            continue
        statement, block, scaler, optimizer, step = found
        groups.setdefault((id(block), scaler, optimizer, step), []).append(
            (finding, statement, f"{scaler}.unscale_({optimizer})")
        )
    for members in groups.values():
        first = min(members, key=lambda member: source.line_of(member[1]))
        new = cst.parse_statement(first[2], config=source.module.config_for_parsing)
        result.insertions.append(Insertion(first[1], new))
        result.fixed += [finding for finding, _, _ in members]
    return result


def _clip(source: SourceFile, finding: Finding) -> Union[Tuple, str]:
    """``(statement, block, scaler, optimizer, step call)`` for the reported clip, or why
    the fix is not certain."""
    clips = [
        call
        for call in source.astroid_at(finding, (nodes.Call,))
        if clip_kind(source.context, call) is not None
    ]
    if len(clips) != 1:
        return "the reported clip could not be located in the source"
    clip = clips[0]
    flow = scaler_analysis(source.context).flow(clip)
    if len(flow.scalers) != 1:
        return "the function uses several GradScalers: which one scaled these gradients is unclear"
    (scaler,) = flow.scalers
    steps = [call for call in flow.scaler_steps if expression_key(call.func.expr) == scaler]
    optimizers = {expression_key(call.args[0]) if call.args else None for call in steps}
    if len(optimizers) != 1 or None in optimizers:
        return "the scaler does not step exactly one optimizer named in this function"
    (optimizer,) = optimizers
    if any(method_call(call)[0] == "unscale_" for call in calls_in_order(flow.scope)):
        return "the function already calls unscale_ on some path (twice in one step raises)"
    phases = flow.phases_before(clip)
    if phases != {SCALED} and phases != {None}:
        return "not every path to the clip ran a scaled backward"
    placed = _statement(source, clip)
    if isinstance(placed, str):
        return placed
    statement, block = placed
    step = _next_step(source, clip, steps, statement, block)
    if step is None:
        return (
            f"no later statement runs {scaler}.step({optimizer}) once per pass through the "
            "clip: the new line could run more often than the step, or after it"
        )
    if any(_between(call, clip, step) for call in flow.scaled_backwards):
        return "a scaled backward runs between the clip and the step"
    if _rebound(flow, (scaler, optimizer), clip, step):
        return f"{scaler} or {optimizer} is bound anew between the clip and the step"
    return statement, block, scaler, optimizer, step


def _statement(
    source: SourceFile, clip: nodes.Call
) -> Union[Tuple[cst.SimpleStatementLine, cst.CSTNode], str]:
    """The line holding the clip as its value, and the block that line is in."""
    call = source.cst_for(clip, (cst.Call,))
    small = source.parent(call) if call is not None else None
    line = source.parent(small) if small is not None else None
    block = source.parent(line) if line is not None else None
    if not (
        isinstance(small, CLIP_STATEMENTS)
        and small.value is call
        and isinstance(line, cst.SimpleStatementLine)
        and isinstance(block, (cst.IndentedBlock, cst.Module))
    ):
        return "the clip is not a statement of its own in an indented block"
    return line, block


def _next_step(
    source: SourceFile,
    clip: nodes.Call,
    steps: List[nodes.Call],
    statement: cst.SimpleStatementLine,
    block: cst.CSTNode,
) -> Optional[nodes.Call]:
    """The first ``scaler.step`` after the clip, when a later statement holds it that runs
    once each time the clip's line may run: a later statement of the clip's block, or of a
    block around it reached through ``if``/``elif``/``else``/``with``/``try`` bodies only
    (a loop in between would run the new line several times per step)."""
    later = [call for call in steps if _start(call) > _start(clip)]
    if not later:
        return None
    step = min(later, key=_start)
    current: cst.CSTNode = statement
    while isinstance(block, (cst.IndentedBlock, cst.Module)):
        siblings = list(block.body)
        for sibling in siblings[siblings.index(current) + 1:]:
            where = source.positions[sibling]
            if where.start.line <= step.lineno <= where.end.line:
                return step
        current = source.parent(block)
        while isinstance(current, (cst.If, cst.Else)) and isinstance(
            source.parent(current), (cst.If, cst.Else)
        ):
            current = source.parent(current)  # up an if/elif/else chain
        if not isinstance(current, ONCE_PER_PASS):
            return None
        block = source.parent(current)
    return None


def _start(node: nodes.NodeNG) -> Tuple[int, int]:
    return node.lineno or 0, node.col_offset or 0


def _between(node: nodes.NodeNG, first: nodes.NodeNG, last: nodes.NodeNG) -> bool:
    return _start(first) < _start(node) < _start(last)


def _rebound(flow: ScalerFlow, keys: Tuple[str, ...], clip: nodes.Call, step: nodes.Call) -> bool:
    """A name or attribute among ``keys`` (or the object it hangs on) is assigned between
    the clip and the step."""
    roots = {key.split(".")[0] for key in keys} | set(keys)
    for target in flow.scope.nodes_of_class((nodes.AssignName, nodes.AssignAttr)):
        if clip.lineno <= (target.lineno or 0) <= step.lineno and expression_key(target) in roots:
            return True
    return False
