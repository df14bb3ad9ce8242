"""AMP009 deprecated-amp-api: ``torch.cuda.amp`` / ``torch.cpu.amp`` spellings of ``torch.amp``.

Every use is reported where it is spelled (through imports and module aliases, not
through variables, so ``ac = torch.cuda.amp.autocast; ac()`` is one finding). A use is a
call, a decorator, a ``functools.partial`` target, an alias assignment, a return value
(a factory such as ``get_autocast(precision)``), a parameter's default
(``def f(scaler=torch.cuda.amp.GradScaler())``, ``ctx=torch.cuda.amp.autocast``) or a
keyword argument's value; comparisons, ``isinstance`` checks and collections of the old
classes (libraries that recognise both APIs) are not uses.

Code that picks the API by torch version stays silent: a ``try`` that also tries
``torch.amp`` (``except (AttributeError, ImportError, TypeError)``), either arm of an
``if``/conditional expression that tests the version (or ``hasattr``) and offers
``torch.amp`` somewhere, or offers it in its other arm (unless it tests the amp switch,
``if amp``, or the device, ``if device.type == "cuda"``: the old API runs on that device
today), and code after ``if <version test>: return <modern>``. A version test that
offers no ``torch.amp`` (``if TORCH_VERSION >= "1.6.0": from torch.cuda.amp import ...``)
chooses nothing: the deprecated API is what runs on current versions.
"""

from __future__ import annotations

import re
from typing import Iterable, Optional

from astroid import nodes

from flake8_amp.analysis.scaler import AMP_CONDITION, condition_key, other_arm
from flake8_amp.engine import Check

REPLACEMENTS = {
    "torch.cuda.amp.autocast": 'torch.amp.autocast("cuda", ...)',
    "torch.cpu.amp.autocast": 'torch.amp.autocast("cpu", ...)',
    "torch.cuda.amp.GradScaler": 'torch.amp.GradScaler("cuda", ...)',
    "torch.cpu.amp.GradScaler": 'torch.amp.GradScaler("cpu", ...)',
    "torch.cuda.amp.custom_fwd": 'torch.amp.custom_fwd(device_type="cuda")',
    "torch.cuda.amp.custom_bwd": 'torch.amp.custom_bwd(device_type="cuda")',
}
PARTIAL = frozenset({"functools.partial"})
#: Exceptions a version fallback catches.
FALLBACK_EXCEPTIONS = frozenset(
    {"AttributeError", "ImportError", "ModuleNotFoundError", "TypeError", "Exception"}
)
VERSION_TEST = re.compile(
    r"version|hasattr|getattr|torch_(ge|gt|le|lt)|_(ge|gt|le|lt)_\d|is_torch_", re.IGNORECASE
)

#: A test of the device: each arm runs on today's torch, for its device.
DEVICE_TEST = re.compile(r"device|\b(?:cuda|cpu|gpu|mps|xpu)\b|is_available", re.IGNORECASE)


class DeprecatedAmpApi(Check):
    """The device-specific AMP namespaces are deprecated since PyTorch 2.4."""

    code = "AMP009"
    triggers = ("cuda.amp", "cpu.amp", "from torch.cuda import amp", "from torch.cpu import amp")

    def visit_attribute(self, node: nodes.Attribute) -> None:
        if self._is_use(node):
            self._check(node)

    def visit_name(self, node: nodes.Name) -> None:
        if not self._is_use(node):
            return
        # A name counts only when imported: a variable bound to the API is reported where bound.
        bindings = self.context.names.bindings(node)
        if bindings and all(isinstance(b, (nodes.Import, nodes.ImportFrom)) for b in bindings):
            # imported by a vendor dispatch (``torch.npu.amp`` ... else ``torch.cuda.amp``), it
            # is the deprecated API on CUDA unless some arm imports ``torch.amp``
            possible = self.context.names.possible_qualnames(node)
            deprecated = sorted(name for name in possible if name in REPLACEMENTS)
            if deprecated and not any(_is_modern(name) for name in possible):
                self._check(node, deprecated[0])

    def _check(self, node: nodes.NodeNG, old: Optional[str] = None) -> None:
        old = old or self.context.names.qualname(node)
        if old in REPLACEMENTS and not self._version_gated(node):
            self.report(node, old=old, new=REPLACEMENTS[old])

    def _is_use(self, node: nodes.NodeNG) -> bool:
        """Called, decorating, partial'ed, bound, returned, a parameter's default or a keyword
        argument's value (also as an ``x if c else y`` arm)."""
        parent = node.parent
        if isinstance(parent, (nodes.Arguments, nodes.Keyword)):
            return True
        if isinstance(parent, (nodes.IfExp, nodes.BoolOp)) and node is not getattr(
            parent, "test", None
        ):
            return self._is_use(parent)
        if isinstance(parent, nodes.Return):
            return True
        if isinstance(parent, nodes.Call):
            if parent.func is node:
                return True
            return (
                bool(parent.args)
                and parent.args[0] is node
                and self.context.names.qualname(parent.func) in PARTIAL
            )
        if isinstance(parent, (nodes.Assign, nodes.AnnAssign)):
            return parent.value is node
        return isinstance(parent, nodes.Decorators)

    def _version_gated(self, node: nodes.NodeNG) -> bool:
        child, parent = node, node.parent
        while parent is not None:
            if isinstance(parent, (nodes.Try, nodes.TryStar)) and _catches_fallback(parent):
                if self._mentions_modern_api(parent):
                    return True
            elif isinstance(parent, (nodes.If, nodes.IfExp)) and child is not parent.test:
                if self._picks_by_version(parent) or self._other_arm_is_modern(parent, child):
                    return True
            if child.is_statement and self._after_version_return(child):
                return True
            child, parent = parent, parent.parent
        return False

    def _picks_by_version(self, branch: nodes.NodeNG) -> bool:
        """``branch`` tests the torch version (or ``hasattr``) to choose between the APIs: it
        offers ``torch.amp`` somewhere (mmcv's ``if TORCH_VERSION >= '1.6.0'``, or
        mmengine's FSDP check, choose nothing: the old API is what runs today)."""
        return _is_version_test(branch.test) and self._mentions_modern_api(branch)

    def _other_arm_is_modern(self, branch: nodes.NodeNG, child: nodes.NodeNG) -> bool:
        """The other arm offers ``torch.amp`` and the test is neither the amp switch
        (``autocast() if amp else torch.autocast("cuda", enabled=False)`` picks no API) nor a
        device test."""
        condition = condition_key(branch.test)
        if condition is not None and condition[0] == AMP_CONDITION:
            return False
        if DEVICE_TEST.search(branch.test.as_string()) and not _is_version_test(branch.test):
            return False  # ``torch.autocast("cuda") if on_gpu else torch.cpu.amp.autocast()``
        return any(self._mentions_modern_api(node) for node in other_arm(branch, child))

    def _after_version_return(self, statement: nodes.NodeNG) -> bool:
        """``statement`` follows ``if <version test>: return <modern>`` in the same block
        (not ``if <too old>: raise``: the code after it still runs on new versions)."""
        sibling = statement.previous_sibling()
        while sibling is not None:
            if isinstance(sibling, nodes.If) and _is_version_test(sibling.test) and sibling.body:
                exits = isinstance(sibling.body[-1], (nodes.Return, nodes.Raise))
                if exits and any(self._mentions_modern_api(node) for node in sibling.body):
                    return True
            sibling = sibling.previous_sibling()
        return False

    def _mentions_modern_api(self, node: nodes.NodeNG) -> bool:
        for sub in _self_and_descendants(node):
            if isinstance(sub, nodes.ImportFrom) and (sub.modname or "").startswith("torch.amp"):
                return True
            if isinstance(sub, (nodes.Name, nodes.Attribute)):
                if _is_modern(self.context.names.qualname(sub)):
                    return True
        return False


def _is_modern(qualname: Optional[str]) -> bool:
    """``torch.amp``, anything in it, or its aliases ``torch.autocast`` and
    ``torch.GradScaler``."""
    return qualname is not None and (
        qualname.startswith("torch.amp.")
        or qualname in ("torch.amp", "torch.autocast", "torch.GradScaler")
    )


def _catches_fallback(statement: nodes.NodeNG) -> bool:
    for handler in statement.handlers:
        if handler.type is None:
            return True
        if any(name in FALLBACK_EXCEPTIONS for name in _exception_names(handler.type)):
            return True
    return False


def _exception_names(expr: nodes.NodeNG) -> Iterable[str]:
    for sub in _self_and_descendants(expr):
        if isinstance(sub, nodes.Name):
            yield sub.name
        elif isinstance(sub, nodes.Attribute):
            yield sub.attrname


def _is_version_test(test: nodes.NodeNG) -> bool:
    return bool(VERSION_TEST.search(test.as_string()))


def _self_and_descendants(node: nodes.NodeNG) -> Iterable[nodes.NodeNG]:
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        stack.extend(current.get_children())
