"""The pre-commit hook: its definition is valid and its entry lints the files it is given.

pre-commit runs a hook as ``<entry> <file names relative to the repository root>``
from the root; these tests do the same with the entry parsed from
``.pre-commit-hooks.yaml``. (``pre-commit try-repo`` would also pip-install the hook
into a fresh environment from the package index, so it is documented in docs/index.md
rather than run here.)
"""
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
HOOKS = ROOT / ".pre-commit-hooks.yaml"

BUGGY = '''\
import torch
import torch.nn.functional as F


def train_step(model, x, target, optimizer):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        probs = torch.sigmoid(model(x))
        loss = F.binary_cross_entropy(probs, target)
    loss.backward()
    optimizer.step()
'''

CLEAN = BUGGY.replace("probs = torch.sigmoid(model(x))\n        ", "").replace(
    "F.binary_cross_entropy(probs, target)", "F.binary_cross_entropy_with_logits(model(x), target)"
)


@pytest.fixture(scope="module")
def hook():
    hooks = yaml.safe_load(HOOKS.read_text(encoding="utf-8"))
    (definition,) = [h for h in hooks if h["id"] == "flake8-amp"]
    return definition


def test_hook_definition_lints_python_files_with_the_amp_codes(hook):
    assert shlex.split(hook["entry"]) == ["flake8", "--select=AMP"]
    assert hook["language"] == "python"
    assert hook["types"] == ["python"]
    assert hook["require_serial"] is False


def test_pre_commit_accepts_the_hook_manifest():
    result = subprocess.run(
        [sys.executable, "-m", "pre_commit", "validate-manifest", str(HOOKS)],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def run_hook(hook, repo, *files):
    """Run the hook's entry as pre-commit does, with this environment's executables."""
    program, *args = shlex.split(hook["entry"])
    here = os.path.dirname(sys.executable)
    executable = shutil.which(program, path=here) or shutil.which(program)
    assert executable, f"{program} is not installed next to {sys.executable}"
    return subprocess.run([executable, *args, *files], cwd=repo, capture_output=True, text=True)


@pytest.fixture
def repo(tmp_path):
    source = tmp_path / "repo" / "src"
    source.mkdir(parents=True)
    (source / "buggy.py").write_text(BUGGY, encoding="utf-8")
    (source / "clean.py").write_text(CLEAN, encoding="utf-8")
    return source.parent


def test_hook_fails_on_a_finding_and_names_file_line_and_code(hook, repo):
    result = run_hook(hook, repo, "src/buggy.py", "src/clean.py")
    assert result.returncode == 1, result.stderr
    reported = [line.split(" ")[:2] for line in result.stdout.splitlines()]
    assert reported == [["src/buggy.py:8:16:", "AMP003"]]


def test_hook_passes_a_clean_file(hook, repo):
    result = run_hook(hook, repo, "src/clean.py")
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def pre_commit_run(hook, repo, cache):
    """``pre-commit run --all-files`` with the hook as a local hook, using this flake8."""
    local_hook = {key: hook[key] for key in ("id", "name", "entry", "types")}
    config = {"repos": [{"repo": "local", "hooks": [dict(local_hook, language="system")]}]}
    (repo / ".pre-commit-config.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    environment = dict(os.environ, PRE_COMMIT_HOME=str(cache), PATH=path)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "."], cwd=repo, check=True)
    return subprocess.run(
        [sys.executable, "-m", "pre_commit", "run", "--all-files", "--color=never"],
        cwd=repo, env=environment, capture_output=True, text=True,
    )


def test_pre_commit_run_fails_on_the_finding(hook, repo, tmp_path):
    result = pre_commit_run(hook, repo, tmp_path / "pre-commit-home")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "src/buggy.py:8:16: AMP003 " in result.stdout
    assert "src/clean.py" not in result.stdout


def test_pre_commit_run_passes_clean_code(hook, repo, tmp_path):
    (repo / "src" / "buggy.py").unlink()
    result = pre_commit_run(hook, repo, tmp_path / "pre-commit-home")
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"flake8-amp\.+Passed", result.stdout)
