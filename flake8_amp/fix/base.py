"""What the fixers share: one file seen both by the linter (astroid) and by libcst.

The linter decides *where* and *what* (its findings, its name resolution and scaler
flow); libcst, with position metadata, finds the same node in a tree that keeps every
comment and space, and rewrites it. A fixer never fixes a node the linter did not report.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Type, TypeVar

import libcst as cst
from astroid import nodes
from libcst.metadata import (
    MetadataWrapper,
    ParentNodeProvider,
    PositionProvider,
    ScopeProvider,
)

from flake8_amp.engine import Context, Finding, walk

Node = TypeVar("Node", bound=cst.CSTNode)
Rewrite = Callable[[cst.CSTNode], cst.CSTNode]


@dataclass(frozen=True)
class Edit:
    """Replace ``node`` (of the original libcst tree) by ``rewrite(updated node)``.

    A function rather than a finished node, so that edits of nested nodes compose: each
    one rewrites the node as the edits inside it have already left it.
    """

    node: cst.CSTNode
    rewrite: Rewrite


@dataclass(frozen=True)
class Insertion:
    """Insert ``statement`` right before ``before``, a statement of an indented block or of
    the module body; the new statement takes over ``before``'s leading comments and blank
    lines, so a comment above the old line now heads both."""

    before: cst.BaseStatement
    statement: cst.BaseStatement


@dataclass
class Plan:
    """What a fixer will do to one file, and which of its findings it leaves alone (why)."""

    edits: List[Edit] = field(default_factory=list)
    insertions: List[Insertion] = field(default_factory=list)
    fixed: List[Finding] = field(default_factory=list)
    left_alone: List[Tuple[Finding, str]] = field(default_factory=list)

    def leave(self, finding: Finding, reason: str) -> None:
        self.left_alone.append((finding, reason))

    def extend(self, other: "Plan") -> None:
        self.edits += other.edits
        self.insertions += other.insertions
        self.fixed += other.fixed
        self.left_alone += other.left_alone


class SourceFile:
    """One module: its linter context and its libcst tree with positions, parents, scopes."""

    def __init__(self, source: str, tree: cst.Module, context: Context):
        self.context = context
        self.names = context.names
        self._lines = source.splitlines()
        self.wrapper = MetadataWrapper(tree)
        self.module = self.wrapper.module
        self.positions = self.wrapper.resolve(PositionProvider)
        self.parents = self.wrapper.resolve(ParentNodeProvider)
        self.scopes = self.wrapper.resolve(ScopeProvider)
        self._starts: Dict[Tuple[int, int], List[cst.CSTNode]] = {}
        for node, where in self.positions.items():
            self._starts.setdefault((where.start.line, where.start.column), []).append(node)

    # -- finding -> nodes ----------------------------------------------------------------

    def char_column(self, line: int, byte_column: int) -> int:
        """astroid (like ``ast``) counts columns in UTF-8 bytes, libcst in characters."""
        text = self._lines[line - 1] if 0 < line <= len(self._lines) else ""
        return len(text.encode("utf-8")[:byte_column].decode("utf-8", errors="ignore"))

    def cst_at(self, finding: Finding, kinds: Tuple[Type[Node], ...]) -> List[Node]:
        """The libcst nodes of ``kinds`` that start where ``finding`` points."""
        start = (finding.line, self.char_column(finding.line, finding.col))
        return [node for node in self._starts.get(start, ()) if isinstance(node, kinds)]

    def astroid_at(self, finding: Finding, kinds: Tuple[type, ...]) -> List[nodes.NodeNG]:
        """The astroid nodes of ``kinds`` that start where ``finding`` points."""
        at = self._astroid_starts.get((finding.line, finding.col), ())
        return [node for node in at if isinstance(node, kinds)]

    @functools.cached_property
    def _astroid_starts(self) -> Dict[Tuple[int, int], List[nodes.NodeNG]]:
        starts: Dict[Tuple[int, int], List[nodes.NodeNG]] = {}
        for node in walk(self.context.module):
            if node.lineno is not None and node.col_offset is not None:
                starts.setdefault((node.lineno, node.col_offset), []).append(node)
        return starts

    def cst_for(self, node: nodes.NodeNG, kinds: Tuple[Type[Node], ...]) -> Optional[Node]:
        """The libcst node of ``kinds`` that spans exactly the source of astroid's ``node``
        (None where parentheses or a different shape make them differ)."""
        if node.end_lineno is None or node.end_col_offset is None:
            return None
        start = (node.lineno, self.char_column(node.lineno, node.col_offset))
        end = (node.end_lineno, self.char_column(node.end_lineno, node.end_col_offset))
        found = [
            candidate
            for candidate in self._starts.get(start, ())
            if isinstance(candidate, kinds) and _end(self.positions[candidate]) == end
        ]
        return found[0] if len(found) == 1 else None

    def outermost(self, candidates: Sequence[Node]) -> Optional[Node]:
        """The candidate that ends last: of nodes starting at one place, the enclosing one."""
        if not candidates:
            return None
        return max(candidates, key=lambda node: _end(self.positions[node]))

    def parent(self, node: cst.CSTNode) -> Optional[cst.CSTNode]:
        return self.parents.get(node)

    def line_of(self, node: cst.CSTNode) -> int:
        return self.positions[node].start.line

    def code(self, node: cst.CSTNode) -> str:
        return self.module.code_for_node(node)

    # -- names ---------------------------------------------------------------------------

    def torch_name(self, at: cst.CSTNode) -> Optional[str]:
        """The name bound to the ``torch`` module where ``at`` runs (``th`` after
        ``import torch as th``), when exactly one import binds it there; else None."""
        scope = self.scopes.get(at)
        if scope is None:
            return None
        candidates = {
            name
            for statement in _module_imports(self.module)
            for name in _torch_bindings(statement)
        }
        for name in sorted(candidates, key=lambda n: n != "torch"):
            bound = [assignment.node for assignment in scope[name]]
            if bound and all(
                isinstance(node, cst.Import) and name in _torch_bindings(node) for node in bound
            ):
                return name
        return None


def dotted(node: cst.CSTNode) -> str:
    """``a.b.c`` for a name or attribute chain of names; '' for anything else."""
    parts = []
    while isinstance(node, cst.Attribute):
        parts.append(node.attr.value)
        node = node.value
    if not isinstance(node, cst.Name):
        return ""
    parts.append(node.value)
    return ".".join(reversed(parts))


def _module_imports(module: cst.Module) -> Iterable[cst.Import]:
    for statement in module.body:
        if isinstance(statement, cst.SimpleStatementLine):
            for small in statement.body:
                if isinstance(small, cst.Import):
                    yield small


def _torch_bindings(statement: cst.Import) -> List[str]:
    """Names that ``statement`` binds to the torch package: ``torch`` for ``import torch``
    and ``import torch.nn``, ``th`` for ``import torch as th``."""
    found = []
    for alias in statement.names:
        module = dotted(alias.name)
        if module == "torch" and alias.asname is not None:
            if isinstance(alias.asname.name, cst.Name):
                found.append(alias.asname.name.value)
        elif (module == "torch" or module.startswith("torch.")) and alias.asname is None:
            found.append("torch")
    return found


def _end(where) -> Tuple[int, int]:
    return where.end.line, where.end.column


def string_literal(text: str) -> cst.SimpleString:
    """``"text"`` as a libcst string (the fixes only ever write short ASCII words)."""
    return cst.SimpleString(f'"{text}"')
