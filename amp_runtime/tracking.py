"""Where an op runs: the module path (``blocks.2.mlp.fc2``) and the user's source line.

``ModuleTracker`` is a lean alternative to ``torch.utils.module_tracker.ModuleTracker``:
that one registers a multi-grad hook on every module call and keeps the handles until
it exits, which grows without bound over a long run and costs host time per call. The
guard only needs the forward-side path, so two global forward hooks maintain a stack.
The hooks are global (all threads); calls from threads other than the guard's are
ignored.
"""
from __future__ import annotations

import os
import sys
import threading
import weakref
from typing import List, Optional

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_SKIPPED_DIRS = (_TORCH_DIR, _PACKAGE_DIR)


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


def op_name(func) -> str:
    """A torch function's short name: ``linear``, ``sum``, ``__add__``."""
    return getattr(func, "__name__", None) or str(func)


class ModuleTracker:
    """Keeps the stack of modules running their forward in one thread.

    Names come from ``model.named_modules()`` when a model is given; otherwise a module
    is named, the first time it runs, by where it sits in the module that called it. The
    root module is reported by its class name.
    """

    def __init__(self, model: Optional[torch.nn.Module] = None):
        self._names: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()
        self._stack: List[torch.nn.Module] = []
        self._thread = threading.get_ident()
        self._handles = []
        if model is not None:
            for name, module in model.named_modules():
                self._names.setdefault(module, name)

    def attach(self) -> None:
        self._thread = threading.get_ident()
        self._handles = [
            register_module_forward_pre_hook(self._enter),
            register_module_forward_hook(self._leave, always_call=True),
        ]

    def detach(self) -> None:
        for handle in reversed(self._handles):
            handle.remove()
        self._handles = []
        self._stack.clear()

    def _enter(self, module, args):
        if threading.get_ident() == self._thread:
            self._stack.append(module)

    def _leave(self, module, args, output):
        if threading.get_ident() != self._thread:
            return
        # Pop up to this module: a module that raised may have skipped its own pop.
        while self._stack:
            if self._stack.pop() is module:
                break

    def current(self) -> Optional[str]:
        """Path of the innermost running module, or None outside any module."""
        if not self._stack:
            return None
        return self.name_of(self._stack[-1])

    def name_of(self, module: torch.nn.Module) -> str:
        return self._path(module) or type(module).__name__

    def _path(self, module: torch.nn.Module) -> str:
        """Dotted path below the root ("" for the root), found once and cached."""
        path = self._names.get(module)
        if path is None:
            path = self._names[module] = self._discover(module)
        return path

    def _discover(self, module: torch.nn.Module) -> str:
        """The path of ``module`` below the innermost running module that contains it."""
        for parent in reversed(self._stack):
            if parent is module:
                continue
            for path, child in parent.named_modules():
                if child is module and path:
                    prefix = self._path(parent)
                    return f"{prefix}.{path}" if prefix else path
        return ""
