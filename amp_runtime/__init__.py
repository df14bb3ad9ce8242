"""Runtime guard for PyTorch mixed-precision training.

    with amp_runtime.guard() as g:
        train()
    print(g.report.summary())
"""
# Imported eagerly: bound after the submodule loads, amp_runtime.compare is the function.
from .compare import compare
from .events import Event, GuardError, Report
from .guard import AmpRuntimeWarning, Guard, guard
from .thresholds import Thresholds

__all__ = [
    "guard", "Guard", "Event", "Report", "GuardError", "Thresholds", "AmpRuntimeWarning", "compare",
]
