"""One file through the fixers: lint, plan, rewrite, check, or leave it exactly as it was.

The linter runs first, as flake8 runs it (the plugin's rules over the astroid tree,
findings silenced by ``# noqa`` dropped); only the reported findings of the selected
codes go to the fixers. The rewritten source must compile, and linting it again must
report exactly what it reported before less the fixed findings: a fix never changes
what the linter says about anything else. Otherwise the file stays untouched.
"""

from __future__ import annotations

import argparse
import ast
import io
import tokenize
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

import libcst as cst

from flake8_amp.engine import Context, Finding, Options, build_module, run_checks
from flake8_amp.fix import FIXABLE, WITHDRAWN, amp005, amp007, amp009
from flake8_amp.fix.base import Edit, Insertion, Plan, SourceFile
from flake8_amp.rules import RULES

#: One fixer per code: ``plan(source, findings of that code)``.
FIXERS: Dict[str, Callable[[SourceFile, Sequence[Finding]], Plan]] = {
    "AMP005": amp005.plan,
    "AMP007": amp007.plan,
    "AMP009": amp009.plan,
}
assert set(FIXERS) == set(FIXABLE), "flake8_amp.fix.FIXABLE lists the codes with a fixer"


class Unreadable(Exception):
    """The file cannot be decoded or parsed; the message says why."""


@dataclass
class FileFix:
    """The outcome for one file: ``fixed`` is the new content, or None when it is unchanged."""

    original: bytes
    fixed: Optional[bytes] = None
    applied: List[Finding] = field(default_factory=list)
    left_alone: List[Tuple[Finding, str]] = field(default_factory=list)

    @property
    def original_text(self) -> str:
        return decode(self.original)

    @property
    def fixed_text(self) -> str:
        return decode(self.fixed) if self.fixed is not None else self.original_text


def decode(data: bytes) -> str:
    """The text of a Python source file, decoded as Python does (PEP 263 cookie, BOM)."""
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        return data.decode(encoding)
    except (SyntaxError, LookupError, UnicodeDecodeError) as error:
        raise Unreadable(f"cannot decode: {error}") from None


def lint(source: str, filename: str, options: Options) -> Tuple[Optional[Context], List[Finding]]:
    """The plugin's findings for ``source``, with the linter's context (None when no rule
    applies), computed the way :class:`flake8_amp.plugin.AmpChecker` computes them."""
    try:
        tree = ast.parse(source, filename)
    except (SyntaxError, ValueError) as error:
        raise Unreadable(f"cannot parse: {error}") from None
    rules = [rule for rule in RULES if rule.applies(source, options)]
    if not rules:
        return None, []
    try:
        context = Context(build_module(tree, source, filename), filename, options)
        return context, run_checks(context, rules)
    except RecursionError:
        raise Unreadable("flake8-amp could not analyse it: nesting too deep") from None
    except Exception as error:  # the plugin reports these as AMP000; here the file is skipped
        reason = f"{type(error).__name__}: {error}".splitlines()[0][:200]
        raise Unreadable(f"flake8-amp could not analyse it: {reason}") from None


@dataclass(frozen=True)
class Configuration:
    """What the user's flake8 configuration decides for ``fix``: the plugin's ``--amp-*``
    options, and which findings flake8 would show (select and ignore lists,
    ``per-file-ignores``, ``# noqa``). The default is flake8's defaults, without files."""

    options: Options = Options()
    flake8_options: Optional[argparse.Namespace] = None
    #: flake8's style guides (``StyleGuideManager``): the select/ignore decisions per file.
    style_guides: Any = None

    @classmethod
    def load(cls, select: Sequence[str]) -> "Configuration":
        """Read by flake8 itself from the configuration files of the current directory,
        with ``select`` in place of the configured selection (as ``flake8 --select``)."""
        from flake8.api import legacy

        from flake8_amp.plugin import AmpChecker

        style_guide = legacy.get_style_guide(select=list(select))  # hands the plugin its options
        return cls(AmpChecker.options, style_guide.options, style_guide._application.guide)

    def shown(self, filename: str, source: str) -> Callable[[Finding], bool]:
        """Whether flake8 would show a finding of this file."""
        from flake8.style_guide import Decision

        noqa = _noqa_filter(filename, source, self.flake8_options)
        if self.style_guides is None:
            return lambda finding: not noqa(finding)
        decide = self.style_guides.style_guide_for(filename).should_report_error
        return lambda finding: decide(finding.code) is Decision.Selected and not noqa(finding)


def fix_file(
    data: bytes, filename: str, select: FrozenSet[str], config: Configuration = Configuration()
) -> FileFix:
    """Fix the selected codes in one file's content; raises :class:`Unreadable`."""
    result = FileFix(original=data)
    source = decode(data)
    options = config.options
    context, findings = lint(source, filename, options)
    shown = config.shown(filename, source)
    wanted = [f for f in findings if f.code in select and shown(f)]
    if context is None or not wanted:
        return result
    try:
        tree = cst.parse_module(data)
    except Exception as error:  # libcst lags behind the newest syntax now and then
        raise Unreadable(f"libcst cannot parse it: {str(error).splitlines()[0]}") from None
    try:
        plan, fixed = _planned(SourceFile(source, tree, context), select, wanted)
        problem = None
        if plan.fixed:
            problem = check_fixed(fixed, filename, options, findings, plan.fixed)
    except Exception as error:  # a fixer's bug costs this file its fixes, never the run
        reason = f"{type(error).__name__}: {error}".splitlines()[0][:200]
        plan, fixed, problem = Plan(fixed=wanted), data, f"internal error, {reason}"
    left_alone = plan.left_alone
    if problem is not None:
        withdrawn = f"{WITHDRAWN}: {problem} (a flake8-amp bug: please report it)"
        left_alone = left_alone + [(finding, withdrawn) for finding in plan.fixed]
    elif plan.fixed and fixed != data:
        result.fixed = fixed
        result.applied = sorted(plan.fixed, key=_position)
    result.left_alone = sorted(left_alone, key=lambda item: _position(item[0]))
    return result


def _planned(
    view: SourceFile, select: FrozenSet[str], wanted: List[Finding]
) -> Tuple[Plan, bytes]:
    """Every fixer's plan for the file, and the file's content with the plans carried out."""
    plan = Plan()
    for code in sorted(select & set(FIXERS)):
        plan.extend(FIXERS[code](view, [f for f in wanted if f.code == code]))
    if not plan.fixed:
        return plan, view.module.bytes
    return plan, view.module.visit(_Apply(plan.edits, plan.insertions)).bytes


def _position(finding: Finding) -> Tuple[int, int, str]:
    return finding.line, finding.col, finding.code


def check_fixed(
    fixed: bytes, filename: str, options: Options, before: List[Finding], done: List[Finding]
) -> Optional[str]:
    """What is wrong with the fixed content, or None: it compiles, and the linter reports
    what it reported before less the fixed findings."""
    try:
        source = decode(fixed)
        compile(source, filename, "exec", dont_inherit=True)
        _, after = lint(source, filename, options)
    except (SyntaxError, ValueError, Unreadable) as error:
        return f"the fixed code does not compile: {error}"
    expected = Counter(f.code for f in before) - Counter(f.code for f in done)
    found = Counter(f.code for f in after)
    if found != expected:
        changed = sorted((found - expected) + (expected - found))
        return f"the linter's findings changed: {', '.join(changed)}"
    return None


def _noqa_filter(
    filename: str, source: str, flake8_options: Optional[argparse.Namespace]
) -> Callable[[Finding], bool]:
    """flake8's own ``# noqa`` test: a finding is silenced by a ``# noqa`` (bare, or naming
    its code or a prefix of it) anywhere in the logical line it is on."""
    from flake8.processor import FileProcessor
    from flake8.violation import Violation

    options = flake8_options or _default_flake8_options()
    if getattr(options, "disable_noqa", False):
        return lambda finding: False
    lines = source.splitlines(keepends=True)
    try:
        logical_lines = FileProcessor(filename, options, lines=lines).noqa_line_for
    except Exception:  # flake8 itself would report E902 here: judge by the physical line
        logical_lines = None

    def silenced(finding: Finding) -> bool:
        if logical_lines is not None:
            physical = logical_lines(finding.line) or ""
        else:
            physical = lines[finding.line - 1] if 0 < finding.line <= len(lines) else ""
        violation = Violation(finding.code, filename, finding.line, finding.col + 1, "", physical)
        return violation.is_inline_ignored(disable_noqa=False)

    return silenced


def _default_flake8_options() -> argparse.Namespace:
    """flake8's defaults for what :class:`FileProcessor` reads (no configuration files)."""
    from flake8 import defaults

    return argparse.Namespace(
        hang_closing=False,
        indent_size=defaults.INDENT_SIZE,
        max_line_length=defaults.MAX_LINE_LENGTH,
        max_doc_length=None,
        verbose=0,
        disable_noqa=False,
    )


class _Apply(cst.CSTTransformer):
    """Applies a plan's edits (innermost first, so nested edits compose) and insertions."""

    def __init__(self, edits: List[Edit], insertions: List[Insertion]):
        super().__init__()
        self._edits: Dict[cst.CSTNode, List] = {}
        for edit in edits:
            self._edits.setdefault(edit.node, []).append(edit.rewrite)
        self._insertions = {insertion.before: insertion.statement for insertion in insertions}

    def on_leave(self, original_node, updated_node):
        for rewrite in self._edits.get(original_node, ()):
            updated_node = rewrite(updated_node)
        if isinstance(updated_node, (cst.IndentedBlock, cst.Module)) and self._insertions:
            updated_node = updated_node.with_changes(
                body=self._with_insertions(original_node.body, updated_node.body)
            )
        return updated_node

    def _with_insertions(self, originals, updated) -> List[cst.BaseStatement]:
        body: List[cst.BaseStatement] = []
        for original, statement in zip(originals, updated):
            new = self._insertions.get(original)
            if new is not None:
                body.append(new.with_changes(leading_lines=statement.leading_lines))
                statement = statement.with_changes(leading_lines=())
            body.append(statement)
        return body
