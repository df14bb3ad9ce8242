"""pytest plugin: run tests inside an amp_runtime guard and fail them on AMP events.

- fixture ``amp_guard``: the test body runs inside ``amp_runtime.guard()`` (the fixture
  value is the Guard); the test fails when an event happened that it does not allow,
  and the failure shows the events as a table.
- marker ``@pytest.mark.amp_guard(allow=[...], trace=..., policy=..., select=..., ignore=...)``
  configures it (and applies it: a marked test is guarded without naming the fixture).
- ini options ``amp_guard_allow`` and ``amp_guard_trace``; flag ``--amp-guard`` guards
  every test.

Allowing: ``allow`` lists code prefixes, as in flake8 (``AMP102``, ``AMP10``). A P0
event (training is broken) is only allowed by its full code, never by a prefix. AMP100 (the
guard's own code failed) never fails a test: the report shows it.

torch is imported only when a guarded test runs, so the plugin costs nothing in
suites that do not use it, and never breaks a run where torch is not installed.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Sequence, Tuple

import _pytest
import pluggy
import pytest

from amp_runtime.events import GUARD_FAILURE, PACKAGE_DIR, GuardError

#: Frames of pytest, pluggy and amp_runtime (this plugin's call wrapper) above a test's own.
_RUNNER_DIRS = tuple(os.path.dirname(module.__file__) + os.sep
                     for module in (_pytest, pluggy)) + (PACKAGE_DIR,)

FIXTURE = "amp_guard"
_GUARD_KEY = pytest.StashKey[object]()
_ALLOW_KEY = pytest.StashKey[List[str]]()
_MARKER_DOC = (
    "amp_guard(allow=[...], trace='auto', policy='record', select=None, ignore=None): "
    "run the test inside an amp_runtime guard; it fails on any AMP event whose code is "
    "not allowed (P0 codes must be listed in full)."
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("amp_guard", "AMP runtime guard (amp_runtime)")
    group.addoption(
        "--amp-guard", action="store_true", dest="amp_guard",
        help="run every test inside an amp_runtime guard, as if it used the amp_guard fixture",
    )
    parser.addini(
        "amp_guard_allow", type="args", default=[],
        help="AMP codes (prefixes; P0 codes in full) a guarded test may produce without failing",
    )
    parser.addini(
        "amp_guard_trace", default="auto",
        help="per-op tracing of guarded tests: off, auto (default) or always",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", _MARKER_DOC)


def pytest_collection_modifyitems(config: pytest.Config, items: Sequence[pytest.Item]) -> None:
    """Give the fixture to every test under --amp-guard, and to every marked test."""
    everywhere = config.getoption("amp_guard")
    for item in items:
        names = getattr(item, "fixturenames", None)
        if names is None or FIXTURE in names:
            continue
        if everywhere or item.get_closest_marker(FIXTURE) is not None:
            names.append(FIXTURE)


def _codes(values) -> List[str]:
    """Codes from a list or a comma/space separated string, upper-cased."""
    if isinstance(values, str):
        values = [values]
    codes = []
    for value in values or ():
        if not isinstance(value, str):
            raise TypeError(f"allow= takes AMP codes as strings, got {value!r}")
        codes += [part.upper() for part in value.replace(",", " ").split()]
    return codes


def is_allowed(code: str, severity: str, allow: Sequence[str]) -> bool:
    if severity == "P0":
        return code in allow
    return any(code.startswith(prefix) for prefix in allow)


def _guard_options(request: pytest.FixtureRequest) -> Tuple[Dict[str, Any], List[str]]:
    """``guard()`` keyword arguments and the allowed codes, from the marker and ini options."""
    marker = request.node.get_closest_marker(FIXTURE)
    if marker and marker.args:
        raise TypeError("takes keyword arguments only (allow=, trace=, policy=, ...)")
    options = dict(marker.kwargs) if marker else {}
    allow = _codes(request.config.getini("amp_guard_allow")) + _codes(options.pop("allow", ()))
    options.setdefault("trace", request.config.getini("amp_guard_trace") or "auto")
    options.setdefault("policy", "record")
    return options, allow


@pytest.fixture
def amp_guard(request: pytest.FixtureRequest):
    """The test body runs inside ``amp_runtime.guard()``; events it does not allow fail it."""
    try:
        import torch  # noqa: F401  (the guard needs it; say so plainly when it is missing)
    except ImportError as err:
        pytest.fail(f"the amp_guard fixture needs torch ({err}); install flake8-amp[runtime]",
                    pytrace=False)
    import amp_runtime

    try:
        options, allow = _guard_options(request)
        guard = amp_runtime.guard(**options)
    except (TypeError, ValueError) as err:
        pytest.fail(f"amp_guard (marker or amp_guard_* ini options): {err}", pytrace=False)
    with guard:
        request.node.stash[_GUARD_KEY] = guard
        request.node.stash[_ALLOW_KEY] = allow
        yield guard


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """Judge the guard's device readings still in flight as the test body ends, before its
    report (which judges the events) is made; the guard itself exits at fixture teardown."""
    guard = item.stash.get(_GUARD_KEY, None)
    error = None
    try:
        result = yield
    finally:  # a test that failed on its own keeps its failure, the events go next to it
        if guard is not None:
            try:
                guard.flush()
            except GuardError as err:  # policy="raise", judged after the test's code returned
                error = err
    if error is not None:  # the event names the test's line; the guard's frames would not
        pytest.fail(f"GuardError: {error}", pytrace=False)
    return result


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    guard = item.stash.get(_GUARD_KEY, None)
    if report.when != "call" or guard is None:
        return
    if report.failed and call.excinfo is not None and call.excinfo.errisinstance(GuardError):
        _end_at_the_users_line(item, call.excinfo, report)
    events = guard.report
    if not len(events):
        return
    allow = item.stash[_ALLOW_KEY]
    # a failure of the guard's own code (AMP100) is shown, but it is not the test's fault
    failing = events.select(lambda group: group.code != GUARD_FAILURE and not all(
        is_allowed(group.code, severity, allow) for severity in group.severities))
    if not (len(failing) and report.passed):
        report.sections.append(("amp_guard events", events.summary()))
        return
    codes = ", ".join(sorted({group.code for group in failing.groups()}))
    allowed = f"; allowed: {', '.join(allow)}" if allow else ""
    report.outcome = "failed"
    report.longrepr = (  # the first line is pytest's short summary: the codes come first
        f"amp_guard: {codes} not allowed ({len(failing)} event(s){allowed})\n"
        f"{failing.summary()}"
    )


def _end_at_the_users_line(item: pytest.Item, excinfo: pytest.ExceptionInfo,
                           report: pytest.TestReport) -> None:
    """A GuardError (policy="raise") shows the test's line that raised it, not the
    guard's own frames below it (nor the runner's above it, this plugin's wrapper among them)."""
    error = excinfo.value
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_RUNNER_DIRS):
        tb = tb.tb_next
    error.__traceback__ = tb
    error.end_at_users_line()
    excinfo.traceback = excinfo.traceback.__class__(excinfo.value.__traceback__)
    report.longrepr = item.repr_failure(excinfo)
