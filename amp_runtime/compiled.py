"""torch.compile under a guard: the guard learns when compilation starts and ends.

Dynamo records the TorchFunctionMode stack when it compiles a frame and guards the compiled code
on it: a compiled model called once with the guard's mode on the stack (a watched step) and once
without (an unwatched one) would be compiled twice, and again at every change. So at the start of
the first compilation in its thread, before dynamo records the stack, a guard takes its mode off
the stack for the rest of the run (``Guard.compilation_starts``): compiled code always meets the
same stack, and per-op checks, which cannot see inside compiled graphs anyway, stop. The
step-level checks (loss at backward, gradients, loss scale, step detection) go on: they reach the
guard through entry points, hooks and GradScaler's methods, not through the mode.

While compilation runs (dynamo, AOTAutograd and inductor trace the model, calling autograd on
fake tensors, possibly inside the user's autocast region), the guard's entry points and handlers
step aside: what they would see is the compiler's work, not the user's backward (the cause of a
false AMP008 on compiled models). The start of a compilation is also a moment the compiled model is
running: its root module is remembered for names (``tracking.py``).

Dynamo's compile callbacks (``torch._dynamo.callback_handler``) are registered while a guard is
active, only if dynamo is loaded (importing it costs most of a second): at entry, or from
``torch.compile`` itself, which the guard wraps while active.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import torch

from .entry_points import SharedPatch

#: The guard compiling in the calling thread (``guard.current_guard``), set by the first user.
_current_guard: Callable[[], Any] = lambda: None


def _compilation_starts(*args) -> None:
    guard = _current_guard()
    if guard is not None:
        guard.compilation_starts()


def _compilation_ends(*args) -> None:
    guard = _current_guard()
    if guard is not None:
        guard.compilation_ends()


_CALLBACKS = (_compilation_starts, _compilation_ends)


def _callback_lists():
    """Dynamo's lists of start and end callbacks, or None while dynamo is not loaded."""
    handler = getattr(sys.modules.get("torch._dynamo"), "callback_handler", None)
    if handler is None:
        return None
    return handler.start_callbacks, handler.end_callbacks


_ORIGINAL_COMPILE = torch.compile


@functools.wraps(_ORIGINAL_COMPILE)
def _compile(*args, **kwargs):
    compiled = _ORIGINAL_COMPILE(*args, **kwargs)  # compiles lazily, at the first call
    guard = _current_guard()
    if guard is not None:  # dynamo is loaded now: the callbacks can go on its lists
        guard.containment.call(guard, _WATCH.register)
    return compiled


class _CompileWatch(SharedPatch):
    """``torch.compile`` replaced, and the callbacks on dynamo's lists, while a guard is active."""

    def register(self) -> None:
        """Put the callbacks on dynamo's lists (again after ``torch._dynamo.reset()`` cleared
        them), once dynamo is loaded."""
        lists = _callback_lists()
        with self.lock:
            if lists is None or not self.active:
                return
            for callbacks, callback in zip(lists, _CALLBACKS):
                if callback not in callbacks:
                    callbacks.append(callback)

    def stop(self) -> None:
        super().stop()
        for callbacks, callback in zip(_callback_lists() or (), _CALLBACKS):
            while callback in callbacks:
                callbacks.remove(callback)


_WATCH = _CompileWatch([(torch, "compile", _compile)])


def watch_compilations(current_guard: Callable[[], Any]) -> None:
    """Tell ``current_guard()`` when compilations start and end, until ``stop_watching``."""
    global _current_guard
    _current_guard = current_guard
    _WATCH.acquire()
    _WATCH.register()


def stop_watching() -> None:
    _WATCH.release()
