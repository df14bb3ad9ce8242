"""Runtime guard for PyTorch mixed-precision training.

    with amp_runtime.guard() as g:
        train()
    print(g.report.summary())

The names that need torch (``guard``, ``Guard``, ``compare``) load
on first use: the pytest plugin and ``python -m amp_runtime report`` import this package,
and must neither break where torch is missing nor make every pytest run import it.
"""
import importlib
import sys
import types

from .events import AmpRuntimeWarning, Event, GuardError, Report
from .thresholds import Thresholds

#: Public name -> the submodule that defines it.
_LAZY = {"guard": "guard", "Guard": "guard", "compare": "compare"}

__all__ = [
    "guard", "Guard", "Event", "Report", "GuardError", "Thresholds", "AmpRuntimeWarning", "compare",
]


class _Package(types.ModuleType):
    """``amp_runtime.guard`` and ``amp_runtime.compare`` stay the functions even though
    importing the submodules of the same names sets them on the package."""

    def __getattr__(self, name):
        if name not in _LAZY:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{self.__name__}.{_LAZY[name]}"), name)
        super().__setattr__(name, value)
        return value

    def __setattr__(self, name, value):
        if name in _LAZY and isinstance(value, types.ModuleType):
            return  # the import system binding a submodule: the function keeps the name
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
