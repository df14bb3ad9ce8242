"""``python -m flake8_amp fix`` as users run it: diff or --write, --select, paths, exit
codes, bad input, configuration, and the linter without libcst."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flake8_amp.engine import Options
from flake8_amp.fix.driver import check_fixed, fix_file, lint

ROOT = Path(__file__).resolve().parents[1]

DEPRECATED = """\
import torch

scaler = torch.cuda.amp.GradScaler()
"""
DEPRECATED_FIXED = """\
import torch

scaler = torch.amp.GradScaler("cuda")
"""
TWO_CODES = """\
import torch
from torch import nn


class Head(nn.Module):
    def forward(self, scores, mask):
        with torch.cuda.amp.autocast():
            return scores.masked_fill(mask, -1e9)
"""


def run_fix(*args, cwd: Path, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flake8_amp", *map(str, args)],
        cwd=cwd, capture_output=True, text=True, timeout=300,
        env={**os.environ, **(env or {})},
    )


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def blocking(tmp_path: Path, module: str) -> dict:
    """An environment in which ``import <module>`` fails, as where it is not installed."""
    folder = tmp_path / f"block_{module}"
    write(folder / "sitecustomize.py", textwrap.dedent(f"""\
        import sys


        class _Block:
            def find_spec(self, name, path=None, target=None):
                if name == {module!r} or name.startswith({module + '.'!r}):
                    raise ImportError("{module} is blocked in this test")
                return None


        sys.meta_path.insert(0, _Block())
        """))
    return {"PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])}


# -- output modes --------------------------------------------------------------------------


def test_default_shows_a_unified_diff_and_leaves_the_file_alone(tmp_path):
    path = write(tmp_path / "train.py", DEPRECATED)
    result = run_fix("fix", "train.py", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert result.stdout.splitlines()[:2] == ["--- train.py", "+++ train.py"]
    assert "-scaler = torch.cuda.amp.GradScaler()" in result.stdout.splitlines()
    assert '+scaler = torch.amp.GradScaler("cuda")' in result.stdout.splitlines()
    assert "run with --write to apply" in result.stderr
    assert path.read_text(encoding="utf-8") == DEPRECATED


@pytest.mark.skipif(shutil.which("patch") is None, reason="needs the patch program")
def test_the_diff_applies_with_patch(tmp_path):
    write(tmp_path / "pkg" / "train.py", DEPRECATED)
    diff = run_fix("fix", "pkg", cwd=tmp_path).stdout
    subprocess.run(["patch", "-p0"], input=diff, text=True, cwd=tmp_path, check=True,
                   capture_output=True)
    assert (tmp_path / "pkg" / "train.py").read_text(encoding="utf-8") == DEPRECATED_FIXED


def test_write_applies_keeps_permissions_and_a_second_run_finds_nothing(tmp_path):
    path = write(tmp_path / "train.py", DEPRECATED)
    path.chmod(0o640)
    first = run_fix("fix", "--write", "train.py", cwd=tmp_path)
    assert first.returncode == 1, first.stderr
    assert (first.stdout, path.read_text(encoding="utf-8")) == ("", DEPRECATED_FIXED)
    assert "fixed train.py: 1 finding(s) (AMP009)" in first.stderr
    assert path.stat().st_mode & 0o777 == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["train.py"]  # no temporary left behind
    second = run_fix("fix", "--write", "train.py", cwd=tmp_path)
    assert (second.returncode, second.stdout) == (0, "")
    assert "nothing to fix" in second.stderr


def test_select_restricts_the_codes(tmp_path):
    path = write(tmp_path / "head.py", TWO_CODES)
    result = run_fix("fix", "--write", "--select", "AMP009", "head.py", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    text = path.read_text(encoding="utf-8")
    assert 'torch.amp.autocast("cuda")' in text and "-1e9" in text
    result = run_fix("fix", "--write", "--select", "amp007", "head.py", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert "torch.finfo(scores.dtype).min" in path.read_text(encoding="utf-8")


def test_verbose_names_each_finding_left_alone_and_why(tmp_path):
    write(tmp_path / "alias.py", "import torch\n\nmake = torch.cuda.amp.GradScaler\n")
    result = run_fix("fix", "-v", "alias.py", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "alias.py:3:8: AMP009 left alone: only calls and decorators are rewritten" in (
        result.stderr
    )


# -- paths -----------------------------------------------------------------------------


def test_directories_are_searched_for_python_files_skipping_hidden_ones_and_venvs(tmp_path):
    for name in ("src/a.py", "src/deep/b.py", "src/.cache/c.py", "src/env/d.py", "src/e.txt"):
        write(tmp_path / name, DEPRECATED)
    write(tmp_path / "src" / "env" / "pyvenv.cfg", "home = /usr/bin\n")
    script = write(tmp_path / "script", DEPRECATED)  # named explicitly: fixed whatever its name
    result = run_fix("fix", "--write", "src", "script", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    fixed = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")
             if p.is_file() and p.read_text(encoding="utf-8") == DEPRECATED_FIXED}
    assert fixed == {"src/a.py", "src/deep/b.py", "script"}
    assert script.read_text(encoding="utf-8") == DEPRECATED_FIXED


# -- usage errors ------------------------------------------------------------------------


def test_help_shows_examples_and_exit_codes(tmp_path):
    result = run_fix("fix", "--help", cwd=tmp_path)
    assert result.returncode == 0
    for text in ("--write", "--select", "examples:", "exit status:", "flake8-amp[fix]"):
        assert text in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["fix", "missing.py"], "no such file or directory: missing.py"),
        (["fix", "--select", "AMP003", "."], "AMP003 has no automatic fix"),
        (["fix", "--frobnicate", "."], "unrecognized arguments: --frobnicate"),
        (["fix"], "the following arguments are required: PATH"),
        ([], "usage: python -m flake8_amp"),
    ],
)
def test_usage_errors_exit_2_with_a_message(tmp_path, args, message):
    result = run_fix(*args, cwd=tmp_path)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_without_libcst_fix_says_what_to_install(tmp_path):
    write(tmp_path / "train.py", DEPRECATED)
    env = blocking(tmp_path, "libcst")
    result = run_fix("fix", "train.py", cwd=tmp_path, env=env)
    assert result.returncode == 2
    assert 'pip install "flake8-amp[fix]"' in result.stderr
    assert "Traceback" not in result.stderr
    assert run_fix("fix", "--help", cwd=tmp_path, env=env).returncode == 0


def test_fix_needs_no_torch(tmp_path):
    path = write(tmp_path / "train.py", TWO_CODES)
    env = blocking(tmp_path, "torch")
    blocked = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True,
                             text=True, env={**os.environ, **env})
    assert "torch is blocked in this test" in blocked.stderr
    result = run_fix("fix", "--write", "train.py", cwd=tmp_path, env=env)
    assert result.returncode == 1, result.stderr
    assert "torch.finfo(scores.dtype).min" in path.read_text(encoding="utf-8")


def test_the_linter_needs_no_libcst(tmp_path, flake8):
    write(tmp_path / "train.py", DEPRECATED)
    env = blocking(tmp_path, "libcst")
    result = flake8(["--isolated", "--select=AMP", "train.py"], cwd=tmp_path, env=env)
    assert result.returncode == 1 and "AMP009" in result.stdout, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, flake8_amp.plugin; print('libcst' in sys.modules)"],
        capture_output=True, text=True, check=True,
    )
    assert loaded.stdout.strip() == "False"


# -- bad input -----------------------------------------------------------------------------


def test_unreadable_files_are_reported_and_skipped_and_the_others_fixed(tmp_path):
    broken = b"import torch\ndef f(:\n    torch.cuda.amp.GradScaler()\n"
    undecodable = b"# -*- coding: utf-8 -*-\nimport torch\nx = '\xe9'\n"
    binary = b"\xff\xfe\x00\x01garbage"
    unknown_codec = b"# -*- coding: no-such-codec -*-\nimport torch\n"
    files = {"broken.py": broken, "undecodable.py": undecodable, "binary.py": binary,
             "codec.py": unknown_codec}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    good = write(tmp_path / "good.py", DEPRECATED)
    result = run_fix("fix", "--write", ".", cwd=tmp_path)
    assert result.returncode == 3, result.stderr
    assert "Traceback" not in result.stderr
    assert "broken.py: skipped, cannot parse: invalid syntax" in result.stderr
    assert "undecodable.py: skipped, cannot decode" in result.stderr
    assert "binary.py: skipped, cannot decode" in result.stderr
    assert "codec.py: skipped, cannot decode" in result.stderr
    assert "4 file(s) skipped" in result.stderr
    assert {name: (tmp_path / name).read_bytes() for name in files} == files
    assert good.read_text(encoding="utf-8") == DEPRECATED_FIXED


def test_encodings_byte_order_marks_and_line_endings_are_kept(tmp_path):
    latin = "# -*- coding: latin-1 -*-\nimport torch\n# café\n" + DEPRECATED.split("\n", 2)[2]
    (tmp_path / "latin.py").write_bytes(latin.encode("latin-1"))
    bom = "\ufeffimport torch\r\nscaler = torch.cuda.amp.GradScaler()\r\n"
    (tmp_path / "bom.py").write_bytes(bom.encode("utf-8"))
    (tmp_path / "tail.py").write_bytes(DEPRECATED.rstrip("\n").encode())
    result = run_fix("fix", "--write", ".", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    new = 'torch.amp.GradScaler("cuda")'
    old = "torch.cuda.amp.GradScaler()"
    assert (tmp_path / "latin.py").read_bytes() == latin.replace(old, new).encode("latin-1")
    assert (tmp_path / "bom.py").read_bytes() == bom.replace(old, new).encode("utf-8")
    assert (tmp_path / "tail.py").read_bytes() == DEPRECATED_FIXED.rstrip("\n").encode()


# -- configuration -----------------------------------------------------------------------


REGION_FILL = """\
import torch
from my_amp import mixed


def masked(scores, mask):
    with mixed():
        return scores.masked_fill(mask, -1e9)
"""


def test_amp_options_come_from_the_flake8_configuration(tmp_path):
    """The finding exists only with the configured autocast function; fix sees it too."""
    path = write(tmp_path / "masked.py", REGION_FILL)
    assert run_fix("fix", "masked.py", cwd=tmp_path).returncode == 0
    write(tmp_path / "setup.cfg", "[flake8]\namp-autocast-functions = my_amp.mixed\n")
    result = run_fix("fix", "--write", "masked.py", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert "torch.finfo(scores.dtype).min" in path.read_text(encoding="utf-8")


def test_configured_ignores_and_per_file_ignores_are_respected(tmp_path):
    """What flake8 would not report, fix does not touch."""
    head = write(tmp_path / "head.py", TWO_CODES)
    legacy = write(tmp_path / "legacy" / "old.py", DEPRECATED)
    write(tmp_path / "setup.cfg",
          "[flake8]\nextend-ignore = AMP007\nper-file-ignores =\n    legacy/*.py: AMP009\n")
    result = run_fix("fix", "--write", ".", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert legacy.read_text(encoding="utf-8") == DEPRECATED
    text = head.read_text(encoding="utf-8")
    assert 'torch.amp.autocast("cuda")' in text and "-1e9" in text


def test_a_configuration_the_plugin_rejects_is_a_usage_error(tmp_path):
    write(tmp_path / "masked.py", REGION_FILL)
    write(tmp_path / "setup.cfg", "[flake8]\namp-autocast-functions = 1bad\n")
    result = run_fix("fix", "masked.py", cwd=tmp_path)
    assert result.returncode == 2
    assert "amp-autocast-functions" in result.stderr and "Traceback" not in result.stderr


# -- every snippet the linter is tested on ---------------------------------------------------


def test_fix_over_every_snippet_and_example_is_safe_and_idempotent(tmp_path, flake8):
    """Whatever shapes the snippet files hold (they grow with the rules), fix never crashes,
    never withdraws a fix, leaves compiling files, and a second run changes nothing."""
    snippets = (ROOT / "tests" / "snippets").glob("amp*.py")
    for source in [*snippets, *(ROOT / "examples").glob("*.py")]:
        shutil.copy(source, tmp_path / source.name)
    first = run_fix("fix", "--write", ".", cwd=tmp_path)
    assert first.returncode == 1, first.stderr
    assert "Traceback" not in first.stderr and "withdrawn" not in first.stderr
    for path in tmp_path.glob("*.py"):
        compile(path.read_text(encoding="utf-8"), str(path), "exec")
    second = run_fix("fix", ".", cwd=tmp_path)
    assert (second.returncode, second.stdout) == (0, ""), second.stderr


# -- the driver's own check --------------------------------------------------------------


def test_a_fix_that_changes_other_findings_or_breaks_the_code_is_refused():
    """The driver's last check, on real linter findings: a rewrite must compile and leave
    every finding but the fixed ones in place."""
    source = DEPRECATED + textwrap.dedent("""\
        import torch.nn.functional as F
        with torch.autocast("cuda"):
            loss = F.binary_cross_entropy(p, y)
        """)
    _, before = lint(source, "t.py", Options())
    assert sorted(f.code for f in before) == ["AMP003", "AMP009"]
    done = [f for f in before if f.code == "AMP009"]
    good = source.replace("torch.cuda.amp.GradScaler()", 'torch.amp.GradScaler("cuda")')
    assert check_fixed(good.encode(), "t.py", Options(), before, done) is None
    lost_other = good.replace("binary_cross_entropy", "mse_loss")
    problem = check_fixed(lost_other.encode(), "t.py", Options(), before, done)
    assert problem == "the linter's findings changed: AMP003"
    problem = check_fixed(b"scaler = (", "t.py", Options(), before, done)
    assert problem.startswith("the fixed code does not compile")


def test_fix_file_leaves_an_unfixable_file_unchanged():
    result = fix_file(b"import torch\nmake = torch.cuda.amp.GradScaler\n", "t.py",
                      frozenset({"AMP009"}))
    assert result.fixed is None and result.applied == []
    assert [f.code for f, _ in result.left_alone] == ["AMP009"]


# -- documentation -------------------------------------------------------------------------


def test_docs_describe_the_command_its_options_and_exit_codes(tmp_path):
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    section = index.split("### Automatic fixes: `python -m flake8_amp fix`", 1)[1].split("\n## ")[0]
    help_text = run_fix("fix", "--help", cwd=tmp_path).stdout
    for option in ("--write", "--select", "-v"):
        assert option in section and option in help_text
    for status in ("`0` nothing to fix", "`1` fixes shown", "`2` usage", "`3` some file"):
        assert status in section
        assert status.replace("`", "").replace(" ", "  ", 1) in help_text
    for code in ("AMP005", "AMP007", "AMP009"):
        assert f"| {code} |" in section
        page = (ROOT / "docs" / "rules" / f"{code}.md").read_text(encoding="utf-8")
        assert "python -m flake8_amp fix" in page
    assert "python -m flake8_amp fix" in (ROOT / "README.md").read_text(encoding="utf-8")
