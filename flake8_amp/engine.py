"""The one walk over a module: every enabled rule sees every node through its hooks.

A rule is a :class:`Check` subclass with ``visit_<nodeclass>`` methods (``visit_call``,
``visit_with``, ``visit_assign``... named after astroid's node classes, lower case)
and an optional ``finish``. The walk dispatches each node to the hooks that want it, in
source order; rules never walk the tree themselves. Shared analyses hang off the
per-module :class:`Context` and are built lazily, the first time a rule asks.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, Iterable, Iterator, List, Sequence, Tuple, Type

from astroid import nodes
from astroid.manager import AstroidManager
from astroid.rebuilder import TreeRebuilder

from flake8_amp import catalog
from flake8_amp.analysis.context import GradContext
from flake8_amp.analysis.dtypes import Dtypes
from flake8_amp.analysis.names import Names
from flake8_amp.analysis.regions import Regions


@dataclass(frozen=True)
class Options:
    """User configuration (flake8 options ``--amp-*``), already validated."""

    #: Extra qualified names (or bare function names) of callables that open autocast regions.
    autocast_functions: FrozenSet[str] = frozenset()
    #: Extra qualified names (or bare names) of loss callables.
    loss_functions: FrozenSet[str] = frozenset()
    #: Extra whole words marking inference/export code (added to the built-in ones).
    inference_words: FrozenSet[str] = frozenset()


@dataclass(frozen=True)
class Finding:
    line: int
    col: int
    code: str
    message: str


class Context:
    """One module under analysis, with lazily built, cached shared analyses."""

    def __init__(self, module: nodes.Module, filename: str = "", options: Options = Options()):
        self.module = module
        self.filename = filename
        self.options = options
        self._nodes_by_class: Dict[type, List[nodes.NodeNG]] = {}

    @functools.cached_property
    def nodes(self) -> List[nodes.NodeNG]:
        """Every node of the module in source (pre-)order: the one walk that the rules'
        hooks and the analyses' module-wide searches share."""
        return list(walk(self.module))

    def nodes_of(self, node_class: Type[nodes.NodeNG]) -> List[nodes.NodeNG]:
        """The module's nodes of ``node_class`` (subclasses included), in source order."""
        found = self._nodes_by_class.get(node_class)
        if found is None:
            found = self._nodes_by_class[node_class] = [
                node for node in self.nodes if isinstance(node, node_class)
            ]
        return found

    @functools.cached_property
    def names(self) -> Names:
        """Qualified names, call targets, assignments (:mod:`flake8_amp.analysis.names`)."""
        return Names(self)

    @functools.cached_property
    def regions(self) -> Regions:
        """Autocast regions (:mod:`flake8_amp.analysis.regions`)."""
        return Regions(self)

    @functools.cached_property
    def grad(self) -> GradContext:
        """no_grad blocks, inference and training code (:mod:`flake8_amp.analysis.context`)."""
        return GradContext(self)

    @functools.cached_property
    def dtypes(self) -> Dtypes:
        """Dtype of expressions (:mod:`flake8_amp.analysis.dtypes`)."""
        return Dtypes(self)


class Check:
    """Base class of a rule: set ``code`` and ``triggers``, write hooks.

    ``triggers`` are substrings of which at least one must occur in a file for the rule
    to be worth running (override :meth:`applies` for more); files no rule applies to
    are skipped before astroid is built.
    """

    code: str = ""
    triggers: Tuple[str, ...] = ()

    @classmethod
    def applies(cls, source: str, options: Options) -> bool:
        """Cheap pre-check on the raw source: can this rule find anything in it?"""
        return any(word in source for word in cls.triggers)

    def __init__(self, context: Context, findings: List[Finding]):
        self.context = context
        self._findings = findings

    def report(self, node: nodes.NodeNG, **fields: object) -> None:
        """Record a finding at ``node`` with the catalog message filled from ``fields``."""
        message = catalog.rule(self.code).format(**fields)
        self._findings.append(Finding(node.lineno or 1, node.col_offset or 0, self.code, message))

    @staticmethod
    def source_text(node: nodes.NodeNG, limit: int = 40) -> str:
        """``node`` as source, shortened for a message."""
        text = " ".join(node.as_string().split())
        return text if len(text) <= limit else text[: limit - 3] + "..."

    def finish(self) -> None:
        """Called once after the walk; override for module-level conclusions."""


Hook = Callable[[nodes.NodeNG], None]


def _hooks_by_node_class(checks: Iterable[Check]) -> Dict[str, List[Hook]]:
    hooks: Dict[str, List[Hook]] = {}
    for check in checks:
        for attr in dir(type(check)):
            if attr.startswith("visit_"):
                hooks.setdefault(attr.removeprefix("visit_"), []).append(getattr(check, attr))
    return hooks


def walk(module: nodes.Module) -> Iterator[nodes.NodeNG]:
    """Every node in source (pre-)order, iteratively so deep nesting cannot overflow."""
    stack: List[nodes.NodeNG] = [module]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(list(node.get_children())))


def run_checks(context: Context, check_classes: Sequence[Type[Check]]) -> List[Finding]:
    """Run ``check_classes`` over ``context.module`` in one walk; findings sorted by position."""
    findings: List[Finding] = []
    checks = [cls(context, findings) for cls in check_classes]
    hooks = _hooks_by_node_class(checks)
    node_kind: Dict[type, str] = {}
    for node in context.nodes:
        kind = node_kind.get(type(node))
        if kind is None:
            kind = node_kind[type(node)] = type(node).__name__.lower()
        for hook in hooks.get(kind, ()):
            hook(node)
    for check in checks:
        check.finish()
    unique = {(f.line, f.col, f.code): f for f in findings}
    return sorted(unique.values(), key=lambda f: (f.line, f.col, f.code))


def build_module(tree: ast.Module, source: str, filename: str = "") -> nodes.Module:
    """An astroid module from an already parsed ``ast`` tree, without any inference.

    ``astroid.parse`` would run astroid's post-build steps, which infer the target of
    every attribute assignment (``torch.backends.cudnn.benchmark = True`` makes astroid
    import and parse torch: seconds per process) and apply brain transforms. Building
    with the tree rebuilder alone keeps the linter torch-free and fast (it also skips
    building astroid's model of ``builtins``); ``from x import y`` names are then added
    to scope locals here, as astroid would (star imports are left out: resolving them
    means importing the module).
    """
    rebuilder = TreeRebuilder(AstroidManager(), data=source)
    module = rebuilder.visit_module(tree, "", filename or "<unknown>", False)
    for import_from, global_names in rebuilder._import_from_nodes:
        for name, alias in import_from.names:
            if name == "*":
                continue
            local = alias or name
            owner = module if local in global_names else import_from.parent
            owner.set_local(local, import_from)
            owner.scope().locals[local].sort(key=lambda node: node.fromlineno or 0)
    return module


def mentions_autocast(source: str, options: Options) -> bool:
    """The source may open an autocast region (for :meth:`Check.applies`)."""
    return "autocast" in source or any(
        name.rsplit(".", 1)[-1] in source for name in options.autocast_functions
    )
