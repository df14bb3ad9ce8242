"""The rule catalog, the per-rule docs and the README stay in sync.

Every catalog code has a page ``docs/rules/AMPxxx.md`` (and every page a code) whose
heading, severity and enforcers agree with the catalog; the README's rule table is the
one the catalog generates; the options and thresholds the docs name exist; and the
static rules' "Example" / "Use instead" code is checked by running real flake8 on it.
"""
import ast
import dataclasses
import re
import subprocess
import warnings
import sys
from pathlib import Path

import pytest

from amp_runtime.thresholds import Thresholds
from flake8_amp.catalog import RULES, RUNTIME, STATIC, markdown_table

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RULE_DOCS = DOCS / "rules"
README = ROOT / "README.md"

SECTIONS = ["What it does", "Why is it bad", "Example", "Use instead", "Options", "References"]
SEVERITY_WORDS = {"P0": "training is broken", "P1": "training is degraded", "P2": "a hint"}
#: A code marked on an example line, as in the snippet tests: ``x.half()  # AMP001``.
MARKER = re.compile(r"#\s*(AMP\d{3})\b")


def page(code):
    return (RULE_DOCS / f"{code}.md").read_text(encoding="utf-8")


def sections(text):
    """``## Title`` -> body, in order of appearance."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def python_blocks(body):
    return re.findall(r"^```python\n(.*?)^```", body, flags=re.S | re.M)


def all_docs():
    return sorted(DOCS.rglob("*.md"))


def test_every_catalog_code_has_a_page_and_every_page_a_code():
    documented = {p.stem for p in RULE_DOCS.glob("*.md")}
    assert documented == set(RULES), (
        f"pages without a catalog entry: {sorted(documented - set(RULES))}; "
        f"codes without a page: {sorted(set(RULES) - documented)}"
    )


@pytest.mark.parametrize("code", sorted(RULES))
def test_page_heading_sections_severity_and_enforcers_match_the_catalog(code):
    entry = RULES[code]
    text = page(code)
    assert text.splitlines()[0] == f"# {code} {entry.name}"
    assert list(sections(text)) == SECTIONS

    facts = re.search(
        r"^\*\*Severity:\*\* (P\d) \(([^)]*)\) · \*\*Enforced by:\*\* (.+)$", text, re.M
    )
    assert facts, "missing the '**Severity:** Px (...) · **Enforced by:** ...' line"
    severity, meaning, enforcers = facts.groups()
    assert (severity, meaning) == (entry.severity, SEVERITY_WORDS[entry.severity])
    stated = {e for e in (STATIC, RUNTIME) if re.search(rf"\b{e}\b", enforcers)}
    assert stated == set(entry.enforcers)


@pytest.mark.parametrize("code", sorted(RULES))
def test_page_code_blocks_are_valid_python(code):
    for block in python_blocks(page(code)):
        ast.parse(block)


@pytest.mark.parametrize("code", sorted(RULES))
def test_page_references_link_to_pytorch_or_flake8_docs(code):
    references = sections(page(code))["References"]
    assert re.search(r"https://(pytorch\.org|flake8\.pycqa\.org)/", references)


def readme_rules_table():
    text = README.read_text(encoding="utf-8")
    block = r"^<!-- rules-table[^\n]*-->\n(.*?)\n<!-- /rules-table -->"
    match = re.search(block, text, re.S | re.M)
    assert match, "README has no <!-- rules-table --> ... <!-- /rules-table --> block"
    return match.group(1)


def test_readme_rules_table_is_the_generated_one():
    assert readme_rules_table() == markdown_table(), "regenerate: python -m flake8_amp.catalog"


def test_readme_names_every_code():
    text = README.read_text(encoding="utf-8")
    assert [code for code in RULES if code not in text] == []


def test_relative_links_in_docs_resolve():
    broken = []
    for doc in all_docs() + [README]:
        for target in re.findall(r"\]\((?!https?://|#)([^)#\s]+)", doc.read_text(encoding="utf-8")):
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert broken == []


def test_thresholds_named_in_docs_exist_and_every_threshold_is_documented():
    fields = {f.name for f in dataclasses.fields(Thresholds)}
    named = set()
    for doc in all_docs():
        named |= set(re.findall(r"Thresholds\.(\w+)", doc.read_text(encoding="utf-8")))
    assert named - fields == set(), "docs name thresholds that do not exist"
    assert fields - named == set(), "thresholds without documentation"


def test_command_line_options_named_in_docs_exist():
    """Every ``--amp-*`` option the docs name is one flake8 or pytest really has."""
    named = set()
    for doc in all_docs():
        named |= set(re.findall(r"--amp-[a-z-]*[a-z]", doc.read_text(encoding="utf-8")))
    assert named, "the docs name no --amp-* option"
    help_text = "".join(
        subprocess.run(
            [sys.executable, "-m", tool, "--help"], capture_output=True, text=True, check=True
        ).stdout
        for tool in ("flake8", "pytest")
    )
    assert {option for option in named if option not in help_text} == set()


STATIC_CODES = sorted(c for c, r in RULES.items() if STATIC in r.enforcers and c != "AMP000")


@pytest.fixture(scope="module")
def example_findings(tmp_path_factory):
    """Lint every static page's Example and Use-instead code in one real flake8 run.

    Returns {(code, section): (marked lines, {line: set of codes found})}.
    """
    folder = tmp_path_factory.mktemp("doc_examples")
    marked = {}
    for code in STATIC_CODES:
        for section in ("Example", "Use instead"):
            blocks = python_blocks(sections(page(code))[section])
            assert blocks, f"{code}: the {section} section has no python block"
            source = blocks[0]
            name = f"{code}_{section.replace(' ', '_').lower()}.py"
            (folder / name).write_text(source, encoding="utf-8")
            lines = {n for n, line in enumerate(source.splitlines(), 1) if MARKER.search(line)}
            marked[(code, section)] = (name, lines)
    result = subprocess.run(
        [sys.executable, "-m", "flake8", "--isolated", "--select=AMP", "."],
        cwd=folder, capture_output=True, text=True,
    )
    assert result.returncode in (0, 1), result.stderr
    found = {}
    for line in result.stdout.splitlines():
        path, lineno, _col, message = line.split(":", 3)
        found.setdefault(Path(path).name, {}).setdefault(int(lineno), set()).add(message.split()[0])
    return {key: (lines, found.get(name, {})) for key, (name, lines) in marked.items()}


@pytest.mark.parametrize("code", STATIC_CODES)
def test_example_is_reported_on_its_marked_lines(code, example_findings):
    marked, found = example_findings[(code, "Example")]
    assert marked, f"{code}: mark the offending line of the example with '# {code}'"
    assert {line for line, codes in found.items() if code in codes} == marked


@pytest.mark.parametrize("code", STATIC_CODES)
def test_use_instead_is_clean(code, example_findings):
    marked, found = example_findings[(code, "Use instead")]
    assert marked == set()
    assert found == {}


RUNTIME_ONLY = sorted(c for c, r in RULES.items() if r.enforcers == {RUNTIME})


def guarded_events(source, name):
    """Codes the guard records while the documented code runs (its own guard nests inside)."""
    amp_runtime = pytest.importorskip("amp_runtime")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with amp_runtime.guard(policy="record") as outer:
            exec(compile(source, name, "exec"), {"__name__": name})
    return {event.code for event in outer.report.events}


@pytest.mark.parametrize("code", RUNTIME_ONLY)
def test_runtime_example_triggers_its_code_and_the_fix_is_quiet(code):
    page_sections = sections(page(code))
    (example,) = python_blocks(page_sections["Example"])
    (fixed,) = python_blocks(page_sections["Use instead"])
    marked = {m.group(1) for m in MARKER.finditer(example)}
    assert code in marked, f"mark the example line with '# {code}'"
    assert code in guarded_events(example, f"{code}_example")
    assert guarded_events(fixed, f"{code}_use_instead") == set()
