"""AMP009 fix: deprecated ``torch.cuda.amp`` / ``torch.cpu.amp`` calls to ``torch.amp``.

Every argument keeps its meaning under torch.amp's signatures (PyTorch 2.4+):

- ``autocast(enabled, dtype, cache_enabled)`` becomes ``autocast(device_type, dtype,
  enabled, cache_enabled)``: the device goes first and positional arguments become
  keywords (a positional ``enabled`` would otherwise land on ``dtype``);
- ``GradScaler(init_scale, ...)`` becomes ``GradScaler(device, init_scale, ...)``: the
  device goes first and the other arguments keep their positions;
- ``custom_fwd`` / ``custom_bwd`` take a ``device_type="cuda"`` keyword; a bare decorator
  becomes a call.

``torch.cuda.amp.X`` (through any alias of ``torch``) is rewritten where it is written.
Names imported from the old modules (``from torch.cuda.amp import autocast``, ``from
torch.cuda import amp``, ``import torch.cuda.amp as amp``) are fixed by importing them
from ``torch.amp`` instead, and only when every use of every name the import binds is a
reported call this fixer rewrites: otherwise the new import would change code the fix
does not cover. Aliases (``ac = torch.cuda.amp.autocast``), ``functools.partial``
targets and ``*args`` spread into ``autocast`` are left alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Union

import libcst as cst
from astroid import nodes
from libcst.metadata import Assignment

from flake8_amp.engine import Finding
from flake8_amp.fix.base import Edit, Plan, Rewrite, SourceFile, dotted, string_literal
from flake8_amp.fix.calls import as_keyword, insert_argument, keyword
from flake8_amp.rules.amp009 import REPLACEMENTS

#: The deprecated modules and the device their API is for.
OLD_MODULES = {"torch.cuda.amp": "cuda", "torch.cpu.amp": "cpu"}
#: What ``torch.amp`` offers under the same names.
MODERN_NAMES = frozenset({"autocast", "GradScaler", "custom_fwd", "custom_bwd"})
#: The deprecated autocast's parameters, in order (``torch.cuda.amp.autocast.__init__``).
OLD_AUTOCAST_PARAMETERS = ("enabled", "dtype", "cache_enabled")
OLD_SCALER_PARAMETERS = frozenset(
    {"init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled"}
)


@dataclass(frozen=True)
class Use:
    """One reported use and its rewrite; ``imported`` is the import that binds its name
    (None when the use spells ``torch.cuda.amp`` out and is rewritten in place)."""

    finding: Finding
    root: cst.CSTNode
    edit: Edit
    imported: Optional[cst.CSTNode]


def plan(source: SourceFile, findings: Sequence[Finding]) -> Plan:
    result = Plan()
    through_imports: Dict[cst.CSTNode, List[Use]] = {}
    for finding in findings:
        use = _use(source, finding)
        if isinstance(use, str):
            result.leave(finding, use)
        elif use.imported is None:
            result.edits.append(use.edit)
            result.fixed.append(finding)
        else:
            through_imports.setdefault(use.imported, []).append(use)
    for imported, uses in through_imports.items():
        blocker = _import_blocker(source, imported, uses)
        if blocker is not None:
            for use in uses:
                result.leave(use.finding, blocker)
            continue
        result.edits += [use.edit for use in uses]
        result.edits.append(Edit(imported, _modern_import))
        result.fixed += [use.finding for use in uses]
    return result


def _use(source: SourceFile, finding: Finding) -> Union[Use, str]:
    """The rewrite of one reported use, or why it is left alone."""
    names = source.names
    reported = [
        node
        for node in source.astroid_at(finding, (nodes.Attribute, nodes.Name))
        if names.qualname(node) in REPLACEMENTS
    ]
    written = source.outermost(source.cst_at(finding, (cst.Attribute, cst.Name)))
    if len(reported) != 1 or written is None or dotted(written) != reported[0].as_string():
        return "the reported name could not be located in the source"
    old = names.qualname(reported[0]) or ""
    module, api = old.rsplit(".", 1)
    device = OLD_MODULES[module]

    imported: Optional[cst.CSTNode] = None
    func_rewrite: Rewrite = _unchanged
    if _spelled_out(reported[0], names):
        func_rewrite = _modern_chain
    else:
        imported = _binding_import(source, written)
        if imported is None:
            return f"`{source.code(written)}` is reached through another module alias"

    parent = source.parent(written)
    if isinstance(parent, cst.Call) and parent.func is written:
        args = _call_rewrite(api, device, parent)
        if isinstance(args, str):
            return args
        edit = Edit(parent, lambda call: args(call.with_changes(func=func_rewrite(call.func))))
    elif isinstance(parent, cst.Decorator) and api in ("custom_fwd", "custom_bwd"):
        edit = Edit(
            parent,
            lambda decorator: decorator.with_changes(
                decorator=cst.Call(
                    func=func_rewrite(decorator.decorator),
                    args=[keyword("device_type", string_literal(device))],
                )
            ),
        )
    else:
        return (
            f"only calls and decorators are rewritten; this {api} is passed on or bound "
            "to a name, whose calls may pass positional arguments"
        )
    return Use(finding, _root(written), edit, imported)


def _root(expr: cst.CSTNode) -> cst.CSTNode:
    """``torch`` of ``torch.cuda.amp.autocast``."""
    while isinstance(expr, cst.Attribute):
        expr = expr.value
    return expr


def _spelled_out(node: nodes.NodeNG, names) -> bool:
    """``<torch>.cuda.amp.X`` with ``<torch>`` any name of the torch module."""
    amp = node.expr if isinstance(node, nodes.Attribute) else None
    device = amp.expr if isinstance(amp, nodes.Attribute) else None
    return (
        isinstance(device, nodes.Attribute)
        and amp.attrname == "amp"
        and device.attrname in ("cuda", "cpu")
        and names.qualname(device.expr) == "torch"
    )


def _modern_chain(func: cst.CSTNode) -> cst.CSTNode:
    """``torch.cuda.amp.X`` -> ``torch.amp.X`` (dots and spacing as written)."""
    amp = func.value
    return func.with_changes(value=amp.with_changes(value=amp.value.value))


def _unchanged(func: cst.CSTNode) -> cst.CSTNode:
    return func


def _call_rewrite(api: str, device: str, call: cst.Call):
    """A function giving the torch.amp call's arguments, or why the call is left alone."""
    star = any(arg.star == "*" for arg in call.args)
    positional = [arg for arg in call.args if arg.keyword is None and not arg.star]
    keywords = {arg.keyword.value for arg in call.args if arg.keyword is not None}
    device_arg = cst.Arg(string_literal(device))
    if api == "autocast":
        if star:
            return "`*args` spread into autocast: which parameters they fill is unknown"
        if len(positional) > len(OLD_AUTOCAST_PARAMETERS) or not keywords <= set(
            OLD_AUTOCAST_PARAMETERS
        ):
            return "the call does not match autocast(enabled, dtype, cache_enabled)"

        def autocast_args(new: cst.Call) -> cst.Call:
            args = [
                as_keyword(arg, OLD_AUTOCAST_PARAMETERS[index]) if index < len(positional) else arg
                for index, arg in enumerate(new.args)
            ]
            return insert_argument(new.with_changes(args=args), 0, device_arg)

        return autocast_args
    if api == "GradScaler":
        if not keywords <= OLD_SCALER_PARAMETERS:
            return "the call does not match GradScaler's parameters"
        return lambda new: insert_argument(new, 0, device_arg)
    if "device_type" in keywords:
        return f"{api} already names a device_type"
    first_keyword = next(
        (i for i, arg in enumerate(call.args) if arg.keyword is not None or arg.star == "**"),
        len(call.args),
    )
    return lambda new: insert_argument(
        new, first_keyword, keyword("device_type", string_literal(device))
    )


def _binding_import(source: SourceFile, written: cst.CSTNode) -> Optional[cst.CSTNode]:
    """The import that binds the first name of ``written`` to an old module or to a name
    in one: the ``from`` statement, or the alias ``torch.cuda.amp as amp`` of an ``import``
    (only that alias is rewritten). None when it is bound otherwise, or not only there."""
    root = _root(written)
    if not isinstance(root, cst.Name):
        return None
    referents = _referents(source, root)
    if len(referents) != 1 or not isinstance(referents[0], Assignment):
        return None
    statement = referents[0].node
    if isinstance(statement, cst.ImportFrom) and not statement.relative:
        return statement
    if isinstance(statement, cst.Import):
        for alias in statement.names:
            if alias.asname is not None and _bound_name(alias) == root.value:
                return alias if dotted(alias.name) in OLD_MODULES else None
    return None


def _referents(source: SourceFile, name: cst.Name) -> list:
    scope = source.scopes.get(name)
    if scope is None:
        return []
    for access in scope.accesses[name.value]:
        if access.node is name:
            return list(access.referents)
    return []


def _bound_name(alias: cst.ImportAlias) -> str:
    if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
        return alias.asname.name.value
    return dotted(alias.name).split(".")[0]


def _import_blocker(source: SourceFile, imported: cst.CSTNode, uses: List[Use]) -> Optional[str]:
    """Why the import cannot move to torch.amp, or None when every use of every name it
    binds is one of ``uses``."""
    if isinstance(imported, cst.ImportFrom):
        module = dotted(imported.module) if imported.module is not None else ""
        if isinstance(imported.names, cst.ImportStar):
            return "a star import from the old module"
        aliases = list(imported.names)
        if module in OLD_MODULES:
            strays = [dotted(a.name) for a in aliases if dotted(a.name) not in MODERN_NAMES]
        elif module in ("torch.cuda", "torch.cpu"):
            strays = [dotted(a.name) for a in aliases if dotted(a.name) != "amp"]
        else:
            return "the name is imported from another module"
        if strays:
            return f"the import also brings {', '.join(strays)}, which torch.amp does not have"
        statement = imported
    else:
        aliases = [imported]
        statement = source.parent(imported)
    fixed_roots = {id(use.root) for use in uses}
    scope = source.scopes.get(statement)
    for alias in aliases:
        name = _bound_name(alias)
        assignments = [a for a in scope.assignments[name] if a.node is statement]
        for assignment in assignments:
            for access in assignment.references:
                if id(access.node) not in fixed_roots or len(access.referents) != 1:
                    return (
                        f"the import on line {source.line_of(statement)} binds `{name}`, also "
                        f"used on line {source.line_of(access.node)} where no fix applies"
                    )
    return None


def _modern_import(node: cst.CSTNode) -> cst.CSTNode:
    """``from torch.cuda.amp import X`` -> ``from torch.amp import X``; ``from torch.cuda
    import amp`` -> ``from torch import amp``; ``torch.cuda.amp as m`` -> ``torch.amp as m``."""
    torch_amp = cst.Attribute(value=cst.Name("torch"), attr=cst.Name("amp"))
    if isinstance(node, cst.ImportAlias):
        return node.with_changes(name=torch_amp)
    if dotted(node.module) in OLD_MODULES:
        return node.with_changes(module=torch_amp)
    return node.with_changes(module=cst.Name("torch"))
