"""The flake8 entry point (``flake8.extension``: ``AMP = flake8_amp.plugin:AmpChecker``)."""

from __future__ import annotations

import ast
import gc
import re
from typing import Iterable, Iterator, Sequence, Tuple

from flake8.exceptions import ExecutionError

from flake8_amp import __version__, catalog
from flake8_amp.engine import Context, Options, build_module, run_checks
from flake8_amp.rules import RULES

_DOTTED_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_WORD = re.compile(r"^[A-Za-z][A-Za-z0-9]*$")


def _validated(
    option: str, values: Iterable[str], pattern: "re.Pattern[str]", expected: str
) -> frozenset:
    bad = [value for value in values if not pattern.match(value)]
    if bad:
        raise ExecutionError(
            f"flake8-amp: --{option} expects {expected}; got {', '.join(map(repr, bad))}"
        )
    return frozenset(values)


class AmpChecker:
    """Runs every AMP rule over one file in a single walk of its astroid tree."""

    name = "flake8-amp"
    version = __version__
    options = Options()

    def __init__(self, tree: ast.Module, lines: Sequence[str], filename: str = ""):
        self.tree = tree
        self.lines = lines
        self.filename = filename

    @classmethod
    def add_options(cls, manager) -> None:
        manager.add_option(
            "--amp-autocast-functions",
            default="",
            parse_from_config=True,
            comma_separated_list=True,
            help="Extra callables that open autocast regions (dotted names, or bare names), "
            "comma separated. Default: none.",
        )
        manager.add_option(
            "--amp-loss-functions",
            default="",
            parse_from_config=True,
            comma_separated_list=True,
            help="Extra loss callables (dotted names, or bare names), comma separated. "
            "Default: none.",
        )
        manager.add_option(
            "--amp-inference-words",
            default="",
            parse_from_config=True,
            comma_separated_list=True,
            help="Extra whole words that mark a function, class or file as inference/export "
            "code, comma separated. Default: none.",
        )

    @classmethod
    def parse_options(cls, options) -> None:
        cls.options = Options(
            autocast_functions=_validated(
                "amp-autocast-functions",
                options.amp_autocast_functions,
                _DOTTED_NAME,
                "dotted Python names",
            ),
            loss_functions=_validated(
                "amp-loss-functions",
                options.amp_loss_functions,
                _DOTTED_NAME,
                "dotted Python names",
            ),
            inference_words=frozenset(
                word.lower()
                for word in _validated(
                    "amp-inference-words", options.amp_inference_words, _WORD, "plain words"
                )
            ),
        )

    def run(self) -> Iterator[Tuple[int, int, str, type]]:
        source = "".join(self.lines)
        rules = [rule for rule in RULES if rule.applies(source, self.options)]
        if not rules:
            return
        # An astroid tree is ~10^5 objects with parent cycles: letting the cyclic GC scan
        # it again and again while it is built doubles the cost. Pause the collector for
        # this file; the tree is unreachable when the collector resumes.
        collecting = gc.isenabled()
        gc.disable()
        try:
            results = [
                (f.line, f.col, f"{f.code} {f.message}", type(self))
                for f in self._analyse(source, rules)
            ]
        except RecursionError:
            results = [self._skipped("nesting too deep")]
        except Exception as error:  # never a traceback from flake8: report the gap instead
            results = [self._skipped(f"{type(error).__name__}: {error}".splitlines()[0][:200])]
        finally:
            if collecting:
                gc.enable()
        yield from results

    def _analyse(self, source: str, rules: list) -> list:
        module = build_module(self.tree, source, self.filename)
        return run_checks(Context(module, self.filename, self.options), rules)

    def _skipped(self, reason: str) -> Tuple[int, int, str, type]:
        return 1, 0, f"AMP000 {catalog.rule('AMP000').format(reason=reason)}", type(self)
