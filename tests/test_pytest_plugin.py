"""The amp_guard pytest plugin, exercised through real pytest sessions (pytester)."""
import pytest
import torch
from test_no_torch import _blocked_env

import amp_runtime


def _load_what_guarded_steps_load():
    """pytester's in-process runs unload every module they import, and torch's lazily
    imported parts (torch._dynamo, loaded by optimizer.step) fail when imported twice in
    one process: load them here, before any such run."""
    model = torch.nn.Linear(2, 1)
    with amp_runtime.guard(policy="record"):
        model(torch.ones(1, 2)).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()


_load_what_guarded_steps_load()

pytest_plugins = ["pytester"]

HEALTHY = """
import torch

def test_healthy_step(amp_guard):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(4, 8)).float().pow(2).mean()
    loss.backward()
    opt.step()
    assert amp_guard.report.events == []
"""


def _overflow_suite(pytester, marker="", fixture="amp_guard"):
    """One test whose fp16 multiply overflows (line 6 of test_overflow.py)."""
    pytester.makepyfile(test_overflow=f"""
import pytest
import torch

{marker}
def test_overflow({fixture}):
    y = torch.full((2, 4), 300.0, dtype=torch.float16) * 300.0  # 90000 > 65504: inf
    assert y.dtype == torch.float16
""")


def _run(pytester, *args):
    return pytester.runpytest("-p", "no:cacheprovider", *args)


def test_an_overflowing_fp16_step_fails_with_the_event_table(pytester):
    _overflow_suite(pytester, '@pytest.mark.amp_guard(trace="always")')
    result = _run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "amp_guard: AMP101 not allowed (1 event(s))",
        "code*sev*count*step*op*module*source*message*",
        "AMP101*P0*test_overflow.py:6*",
        "FAILED test_overflow.py::test_overflow - amp_guard: AMP101 not allowed*",
    ])


def test_policy_raise_shows_the_tests_line_not_the_guards_frames(pytester):
    """The overflow is judged when the test body ends (its readings are flushed then, before
    the report): the failure is the GuardError naming the test's line, without a traceback
    through the guard."""
    _overflow_suite(pytester, '@pytest.mark.amp_guard(trace="always", policy="raise")')
    result = _run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "GuardError: AMP101 (P0) *step 0* mul: mul produced inf*at test_overflow.py:6",
        "FAILED test_overflow.py::test_overflow - *GuardError: AMP101*",
    ])
    assert "amp_runtime/" not in result.stdout.str()


def test_policy_raise_in_a_training_step_stops_it_at_the_optimizer_step(pytester):
    """Readings are judged when the optimizer is about to apply the step (on the CPU before it
    does): the GuardError is raised there, in the test's own frame."""
    pytester.makepyfile(test_nan_step="""
import pytest
import torch

@pytest.mark.amp_guard(policy="raise")
def test_nan_step(amp_guard):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    try:
        (model(torch.ones(2, 4)) * float("nan")).sum().backward()
        opt.step()
    finally:
        assert torch.equal(model.weight, before)  # the NaN step was not applied
""")
    result = _run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([">*opt.step()", "E*GuardError: AMP112*",
                                 "test_nan_step.py:11: GuardError"])
    assert "amp_runtime/" not in result.stdout.str()


def test_a_healthy_step_passes(pytester):
    pytester.makepyfile(test_healthy=HEALTHY)
    _run(pytester).assert_outcomes(passed=1)


def test_allow_lets_a_listed_code_pass_but_a_prefix_never_allows_p0(pytester):
    _overflow_suite(pytester, '@pytest.mark.amp_guard(trace="always", allow=["AMP101", "AMP102"])')
    _run(pytester).assert_outcomes(passed=1)
    _overflow_suite(pytester, '@pytest.mark.amp_guard(trace="always", allow=["AMP1"])')
    result = _run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["amp_guard: AMP101 not allowed (1 event(s); allowed: AMP1)",
                                 "AMP101*P0*"])


def test_ini_options_allow_and_trace(pytester):
    pytester.makeini("[pytest]\namp_guard_allow = AMP101 AMP102\namp_guard_trace = always\n")
    _overflow_suite(pytester)
    _run(pytester).assert_outcomes(passed=1)


def test_the_flag_guards_every_test(pytester):
    _overflow_suite(pytester, fixture="")
    pytester.makepyfile(test_plain="def test_plain():\n    assert 1 + 1 == 2\n")
    _run(pytester).assert_outcomes(passed=2)  # unguarded without the flag
    pytester.makeini("[pytest]\namp_guard_trace = always\n")
    result = _run(pytester, "--amp-guard")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["FAILED test_overflow.py::test_overflow*"])


def test_a_marker_alone_guards_the_test(pytester):
    _overflow_suite(pytester, '@pytest.mark.amp_guard(trace="always")', fixture="")
    _run(pytester).assert_outcomes(failed=1)


def test_help_documents_the_options_and_the_marker_is_registered(pytester):
    _run(pytester, "--help").stdout.fnmatch_lines([
        "*--amp-guard*",
        "*amp_guard_allow*",
        "*amp_guard_trace*",
    ])
    _run(pytester, "--markers").stdout.fnmatch_lines(["@pytest.mark.amp_guard(allow=*"])
    pytester.makepyfile(test_strict="import pytest\n\n@pytest.mark.amp_guard\ndef test_x(): pass\n")
    _run(pytester, "--strict-markers").assert_outcomes(passed=1)


def test_without_torch_plain_suites_run_and_the_fixture_fails_clearly(
        pytester, monkeypatch, tmp_path):
    # "import torch" fails from interpreter start, as on a lint-only machine: the plugin
    # itself is loaded through its entry point before any conftest could intervene
    monkeypatch.setenv("PYTHONPATH", _blocked_env(tmp_path)["PYTHONPATH"])
    pytester.makepyfile(
        test_plain="def test_plain():\n    assert True\n",
        test_uses=("def test_uses(amp_guard):\n    pass\n"),
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*the amp_guard fixture needs torch*install flake8-amp?runtime?"])


def test_loading_the_plugin_does_not_import_torch(pytester):
    pytester.makepyfile(test_modules="""
import sys

def test_no_torch_yet():
    assert "amp_runtime.pytest_plugin" in sys.modules
    assert "torch" not in sys.modules
""")
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_a_misconfigured_marker_fails_the_test_with_a_clear_message(pytester):
    pytester.makepyfile(test_bad="""
import pytest

@pytest.mark.amp_guard(trace="sometimes")
def test_bad_trace():
    pass

@pytest.mark.amp_guard(allow=[101])
def test_bad_allow():
    pass
""")
    result = _run(pytester)
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines([
        "*amp_guard (marker or amp_guard_* ini options): *sometimes*",
        "*: allow= takes AMP codes as strings, got 101",
    ])


#: (module, class, method made to fail, the test's step, what the test body sees)
BROKEN_PARTS = [
    # a handler, run during the test body
    ("amp_runtime.rules.amp008", "BackwardUnderAutocast", "_check",
     "model(torch.randn(4, 8)).pow(2).mean().backward()",
     'assert [e.code for e in amp_guard.report.events] == ["AMP100"]'),
    # the judge of a reading still pending when the body ends, judged by the plugin's flush
    ("amp_runtime.monitors.forward", "ForwardMonitor", "_judge_loss",
     '(model(torch.randn(4, 8)).sum() * float("nan")).backward()',
     "assert len(amp_guard.report) == 0"),
]


@pytest.mark.parametrize("module, monitor, method, step, seen", BROKEN_PARTS,
                         ids=[method for _, _, method, _, _ in BROKEN_PARTS])
def test_a_failure_of_the_guard_itself_does_not_fail_the_test(pytester, module, monitor, method,
                                                              step, seen):
    """AMP100 says a part of the guard broke and was switched off: not the test's fault."""
    pytester.makepyfile(test_guard_bug=f"""
import pytest
import torch
from {module} import {monitor}

def broken(self, *args):
    raise ValueError("a bug in the check")

@pytest.fixture
def broken_part(monkeypatch):
    monkeypatch.setattr({monitor}, "{method}", broken)

def test_step(broken_part, amp_guard):
    model = torch.nn.Linear(8, 2)
    {step}
    {seen}
""")
    result = _run(pytester, "-rP")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"*AMP100*P2*{monitor} failed (ValueError*"])


def test_a_repeated_event_fails_the_test_once_with_its_exact_count(pytester):
    pytester.makepyfile(test_repeated="""
import torch

def test_steps(amp_guard):
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(30):
        (model(torch.randn(4, 8)).sum() * float("nan")).backward()
        optimizer.zero_grad()
""")
    result = _run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["amp_guard: AMP112 not allowed (30 event(s))",
                                 "AMP112*P0*30*0*backward*"])
