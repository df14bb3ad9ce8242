"""Torch functions the guard observes by replacing them, so that they are seen on every step.

The guard's mode is on the stack only on watched steps (``Guard`` in ``guard.py``): every
torch call crossing a Python TorchFunctionMode costs time, and the code-pattern rules need
to see a loop's code once, not at every step. The step-level checks must see a few calls on
every step, though: where backward starts (AMP112's loss check, AMP008, AMP006's scaled
backward, step detection), the norms ``clip_grad_norm_`` computes (AMP005) and the loss-scale
kernels of GradScaler subclasses (``monitors/scaler.py``).
Those functions are replaced on their modules while a guard is active, and run the handlers
the mode would have run, with the mode off, as the mode runs them.

Calls through the attribute (``loss.backward()``, ``torch.autograd.grad(...)``,
``clip_grad_norm_``'s ``torch._foreach_norm``) are seen; a name imported before the guard
was entered (``from torch.autograd import grad``) is seen on watched steps only.
"""
from __future__ import annotations

import abc
import functools
import threading
from typing import Any, Callable, Iterable, Tuple

import torch

#: (owner, attribute) of each function replaced while a guard is active.
ENTRY_POINTS: Tuple[Tuple[Any, str], ...] = (
    (torch.Tensor, "backward"),
    (torch.autograd, "backward"),
    (torch.autograd, "grad"),
    (torch, "_foreach_norm"),
)

#: The original functions: the keys under which monitors declare their handlers.
ORIGINALS = tuple(vars(owner)[name] for owner, name in ENTRY_POINTS)


class Shared(abc.ABC):
    """Something of torch's changed while at least one guard uses it: ``start`` runs for the
    first user, ``stop`` after the last (refcounted; thread-safe: both run under ``lock``,
    which subclasses also take to act only while ``active``)."""

    def __init__(self):
        self.lock = threading.RLock()
        self._users = 0

    @property
    def active(self) -> bool:
        return self._users > 0

    def acquire(self) -> None:
        with self.lock:
            self._users += 1
            if self._users == 1:
                self.start()

    def release(self) -> None:
        with self.lock:
            self._users -= 1
            if self._users == 0:
                self.stop()

    @abc.abstractmethod
    def start(self) -> None:
        """Change torch (the first user came)."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Undo ``start`` (the last user left)."""


def restore(owner: Any, name: str, original: Any, ours: Any) -> None:
    """Put ``original`` back as ``owner.name`` if that is still ``ours``: code that patched
    it after us keeps its own."""
    if vars(owner).get(name) is ours:
        setattr(owner, name, original)


class SharedPatch(Shared):
    """Attributes replaced while at least one user holds the patch."""

    def __init__(self, replacements: Iterable[Tuple[Any, str, Callable]]):
        super().__init__()
        self._replacements = [(owner, name, vars(owner)[name], new)
                              for owner, name, new in replacements]

    def start(self) -> None:
        for owner, name, _, new in self._replacements:
            setattr(owner, name, new)

    def stop(self) -> None:
        for owner, name, original, new in self._replacements:
            restore(owner, name, original, new)


#: The guard that runs the calling thread's calls of the entry points (its innermost active
#: guard), or None: ``guard.current_guard``, handed over by the first observer.
_current_guard: Callable[[], Any] = lambda: None


def _observed(original: Callable) -> Callable:
    @functools.wraps(original)
    def observed(*args, **kwargs):
        guard = _current_guard()
        if guard is None or guard.passes_entry_points():  # another thread, no guard, or its own
            return original(*args, **kwargs)
        # the original runs once whatever the guard's code does around it
        return guard.containment.around(guard, original, args, kwargs, guard.run_entry_point)

    return observed


_PATCH = SharedPatch(
    (owner, name, _observed(original))
    for (owner, name), original in zip(ENTRY_POINTS, ORIGINALS)
)


def observe_entry_points(current_guard: Callable[[], Any]) -> None:
    """Replace the entry points (for the first observer) and route each call to
    ``current_guard().run_entry_point``; undone by ``stop_observing_entry_points``."""
    global _current_guard
    _current_guard = current_guard
    _PATCH.acquire()


def stop_observing_entry_points() -> None:
    _PATCH.release()
