"""python -m amp_runtime ..., run as users run it, on small real scripts."""
import json
import subprocess
import sys
import textwrap

import pytest
from test_no_torch import _blocked_env

from amp_runtime.cli import main


def amp_runtime(*args, cwd):
    return subprocess.run([sys.executable, "-m", "amp_runtime", *map(str, args)],
                          cwd=cwd, capture_output=True, text=True, timeout=300)


def script(path, body):
    path.write_text(textwrap.dedent(body), encoding="utf-8")
    return path


OVERFLOW = """\
    import torch
    x = torch.full((2, 4), 300.0, dtype=torch.float16)
    y = x * x  # inf in fp16
"""


def test_run_executes_the_script_as_main_with_its_argv_path_and_exit_code(tmp_path):
    (tmp_path / "sub").mkdir()
    script(tmp_path / "sub" / "train.py", """\
        import json, pickle, sys

        class Config:
            pass

        pickle.dumps(Config())  # classes of the script are __main__.Config
        print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "name": __name__}))
        sys.exit(3)
    """)
    result = amp_runtime("run", "--out", "out", "sub/train.py", "--epochs", "1", "--x",
                         cwd=tmp_path)
    assert result.returncode == 3, result.stderr
    seen = json.loads(result.stdout)
    assert seen == {"argv": ["sub/train.py", "--epochs", "1", "--x"],
                    "path0": str((tmp_path / "sub").resolve()), "name": "__main__"}
    assert "amp_runtime: no events" in result.stderr
    assert (tmp_path / "out" / "events.jsonl").exists()


def test_run_reports_events_and_builds_the_report(tmp_path):
    script(tmp_path / "overflow.py", OVERFLOW)
    result = amp_runtime("run", "--trace", "always", "overflow.py", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "AMP101" in result.stderr and "overflow.py:3" in result.stderr
    assert "code    sev  count" in result.stderr  # the summary table
    report = tmp_path / "amp-report" / "report.html"
    assert f"amp_runtime: report at {report.relative_to(tmp_path)}" in result.stderr
    assert "AMP101" in report.read_text(encoding="utf-8")

    again = amp_runtime("report", "amp-report", "--out", "page.html", cwd=tmp_path)
    assert again.returncode == 0 and again.stdout.strip() == "page.html"
    assert (tmp_path / "page.html").read_text(encoding="utf-8").startswith("<!DOCTYPE html>")


def test_run_options_select_policy_and_no_report(tmp_path):
    script(tmp_path / "overflow.py", OVERFLOW)
    (tmp_path / "amp-report").mkdir()
    (tmp_path / "amp-report" / "report.html").write_text("an earlier run's page")
    ignored = amp_runtime("run", "--trace", "always", "--ignore", "AMP101,AMP102", "--no-report",
                          "overflow.py", cwd=tmp_path)
    assert ignored.returncode == 0 and "amp_runtime: no events" in ignored.stderr
    assert not (tmp_path / "amp-report" / "report.html").exists()  # it would describe old logs
    assert (tmp_path / "amp-report" / "events.jsonl").exists()

    raised = amp_runtime("run", "--trace", "always", "--policy", "raise", "overflow.py",
                         cwd=tmp_path)
    assert raised.returncode == 1
    # judged when the guard exits, after the script (it has no training step): the message
    # names the line, and no traceback runs through the guard
    assert "GuardError: AMP101" in raised.stderr and "at overflow.py:3" in raised.stderr
    assert 'File "' not in raised.stderr and "amp_runtime/" not in raised.stderr


def test_a_failing_script_shows_its_own_traceback_and_exit_status(tmp_path):
    script(tmp_path / "fails.py", """\
        def main():
            raise ValueError("bad batch")

        main()
    """)
    result = amp_runtime("run", "fails.py", cwd=tmp_path)
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    # the guard's summary and report first; the script's error last, as a log's tail shows it
    start = lines.index("Traceback (most recent call last):")
    assert lines[:start] and all(line.startswith("amp_runtime: ") for line in lines[:start])
    assert 'fails.py", line 4, in <module>' in lines[start + 1]
    assert lines[-1] == "ValueError: bad batch"
    assert "amp_runtime" not in "\n".join(lines[start:])  # no frames of the runner


def test_doctor_text_and_json(tmp_path):
    text = amp_runtime("doctor", cwd=tmp_path)
    assert text.returncode == 0 and "Recommended on" in text.stdout
    data = json.loads(amp_runtime("doctor", "--json", cwd=tmp_path).stdout)
    assert data["recommendations"][0]["dtype"] in ("bfloat16", "float16", "float32")


def test_compare_imports_a_factory_and_names_the_module_to_keep(tmp_path):
    script(tmp_path / "model.py", """\
        import torch
        from torch import nn

        class Square(nn.Module):
            def forward(self, x):
                return x * x

        def example():
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(8, 8), Square(), nn.Linear(8, 2))
            return model, torch.randn(4, 8) * 2000
    """)
    text = amp_runtime("compare", "model.py:example", "--dtype", "float16", cwd=tmp_path)
    assert text.returncode == 0, text.stderr
    assert "Keep in float32:\n  1: its own code overflows to NaN/Inf" in text.stdout
    assert "def keep_fp32(module):" in text.stdout
    as_json = amp_runtime("compare", "model:example", "--json", "--dtype", "float16", cwd=tmp_path)
    data = json.loads(as_json.stdout)
    assert data["keep_fp32"] == ["1"] and data["dtype"] == "float16"


@pytest.mark.parametrize("command", [(), ("run",), ("report",), ("doctor",), ("compare",)])
def test_every_command_has_help(capsys, command):
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m amp_runtime")


BAD_INPUT = [
    ((), "the following arguments are required: COMMAND"),
    (("bogus",), "invalid choice: 'bogus'"),
    (("run",), "the following arguments are required: SCRIPT"),
    (("run", "--"), "the following arguments are required: SCRIPT"),
    (("run", "missing.py"), "run: missing.py: no such file"),
    (("run", "-m", "no_such_pkg.train"), "run: -m no_such_pkg.train: no such module"),
    (("run", "--trace", "sometimes", "x.py"), "invalid choice: 'sometimes'"),
    (("run", "--select", ",", "x.py"), "expected AMP codes"),
    (("run", "--out", "x.py", "x.py"), "--out x.py: exists and is not a folder"),
    (("report", "nowhere"), "report: nowhere: no such directory"),
    (("report", "."), "neither events.jsonl nor metrics.jsonl"),
    (("compare", "nocolon"), "is not MODULE:FACTORY"),
    (("compare", "no_such_module:f"), "cannot import no_such_module"),
    (("compare", "missing.py:f"), "missing.py: no such file"),
    (("compare", "model.py:bare"), "bare() returned a model without inputs: give --input-shape"),
    (("compare", "model.py:example", "--input-shape", "4,8"),
     "--input-shape is for factories that return only a model"),
    (("compare", "model.py:bare", "--input-shape", "4,x"), "expected positive sizes"),
    (("compare", "model.py:example", "--device-type", "cuda"),
     "device_type 'cuda' does not match the model and inputs, which are on 'cpu'"),
]

MODEL = """\
    import torch
    from torch import nn

    def example():
        return nn.Linear(8, 2), torch.randn(4, 8)

    def bare():
        return nn.Linear(8, 2)

    def broken():
        raise ValueError("no data here")
"""


@pytest.mark.parametrize("args, message", BAD_INPUT)
def test_bad_input_is_one_line_and_exit_status_2(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("print('never runs')\n", encoding="utf-8")
    script(tmp_path / "model.py", MODEL)
    assert main(list(args)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err


def test_bad_input_through_the_real_command_line(tmp_path):
    for args, message in (BAD_INPUT[0], BAD_INPUT[4], BAD_INPUT[9]):  # none, run, report
        result = amp_runtime(*args, cwd=tmp_path)
        assert result.returncode == 2
        assert result.stderr.count("\n") == 1 and message in result.stderr


def test_report_and_help_run_where_torch_is_missing(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "metrics.jsonl").write_text('{"step": 0, "loss": 1.5, "skipped": false}\n',
                                        encoding="utf-8")
    env = _blocked_env(tmp_path)
    for args in (("--help",), ("report", "logs")):
        result = subprocess.run([sys.executable, "-m", "amp_runtime", *args], cwd=tmp_path,
                                env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
    assert (logs / "report.html").exists()


def test_guard_and_compare_stay_the_functions_when_their_submodules_are_imported():
    check = ("import amp_runtime, sys; assert 'torch' not in sys.modules; "
             "from amp_runtime.guard import Guard; from amp_runtime.compare import ErrorStats; "
             "assert callable(amp_runtime.guard) and amp_runtime.guard.__name__ == 'guard'; "
             "assert amp_runtime.compare.__name__ == 'compare' and callable(amp_runtime.compare)")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr


def test_run_passes_everything_after_the_script_on_verbatim(tmp_path):
    script(tmp_path / "argv.py", "import sys\nprint(sys.argv[1:])\n")
    after_script = amp_runtime("run", "--no-report", "argv.py", "--", "--out", "x", cwd=tmp_path)
    assert after_script.stdout.strip() == "['--', '--out', 'x']", after_script.stderr
    before_script = amp_runtime("run", "--no-report", "--", "argv.py", "--policy", "raise",
                                cwd=tmp_path)
    assert before_script.stdout.strip() == "['--policy', 'raise']", before_script.stderr


def test_compare_builds_inputs_for_a_bare_model_and_repeats_itself(tmp_path):
    script(tmp_path / "nets.py", """\
        import torch
        from torch import nn

        class Net(nn.Sequential):
            def __init__(self):
                super().__init__(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

        def noisy():  # unseeded: the command seeds before calling it
            return Net(), torch.randn(4, 8)
    """)
    bare = amp_runtime("compare", "nets.py:Net", "--input-shape", "4,8", "--json", cwd=tmp_path)
    assert bare.returncode == 0, bare.stderr
    assert {m["name"] for m in json.loads(bare.stdout)["modules"]} == {"(model)", "0", "1", "2"}
    first, second = (amp_runtime("compare", "nets.py:noisy", "--json", cwd=tmp_path).stdout
                     for _ in range(2))
    assert first == second and json.loads(first)["modules"]


def test_a_failing_factory_shows_its_own_traceback(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    script(tmp_path / "model.py", MODEL)
    assert main(["compare", "model.py:broken"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):\n  File \"model.py\", line 11")
    assert err.endswith("ValueError: no data here\n") and "cli.py" not in err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("python -m amp_runtime 0.")


def test_help_of_run_and_compare_shows_examples(capsys):
    for command, example in (("run", "run train.py --epochs 1"),
                             ("compare", "compare mypkg.models:MyNet --input-shape 8,3,32,32")):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert f"python -m amp_runtime {example}" in capsys.readouterr().out


def test_run_m_runs_a_module_as_python_m_does(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("", encoding="utf-8")
    (tmp_path / "pkg" / "helper.py").write_text("VALUE = 7\n", encoding="utf-8")
    script(tmp_path / "pkg" / "train.py", """\
        import json, sys
        from .helper import VALUE  # relative imports work only when run as a module

        print(json.dumps({"argv": sys.argv[1:], "name": __name__, "value": VALUE}))
        sys.exit(4)
    """)
    result = amp_runtime("run", "--no-report", "-m", "pkg.train", "--out", "x", cwd=tmp_path)
    assert result.returncode == 4, result.stderr
    assert json.loads(result.stdout) == {"argv": ["--out", "x"], "name": "__main__", "value": 7}


def test_run_works_with_forked_dataloader_workers(tmp_path):
    script(tmp_path / "loader.py", """\
        import multiprocessing
        import torch
        from torch.utils.data import DataLoader, Dataset

        class Squares(Dataset):  # defined in __main__, as in most training scripts
            def __len__(self):
                return 16

            def __getitem__(self, i):
                return torch.full((4,), float(i))

        if __name__ == "__main__":
            model = torch.nn.Linear(4, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            loader = DataLoader(Squares(), batch_size=4, num_workers=2,
                                multiprocessing_context=multiprocessing.get_context("fork"))
            for x in loader:
                model(x).pow(2).mean().backward()
                opt.step()
            print("batches done")
    """)
    result = amp_runtime("run", "loader.py", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "batches done" and "Traceback" not in result.stderr
    assert len((tmp_path / "amp-report" / "metrics.jsonl").read_text().splitlines()) == 4
