"""Where an op runs: the module path (``blocks.2.mlp.fc2``) and the user's source line.

Both are read off the Python call stack when an event is emitted, so tracking costs
nothing while no event happens. (``torch.utils.module_tracker.ModuleTracker`` instead
registers a multi-grad hook per module call and keeps the handles until it exits,
which grows over a long run and costs host time per call.)
"""
from __future__ import annotations

import os
import sys
import weakref
from types import CodeType, FrameType
from typing import Dict, List, Optional, Tuple

import torch

from .events import PACKAGE_DIR
from .monitors import live_instances

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_SKIPPED_DIRS = (_TORCH_DIR, PACKAGE_DIR)


def user_frame():
    """The innermost frame outside torch and amp_runtime (the user's code), or None."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED_DIRS):
        frame = frame.f_back
    return frame


def format_source(filename: str, lineno: int) -> str:
    """``file:line``, relative to the working directory when the file is below it."""
    try:
        relative = os.path.relpath(filename)
    except ValueError:  # another drive on Windows
        relative = filename
    return f"{filename if relative.startswith('..') else relative}:{lineno}"


def user_source() -> Optional[str]:
    """``file:line`` of the user's code running now, or None."""
    frame = user_frame()
    return None if frame is None else format_source(frame.f_code.co_filename, frame.f_lineno)


#: ``(file, line)`` of the user's code, kept with a deferred reading and formatted
#: (``format_location``) only if its judge reports something.
Location = Optional[Tuple[str, int]]


def user_location() -> Location:
    """Where the user's code runs now, unformatted (cheaper than ``user_source``)."""
    frame = user_frame()
    return None if frame is None else (frame.f_code.co_filename, frame.f_lineno)


def format_location(location: Location) -> Optional[str]:
    return None if location is None else format_source(*location)


def op_name(func) -> str:
    """A torch function's short name: ``linear``, ``sum``, ``__add__``."""
    return getattr(func, "__name__", None) or str(func)


class ModuleTracker:
    """Names the module whose forward is running, from the Python call stack.

    Nothing is installed: every ``module(...)`` call runs ``Module._call_impl``, whose
    frame holds the module, so the running modules are read off the stack only when an
    event needs a name. This costs nothing per op or per module call (global forward
    hooks would cost ~3% of a small model's step and force ``_call_impl``'s slow path),
    and it is naturally per thread.

    Names come from ``model.named_modules()`` when a model is given; otherwise a module
    is named, the first time it is asked for, by where it sits in the running module
    that contains it, or for a module not running (``model.blocks[2].half()``) in the live
    root module that contains it. The root module is reported by its class name.
    """

    def __init__(self, model: Optional[torch.nn.Module] = None):
        self._names: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()
        #: The module call frame ``site`` read last, its module's path and the user's code
        #: that called it.
        self._last_call: Tuple[Optional[FrameType], Optional[str], Location] = (None, None, None)
        #: Whether a code object is the user's (outside torch and amp_runtime), as ``site`` found.
        self._user_code: Dict[CodeType, bool] = {}
        if model is not None:
            for name, module in model.named_modules():
                self._names.setdefault(module, name)

    def current(self) -> Optional[str]:
        """Path of the innermost running module, or None outside any module."""
        stack = running_modules()
        if not stack:
            return None
        return self._path(stack[-1], stack) or type(stack[-1]).__name__

    def site(self) -> Tuple[Optional[str], Location]:
        """Where the running op was called: the innermost running module's path and the user's
        code, read in one short walk up the stack, cheap enough to take for every op while
        tracing. It stops at the innermost module call when the op ran in the user's code of
        that module's forward; for an op inside a module of torch's (``nn.Linear``) the user's
        line is the one that called the module, remembered with the call."""
        frame = sys._getframe(1)
        location = None
        user_code = self._user_code
        while frame is not None:
            code = frame.f_code
            if code is _CALL_IMPL_CODE:
                call, module_path, call_location = self._last_call
                if frame is not call:  # ops of one forward: read its module once
                    module_path, call_location = self._module_call(frame)
                return module_path, location or call_location
            if location is None:
                users = user_code.get(code)
                if users is None:
                    users = user_code[code] = not code.co_filename.startswith(_SKIPPED_DIRS)
                if users:
                    location = (code.co_filename, frame.f_lineno)
            frame = frame.f_back
        return None, location

    def _module_call(self, frame: FrameType) -> Tuple[Optional[str], Location]:
        """The module of a ``Module._call_impl`` frame and the user's code that called it."""
        module = frame.f_locals.get("self")
        module_path, caller = None, frame.f_back
        if isinstance(module, torch.nn.Module):
            module_path = self._names.get(module)
            if module_path is None:  # the first time: named from the running modules
                module_path = self.current()
            module_path = module_path or type(module).__name__
        while caller is not None and caller.f_code.co_filename.startswith(_SKIPPED_DIRS):
            caller = caller.f_back
        location = None if caller is None else (caller.f_code.co_filename, caller.f_lineno)
        self._last_call = (frame, module_path, location)
        return module_path, location

    def release_frames(self) -> None:
        """Forget the module call ``site`` read last (its frame keeps the call's locals alive)."""
        self._last_call = (None, None, None)

    def name_of(self, module: torch.nn.Module) -> str:
        """Path of ``module`` (running or not), or its class name when unknown."""
        return self._path(module, running_modules()) or type(module).__name__

    def _path(self, module: torch.nn.Module, stack: List[torch.nn.Module]) -> str:
        """Dotted path below the root ("" for the root), found once and cached."""
        path = self._names.get(module)
        if path is None:
            path = self._discover(module, stack)
            self._names[module] = path
        return path

    def _discover(self, module: torch.nn.Module, stack: List[torch.nn.Module]) -> str:
        """The path of ``module`` below the innermost running module that contains it."""
        for depth in range(len(stack) - 1, -1, -1):
            parent = stack[depth]
            path = _path_below(parent, module)
            if path:
                prefix = self._path(parent, stack[:depth])
                return f"{prefix}.{path}" if prefix else path
        if stack:
            return ""  # running below a root that does not contain it: no better name
        return next(filter(None, (_path_below(root, module) for root in live_root_modules())), "")


def _path_below(parent: torch.nn.Module, module: torch.nn.Module) -> str:
    """The dotted path of ``module`` inside ``parent`` ("" if it is not a descendant)."""
    return next((path for path, child in parent.named_modules() if child is module and path), "")


_CALL_IMPL_CODE = torch.nn.Module._call_impl.__code__


def live_root_modules() -> List[torch.nn.Module]:
    """Every live module that is no other live module's child (a heap walk: call rarely)."""
    modules = live_instances(torch.nn.Module)
    children = {id(child) for module in modules for child in module.children()}
    return [module for module in modules if id(module) not in children]


def running_modules() -> List[torch.nn.Module]:
    """Modules whose forward is running in this thread, outermost first."""
    modules = []
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _CALL_IMPL_CODE:
            module = frame.f_locals.get("self")
            if isinstance(module, torch.nn.Module):
                modules.append(module)
        frame = frame.f_back
    modules.reverse()
    return modules
