"""flake8-amp as users run it: registration, options, noqa, odd files, the skip path."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flake8_amp.plugin import AmpChecker

BCE_IN_CUSTOM_REGION = textwrap.dedent("""\
    import torch.nn.functional as F
    from mylib.amp import my_amp_ctx


    def step(model, x, y):
        with my_amp_ctx():
            return F.binary_cross_entropy(model(x), y)
    """)

# Named for what it is not (a loss called ``focal_loss`` is known by its name).
FOCAL_LOSS_OUTSIDE = textwrap.dedent("""\
    import torch
    from mylib.objectives import sigmoid_focal


    def step(model, x, y):
        with torch.autocast("cuda"):
            logits = model(x)
        return sigmoid_focal(logits, y)
    """)

ROLLOUT_CAST = textwrap.dedent("""\
    def rollout_policy(policy, env, optimizer):
        policy.half()
        loss = policy(env.reset())
        loss.backward()
    """)

BCE_UNDER_AUTOCAST = textwrap.dedent("""\
    import torch
    import torch.nn.functional as F


    def step(model, x, y):
        with torch.autocast("cuda"):
            return F.binary_cross_entropy(model(x), y){noqa}
    """)


def codes(stdout: str) -> list:
    return [line.split(": ", 1)[1].split()[0] for line in stdout.splitlines() if ": AMP" in line]


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_version_lists_plugin(flake8):
    result = flake8(["--version"])
    assert result.returncode == 0
    assert "flake8-amp" in result.stdout


def test_finding_format_and_column(tmp_path, flake8):
    path = write(tmp_path, "train.py", BCE_UNDER_AUTOCAST.format(noqa=""))
    result = flake8(["--isolated", "--select=AMP", path.name], cwd=tmp_path)
    assert result.returncode == 1
    assert result.stdout.startswith("train.py:7:16: AMP003 binary_cross_entropy under autocast")
    assert "binary_cross_entropy_with_logits" in result.stdout  # the fix hint


@pytest.mark.parametrize(
    "noqa, expected", [("  # noqa: AMP003", []), ("  # noqa: AMP001", ["AMP003"]), ("  # noqa", [])]
)
def test_noqa(tmp_path, flake8, noqa, expected):
    path = write(tmp_path, "train.py", BCE_UNDER_AUTOCAST.format(noqa=noqa))
    result = flake8(["--isolated", "--select=AMP", path.name], cwd=tmp_path)
    assert codes(result.stdout) == expected


@pytest.mark.parametrize(
    "option, value, source, code",
    [
        ("amp-autocast-functions", "mylib.amp.my_amp_ctx", BCE_IN_CUSTOM_REGION, "AMP003"),
        ("amp-autocast-functions", "my_amp_ctx", BCE_IN_CUSTOM_REGION, "AMP003"),
        ("amp-loss-functions", "mylib.objectives.sigmoid_focal", FOCAL_LOSS_OUTSIDE, "AMP002"),
    ],
)
def test_options_enable_findings_on_command_line(tmp_path, flake8, option, value, source, code):
    path = write(tmp_path, "train.py", source)
    without = flake8(["--isolated", "--select=AMP", path.name], cwd=tmp_path)
    with_option = flake8(
        ["--isolated", "--select=AMP", f"--{option}={value}", path.name], cwd=tmp_path
    )
    assert codes(without.stdout) == []
    assert codes(with_option.stdout) == [code], with_option.stderr


def test_inference_words_option_silences(tmp_path, flake8):
    write(tmp_path, "agent.py", ROLLOUT_CAST)
    before = flake8(["--isolated", "--select=AMP", "agent.py"], cwd=tmp_path)
    after = flake8(
        ["--isolated", "--select=AMP", "--amp-inference-words=Rollout", "agent.py"], cwd=tmp_path
    )
    assert codes(before.stdout) == ["AMP001"]
    assert codes(after.stdout) == []


@pytest.mark.parametrize(
    "config_name, section",
    [("setup.cfg", "flake8"), ("tox.ini", "flake8"), (".flake8", "flake8")],
)
def test_options_from_config_files(tmp_path, flake8, config_name, section):
    write(tmp_path, "train.py", BCE_IN_CUSTOM_REGION)
    write(
        tmp_path,
        config_name,
        f"[{section}]\nselect = AMP\n"
        "amp-autocast-functions =\n    mylib.amp.my_amp_ctx,\n    other_ctx\n",
    )
    result = flake8(["train.py"], cwd=tmp_path)
    assert codes(result.stdout) == ["AMP003"], result.stdout + result.stderr


@pytest.mark.parametrize(
    "argument",
    [
        "--amp-autocast-functions=mylib..amp_ctx",
        "--amp-loss-functions=1focal",
        "--amp-inference-words=roll-out",
    ],
)
def test_malformed_option_is_a_clean_error(tmp_path, flake8, argument):
    write(tmp_path, "train.py", BCE_IN_CUSTOM_REGION)
    result = flake8(["--isolated", "--select=AMP", argument, "train.py"], cwd=tmp_path)
    assert result.returncode != 0
    assert "Traceback" not in result.stdout + result.stderr
    option = argument.split("=")[0]
    assert f"flake8-amp: {option} expects" in result.stdout


def test_malformed_option_in_config_is_a_clean_error(tmp_path, flake8):
    write(tmp_path, "train.py", BCE_IN_CUSTOM_REGION)
    write(tmp_path, "setup.cfg", "[flake8]\namp-loss-functions = focal-loss\n")
    result = flake8(["--select=AMP", "train.py"], cwd=tmp_path)
    assert result.returncode != 0
    assert "Traceback" not in result.stdout + result.stderr
    assert (
        "flake8-amp: --amp-loss-functions expects dotted Python names; got 'focal-loss'"
        in result.stdout
    )


def test_syntax_error_is_only_e999(tmp_path, flake8):
    write(tmp_path, "broken.py", "import torch\nwith torch.autocast('cuda'):\n    x = (\n")
    result = flake8(["--isolated", "--select=AMP,E9", "broken.py"], cwd=tmp_path)
    assert "Traceback" not in result.stdout + result.stderr
    assert [line.split()[1] for line in result.stdout.splitlines()] == ["E999"]


def test_latin1_file_with_coding_cookie(tmp_path, flake8):
    source = "# -*- coding: latin-1 -*-\n# Auteur: José\n" + BCE_UNDER_AUTOCAST.format(noqa="")
    (tmp_path / "latin.py").write_bytes(source.encode("latin-1"))
    result = flake8(["--isolated", "--select=AMP", "latin.py"], cwd=tmp_path)
    assert "Traceback" not in result.stderr
    assert result.stdout.startswith("latin.py:9:16: AMP003")


def test_undecodable_file_has_no_traceback(tmp_path, flake8):
    (tmp_path / "bad.py").write_bytes(b"import torch\nx = '\xff\xfe autocast half'\n")
    result = flake8(["--isolated", "--select=AMP,E9", "bad.py"], cwd=tmp_path)
    assert "Traceback" not in result.stdout + result.stderr
    assert codes(result.stdout) == []


def test_files_without_trigger_words_are_not_analysed():
    # A tree that cannot be built proves whether the analysis ran: with trigger words
    # it fails (and is reported as AMP000), without them nothing is even attempted.
    quiet = ["import os\n", "print(os.getcwd())\n"]
    assert list(AmpChecker(tree=None, lines=quiet, filename="quiet.py").run()) == []
    triggered = ["import torch\n", "x = torch.zeros(1).half()\n"]
    (result,) = AmpChecker(tree=None, lines=triggered, filename="loud.py").run()
    assert result[:2] == (1, 0)
    assert result[2].startswith("AMP000 flake8-amp could not analyse this file: ")


@pytest.mark.parametrize("constant", ["-1_000_000", "-100000", "-1e9", "-70000.0"])
def test_every_spelling_of_a_big_constant_passes_the_pre_check(tmp_path, flake8, constant):
    path = tmp_path / "attention.py"
    path.write_text(textwrap.dedent(f"""\
        import torch


        def scores(q, k, mask):
            with torch.autocast("cuda", dtype=torch.float16):
                return (q @ k.transpose(-2, -1)).masked_fill(mask, {constant})
        """))
    result = flake8(["--isolated", "--select=AMP", path])
    assert codes(result.stdout) == ["AMP007"], result.stdout + result.stderr


@pytest.mark.parametrize(
    "source, code",
    [
        (
            """\
            import torch.nn as nn


            class Windows(nn.Module):
                def forward(self, scores, n):
                    return nn.functional.pad(scores, (0, n), value=-1e9)
            """,
            "AMP007",
        ),
        (
            """\
            def train(model, loader, optimizer):
                for x, y in loader:
                    model(x.type("torch.cuda.BFloat16Tensor"), y).backward()
                    optimizer.step()
            """,
            "AMP001",
        ),
        (
            """\
            import torch


            def step(model, x, y, criterion, scaler):
                with torch.autocast("cuda"):
                    out = model(x)
                scaler.scale(criterion(out, y)).backward()
            """,
            "AMP002",
        ),
    ],
    ids=["pad", "bfloat16-tensor-string", "criterion"],
)
def test_new_shapes_pass_the_pre_check(tmp_path, flake8, source, code):
    path = tmp_path / "train_step.py"
    path.write_text(textwrap.dedent(source))
    result = flake8(["--isolated", "--select=AMP", path])
    assert code in codes(result.stdout), result.stdout + result.stderr


def test_analysis_failure_is_one_amp000_line_not_a_traceback():
    # Python parses this 1000-term sum, but building astroid's tree recurses too deep.
    # (Through the flake8 CLI, pyflakes already fails on such a file, so call the checker.)
    deep = "import torch\nx = torch.zeros(1).half()\ny = " + " + ".join(["x"] * 1000) + "\n"
    findings = list(AmpChecker(ast.parse(deep), deep.splitlines(True), "generated.py").run())
    assert [message for _, _, message, _ in findings] == [
        "AMP000 flake8-amp could not analyse this file: nesting too deep"
    ]


def test_a_long_chain_of_casts_to_another_tensors_dtype_is_analysed(tmp_path, flake8):
    # ``x.to(other)`` asks for ``other``'s dtype inside the query it is part of: the depth
    # limit holds through it (a model file of transformers' once exhausted the recursion).
    links = "\n".join(f"    x{i} = (x{i - 1} + 1).to(x{i - 1})" for i in range(1, 400))
    source = (
        "import torch\n\n\ndef chain(x0):\n" + links + "\n"
        "    return x399\n\n\n"
        "def train(model, optimizer):\n"
        "    with torch.autocast('cuda', dtype=torch.float16):\n"
        "        loss = chain(model(torch.ones(2))).mean()\n"
        "    loss.backward()\n"
    )
    path = tmp_path / "chain.py"
    path.write_text(source)
    result = flake8(["--isolated", "--select=AMP", path])
    assert "AMP000" not in result.stdout and result.returncode in (0, 1), result.stdout
    assert "AMP010" in codes(result.stdout), result.stdout


def test_astroid_never_loads_torch():
    # Attribute assignments (``torch.backends.cudnn.benchmark = True``) and imports are
    # where astroid's own post-processing would infer into torch; the checker must not.
    from astroid.manager import AstroidManager

    source = textwrap.dedent(
        """\
        import torch
        from torch import *
        torch.backends.cudnn.benchmark = True
        model = torch.nn.Linear(2, 2).half()
        model.weight.requires_grad = False
        """
    ) + BCE_UNDER_AUTOCAST.format(noqa="")
    findings = list(AmpChecker(ast.parse(source), source.splitlines(True), "train.py").run())
    assert [message.split()[0] for _, _, message, _ in findings] == ["AMP003"]
    assert not [name for name in AstroidManager().astroid_cache if name.split(".")[0] == "torch"]


@pytest.mark.parametrize(
    "filename, expected",
    [("test_train_loop.py", ["AMP001"]), ("train.py", ["AMP001"]), ("export_model.py", [])],
)
def test_file_names_marking_inference_code(tmp_path, flake8, filename, expected):
    write(tmp_path, filename, ROLLOUT_CAST)
    result = flake8(["--isolated", "--select=AMP", filename], cwd=tmp_path)
    assert codes(result.stdout) == expected


FP16_REFERENCE_TEST = textwrap.dedent("""\
    import torch


    def check_fp16_gradients(model, batch, expected):
        model = model.half().cuda()
        model(batch.half()).sum().backward()
        torch.testing.assert_close(model.weight.grad, expected)
    """)


@pytest.mark.parametrize(
    "filename, expected",
    [("test_fp16_reference.py", []), ("fp16_test.py", []), ("check_fp16.py", ["AMP001"] * 2)],
)
def test_tests_that_assert_choose_dtypes_on_purpose(tmp_path, flake8, filename, expected):
    """In a pytest test module, a function that asserts on what it computed casts on purpose."""
    write(tmp_path, filename, FP16_REFERENCE_TEST)
    result = flake8(["--isolated", "--select=AMP", filename], cwd=tmp_path)
    assert codes(result.stdout) == expected


@pytest.mark.parametrize(
    "source",
    [
        """
        from functools import cached_property

        import torch

        class Net(torch.nn.Module):
            @cached_property
            def width(self):
                return 4

            @staticmethod
            def make():
                with torch.autocast("cuda"):
                    return Net()
        """,
        # names no scope binds where they are read: astroid's lookup ends in ``builtins``
        """
        import torch

        class Net(torch.nn.Module):
            NEG = -1e9

            def forward(self, scores, mask):
                return scores.masked_fill(mask, NEG)

        def train(model, x):
            with torch.autocast("cuda"):
                out = model(x)
            total = out.sum() + later
            later = 1
            return total
        """,
    ],
    ids=["method_decorator", "unbound_names"],
)
def test_lookups_do_not_build_astroids_builtins(tmp_path, source):
    """astroid's model of ``builtins`` costs ~0.1-0.4 s to build per flake8 process, and its
    ~10^5 objects are scanned by every later cyclic collection: names that no scope of the
    file binds (builtins, class attributes read in methods, locals read before their
    assignment) are answered without it."""
    source = textwrap.dedent(source)
    path = tmp_path / "net.py"
    path.write_text(source)
    program = textwrap.dedent(
        f"""
        from astroid.manager import AstroidManager
        from flake8.api import legacy
        report = legacy.get_style_guide(select=["AMP"]).check_files([{str(path)!r}])
        print(report.total_errors, "builtins" in AstroidManager().astroid_cache)
        """
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "False"]
