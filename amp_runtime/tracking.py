"""Where an op runs: the module path (``blocks.2.mlp.fc2``) and the user's source line.

Both are read off the Python call stack when an event is emitted (and, while tracing, for
each checked op: ``ModuleTracker.site``), so tracking costs nothing while no event happens.
A step-level check judged after its call (a loss read at backward, judged at the optimizer
step or a step later) takes the line of that call the first time the loop makes it
(``ModuleTracker.loop_location``): a steady step reads no frame.
(``torch.utils.module_tracker.ModuleTracker`` instead registers a multi-grad hook per module
call and keeps the handles until it exits, which grows over a long run and costs host time
per call.)

Modules that are not running (a parameter's module in a gradient event, a submodule cast
with ``.half()``) are named inside the root modules the guard has seen: ``guard(model=...)``,
the outermost running module whenever the stack is read (an event, a compilation, and on the
first watched steps the first op run inside a module: ``ModuleTracker.sight``), and for a
module no root holds, a model in a variable of the user's code making the call
(``model.encoder.half()`` before the first forward). Never by searching the heap.
``torch.compile``'s wrapper is transparent: names are those of the compiled module, without
``_orig_mod``.

The user's line is the innermost frame outside torch, this package and the training
frameworks that drive the loop (Lightning, Hugging Face transformers and accelerate):
under ``Trainer.fit`` a GradScaler is stepped from Lightning's precision plugin, and
pointing there would send the user to a file they cannot change. The innermost framework
frame, where there is one, is kept as the library's line.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import sys
import weakref
from types import CodeType, FrameType
from typing import Dict, Hashable, List, Optional, Tuple

import torch

from .events import PACKAGE_DIR

#: Top-level packages of the training frameworks whose frames are not the user's.
FRAMEWORKS = ("lightning", "pytorch_lightning", "lightning_fabric", "transformers", "accelerate")


def _package_dirs(names) -> Tuple[str, ...]:
    """The folders of the installed packages among ``names``, found without importing them."""
    dirs = []
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        for location in (spec and spec.submodule_search_locations) or ():
            dirs.append(os.path.join(os.path.abspath(location), ""))
    return tuple(dirs)


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
#: Frames of the guard and of torch: skipped without a trace.
_SKIPPED_DIRS = (_TORCH_DIR, PACKAGE_DIR)
#: Frames of the frameworks (resolved once, here): skipped, the innermost kept as the library's.
_FRAMEWORK_DIRS = _package_dirs(FRAMEWORKS)
#: Whose code a frame runs (``_code_kind``).
_SKIPPED, _FRAMEWORK, _USER = range(3)


#: ``_code_kind`` of the code objects met so far (per-op tracing asks for a few at every op).
_CODE_KINDS: Dict[CodeType, int] = {}
#: Code objects remembered before ``_CODE_KINDS`` starts anew (code made by ``exec`` is new
#: each time).
MAX_CODE_KINDS = 4096


def _code_kind(code: CodeType) -> int:
    """``_SKIPPED`` (torch's, the guard's), ``_FRAMEWORK`` or ``_USER`` code."""
    kind = _CODE_KINDS.get(code)
    if kind is None:
        if len(_CODE_KINDS) >= MAX_CODE_KINDS:
            _CODE_KINDS.clear()
        filename = code.co_filename
        if filename.startswith(_FRAMEWORK_DIRS):
            kind = _FRAMEWORK
        else:
            kind = _SKIPPED if filename.startswith(_SKIPPED_DIRS) else _USER
        _CODE_KINDS[code] = kind
    return kind


def called_through(method_names: frozenset) -> bool:
    """Whether a framework method named in ``method_names`` is on the stack between the
    user's code and here (Lightning's ``manual_backward``)."""
    frame = sys._getframe(1)
    while frame is not None:
        kind = _code_kind(frame.f_code)
        if kind == _USER:
            return False
        if kind == _FRAMEWORK and frame.f_code.co_name in method_names:
            return True
        frame = frame.f_back
    return False


#: While a replay runs a root module's forward again: the code object of the guard's function
#: calling it and where the user's loop made the original call. The frames above that one are
#: where the guard judged the step, not where the module was called.
_replayed_call: List = [None, (None, None)]


def replay_calls_from(code: Optional[CodeType], location: "Location") -> None:
    """Frames of ``code`` stand for ``location`` (None: stop)."""
    _replayed_call[:] = [code, location]


def call_frames(frame) -> "Location":
    """Where the code of ``frame`` was called from, as ``(user's place, library's place)``: the
    innermost frame outside torch, this package and the frameworks (None when the whole stack
    is theirs), and the innermost framework frame inside it (None when the user's code called
    torch directly). Under a replay, the original call's place (``replay_calls_from``)."""
    library = None
    while frame is not None:
        if frame.f_code is _replayed_call[0]:
            user, replayed_library = _replayed_call[1]
            return user, _place(library) or replayed_library
        kind = _code_kind(frame.f_code)
        if kind == _USER:
            break
        if kind == _FRAMEWORK:
            library = library or frame
        frame = frame.f_back
    return _place(frame), _place(library)


def format_source(filename: str, lineno: int) -> str:
    """``file:line``, relative to the working directory when the file is below it."""
    return f"{_shown_path(filename, os.getcwd())}:{lineno}"


@functools.lru_cache(maxsize=256)
def _shown_path(filename: str, cwd: str) -> str:
    """``filename`` relative to ``cwd`` when it is below it (cached: an event that repeats at
    every step names the same few files)."""
    try:
        relative = os.path.relpath(filename, cwd)
    except ValueError:  # another drive on Windows
        return filename
    return filename if relative.startswith("..") else relative


#: ``(file, line)`` of a frame, or None.
Place = Optional[Tuple[str, int]]
#: Where code ran: the user's place and the framework's inside it (see ``call_frames``), kept
#: unformatted with a deferred reading and formatted (``format_location``) only if its judge
#: reports something.
Location = Tuple[Place, Place]
NOWHERE: Location = (None, None)


def _place(frame) -> Place:
    return None if frame is None else (frame.f_code.co_filename, frame.f_lineno)


def user_location() -> Location:
    """Where the code running now was called from (see ``call_frames``), unformatted."""
    return call_frames(sys._getframe(1))


def format_location(location: Location) -> Tuple[Optional[str], Optional[str]]:
    """``(user's file:line, library's file:line)``, each None where unknown."""
    user, library = location
    return (None if user is None else format_source(*user),
            None if library is None else format_source(*library))


def op_name(func) -> str:
    """A torch function's short name: ``linear``, ``sum``, ``__add__``."""
    return getattr(func, "__name__", None) or str(func)


#: The attribute under which ``torch.compile``'s ``OptimizedModule`` holds the compiled module.
COMPILED_MODULE = "_orig_mod"


def unwrap_compiled(module: torch.nn.Module) -> torch.nn.Module:
    """The module ``torch.compile`` wrapped (``OptimizedModule._orig_mod``), else ``module``
    (without importing dynamo, which no model needs before it compiles something)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is not None and isinstance(module, eval_frame.OptimizedModule):
        return module._orig_mod
    return module


def clean_path(path: str) -> str:
    """A module or parameter path without ``torch.compile``'s ``_orig_mod`` steps."""
    if COMPILED_MODULE not in path:
        return path
    return ".".join(part for part in path.split(".") if part != COMPILED_MODULE)


class ModuleTracker:
    """Names the module whose forward is running, from the Python call stack.

    Nothing is installed: every ``module(...)`` call runs ``Module._call_impl``, whose
    frame holds the module, so the running modules are read off the stack only when an
    event needs a name. This costs nothing per op or per module call (global forward
    hooks would cost ~3% of a small model's step and force ``_call_impl``'s slow path),
    and it is naturally per thread.

    Names come from ``model.named_modules()`` when a model is given; otherwise a module
    is named, the first time it is asked for, by where it sits in the running module
    that contains it, or for a module not running (``model.blocks[2].half()``) in a root
    module seen earlier (``roots``). The root module is reported by its class name.
    """

    def __init__(self, model: Optional[torch.nn.Module] = None):
        self._names: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()
        self._roots: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
        #: Grows each time a new root module is seen: names not found before may be found now.
        self.generation = 0
        #: The module call frame ``site`` read last, its module's path and where it was called.
        self._last_call: Tuple[Optional[FrameType], Optional[str], Location] = (None, None, NOWHERE)
        #: ``loop_location``'s locations, by the caller's key.
        self._loop_locations: Dict[Hashable, Location] = {}
        if model is not None:
            self.saw_root(model)

    def roots(self) -> List[torch.nn.Module]:
        """The root modules seen so far (``model=`` and the outermost modules seen running)."""
        return list(self._roots)

    def saw_root(self, module: torch.nn.Module) -> None:
        """Remember ``module`` (an outermost running module, or ``model=``) as a root."""
        module = unwrap_compiled(module)
        if module in self._roots:
            return
        self._roots.add(module)
        self.generation += 1
        for name, child in module.named_modules():
            self._names.setdefault(child, clean_path(name))

    def sight(self) -> bool:
        """Look at the stack for a running module and remember its root; whether one ran."""
        stack = running_modules()
        if stack:
            self.saw_root(stack[0])
        return bool(stack)

    def current(self) -> Optional[str]:
        """Path of the innermost running module, or None outside any module."""
        stack = running_modules()
        if not stack:
            return None
        self.saw_root(stack[0])
        module = unwrap_compiled(stack[-1])
        return self._path(module, stack) or type(module).__name__

    def site(self) -> Tuple[Optional[str], Location]:
        """Where the running op was called: the innermost running module's path and the code
        (``call_frames``), read in one short walk up the stack, cheap enough to take for every
        op while tracing. It stops at the innermost module call when the op ran in the user's
        code of that module's forward; for an op inside a module of torch's (``nn.Linear``) or
        a framework's, the place is the one that called the module, remembered with the call."""
        frame = sys._getframe(1)
        user = library = None
        while frame is not None:
            code = frame.f_code
            if code is CALL_IMPL_CODE:
                call, module_path, called_from = self._last_call
                if frame is not call:  # ops of one forward: read its module once
                    module_path, called_from = self._module_call(frame)
                if user is None:
                    user, library = called_from[0], library or called_from[1]
                return module_path, (user, library)
            if user is None:
                kind = _code_kind(code)
                if kind == _USER:
                    user = (code.co_filename, frame.f_lineno)
                elif kind == _FRAMEWORK and library is None:
                    library = (code.co_filename, frame.f_lineno)
            frame = frame.f_back
        return None, (user, library)

    def _module_call(self, frame: FrameType) -> Tuple[Optional[str], Location]:
        """The module of a ``Module._call_impl`` frame and where it was called."""
        module = frame.f_locals.get("self")
        module_path = None
        if isinstance(module, torch.nn.Module):
            module = unwrap_compiled(module)
            module_path = self._names.get(module)
            if module_path is None:  # the first time: named from the running modules
                module_path = self.current()
            module_path = module_path or type(module).__name__
        called_from = call_frames(frame.f_back)
        self._last_call = (frame, module_path, called_from)
        return module_path, called_from

    def loop_location(self, key: Hashable) -> Location:
        """Where the loop makes the step-level call ``key`` names (the how-many-th backward of a
        step, an optimizer's step, a scaler's update), for a judge that runs after the call: read
        off the stack (``call_frames``) the first time, then remembered. A loop makes the same
        calls from the same lines at every step: no stack walk per step."""
        known = self._loop_locations.get(key)
        if known is None:
            if len(self._loop_locations) >= MAX_LOOP_LOCATIONS:
                self._loop_locations.clear()
            known = self._loop_locations[key] = call_frames(sys._getframe(1))
        return known

    def release_frames(self) -> None:
        """Forget the module call ``site`` read last (its frame keeps the call's locals alive)."""
        self._last_call = (None, None, NOWHERE)

    def name_of(self, module: torch.nn.Module) -> str:
        """Path of ``module`` (running or not), or its class name when unknown."""
        module = unwrap_compiled(module)
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
                prefix = self._path(unwrap_compiled(parent), stack[:depth])
                return f"{prefix}.{path}" if prefix else path
        if stack:
            return ""  # running below a root that does not contain it: no better name
        found = next(filter(None, (_path_below(root, module) for root in self.roots())), "")
        return found or self._held_by_caller(module)

    def _held_by_caller(self, module: torch.nn.Module) -> str:
        """The path of ``module`` in a model a local variable of the user's innermost frame
        holds (``model.encoder.half()`` before the model first ran, with no ``model=``): the
        model that holds it deepest is remembered as a root."""
        frame = sys._getframe(1)
        while frame is not None and _code_kind(frame.f_code) != _USER:
            frame = frame.f_back
        best = ""
        for value in list(frame.f_locals.values()) if frame is not None else ():
            if isinstance(value, torch.nn.Module) and value is not module:
                holder = unwrap_compiled(value)
                path = _path_below(holder, module)
                if path.count(".") >= best.count(".") and path:
                    best, root = path, holder
        if best:
            self.saw_root(root)
        return best


def _path_below(parent: torch.nn.Module, module: torch.nn.Module) -> str:
    """The dotted path of ``module`` inside ``parent`` ("" if it is not a descendant)."""
    return next((clean_path(path) for path, child in parent.named_modules()
                 if child is module and clean_path(path)), "")


CALL_IMPL_CODE = torch.nn.Module._call_impl.__code__
#: Step-level calls ``ModuleTracker.loop_location`` remembers (a few per loop); beyond it, anew.
MAX_LOOP_LOCATIONS = 256


def running_modules() -> List[torch.nn.Module]:
    """Modules whose forward is running in this thread, outermost first."""
    modules = []
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is CALL_IMPL_CODE:
            module = frame.f_locals.get("self")
            if isinstance(module, torch.nn.Module):
                modules.append(module)
        frame = frame.f_back
    modules.reverse()
    return modules
