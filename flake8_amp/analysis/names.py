"""Qualified names from the module's own imports and assignments.

``F.binary_cross_entropy`` becomes ``torch.nn.functional.binary_cross_entropy`` by
following ``import torch.nn.functional as F`` — never by importing or parsing torch
(astroid inference into torch costs seconds per process and finds nothing when torch
is not installed). Instances are resolved to the class that built them
(``criterion = nn.BCELoss()``, ``self.criterion = nn.BCELoss()`` in ``__init__``), and
``functools.partial(f, ...)`` bindings to ``f`` with the bound arguments.
"""

from __future__ import annotations

import builtins
import functools
from dataclasses import dataclass, field
from typing import (
    Callable,
    Dict,
    FrozenSet,
    Iterator,
    List,
    Optional,
    Sequence,
    Set,
    Tuple,
    TypeVar,
    Union,
)

from astroid import nodes
from astroid.const import Context
from astroid.manager import AstroidManager

#: Module paths that re-export the same objects under a shorter public name.
_CANONICAL_PREFIXES: Tuple[Tuple[str, str], ...] = (
    ("torch.nn.modules.loss.", "torch.nn."),
    ("torch.nn.modules.linear.", "torch.nn."),
    ("torch.nn.modules.conv.", "torch.nn."),
    ("torch.nn.modules.", "torch.nn."),
    ("torch.amp.autocast_mode.", "torch.amp."),
    ("torch.cuda.amp.autocast_mode.", "torch.cuda.amp."),
    ("torch.cpu.amp.autocast_mode.", "torch.cpu.amp."),
    ("torch.cuda.amp.grad_scaler.", "torch.cuda.amp."),
    ("torch.amp.grad_scaler.", "torch.amp."),
)

_PARTIAL = frozenset({"functools.partial"})
#: ``nn.Module`` methods that return the module itself.
_RETURNS_SELF = frozenset(
    {"to", "cuda", "cpu", "train", "eval", "requires_grad_", "share_memory", "half",
     "bfloat16", "float", "double"}
)

#: Record types a model's outputs come in (:meth:`Names.record_fields`).
_RECORD_BASES = frozenset({"typing.NamedTuple"})
_RECORD_FACTORIES = frozenset({"collections.namedtuple", "typing.NamedTuple"})

#: ``nn.Module`` methods that bind ``self.<name>`` to a value: (method, value's keyword).
REGISTER_METHODS = {"register_buffer": "tensor", "register_parameter": "param"}

#: How many alias hops are followed before giving up (``a = b``, ``b = c``...).
_MAX_DEPTH = 8
T = TypeVar("T")
#: Markers of :class:`CutCache`.
_MISSING, _IN_PROGRESS = object(), object()

#: Calls returning a module that runs the module they are given (its ``forward``): the
#: wrapped one is reached again as ``.module`` (DDP, DataParallel) or ``._orig_mod``; the
#: reparametrisations return the module itself.
MODULE_WRAPPERS = frozenset(
    {
        "torch.nn.parallel.DistributedDataParallel",
        "torch.nn.parallel.distributed.DistributedDataParallel",
        "torch.nn.DataParallel",
        "torch.nn.parallel.DataParallel",
        "torch.compile",
        "torch.nn.SyncBatchNorm.convert_sync_batchnorm",
        "torch.nn.utils.weight_norm",
        "torch.nn.utils.spectral_norm",
        "torch.nn.utils.parametrizations.weight_norm",
        "torch.nn.utils.parametrizations.spectral_norm",
    }
)
WRAPPED_ATTRIBUTES = frozenset({"module", "_orig_mod"})
#: Containers of modules: their elements are reached by iteration and indexing.
MODULE_CONTAINERS = frozenset({"torch.nn.ModuleList", "torch.nn.Sequential", "torch.nn.ModuleDict"})
#: Methods that add elements to a list or a module container.
_ADDERS = frozenset({"append", "extend", "insert", "add_module"})


def canonical(qualname: str) -> str:
    """``torch.nn.modules.loss.BCELoss`` -> ``torch.nn.BCELoss`` (public spelling)."""
    for prefix, public in _CANONICAL_PREFIXES:
        if qualname.startswith(prefix):
            return public + qualname.removeprefix(prefix)
    return qualname


def last_part(qualname: Optional[str]) -> str:
    """``torch.nn.functional.mse_loss`` -> ``mse_loss``; '' for None."""
    return qualname.rsplit(".", 1)[-1] if qualname else ""


@dataclass(frozen=True)
class Callee:
    """What a call calls: a qualified name, or an instance of a qualified class.

    ``args``/``keywords`` include those bound by ``functools.partial``.
    """

    qualname: str
    #: True when the callee is an object built by calling ``qualname`` (``nn.BCELoss()``).
    instance: bool = False
    args: Tuple[nodes.NodeNG, ...] = ()
    keywords: Tuple[nodes.Keyword, ...] = field(default=())

    @property
    def name(self) -> str:
        return last_part(self.qualname)

    def keyword(self, name: str) -> Optional[nodes.NodeNG]:
        """The value passed as ``name=`` (the last one wins, as in a partial override)."""
        found = None
        for kw in self.keywords:
            if kw.arg == name:
                found = kw.value
        return found

    def argument(self, position: int, name: str) -> Optional[nodes.NodeNG]:
        """The argument at ``position`` or passed as ``name=``."""
        value = self.keyword(name)
        if (
            value is None
            and position < len(self.args)
            and not isinstance(self.args[position], nodes.Starred)
        ):
            value = self.args[position]
        return value


class CutCache:
    """Answers of a recursive query (what a name holds, what dtype a value has) that may
    reach itself again or go too deep. An answer cut short that way is unknown from where
    that query stood, so it is kept only when it is the outermost query's own: the partial
    answers of inner queries are computed again when asked later, instead of being handed
    on to whichever rule asks next."""

    def __init__(self):
        self._answers: Dict[object, object] = {}
        #: Queries cut short so far (cycles and the depth limit), and those that were cycles.
        self.cuts = 0
        self.cycles = 0
        self._computing = 0

    def cut(self) -> None:
        """A query was cut short at the depth limit."""
        self.cuts += 1

    def answer(self, key: object, compute: Callable[[], T], too_deep: bool = False):
        """The cached answer for ``key``, else ``compute()`` (None for a cycle, or when
        ``too_deep`` and not cached)."""
        cached = self._answers.get(key, _MISSING)
        if cached is _IN_PROGRESS:
            self.cuts += 1
            self.cycles += 1
            return None
        if cached is not _MISSING:
            return cached
        if too_deep:
            self.cut()
            return None
        self._answers[key] = _IN_PROGRESS
        cuts, outermost = self.cuts, self._computing == 0
        self._computing += 1
        try:
            value = compute()
        except BaseException:
            del self._answers[key]
            raise
        finally:
            self._computing -= 1
        if outermost or self.cuts == cuts:
            self._answers[key] = value
        else:
            del self._answers[key]
        return value


class Names:
    """Name resolution for one module; see the module docstring."""

    def __init__(self, context):
        self.context = context
        self._class_attributes: Dict[nodes.ClassDef, Dict[str, List[nodes.NodeNG]]] = {}
        #: Parameters whose passed lists ``_passed_items`` is working out (a cycle gives up).
        self._passing: Set[nodes.NodeNG] = set()
        # Every rule asks about the same calls: answers are cached per node.
        self._bindings: Dict[nodes.Name, List[nodes.NodeNG]] = {}
        self._callees: Dict[nodes.Call, Optional[Callee]] = {}
        self._mros: Dict[nodes.ClassDef, Optional[Tuple[MroEntry, ...]]] = {}
        self._sharing_self: Dict[nodes.FunctionDef, Optional[List[nodes.FunctionDef]]] = {}
        self._constructions = CutCache()

    # -- calls -------------------------------------------------------------------------

    @functools.cached_property
    def module_calls(self) -> List[nodes.Call]:
        """Every call of the module in source order: one walk that the analyses share."""
        return self.context.nodes_of(nodes.Call)

    @functools.cached_property
    def calls_by_name(self) -> Dict[str, List[nodes.Call]]:
        """The module's calls by the called name (``f`` for ``f(...)`` and ``x.f(...)``)."""
        by_name: Dict[str, List[nodes.Call]] = {}
        for call in self.module_calls:
            name = simple_name(call.func)
            if name:
                by_name.setdefault(name, []).append(call)
        return by_name

    def local_function(self, call: nodes.Call) -> Optional[nodes.FunctionDef]:
        """The function or method of this module that ``call`` calls: ``self.f(...)`` (and
        ``cls.f(...)``) calls the ``f`` of the first class defining it in its class's MRO
        (:meth:`method_of`)."""
        func = call.func
        if isinstance(func, nodes.Name):
            definitions = self.bindings(func)
            if len(definitions) != 1 or not isinstance(definitions[0], nodes.FunctionDef):
                return None
            return definitions[0]
        if isinstance(func, nodes.Attribute) and (is_self(func.expr) or is_cls(func.expr)):
            # ``self.f(...)``; ``cls.f(...)`` in a classmethod (an ESPnet-style trainer)
            owner = enclosing_class(call)
            return self.method_of(owner, func.attrname) if owner is not None else None
        if isinstance(func, nodes.Attribute) and _is_super_call(func.expr):
            # ``super().forward(x)``: the method of the next class of the MRO that has it
            owner = enclosing_class(call)
            mro = self.class_mro(owner) if owner is not None else None
            for entry in (mro or ())[1:]:
                if not isinstance(entry, nodes.ClassDef):
                    return None
                if func.attrname in entry.locals:
                    return self.method_of(entry, func.attrname)
            return None
        if isinstance(func, nodes.Attribute) and isinstance(func.expr, nodes.Name):
            # ``SeparateHead.branch(c, 64, n)``: a static or class method of this module's class
            classes = [b for b in self.bindings(func.expr) if isinstance(b, nodes.ClassDef)]
            method = self.method_of(classes[0], func.attrname) if len(classes) == 1 else None
            if method is not None and _decorated(method, ("staticmethod", "classmethod")):
                return method
        if isinstance(func, nodes.Attribute) and func.attrname not in _RETURNS_SELF:
            # ``model.encode(x)`` for ``model = Net()``: unless ``encode`` is an attribute
            # holding something else (``self.encode = nn.Linear(...)``)
            owner = self.local_class(func.expr)
            if owner is not None and func.attrname not in self._self_attributes(owner):
                return self.method_of(owner, func.attrname)
        return None

    def overrides(self, method: nodes.FunctionDef) -> List[nodes.FunctionDef]:
        """The methods that objects of the subclasses of ``method``'s class in this module run
        in its place (``PatchTST.encode`` for an abstract ``ForecasterBase.encode``)."""
        owner = method.parent
        if not isinstance(owner, nodes.ClassDef):
            return []
        found: List[nodes.FunctionDef] = []
        for classdef in self.module_classes:
            if classdef is owner or owner not in (self.class_mro(classdef) or ()):
                continue
            override = self.method_of(classdef, method.name)
            if override is not None and override is not method and override not in found:
                found.append(override)
        return found

    def possible_functions(self, call: nodes.Call) -> Set[nodes.FunctionDef]:
        """The functions of this module ``call`` may call: :meth:`local_function`'s, or for
        ``obj.m(...)`` on an object one of several classes of this module may have built
        (``self.optimizer = AMPOptimizer(...) if cfg.amp else FairseqOptimizer(...)``),
        each one's ``m``."""
        function = self.local_function(call)
        if function is not None:
            return {function}
        func = call.func
        if not isinstance(func, nodes.Attribute) or func.attrname in _RETURNS_SELF:
            return set()
        if is_self(func.expr) or is_cls(func.expr) or _is_super_call(func.expr):
            return set()
        owners = self.local_classes(func.expr)
        if len(owners) < 2 or None in owners:
            return set()
        found = set()
        for owner in owners:
            if func.attrname in self._self_attributes(owner):
                return set()
            method = self.method_of(owner, func.attrname)
            if method is not None:
                found.add(method)
        return found

    def object_methods(self, call: nodes.Call) -> List[nodes.FunctionDef]:
        """The ``__call__`` of each class of this module that may have built the object
        ``call`` calls (``loss_scaler(loss, optimizer)`` after ``loss_scaler = ApexScaler()
        if apex else NativeScaler()``, ``self.loss_scaler(...)``); none when a class from
        elsewhere may have, or one has no ``__call__``. ``obj.m(...)`` is
        :meth:`local_function`'s."""
        if not isinstance(call.func, (nodes.Name, nodes.Attribute)):
            return []
        methods = [self.method_of(classdef, "__call__") if classdef is not None else None
                   for classdef in self.local_classes(call.func)]
        return methods if methods and None not in methods else []

    def call_sites(self, function: nodes.FunctionDef) -> List[nodes.Call]:
        """The calls of ``function`` in this module: ``f(...)``, or ``self.f(...)`` in its
        class and in the subclasses that inherit it, and in a base class's method that its
        class inherits (``self._attend(q, k, v)`` in ``AxialAttentionBase.forward`` runs
        ``TiedRowAttention._attend``); for an ``__init__``, the calls of its class
        (``Trainer(model, args)``)."""
        calls = self.calls_by_name.get(function.name, ())
        sites = [call for call in calls if function in self.possible_functions(call)]
        owner = function.parent
        if not isinstance(owner, nodes.ClassDef):
            return sites
        if function.name == "__init__":
            sites.extend(
                call
                for call in self.calls_by_name.get(owner.name, ())
                if self._called_class(call) is owner
            )
            return sites
        bases = (self.class_mro(owner) or ())[1:]
        for call in calls:
            caller = code_frame(call)
            if (call not in sites and isinstance(call.func, nodes.Attribute)
                    and is_self(call.func.expr) and isinstance(caller, nodes.FunctionDef)
                    and caller.parent in bases
                    and self.method_of(owner, caller.name) is caller):
                sites.append(call)
        return sites

    def parameter_call_sites(self, name: nodes.Name) -> List[nodes.Call]:
        """The call sites in this module of the function whose parameter ``name`` is."""
        bindings = self.bindings(name)
        if len(bindings) != 1 or not isinstance(bindings[0].parent, nodes.Arguments):
            return []
        function = bindings[0].parent.parent
        return self.call_sites(function) if isinstance(function, nodes.FunctionDef) else []

    def argument_values(self, name: nodes.Name) -> Optional[List[nodes.NodeNG]]:
        """What the parameter ``name`` receives: the argument at every call site of its
        function in this module (by position or keyword; the default where one is omitted).
        None if it is not a parameter, has no call site, or a site passes ``*args``."""
        sites = self.parameter_call_sites(name)
        if not sites:
            return None
        arguments = self.bindings(name)[0].parent
        values = []
        for call in sites:
            if any(isinstance(a, nodes.Starred) for a in call.args) or any(
                kw.arg is None for kw in call.keywords or ()
            ):
                return None
            value = argument_for(call, arguments, name.name)
            if value is None:
                value = self.parameter_default(name)
            if value is None:
                return None
            values.append(value)
        return values

    # -- classes -----------------------------------------------------------------------

    @functools.cached_property
    def module_classes(self) -> List[nodes.ClassDef]:
        return self.context.nodes_of(nodes.ClassDef)

    @functools.cached_property
    def root_model(self) -> Optional[nodes.ClassDef]:
        """The one class of this module that is an ``nn.Module`` with a ``forward`` and that no
        other such class builds, when every other such class is built in one of the classes'
        code (a model file: blocks, heads and losses, and the model they make up, which its
        training functions may build); None otherwise."""
        modules = [c for c in self.module_classes if self._is_module_class(c)]
        builds = [(call, self._called_class(call)) for call in self.module_calls]
        roots = [c for c in modules
                 if not any(built is c and any(owner.parent_of(call) for owner in modules)
                            for call, built in builds)]
        if len(roots) != 1:
            return None
        root = roots[0]
        # every other module class is built in the code of one of them: a part of the model
        if not all(any(built is c and any(owner.parent_of(call) for owner in modules)
                       for call, built in builds)
                   for c in modules if c is not root):
            return None
        # a model is made of layers (a loss module of the file is no model)
        made_of_layers = any(root.parent_of(call) and (built in modules or self._builds_layer(call))
                             for call, built in builds)
        return root if made_of_layers else None

    def _builds_layer(self, call: nodes.Call) -> bool:
        """``nn.Linear(...)``, ``nn.Conv2d(...)``...: a ``torch.nn`` layer class."""
        qualname = self.qualname(call.func) or ""
        name = last_part(qualname)
        return (qualname.startswith("torch.nn.") and name[:1].isupper()
                and name not in ("Parameter", "Module", "ModuleList", "ModuleDict"))

    def _is_module_class(self, classdef: nodes.ClassDef) -> bool:
        if self.method_of(classdef, "forward") is None:
            return False
        return any(isinstance(entry, str) and entry in _MODULE_BASES
                   for entry in self.class_mro(classdef) or ())

    def class_mro(self, classdef: nodes.ClassDef) -> Optional[Tuple[MroEntry, ...]]:
        """``classdef``'s method resolution order (C3, as Python computes it) over the
        classes of this module; a base from elsewhere (``nn.Module``) stands as its source
        text, its own bases unseen. None when C3 fails (or the bases loop)."""
        if classdef in self._mros:
            return self._mros[classdef]
        self._mros[classdef] = None  # a class reached again while computing is a loop
        bases: List[MroEntry] = []
        for base in classdef.bases:
            classes = (
                [b for b in self.bindings(base) if isinstance(b, nodes.ClassDef)]
                if isinstance(base, nodes.Name)
                else []
            )
            if len(classes) == 1 and classes[0] is not classdef:
                bases.append(classes[0])
            elif base.as_string() != "object":
                bases.append(self.qualname(base) or base.as_string())
        linearizations = []
        for base in bases:
            linearization = self.class_mro(base) if isinstance(base, nodes.ClassDef) else (base,)
            if linearization is None:
                return None
            linearizations.append(list(linearization))
        merged = _c3_merge([*linearizations, list(bases)])
        mro = self._mros[classdef] = (classdef, *merged) if merged is not None else None
        return mro

    def method_of(self, classdef: nodes.ClassDef, name: str) -> Optional[nodes.FunctionDef]:
        """The method ``name`` that ``self.<name>`` finds on a ``classdef`` object: that of
        the first class of its MRO that defines the name; None when that is no single
        ``def``, or a base from elsewhere comes first (it may define the name)."""
        for entry in self.class_mro(classdef) or ():
            if not isinstance(entry, nodes.ClassDef):
                return None
            definitions = entry.locals.get(name)
            if definitions:
                if len(definitions) == 1 and isinstance(definitions[0], nodes.FunctionDef):
                    return definitions[0]
                return None
        return None

    def is_model(self, classdef: nodes.ClassDef) -> bool:
        """``classdef`` or a class of its MRO is a model class (:func:`is_model_class`): also a
        subclass of a model class of the file that only overrides a helper of its forward."""
        return any(
            is_model_class(entry) if isinstance(entry, nodes.ClassDef)
            else entry.startswith("torch.nn.")
            for entry in self.class_mro(classdef) or (classdef,)
        )

    def forward_path(self, classdef: nodes.ClassDef) -> Set[nodes.FunctionDef]:
        """The ``forward`` (or ``__call__``) an object of ``classdef`` runs and the methods it
        calls through ``self`` (``self._attention(q, k, v)``), transitively, each as that
        object finds it (a base class's ``forward`` calling the subclass's ``_attend``)."""
        pending = [method for name in FORWARD_METHODS
                   if (method := self.method_of(classdef, name)) is not None]
        path: Set[nodes.FunctionDef] = set()
        while pending:
            method = pending.pop()
            if method in path:
                continue
            path.add(method)
            for call in method.nodes_of_class(nodes.Call):
                name, receiver = method_call(call)
                if name is not None and is_self(receiver):
                    called = self.method_of(classdef, name)
                    if called is not None:
                        pending.append(called)
        return path

    def call_method(self, classdef: nodes.ClassDef) -> Optional[nodes.FunctionDef]:
        """The method calling an object of ``classdef`` runs: a ``__call__`` of the module's
        classes (a loss object's), else ``forward`` (``nn.Module.__call__`` runs it)."""
        return self.method_of(classdef, "__call__") or self.method_of(classdef, "forward")

    def methods_sharing_self(self, method: nodes.FunctionDef) -> Optional[List[nodes.FunctionDef]]:
        """The methods that can run on an object ``method`` runs on: those of every class
        in the MRO of each class of this module whose objects can run ``method`` (its class
        and the subclasses that inherit it or reach it other than by ``self.<name>()``,
        e.g. ``super().<name>()``). None when a base from elsewhere is among them (its code
        is unseen) or an MRO is unknown."""
        if method in self._sharing_self:
            return self._sharing_self[method]
        owner = method.parent
        found: Optional[List[nodes.FunctionDef]] = []
        for classdef in self.module_classes:
            mro = self.class_mro(classdef)
            if mro is None:
                found = None
                break
            if owner not in mro or not self._runs_on(method, mro):
                continue
            if not all(isinstance(entry, nodes.ClassDef) for entry in mro):
                found = None
                break
            for entry in mro:
                found.extend(m for m in entry.mymethods() if m not in found)
        self._sharing_self[method] = found
        return found

    def _runs_on(self, method: nodes.FunctionDef, mro: Tuple[MroEntry, ...]) -> bool:
        """Objects of the class whose MRO is ``mro`` may run ``method``: it is the one
        ``self.<name>`` finds, or their code calls ``<name>`` on something else than ``self``
        (an override calling ``super().<name>()``)."""
        if self.method_of(mro[0], method.name) is method:
            return True
        return any(
            isinstance(call.func, nodes.Attribute)
            and not is_self(call.func.expr)
            and enclosing_class(call) in mro
            for call in self.calls_by_name.get(method.name, ())
        )

    # -- assignments -------------------------------------------------------------------

    def bindings(self, name: nodes.Name) -> List[nodes.NodeNG]:
        """The statements that may bind ``name`` where it is used (astroid scope lookup).

        Import nodes, function/class definitions, or ``AssignName`` nodes; empty for
        builtins and unknown names. A binding (``AssignName``) binds itself.
        """
        if isinstance(name, nodes.AssignName):
            return [name]
        found = self._bindings.get(name)
        if found is None and not _defined_in_module(name):
            # A builtin or an undefined name: skip astroid's lookup in builtins.
            found = self._bindings[name] = []
        if found is None:
            try:
                scope, statements = _lookup(name)
            except Exception:  # astroid lookup on unusual trees: treat as unknown
                scope, statements = None, ()
            if isinstance(scope, nodes.Module) and scope is not name.root():
                statements = ()  # builtins
            found = self._bindings[name] = list(statements)
        return found

    def reaching_bindings(self, name: nodes.Name) -> List[nodes.NodeNG]:
        """:meth:`bindings`, less those that an assignment on every path to ``name``
        overwrites: after ``with torch.no_grad(): out = model(x)``, an ``out = model(x)``
        in an earlier block no longer reaches. Loops end the search (a later assignment
        in the loop body reaches the next iteration)."""
        bindings = self.bindings(name)
        if len(bindings) > 1:
            bindings = [b for b in bindings if not _leaves_before(b, name)]
        last = _last_unconditional_binding(name, bindings) if len(bindings) > 1 else None
        if last is None:
            return bindings
        start, end = _position(last), _position(name)
        return [b for b in bindings if b is last or start < _position(b) < end]

    def earlier_bindings(self, name: nodes.Name) -> List[nodes.NodeNG]:
        """:meth:`reaching_bindings` but one in ``name``'s own statement: in ``x = x.half()``
        the right-hand ``x`` is the earlier value."""
        statement = name.statement()
        return [b for b in self.reaching_bindings(name)
                if b.statement() is not statement or _comprehension_target(b)]

    def parameter_default(self, name: nodes.Name) -> Optional[nodes.NodeNG]:
        """The default value of the parameter ``name`` is bound by (and nothing else), if any."""
        bindings = self.bindings(name)
        if len(bindings) != 1 or not isinstance(bindings[0].parent, nodes.Arguments):
            return None
        try:
            return bindings[0].parent.default_value(name.name)
        except Exception:  # astroid's NoDefault
            return None

    def bound_values(self, expr: nodes.NodeNG) -> Optional[List[nodes.NodeNG]]:
        """What a variable (:meth:`assigned_values`) or a ``self.<x>`` attribute (in any
        method of its class, also by ``register_buffer("x", value)``) is assigned; also
        ``obj.<x>`` for an object of a class of this module (``model.head`` after ``model =
        Net()`` or ``model: Net``) whose ``<x>`` only its own methods assign. None for other
        expressions or unknown bindings."""
        if isinstance(expr, nodes.Name):
            return self.assigned_values(expr)
        if not isinstance(expr, nodes.Attribute):
            return None
        if is_self(expr.expr):
            return self.self_attribute_values(expr)
        owner = self.local_class(expr.expr)
        if owner is None or expr.attrname in self._attributes_set_from_outside:
            return None
        return self._self_attributes(owner).get(expr.attrname) or None

    def held_values(self, expr: nodes.NodeNG) -> Optional[List[nodes.NodeNG]]:
        """:meth:`bound_values`, or for a parameter what its call sites in this module pass
        (:meth:`argument_values`: ``def train(..., scaler)`` called with ``scaler``)."""
        values = self.bound_values(expr)
        if not values and isinstance(expr, nodes.Name):
            return self.argument_values(expr)
        return values

    def keyed_values(self, subscript: nodes.Subscript) -> Optional[List[nodes.NodeNG]]:
        """What ``d["key"]`` holds where the code shows everything put under that key
        (:meth:`dict_entries` of each dict literal ``d`` is bound to, also of one a function of
        this module builds and returns: ``data = load_dataset(...)`` after ``data["scaler"] =
        scaler; return data``). None for other subscripts, or when a dict's origin is unknown."""
        key = subscript.slice
        if not (isinstance(key, nodes.Const) and isinstance(key.value, str)
                and isinstance(subscript.value, nodes.Name)):
            return None
        literals = self._dict_literals(subscript.value)
        values = [value for literal in literals or () for k, value in self.dict_entries(literal)
                  if isinstance(k, nodes.Const) and k.value == key.value]
        return values or None

    def dict_entries(self, literal: nodes.Dict) -> List[Tuple[nodes.NodeNG, nodes.NodeNG]]:
        """``(key, value)`` of what a dict literal holds: its items and, for one bound to a
        name, the ``d[key] = value`` stores of its function (``out = {}``, then ``out[t] =
        head(f)``)."""
        entries = list(literal.items)
        target = assign_target(literal)
        if isinstance(target, nodes.AssignName):
            for statement in target.frame().nodes_of_class(nodes.Assign):
                entries += [(stored.slice, statement.value) for stored in statement.targets
                            if isinstance(stored, nodes.Subscript)
                            and isinstance(stored.value, nodes.Name)
                            and stored.value.name == target.name]
        return entries

    def _dict_literals(self, name: nodes.Name, hops: int = 2) -> Optional[List[nodes.Dict]]:
        """The dict literals ``name`` may hold: bound to it in its function, or to the name a
        function of this module returns."""
        found: List[nodes.Dict] = []
        for value in self.assigned_values(name) or [None]:
            if isinstance(value, nodes.Dict):
                found.append(value)
                continue
            function = self.local_function(value) if isinstance(value, nodes.Call) else None
            returns = returned_values(function) if function is not None and hops else None
            if not returns or not all(isinstance(r, nodes.Name) for r in returns):
                return None
            for returned in returns:
                inner = self._dict_literals(returned, hops - 1)
                if not inner:
                    return None
                found += inner
        return found

    def assigned_values(self, name: nodes.Name) -> Optional[List[nodes.NodeNG]]:
        """The expressions assigned to ``name`` where it is used, or None if any binding
        is not an assignment of a known value (parameters, loops, imports, unpacking of an
        unknown call...)."""
        values: List[nodes.NodeNG] = []
        for binding in self.reaching_bindings(name):
            bound = self._binding_values(binding)
            if not bound:
                return None
            values.extend(bound)
        return values or None

    def _binding_values(self, binding: nodes.NodeNG) -> List[nodes.NodeNG]:
        """What ``binding`` is bound to: its assigned value, its element of a literal tuple,
        or of each tuple a function of this module returns (``amp_ctx, scaler =
        build_amp(opt.precision)``); [] if unknown."""
        value = literal_value(binding)
        if value is not None:
            return [value]
        unpacked = unpacked_value(binding)
        if unpacked is None or not isinstance(unpacked[0], nodes.Call):
            return []
        function = self.local_function(unpacked[0])
        returns = returned_values(function) if function is not None else None
        index = unpacked[1]
        if not returns or not all(
            isinstance(r, (nodes.Tuple, nodes.List)) and index < len(r.elts) for r in returns
        ):
            return []
        return [r.elts[index] for r in returns]

    # -- qualified names ---------------------------------------------------------------

    def qualname(self, expr: nodes.NodeNG, _depth: int = 0) -> Optional[str]:
        """Dotted name of the object ``expr`` names, via the module's imports and aliases.

        ``F.cross_entropy`` -> ``torch.nn.functional.cross_entropy``; None when it is not
        a chain of names rooted in an import (locals, parameters, call results...).
        """
        if _depth > _MAX_DEPTH:
            return None
        if isinstance(expr, nodes.Attribute):
            base = self.qualname(expr.expr, _depth + 1)
            return canonical(f"{base}.{expr.attrname}") if base else None
        if not isinstance(expr, nodes.Name):
            return None
        results = self.possible_qualnames(expr, _depth)
        return results.pop() if len(results) == 1 else None

    def builtin_name(self, expr: nodes.NodeNG) -> Optional[str]:
        """The name of the Python builtin ``expr`` names (``len``, ``sum``, ``enumerate``),
        if it is one this module does not rebind."""
        if isinstance(expr, nodes.Name) and not self.bindings(expr):
            return expr.name
        return None

    def possible_qualnames(self, name: nodes.Name, _depth: int = 0) -> Set[Optional[str]]:
        """The dotted name each binding of ``name`` gives it (None where unknown): one for
        most names, several for a vendor dispatch (``if npu: from torch.npu.amp import
        GradScaler ... else: from torch.cuda.amp import GradScaler``)."""
        return {self._binding_qualname(name.name, b, _depth) for b in self.bindings(name)}

    def _binding_qualname(self, name: str, binding: nodes.NodeNG, depth: int) -> Optional[str]:
        if isinstance(binding, nodes.Import):
            for module, alias in binding.names:
                if alias == name:
                    return canonical(module)
                if alias is None and module.split(".")[0] == name:
                    return name
            return None
        if isinstance(binding, nodes.ImportFrom):
            prefix = "." * (binding.level or 0) + (binding.modname or "")
            for original, alias in binding.names:
                if (alias or original) == name:
                    return canonical(
                        f"{prefix}.{original}" if binding.modname else prefix + original
                    )
            return None
        value = assigned_value(binding)
        if isinstance(value, (nodes.Name, nodes.Attribute)):
            return self.qualname(value, depth + 1)
        return None

    # -- instances ---------------------------------------------------------------------

    def instance_class(self, expr: nodes.NodeNG, _depth: int = 0) -> Optional[str]:
        """Qualified name of the class whose call built the object ``expr`` refers to.

        ``nn.BCELoss()``, ``criterion`` after ``criterion = nn.BCELoss()`` (or a parameter
        every call site passes one), and
        ``self.criterion`` assigned ``nn.BCELoss()`` in any method of the class; also
        through methods that return the module itself (``nn.BCELoss().cuda()``).
        """
        if _depth > _MAX_DEPTH:
            return None
        if (
            isinstance(expr, nodes.Call)
            and isinstance(expr.func, nodes.Attribute)
            and expr.func.attrname in _RETURNS_SELF
            and isinstance(expr.func.expr, (nodes.Call, nodes.Name, nodes.Attribute))
            and self.qualname(expr.func) is None
        ):
            return self.instance_class(expr.func.expr, _depth + 1)
        if isinstance(expr, nodes.Call):
            callee = self.callee(expr, _depth + 1)
            return callee.qualname if callee is not None and not callee.instance else None
        values = self.held_values(expr)
        if not values:
            return None
        classes = {
            self.instance_class(v, _depth + 1) if isinstance(v, (nodes.Call, nodes.Name)) else None
            for v in values
        }
        return classes.pop() if len(classes) == 1 else None

    def local_class(self, expr: nodes.NodeNG, _depth: int = 0) -> Optional[nodes.ClassDef]:
        """The class defined in this module whose call built ``expr``'s object, if any
        (``Net(...)``, ``model`` after ``model = Net(...).to(device)``, ``self.criterion``
        after ``self.criterion = DiceLoss()``, ``model: Net``, ``DDP(model).module``): the
        one class of its :meth:`constructions`."""
        classes = self.local_classes(expr, _depth)
        return classes.pop() if len(classes) == 1 else None

    def local_classes(self, expr: nodes.NodeNG, _depth: int = 0) -> Set[Optional[nodes.ClassDef]]:
        """The classes whose call may have built ``expr``'s object (``self.se`` after ``self.se
        = SqueezeExcite(c) if use_se else nn.Identity()``): None stands for a class from
        elsewhere."""
        return {self.construction_class(c) for c in self.constructions(expr, _depth) or ()}

    def may_run(self, expr: nodes.NodeNG, method: nodes.FunctionDef) -> bool:
        """Whether calling the object ``expr`` refers to may run ``method`` (a ``forward`` or
        ``__call__``): an object of its class, or of a subclass that inherits it."""
        return any(classdef is not None and self.method_of(classdef, method.name) is method
                   for classdef in self.local_classes(expr))

    def _annotated_class(self, parameter: nodes.AssignName) -> Optional[nodes.ClassDef]:
        """The class of this module a parameter is annotated with (``model: Net``)."""
        arguments = parameter.parent
        for params, hints in (
            (arguments.posonlyargs, arguments.posonlyargs_annotations),
            (arguments.args, arguments.annotations),
            (arguments.kwonlyargs, arguments.kwonlyargs_annotations),
        ):
            if parameter in params:
                annotation = hints[params.index(parameter)]
                return self._class_named(annotation)
        return None

    def constructions(self, expr: nodes.NodeNG, _depth: int = 0) -> Optional[List[nodes.NodeNG]]:
        """The calls that may have built the module object ``expr`` refers to: a class of this
        module called (``Net(...)``) or a ``torch.nn`` one (``nn.Sequential(...)``); for a
        parameter, the class it is annotated with (``model: Net``) or what every call site here
        passes (``train(model)`` after ``model = Net().cuda()``). Followed: names, ``self.<x>`` and
        ``obj.<x>`` attributes, methods returning the module itself (``.cuda()``), wrappers
        (``DDP(model)``, ``torch.compile(model)``, and their ``.module`` / ``._orig_mod``),
        and the elements of ``nn.ModuleList`` / ``nn.Sequential`` / ``nn.ModuleDict`` reached
        by iteration (``for layer in self.layers``, ``enumerate(...)``) or indexing. None
        when some possibility is unknown."""
        # a cycle (``self.m = self.m.cuda()``) or the depth limit makes an answer unknown
        return self._constructions.answer(
            expr,
            lambda: self._compute_constructions(expr, _depth + 1),
            too_deep=_depth > _MAX_DEPTH,
        )

    def _compute_constructions(
        self, expr: nodes.NodeNG, depth: int
    ) -> Optional[List[nodes.NodeNG]]:
        while (
            isinstance(expr, nodes.Call)
            and isinstance(expr.func, nodes.Attribute)
            and expr.func.attrname in _RETURNS_SELF
            and self.qualname(expr.func) is None
        ):
            expr = expr.func.expr
        if isinstance(expr, nodes.IfExp):
            return self._all_constructions([expr.body, expr.orelse], depth)
        if isinstance(expr, nodes.Call):
            qualname = self.class_qualname(expr.func) or ""
            if qualname in MODULE_WRAPPERS:
                wrapped = call_argument(expr, 0, "module")
                return self.constructions(wrapped, depth) if wrapped is not None else None
            if (qualname.startswith("torch.nn.") and last_part(qualname)[:1].isupper()) or (
                isinstance(expr.func, nodes.Name) and self._called_class(expr) is not None
            ):
                return [expr]
            registered = self._registered(expr, depth)
            if registered is not None:  # ``MODELS[cfg.arch](cfg)``
                return registered
            chosen = self._chosen(expr, depth)
            if chosen is not None:  # ``head_cls = ArcFace if arc else CosFace; head_cls(512)``
                return chosen
            # ``model = build_model(args)``, ``self.loss = self._build_loss()``: what a
            # function or method of this module returns; a parameter it returns is what this
            # call passes (``init_weights(UnetGenerator())`` returning ``net``)
            function = self.local_function(expr)
            returns = returned_values(function) if function is not None else None
            return self._all_constructions(
                [self._passed_back(expr, function, value) for value in returns or []], depth
            )
        if isinstance(expr, nodes.Subscript):
            stored = self.keyed_values(expr)
            if stored is not None:  # ``data["scaler"]`` of a dict the file fills
                return self._all_constructions(stored, depth)
            containers = self.constructions(expr.value, depth)
            if isinstance(expr.slice, nodes.Slice):  # ``self.layers[:-1]``: the same kind
                return containers
            return self._elements(containers, depth) if containers else None
        if isinstance(expr, nodes.Attribute) and expr.attrname in WRAPPED_ATTRIBUTES:
            inner = self.constructions(expr.expr, depth)
            if inner and all(self._without_attribute(c, expr.attrname) for c in inner):
                return inner
        if isinstance(expr, nodes.Name):
            statement = expr.statement()
            found: List[nodes.NodeNG] = []
            for binding in self.reaching_bindings(expr):
                if binding.statement() is statement and not _comprehension_target(binding):
                    continue
                if _is_none(assigned_value(binding)):
                    continue  # ``loss_scaler = None`` (then ``NativeScaler()`` if amp)
                built = self._binding_constructions(binding, depth)
                if not built:
                    return None
                found.extend(built)
            return found or None
        values = self.bound_values(expr) if isinstance(expr, nodes.Attribute) else None
        # in ``self.model = wrap(self.model) if sync else self.model`` the right-hand
        # ``self.model`` is what was assigned before
        statement = expr.statement()
        values = [v for v in values or [] if v is None or v.statement() is not statement]
        return self._all_constructions(values, depth)

    def _registered(self, call: nodes.Call, depth: int) -> Optional[List[nodes.NodeNG]]:
        """What calling an entry of a registry builds: for ``MODELS[cfg.arch](...)`` with
        ``MODELS`` bound once to a dict literal, each value's class of this module, the
        constructions of what each builder function or lambda of this module returns, and
        ``call`` itself for a ``torch.nn`` class (``"BN": nn.BatchNorm1d``: a module from
        elsewhere); None for anything else."""
        func = call.func
        if not isinstance(func, nodes.Subscript) or not isinstance(func.value, nodes.Name):
            return None
        bindings = self.bindings(func.value)
        registry = assigned_value(bindings[0]) if len(bindings) == 1 else None
        if not isinstance(registry, nodes.Dict) or not registry.items:
            return None
        return self._callables_build([entry for _, entry in registry.items], call, depth)

    def _chosen(self, call: nodes.Call, depth: int) -> Optional[List[nodes.NodeNG]]:
        """What calling a name bound to a class or builder of this module, or to a choice of
        them, builds (``head_cls = ArcMarginProduct if arc else CosFaceHead``, then
        ``head_cls(512, n)``); None for anything else."""
        func = call.func
        if not isinstance(func, nodes.Name):
            return None
        choices: List[nodes.NodeNG] = []
        for binding in self.reaching_bindings(func) or [None]:
            value = assigned_value(binding) if isinstance(binding, nodes.AssignName) else None
            if value is None:
                return None
            arms = [value.body, value.orelse] if isinstance(value, nodes.IfExp) else [value]
            choices.extend(arms)
        return self._callables_build(choices, call, depth)

    def _callables_build(
        self, callables: List[nodes.NodeNG], call: nodes.Call, depth: int
    ) -> Optional[List[nodes.NodeNG]]:
        """What ``call`` builds when it calls one of ``callables``: a class of this module, a
        ``torch.nn`` class (``call`` itself: a module from elsewhere), or the constructions a
        builder function or lambda of this module returns; None if one is anything else."""
        built: List[nodes.NodeNG] = []
        for entry in callables:
            classdef = self._class_named(entry)
            if classdef is not None:
                built.append(classdef)
                continue
            qualname = self.qualname(entry) or ""
            if qualname.startswith("torch.nn.") and last_part(qualname)[:1].isupper():
                built.append(call)
                continue
            if isinstance(entry, nodes.Lambda):  # ``"fno2d": lambda cfg: FNO2d(cfg.modes)``
                returned = self.constructions(entry.body, depth)
            else:
                definitions = self.bindings(entry) if isinstance(entry, nodes.Name) else []
                if len(definitions) != 1 or not isinstance(definitions[0], nodes.FunctionDef):
                    return None
                returned = self._all_constructions(returned_values(definitions[0]) or [], depth)
            if returned is None:
                return None
            built.extend(returned)
        return built

    def _passed_back(
        self, call: nodes.Call, function: nodes.FunctionDef, returned: nodes.NodeNG
    ) -> Optional[nodes.NodeNG]:
        """``returned`` as ``call`` sees it: for a parameter of ``function`` returned as it
        came, the argument ``call`` passes."""
        if isinstance(returned, nodes.Name):
            bindings = self.bindings(returned)
            if len(bindings) == 1 and bindings[0].parent is function.args:
                return argument_for(call, function.args, returned.name)
        return returned

    def _all_constructions(
        self, values: Sequence[Optional[nodes.NodeNG]], depth: int
    ) -> Optional[List[nodes.NodeNG]]:
        """The constructions of every one of ``values``; None if any is unknown (or none).
        A ``None`` among them holds no object (``Cls() if use_amp else None``, a parameter
        defaulting to None): where the object is used, it is one of the others."""
        found: List[nodes.NodeNG] = []
        for value in values:
            if _is_none(value):
                continue
            built = self.constructions(value, depth) if value is not None else None
            if not built:
                return None
            found.extend(built)
        return found or None

    def _binding_constructions(
        self, binding: nodes.NodeNG, depth: int
    ) -> Optional[List[nodes.NodeNG]]:
        value = assigned_value(binding)
        if value is not None:
            return self.constructions(value, depth)
        parent = binding.parent
        if isinstance(parent, nodes.Arguments):
            annotated = self._annotated_class(binding)
            if annotated is not None:
                return [annotated]
            # ``train(model, ...)`` called here with ``model = Net().cuda()``
            values = self.argument_values(binding)
            if values is None and binding.name == "model" and self.root_model is not None:
                # ``def train(model, ...)`` that no call here binds, in a file defining one
                # model: that model (its other classes are its parts)
                return [self.root_model]
            return self._all_constructions(values or [], depth)
        value = literal_value(binding)
        if value is not None:  # ``criterion, spread = DINOLoss(...), KoLeoLoss()``
            return self.constructions(value, depth)
        unpacked = unpacked_value(binding)
        if unpacked is not None and isinstance(unpacked[0], nodes.Call):
            # ``encoder, head = build_model(args)``: a function of this module returning tuples
            return self._all_constructions(self._binding_values(binding), depth)
        if unpacked is not None and isinstance(unpacked[0], nodes.Name):
            # ``net_g, net_d = nets`` for ``train(hps, (net_g, net_d), ...)``
            held = self.held_values(unpacked[0]) or []
            index = unpacked[1]
            if held and all(
                isinstance(v, (nodes.Tuple, nodes.List)) and index < len(v.elts) for v in held
            ):
                return self._all_constructions([v.elts[index] for v in held], depth)
            return None
        iterable = self.iterated(binding)
        if iterable is None:
            return None
        listed = self.list_items(iterable)
        if listed:  # a plain list of modules: ``[Block(d, m) for m in mixers]``
            return self._all_constructions(listed, depth)
        mapping = None
        if isinstance(iterable, nodes.Call) and isinstance(iterable.func, nodes.Attribute):
            mapping, iterable = iterable.func.attrname, iterable.func.expr  # ``heads.values()``
        containers = self.constructions(iterable, depth)
        if not containers:
            return None
        dicts = [self.qualname(getattr(c, "func", None)) == "torch.nn.ModuleDict"
                 for c in containers]
        # iterating a ModuleDict gives its keys; its ``values()`` and ``items()`` its modules
        if any(dicts) if mapping is None else not (mapping in ("values", "items") and all(dicts)):
            return None
        return self._elements(containers, depth)

    def iterated(self, binding: nodes.AssignName) -> Optional[nodes.NodeNG]:
        """The sequence whose elements a loop variable takes: ``self.layers`` for ``layer`` in
        ``for layer in self.layers``, ``for i, layer in enumerate(self.layers)``, ``for layer
        in reversed(self.layers[1:])`` or ``for layer, shape in zip(self.layers, shapes)``;
        ``self.heads.items()`` for ``head`` in ``for name, head in self.heads.items()``; None for
        a binding that is not a loop variable or a shape not followed."""
        loop, path = loop_of(binding)
        if loop is None:
            return None
        iterable = loop.iter
        while True:
            if isinstance(iterable, nodes.Subscript) and isinstance(iterable.slice, nodes.Slice):
                iterable = iterable.value  # a slice holds some of the same elements
                continue
            if not isinstance(iterable, nodes.Call) or iterable.keywords:
                break
            if isinstance(iterable.func, nodes.Attribute) and iterable.func.attrname == "items":
                # ``for name, head in self.heads.items()``: the values (``_binding_constructions``)
                if iterable.args or path[:1] != [1]:
                    return None
                path = path[1:]
                break
            wrapper = self.builtin_name(iterable.func)
            if wrapper in ("reversed", "list", "tuple", "iter") and len(iterable.args) == 1:
                iterable = iterable.args[0]
            elif wrapper == "enumerate" and iterable.args and path[:1] == [1]:
                iterable, path = iterable.args[0], path[1:]
            elif wrapper == "zip" and path and path[0] < len(iterable.args):
                iterable, path = iterable.args[path[0]], path[1:]
            else:
                break
        if path or any(isinstance(arg, nodes.Starred) for arg in getattr(iterable, "args", ())):
            return None
        return iterable

    def _elements(self, containers: List[nodes.NodeNG], depth: int) -> Optional[List[nodes.NodeNG]]:
        """The constructions of the modules held by module containers."""
        items: List[nodes.NodeNG] = []
        for container in containers:
            held = self.container_items(container)
            if held is None:
                return None
            items.extend(held)
        return self._all_constructions(items, depth)

    def container_items(self, container: nodes.NodeNG) -> Optional[List[nodes.NodeNG]]:
        """The expressions of the modules an ``nn.ModuleList`` / ``nn.Sequential`` /
        ``nn.ModuleDict`` construction holds, in order where the code shows it (a
        comprehension's element stands for all; a list spread in, ``nn.Sequential(*layers)``,
        gives what was put in it, see :meth:`list_items`; an empty one, what its function
        appends to it); None if unknown."""
        if not isinstance(container, nodes.Call):
            return None
        qualname = self.qualname(container.func)
        if qualname not in MODULE_CONTAINERS or container.keywords:
            return None
        if not container.args and qualname != "torch.nn.ModuleDict":
            return self._added_items(container) or None
        if qualname == "torch.nn.Sequential":
            arguments = list(container.args)
        elif len(container.args) == 1:
            arguments = [container.args[0]]
        else:
            return None
        items: List[nodes.NodeNG] = []
        for argument in arguments:
            if qualname == "torch.nn.Sequential" and not isinstance(argument, nodes.Starred):
                items.append(argument)
                continue
            source = argument.value if isinstance(argument, nodes.Starred) else argument
            if isinstance(source, nodes.Dict) and qualname == "torch.nn.ModuleDict":
                items.extend(value for _, value in source.items)
                continue
            if isinstance(source, nodes.DictComp) and qualname == "torch.nn.ModuleDict":
                items.append(source.value)  # ``{t: Tower(d) for t in TASKS}``: one for all
                continue
            held = self.list_items(source)
            if held is None:
                return None
            items.extend(held)
        added = self._added_items(container)  # ``self.convs.append(...)`` after it is built
        return items if added is None else items + added

    def class_qualname(self, func: nodes.NodeNG, _depth: int = 0) -> Optional[str]:
        """The dotted name of what ``func`` calls, also through a variable or parameter that
        holds a class (``norm_module=nn.BatchNorm3d``; ``norm = get_norm(cfg)`` returning
        ``nn.BatchNorm3d``): every value it may hold must name the same one."""
        qualname = self.qualname(func)
        if qualname is not None or not isinstance(func, nodes.Name) or _depth > _MAX_DEPTH:
            return qualname
        found = set()
        for value in self.held_values(func) or [None]:
            if isinstance(value, nodes.Call) and self.local_function(value) is not None:
                returns = returned_values(self.local_function(value)) or [None]
            else:
                returns = [value]
            for returned in returns:
                if not isinstance(returned, (nodes.Name, nodes.Attribute)):
                    return None
                found.add(self.class_qualname(returned, _depth + 1))
        return found.pop() if len(found) == 1 else None

    def _added_items(self, container: nodes.Call) -> Optional[List[nodes.NodeNG]]:
        """What the function that builds an empty container (``self.convs = nn.ModuleList()``)
        adds to it there (``self.convs.append(nn.Conv1d(...))``, ``.extend([...])``,
        ``.insert(i, m)``, ``.add_module(name, m)``), in source order; None if unknown."""
        target = literal_target(container)
        if target is None:
            return []
        key = target.as_string()
        items: List[nodes.NodeNG] = []
        for call in container.frame().nodes_of_class(nodes.Call):
            func = call.func
            if not isinstance(func, nodes.Attribute) or func.expr.as_string() != key:
                continue
            if func.attrname in _ADDERS:
                added = self._added_by(call)
                if added is None:
                    return None
                items.extend(added)
        return items

    def _added_by(self, call: nodes.Call) -> Optional[List[nodes.NodeNG]]:
        """What ``x.append(m)``, ``x.insert(i, m)``, ``x.add_module(name, m)`` or
        ``x.extend(ms)`` adds to ``x``; None if unknown."""
        method, args = call.func.attrname, call.args
        if method == "append" and len(args) == 1:
            return [args[0]]
        if method in ("insert", "add_module") and len(args) == 2:
            return [args[1]]
        if method == "extend" and len(args) == 1:
            return self.list_items(args[0])
        return None

    def list_items(self, expr: nodes.NodeNG, _depth: int = 0) -> Optional[List[nodes.NodeNG]]:
        """What a list holds: a literal's elements, a comprehension's element, or for a
        name every element put into it in its function (``layers = []``, ``.append(x)``,
        ``.extend([...])``, ``.insert(i, x)``, ``layers += [...]``), in source order, and for
        a parameter what every call site passes (``SequentialFlow(layers)``); None if the
        list may hold something else (another use than reading it whole)."""
        if isinstance(expr, (nodes.List, nodes.Tuple)):
            if any(isinstance(e, nodes.Starred) for e in expr.elts):
                return None
            return list(expr.elts)
        if isinstance(expr, (nodes.ListComp, nodes.GeneratorExp)):
            return [expr.elt]  # ``nn.ModuleList(Block(d) for _ in range(n))`` too
        if isinstance(expr, nodes.Call):
            return self._returned_items(expr)
        if not isinstance(expr, (nodes.Name, nodes.AssignName)):
            return None
        bindings = self.bindings(expr)
        if not bindings:
            return None
        if len(bindings) == 1 and isinstance(bindings[0].parent, nodes.Arguments):
            return self._passed_items(expr, _depth)
        frame = bindings[0].frame()
        items: List[nodes.NodeNG] = []
        for binding in bindings:
            value = _list_binding_value(binding)
            if binding.frame() is not frame or not (
                isinstance(value, (nodes.List, nodes.Tuple, nodes.ListComp))
                or isinstance(value, nodes.Call) and isinstance(binding.parent, nodes.AugAssign)
            ):
                return None
        for use in frame.nodes_of_class((nodes.Name, nodes.AssignName)):
            if use.name != expr.name or use.frame() is not frame:
                continue
            if isinstance(use, nodes.AssignName):
                value = _list_binding_value(use)
                held = self.list_items(value) if value is not None else None
            else:
                held = self._list_use(use)
            if held is None:
                return None
            items.extend(held)
        return items

    def _passed_items(self, parameter: nodes.NodeNG, depth: int) -> Optional[List[nodes.NodeNG]]:
        """The items of the lists every call site here passes to ``parameter`` (None while
        it is being worked out: a list handed round a cycle of calls)."""
        binding = self.bindings(parameter)[0]
        if depth >= _MAX_PASSED_LISTS or binding in self._passing:
            return None
        self._passing.add(binding)
        try:
            passed = self.argument_values(parameter)
            items: List[nodes.NodeNG] = []
            for value in passed or [None]:
                held = self.list_items(value, depth + 1) if value is not None else None
                if held is None:
                    return None
                items.extend(held)
            return items
        finally:
            self._passing.discard(binding)

    def _returned_items(self, call: nodes.Call) -> Optional[List[nodes.NodeNG]]:
        """The items of the lists a function of this module returns (``layers +=
        conv_stage(c_in, c_out)``), each return's in turn."""
        function = self.local_function(call)
        returns = returned_values(function) if function is not None else None
        if not returns:
            return None
        items: List[nodes.NodeNG] = []
        for value in returns:
            held = self.list_items(value) if value is not call else None
            if held is None:
                return None
            items.extend(held)
        return items

    def last_item(self, expr: nodes.NodeNG) -> Optional[nodes.NodeNG]:
        """The element a list ends with where the code shows it: a literal's last, or for a
        name the element its function adds last and unconditionally (``layers.append(head)``
        after a loop of appends); None otherwise."""
        items = self.list_items(expr)
        if not items or isinstance(expr, (nodes.ListComp, nodes.GeneratorExp)):
            return None
        last = items[-1]
        if isinstance(expr, (nodes.List, nodes.Tuple)):
            return last
        frame, node = last.frame(), last.parent
        while node is not frame:
            if isinstance(node, _CONDITIONAL_CODE) or (
                    isinstance(node, nodes.Call) and isinstance(node.func, nodes.Attribute)
                    and node.func.attrname == "insert"):
                return None
            node = node.parent
        return last

    def stored_into(self, name: nodes.Name) -> bool:
        """Whether the function of ``name`` stores into an element of what it names
        (``outs[i] = outs[i].float()``)."""
        frame = name.frame()
        return any(
            isinstance(node.value, nodes.Name) and node.value.name == name.name
            and node.ctx != Context.Load
            for node in frame.nodes_of_class(nodes.Subscript)
        )

    def _list_use(self, use: nodes.Name) -> Optional[List[nodes.NodeNG]]:
        """What a use of a list name adds to it ([] for a read); None if it may change it
        otherwise."""
        parent = use.parent
        if isinstance(parent, nodes.Attribute) and parent.expr is use:
            call = parent.parent
            if not isinstance(call, nodes.Call) or call.func is not parent:
                return None
            if parent.attrname == "add_module" or any(arg is use for arg in call.args):
                return None  # not a list's method; ``x.extend(x)``
            return self._added_by(call)
        if isinstance(parent, (nodes.For, nodes.Comprehension)) and parent.iter is use:
            return []  # iterated over
        if (isinstance(parent, nodes.Subscript) and parent.value is use
                and parent.ctx == Context.Load):
            return []  # an element read (``outs[0]``), not stored
        if isinstance(parent, nodes.Tuple) and isinstance(parent.parent, nodes.Return):
            parent = parent.parent  # ``return scores, fmaps``
        if isinstance(parent, nodes.Return):
            return []  # handed back whole (``return layers`` of a block builder)
        if isinstance(parent, nodes.Starred):
            parent = parent.parent
        if isinstance(parent, nodes.Call) and use is not parent.func:
            qualname = self.qualname(parent.func) or ""
            if (qualname in MODULE_CONTAINERS or qualname in _LIST_READERS
                    or self.builtin_name(parent.func) in ("len", "zip", "enumerate")):
                return []
            if isinstance(parent.func, nodes.Name) and self._called_class(parent) is not None:
                return []  # handed to a class of this module (``SequentialFlow(layers)``)
        return None

    # -- records ---------------------------------------------------------------------

    def record_fields(self, func: nodes.NodeNG) -> Optional[List[str]]:
        """The fields, in order, of the record type of this module ``func`` names: a
        ``namedtuple("Out", ["logits", "value"])``, a ``typing.NamedTuple`` class or a
        ``@dataclass`` (a model's outputs); None for anything else."""
        if not isinstance(func, nodes.Name):
            return None
        found = [self._fields_of(binding) for binding in self.bindings(func)]
        return found[0] if len(found) == 1 else None

    @functools.cached_property
    def record_field_names(self) -> FrozenSet[str]:
        """Every field name of the module's record types: ``out.logits`` may read one."""
        definitions = [*self.context.nodes_of(nodes.ClassDef), *self.context.nodes_of(nodes.Assign)]
        return frozenset(
            name for definition in definitions for name in self._fields_of(definition) or ()
        )

    def _fields_of(self, binding: nodes.NodeNG) -> Optional[List[str]]:
        if isinstance(binding, nodes.AssignName):
            binding = binding.parent
        if isinstance(binding, nodes.ClassDef):
            if not binding.bases and not binding.decorators:
                return None
            record = any(self.qualname(base) in _RECORD_BASES for base in binding.bases) or any(
                self.qualname(getattr(d, "func", d)) == "dataclasses.dataclass"
                for d in (binding.decorators.nodes if binding.decorators else ())
            )
            if not record:
                return None
            return [
                statement.target.name for statement in binding.body
                if isinstance(statement, nodes.AnnAssign)
                and isinstance(statement.target, nodes.AssignName)
            ]
        value = binding.value if isinstance(binding, nodes.Assign) else None
        if not isinstance(value, nodes.Call) or len(value.args) < 2:
            return None
        if simple_name(value.func) not in ("namedtuple", "NamedTuple"):
            return None  # cheap test before name resolution
        if self.qualname(value.func) not in _RECORD_FACTORIES:
            return None
        fields = value.args[1]
        if isinstance(fields, nodes.Const) and isinstance(fields.value, str):
            return fields.value.replace(",", " ").split()
        if not isinstance(fields, (nodes.List, nodes.Tuple)):
            return None
        names = [
            field.elts[0] if isinstance(field, nodes.Tuple) and field.elts else field
            for field in fields.elts
        ]  # ``NamedTuple("Out", [("logits", Tensor)])`` names its fields in pairs
        if not all(isinstance(n, nodes.Const) and isinstance(n.value, str) for n in names):
            return None
        return [n.value for n in names]

    def _called_class(self, call: nodes.Call) -> Optional[nodes.ClassDef]:
        """The class of this module that ``call`` (``Net(...)``) instantiates."""
        return self._class_named(call.func)

    def _class_named(self, name: Optional[nodes.NodeNG]) -> Optional[nodes.ClassDef]:
        """The class of this module the name ``name`` binds, if it binds exactly one."""
        if not isinstance(name, nodes.Name):
            return None
        classes = [b for b in self.bindings(name) if isinstance(b, nodes.ClassDef)]
        return classes[0] if len(classes) == 1 else None

    def construction_class(self, construction: nodes.NodeNG) -> Optional[nodes.ClassDef]:
        """The class of this module a construction (:meth:`constructions`) builds."""
        if isinstance(construction, nodes.ClassDef):
            return construction
        return self._called_class(construction) if isinstance(construction, nodes.Call) else None

    def _without_attribute(self, construction: nodes.NodeNG, attribute: str) -> bool:
        """A module built by ``construction`` is a wrapper's view: ``.module`` on it is the
        module (its class, when of this module, sets no ``self.<attribute>``)."""
        classdef = self.construction_class(construction)
        if classdef is None:
            return False
        return attribute not in self._self_attributes(classdef)

    def self_attribute_values(self, attribute: nodes.Attribute) -> List[nodes.NodeNG]:
        """Values assigned (or registered as a buffer or parameter) to ``self.<attr>``
        anywhere in the enclosing class's methods; where they assign none, in the methods of
        the classes of this module its objects may be (its bases and the subclasses: a base
        class's ``forward`` looping over the ``self.convs`` each subclass builds)."""
        classdef = enclosing_class(attribute)
        if classdef is None:
            return []
        own = self._self_attributes(classdef).get(attribute.attrname)
        if own:
            return own
        return [value for related in self._classes_sharing_objects(classdef)
                for value in self._self_attributes(related).get(attribute.attrname, [])]

    def _classes_sharing_objects(self, classdef: nodes.ClassDef) -> List[nodes.ClassDef]:
        """The classes of this module in the MRO of ``classdef`` or of a subclass of it, where
        no base from elsewhere but ``nn.Module`` (whose code assigns none of the user's
        attributes) is among them."""
        related: List[nodes.ClassDef] = []
        for other in self.module_classes:
            mro = self.class_mro(other)
            if not mro or classdef not in mro:
                continue
            if not all(isinstance(entry, nodes.ClassDef) or entry in _BARE_BASES
                       for entry in mro):
                return []
            related.extend(e for e in mro if isinstance(e, nodes.ClassDef)
                           and e is not classdef and e not in related)
        return related

    def _self_attributes(self, classdef: nodes.ClassDef) -> Dict[str, List[nodes.NodeNG]]:
        found = self._class_attributes.get(classdef)
        if found is None:
            found = self._class_attributes[classdef] = self._collect_self_attributes(classdef)
        return found

    @functools.cached_property
    def _attributes_set_from_outside(self) -> FrozenSet[str]:
        """Attribute names assigned on objects other than ``self`` (``backbone.fc = ...``,
        ``backbone.register_buffer("fc", ...)``)."""
        assigned = {
            target.attrname
            for target in self.context.nodes_of(nodes.AssignAttr)
            if not is_self(target.expr)
        }
        registered = {
            registration[0]
            for name in REGISTER_METHODS
            for call in self.calls_by_name.get(name, ())
            for registration in [registered_attribute(call)]
            if registration is not None and not is_self(call.func.expr)
        }
        return frozenset(assigned | registered)

    def _collect_self_attributes(self, classdef: nodes.ClassDef) -> Dict[str, List[nodes.NodeNG]]:
        """``self.<x> = value`` and ``self.register_buffer("x", value)`` (a buffer or
        parameter is read back as ``self.x``) in the class's own methods."""
        found: Dict[str, List[nodes.NodeNG]] = {}
        methods = set(classdef.mymethods())
        for method in methods:
            for target in method.nodes_of_class(nodes.AssignAttr):
                if is_self(target.expr) and target.frame() is method:
                    value = literal_value(target)
                    found.setdefault(target.attrname, []).append(value)
        for name in REGISTER_METHODS:
            for call in self.calls_by_name.get(name, ()):
                registration = registered_attribute(call)
                if registration is not None and call.frame() in methods and is_self(call.func.expr):
                    found.setdefault(registration[0], []).append(registration[1])
        return found

    # -- calls -------------------------------------------------------------------------

    def callee(self, call: nodes.Call, _depth: int = 0) -> Optional[Callee]:
        """What ``call`` calls, following ``partial`` bindings and instances; None if unknown."""
        if call in self._callees:
            return self._callees[call]
        if _depth > _MAX_DEPTH:
            return None
        callee = self._callees[call] = self._resolve_callee(call, _depth)
        return callee

    def _resolve_callee(self, call: nodes.Call, _depth: int) -> Optional[Callee]:
        func = call.func
        qualname = self.qualname(func)
        if qualname is not None:
            return Callee(qualname, False, tuple(call.args), tuple(call.keywords or ()))
        partial = self._partial_binding(func, _depth)
        if partial is not None:
            return Callee(
                partial.qualname,
                partial.instance,
                partial.args + tuple(call.args),
                partial.keywords + tuple(call.keywords or ()),
            )
        cls = self.instance_class(func, _depth + 1)
        if cls is not None:
            return Callee(cls, True, tuple(call.args), tuple(call.keywords or ()))
        return None

    def _partial_binding(self, func: nodes.NodeNG, depth: int) -> Optional[Callee]:
        values = self.bound_values(func)
        if not values or len(values) != 1 or not isinstance(values[0], nodes.Call):
            return None
        return self.partial_target(values[0])

    def partial_target(self, call: nodes.Call) -> Optional[Callee]:
        """For ``functools.partial(f, *args, **kwargs)``: ``f`` with the bound arguments."""
        if self.qualname(call.func) not in _PARTIAL or not call.args:
            return None
        target = self.qualname(call.args[0])
        if target is None:
            return None
        return Callee(target, False, tuple(call.args[1:]), tuple(call.keywords or ()))

    def callee_qualname(self, call: nodes.Call) -> Optional[str]:
        """Shortcut: the qualified name of what ``call`` calls (instances: their class)."""
        callee = self.callee(call)
        return callee.qualname if callee is not None else None


#: An entry of a class's MRO: a class of this module, or the source text of one from elsewhere.
MroEntry = Union[nodes.ClassDef, str]


def _c3_merge(sequences: List[List[MroEntry]]) -> Optional[List[MroEntry]]:
    """C3 merge of the bases' linearizations; None when no consistent order exists."""
    merged: List[MroEntry] = []
    sequences = [s for s in sequences if s]
    while sequences:
        head = next(
            (s[0] for s in sequences if not any(s[0] in other[1:] for other in sequences)),
            None,
        )
        if head is None:
            return None
        merged.append(head)
        sequences = [rest for rest in ([e for e in s if e != head] for s in sequences) if rest]
    return merged


# -- small tree helpers shared by the analyses -------------------------------------------

#: Nodes whose bodies run at another time: analyses of a function skip them.
NESTED_SCOPES = (nodes.FunctionDef, nodes.ClassDef, nodes.Lambda)


def returned_values(function: nodes.FunctionDef) -> Optional[List[nodes.NodeNG]]:
    """The values ``function`` returns; None if it has a bare ``return`` or none."""
    returns = [r.value for r in function.nodes_of_class(nodes.Return, skip_klass=nodes.FunctionDef)]
    return returns if returns and all(v is not None for v in returns) else None


def calls_in_order(node: nodes.NodeNG) -> Iterator[nodes.Call]:
    """Calls in ``node`` in evaluation order (inner before outer), skipping nested scopes."""
    stack: List[Tuple[nodes.NodeNG, bool]] = [(node, False)]
    while stack:
        current, expanded = stack.pop()
        if expanded:
            if isinstance(current, nodes.Call):
                yield current
            continue
        stack.append((current, True))
        for child in reversed(list(current.get_children())):
            if not isinstance(child, NESTED_SCOPES):
                stack.append((child, False))


def _lookup(name: nodes.Name):
    """astroid's scope lookup, without astroid's model of ``builtins``.

    A name no scope binds (a builtin, or a local read before its assignment) ends in
    astroid's ``builtins`` model: ~0.4 s to build once per flake8 process, and ~10^5
    objects that every later cyclic collection scans. An empty stand-in answers "not
    bound here" for the one lookup and is removed after it, so another astroid user of
    the process still gets the real model. For a name in a method's decorator astroid
    asks whether it is a builtin: Python's ``builtins`` answers that here, and the lookup
    goes where astroid's would (a builtin-named decorator is looked up in the frame around
    the class)."""
    scope = name.scope()
    if isinstance(name.parent, nodes.Decorators) and isinstance(scope, nodes.ClassDef):
        if hasattr(builtins, name.name) and scope.parent is not None:
            return scope.parent.frame()._scope_lookup(name, name.name, -1)
        return scope._scope_lookup(name, name.name)
    cache = AstroidManager().astroid_cache
    if "builtins" in cache:
        return name.lookup(name.name)
    cache["builtins"] = _NO_BUILTINS
    try:
        return name.lookup(name.name)
    finally:
        del cache["builtins"]


#: The stand-in for astroid's ``builtins`` model during :func:`_lookup`: binds nothing.
_NO_BUILTINS = nodes.Module("builtins", pure_python=False)


def _defined_in_module(name: nodes.Name) -> bool:
    """Some scope enclosing ``name`` binds it (else astroid would look in builtins)."""
    scope = name.scope()
    while True:
        if name.name in scope.locals:
            return True
        if scope.parent is None:
            return False
        scope = scope.parent.scope()


#: Statement lists whose earlier statements have run when a later one runs.
_BLOCKS = ("body", "orelse", "finalbody")
#: Where the search for an overwriting assignment stops: scopes, loops that bind the name (an
#: assignment later in the body reaches the next iteration), handlers (the ``try`` may have
#: failed).
_SEARCH_ENDS = (
    nodes.For,
    nodes.While,
    nodes.FunctionDef,
    nodes.ClassDef,
    nodes.Module,
    nodes.ExceptHandler,
)


def _position(node: nodes.NodeNG) -> Tuple[int, int]:
    return (node.lineno or 0, node.col_offset or 0)


def _last_unconditional_binding(
    name: nodes.Name, bindings: Sequence[nodes.NodeNG]
) -> Optional[nodes.NodeNG]:
    """The binding of ``name`` that runs last, on every path, before ``name``'s statement
    in its function (straight-line code and ``with`` blocks only); None if unsure."""
    by_statement = {b.statement(): b for b in bindings}
    child = name.statement()
    while child.parent is not None:
        parent = child.parent
        block = next(
            (
                statements
                for statements in (getattr(parent, f, None) for f in _BLOCKS)
                if isinstance(statements, list) and child in statements
            ),
            [],
        )
        for statement in reversed(block[: block.index(child)] if block else []):
            found = _binding_run_by(statement, by_statement)
            if found is not None:
                return found
        if isinstance(parent, _SEARCH_ENDS) and not _rebinds_nothing(parent, bindings):
            return None
        child = parent
    return None


def _rebinds_nothing(block: nodes.NodeNG, bindings: Sequence[nodes.NodeNG]) -> bool:
    """``block`` is a loop that binds none of ``bindings``: no later iteration can see a value
    it assigned, so the search goes on before it."""
    return isinstance(block, (nodes.For, nodes.While)) and not any(
        block.parent_of(binding) for binding in bindings)


def _binding_run_by(statement: nodes.NodeNG, by_statement: Dict) -> Optional[nodes.NodeNG]:
    """The binding that ``statement`` surely runs (itself, or inside ``with`` blocks)."""
    if statement in by_statement:
        return by_statement[statement]
    if isinstance(statement, nodes.With):
        for inner in reversed(statement.body):
            found = _binding_run_by(inner, by_statement)
            if found is not None:
                return found
    return None


def registered_attribute(call: nodes.Call) -> Optional[Tuple[str, nodes.NodeNG]]:
    """``("queue", value)`` for ``m.register_buffer("queue", value)`` (or
    ``register_parameter``): afterwards ``m.queue`` is ``value``. None for other calls."""
    method, receiver = method_call(call)
    if method not in REGISTER_METHODS:
        return None
    name = call_argument(call, 0, "name")
    value = call_argument(call, 1, REGISTER_METHODS[method])
    if not isinstance(name, nodes.Const) or not isinstance(name.value, str) or value is None:
        return None
    return name.value, value


def method_call(call: nodes.Call) -> Tuple[str, Optional[nodes.NodeNG]]:
    """``(method name, receiver)`` of ``receiver.method(...)``; ``("", None)`` otherwise."""
    func = call.func
    if isinstance(func, nodes.Attribute):
        return func.attrname, func.expr
    return "", None


def assigned_value(binding: nodes.NodeNG) -> Optional[nodes.NodeNG]:
    """For ``x = value`` / ``x: T = value`` / ``x := value``, the value bound to the
    target ``binding``; None for unpacking, loops, augmented assignment and others."""
    parent = binding.parent
    if isinstance(parent, nodes.Assign) and binding in parent.targets:
        return parent.value
    if isinstance(parent, nodes.AnnAssign) and parent.target is binding:
        return parent.value
    if isinstance(parent, nodes.NamedExpr) and parent.target is binding:
        return parent.value
    return None


def literal_value(binding: nodes.NodeNG) -> Optional[nodes.NodeNG]:
    """:func:`assigned_value`, or the element a target takes in the unpacking of a literal
    tuple (``self.model, self.cfg = model, cfg``)."""
    value = assigned_value(binding)
    if value is not None:
        return value
    unpacked = unpacked_value(binding)
    if unpacked is not None and isinstance(unpacked[0], (nodes.Tuple, nodes.List)):
        return unpacked[0].elts[unpacked[1]]
    return None


def unpacked_value(binding: nodes.NodeNG) -> Optional[Tuple[nodes.NodeNG, int]]:
    """For ``a, b = value``: ``(value, position of binding)``; None for other bindings and
    for unpacking with a starred target."""
    target = binding.parent
    statement = target.parent if isinstance(target, (nodes.Tuple, nodes.List)) else None
    if not isinstance(statement, nodes.Assign) or target not in statement.targets:
        return None
    if any(isinstance(element, nodes.Starred) for element in target.elts):
        return None
    position = target.elts.index(binding)
    value = statement.value
    if isinstance(value, (nodes.Tuple, nodes.List)) and len(value.elts) != len(target.elts):
        return None
    return value, position


#: Methods a call of the model object runs.
FORWARD_METHODS = frozenset({"forward", "__call__"})


def is_inert(statement: nodes.NodeNG) -> bool:
    """A statement that does nothing: ``pass``, a docstring, ``...``."""
    return isinstance(statement, nodes.Pass) or (
        isinstance(statement, nodes.Expr) and isinstance(statement.value, nodes.Const))


def is_abstract(function: nodes.FunctionDef) -> bool:
    """A method left to subclasses: besides inert statements (:func:`is_inert`) its body at
    most raises ``NotImplementedError``."""
    body = [statement for statement in function.body if not is_inert(statement)]
    if not body:
        return True
    statement = body[0]
    if len(body) != 1 or not isinstance(statement, nodes.Raise) or statement.exc is None:
        return False
    raised = statement.exc.func if isinstance(statement.exc, nodes.Call) else statement.exc
    return isinstance(raised, nodes.Name) and raised.name == "NotImplementedError"


def is_model_class(classdef: nodes.ClassDef) -> bool:
    """Defines ``forward`` or derives from a ``torch.nn`` class / a ``*Module`` base."""
    if "forward" in classdef.locals:
        return True
    return any(
        last_part(base.as_string()).endswith("Module")
        or base.as_string().startswith(("nn.", "torch.nn."))
        for base in classdef.bases
    )


#: How many parameters deep ``list_items`` follows a list to the calls that pass it.
_MAX_PASSED_LISTS = 3
#: Bases from elsewhere whose code assigns none of a subclass's attributes.
_BARE_BASES = frozenset({"torch.nn.Module", "nn.Module", "torch.nn.modules.module.Module"})


#: Nodes that decide whether the code in one of their parts runs.
_CHOICES = (nodes.If, nodes.IfExp, nodes.MatchCase, nodes.ExceptHandler, nodes.BoolOp)


def conditional_in(node: nodes.NodeNG, scope: nodes.NodeNG) -> bool:
    """An ``if``/``else``, conditional expression, ``match`` case, ``except`` handler or
    ``and``/``or`` between ``node`` and ``scope`` decides whether ``node`` runs."""
    child, parent = node, node.parent
    while parent is not None and child is not scope:
        if isinstance(parent, _CHOICES) and child is not getattr(parent, "test", None):
            if not isinstance(parent, nodes.BoolOp) or child is not parent.values[0]:
                return True
        child, parent = parent, parent.parent
    return False


def code_frame(node: nodes.NodeNG) -> nodes.NodeNG:
    """The function, class or module whose code ``node`` runs as part of: a lambda belongs
    to the code that defines it (``tree_map(lambda t: t.half(), batch)`` in a train step)."""
    frame = node.frame()
    while isinstance(frame, nodes.Lambda) and not isinstance(frame, nodes.FunctionDef):
        frame = frame.parent.frame()
    return frame


def bound_value(binding: nodes.NodeNG) -> Optional[nodes.NodeNG]:
    """The value assigned to ``binding``: also an element of tuple unpacking (``a, b = f()``:
    ``f()``; ``a, b = x, y``: ``x``), the added term of ``loss += term``, and the iterable a
    loop or comprehension target comes from (``for a in aux_outputs``)."""
    value = assigned_value(binding)
    if value is not None:
        return value
    unpacked = unpacked_value(binding)
    if unpacked is not None:
        value, index = unpacked
        return value.elts[index] if isinstance(value, (nodes.Tuple, nodes.List)) else value
    parent = binding.parent
    if isinstance(parent, nodes.AugAssign):
        return parent.value
    if isinstance(parent, (nodes.For, nodes.Comprehension)) and parent.target is binding:
        return parent.iter
    while isinstance(parent, (nodes.Tuple, nodes.List, nodes.Starred)):
        parent = parent.parent
    if isinstance(parent, nodes.Assign):
        return parent.value
    return None


#: Torch functions that read a list of tensors whole (``torch.stack(heads, dim=2)``).
_LIST_READERS = frozenset(
    "torch." + name for name in "stack cat concat concatenate hstack vstack dstack".split()
)
#: ``nn.Module`` as a base class's qualified name.
_MODULE_BASES = frozenset({"torch.nn.Module", "torch.nn.modules.module.Module"})
#: Code that may run any number of times, or not at all.
_CONDITIONAL_CODE = (nodes.For, nodes.While, nodes.If, nodes.Try, nodes.IfExp, nodes.BoolOp,
                     nodes.Comprehension)


#: Statements whose blocks are left only through their end (not ``try``: a handler may
#: run after any statement of its body).
_BLOCK_HOLDERS = (nodes.If, nodes.For, nodes.While, nodes.With)


def _leaves_before(binding: nodes.NodeNG, use: nodes.NodeNG) -> bool:
    """``binding`` sits in a block that ends with ``return``/``raise`` and does not hold
    ``use``: ``if not self.training: x = ...; return x`` does not reach the code after
    the ``if``."""
    frame, node = binding.frame(), binding.statement()
    while node is not frame and isinstance(node.parent, _BLOCK_HOLDERS):
        holder = node.parent
        for block in (holder.body, getattr(holder, "orelse", None) or []):
            if node in block:
                if isinstance(block[-1], (nodes.Return, nodes.Raise)) and not any(
                        statement.parent_of(use) for statement in block):
                    return True
                break
        node = holder
    return False


def _list_binding_value(binding: nodes.NodeNG) -> Optional[nodes.NodeNG]:
    """The list a binding puts in a name (``layers = []``, ``layers, dim = [], 2048``) or
    adds to it (``layers += [...]``)."""
    if isinstance(binding.parent, nodes.AugAssign):
        return binding.parent.value if binding.parent.op == "+=" else None
    return literal_value(binding)


def _decorated(function: nodes.FunctionDef, names: Tuple[str, ...]) -> bool:
    """``function`` has one of the decorators ``names`` (``@staticmethod``)."""
    decorators = function.decorators.nodes if function.decorators else []
    return any(isinstance(d, nodes.Name) and d.name in names for d in decorators)


def _binds_self(function: nodes.NodeNG) -> bool:
    """``function`` is a method whose first parameter its calls do not pass."""
    if not isinstance(function, nodes.FunctionDef):
        return False
    if not isinstance(function.parent, nodes.ClassDef):
        return False
    return not _decorated(function, ("staticmethod",))


def assign_target(expr: nodes.NodeNG) -> Optional[nodes.NodeNG]:
    """``t`` in ``t = expr`` (a name or attribute), if ``expr`` is assigned to one."""
    parent = expr.parent
    if isinstance(parent, nodes.Assign) and parent.value is expr and len(parent.targets) == 1:
        return parent.targets[0]
    return None


def literal_target(expr: nodes.NodeNG) -> Optional[nodes.NodeNG]:
    """:func:`assign_target`, or the target ``expr`` takes in the unpacking of a literal tuple
    (``stages`` in ``stages, c = nn.ModuleList(), 32``)."""
    target = assign_target(expr)
    if target is not None:
        return target
    parent = expr.parent
    if isinstance(parent, nodes.Tuple) and isinstance(parent.parent, nodes.Assign):
        targets = parent.parent.targets
        if (parent.parent.value is parent and len(targets) == 1
                and isinstance(targets[0], nodes.Tuple)
                and len(targets[0].elts) == len(parent.elts)):
            return targets[0].elts[parent.elts.index(expr)]
    return None


def _is_super_call(expr: nodes.NodeNG) -> bool:
    """``super()`` (with no arguments, or ``super(Cls, self)``)."""
    return (
        isinstance(expr, nodes.Call)
        and isinstance(expr.func, nodes.Name)
        and expr.func.name == "super"
    )


def loop_of(binding: nodes.AssignName) -> Tuple[Optional[nodes.NodeNG], List[int]]:
    """The ``for`` loop or comprehension whose variable ``binding`` is (part of), and where
    in the unpacked target it sits (``[1, 0]`` for ``b`` in ``for i, (b, c) in ...``); None
    for a binding that is no loop variable."""
    path: List[int] = []
    node = binding
    while isinstance(node.parent, nodes.Tuple):
        path.insert(0, node.parent.elts.index(node))
        node = node.parent
    loop = node.parent
    if not isinstance(loop, (nodes.For, nodes.Comprehension)) or loop.target is not node:
        return None, path
    return loop, path


def _comprehension_target(binding: nodes.AssignName) -> bool:
    """Whether ``binding`` is (part of) a comprehension's loop variable (``for a, b in ...``)."""
    return isinstance(loop_of(binding)[0], nodes.Comprehension)


def _is_none(value: Optional[nodes.NodeNG]) -> bool:
    return isinstance(value, nodes.Const) and value.value is None


def argument_for(
    call: nodes.Call, arguments: nodes.Arguments, parameter: str
) -> Optional[nodes.NodeNG]:
    """What ``call`` passes to ``parameter`` of the function ``arguments`` belongs to (by
    keyword or position; ``self.f(...)`` and ``Cls(...)`` bind ``self``); None if omitted."""
    positional = [a.name for a in arguments.posonlyargs + arguments.args]
    if _binds_self(arguments.parent):
        positional = positional[1:]
    return named_argument(call, positional, parameter)


def named_argument(
    call: nodes.Call, positional: Sequence[str], name: str
) -> Optional[nodes.NodeNG]:
    """What ``call`` passes to ``name``: by keyword, or by its place in ``positional`` (the
    names its positional arguments bind); None if omitted or behind a ``*args``."""
    value = keyword_value(call, name)
    if value is not None or name not in positional:
        return value
    index = list(positional).index(name)
    before = call.args[: index + 1]
    if index < len(call.args) and not any(isinstance(a, nodes.Starred) for a in before):
        return call.args[index]
    return None


def is_self(expr: nodes.NodeNG) -> bool:
    """``expr`` is the first parameter of the method it appears in (``self``)."""
    return _first_parameter_of(expr) == "method"


def is_cls(expr: nodes.NodeNG) -> bool:
    """``expr`` is the first parameter of the classmethod it appears in (``cls``)."""
    return _first_parameter_of(expr) == "classmethod"


def _first_parameter_of(expr: nodes.NodeNG) -> Optional[str]:
    """"method" or "classmethod" when ``expr`` names the first parameter of the method it
    appears in, of that kind; None otherwise (and in a staticmethod)."""
    if not isinstance(expr, nodes.Name):
        return None
    function = code_frame(expr)
    if not isinstance(function, nodes.FunctionDef) or not isinstance(
        function.parent, nodes.ClassDef
    ):
        return None
    params = function.args.posonlyargs + function.args.args
    if not params or params[0].name != expr.name:
        return None
    decorators = {d.name for d in (function.decorators.nodes if function.decorators else ())
                  if isinstance(d, nodes.Name)}
    if "staticmethod" in decorators:
        return None
    return "classmethod" if "classmethod" in decorators else "method"


def enclosing_class(node: nodes.NodeNG) -> Optional[nodes.ClassDef]:
    """The class whose method contains ``node``."""
    function = code_frame(node)
    if isinstance(function, nodes.FunctionDef) and isinstance(function.parent, nodes.ClassDef):
        return function.parent
    return None


def simple_name(expr: nodes.NodeNG) -> str:
    """The last identifier of a name or attribute chain (``a.b.c`` -> "c"); '' otherwise."""
    if isinstance(expr, nodes.Name):
        return expr.name
    if isinstance(expr, nodes.Attribute):
        return expr.attrname
    return ""


def attribute_not_in(func: nodes.NodeNG, names: frozenset) -> bool:
    """``func`` is ``x.<name>`` with a name outside ``names`` (bare names may be aliases)."""
    return isinstance(func, nodes.Attribute) and func.attrname not in names


def chain_root(
    expr: nodes.NodeNG, methods: FrozenSet[str], attributes: bool = False
) -> nodes.NodeNG:
    """The object a chain of indexing, calls of ``methods`` (and, with ``attributes``,
    attribute access) starts from: ``x`` for ``x["model"].cuda().half()``."""
    while True:
        if isinstance(expr, nodes.Subscript):
            expr = expr.value
        elif attributes and isinstance(expr, nodes.Attribute):
            expr = expr.expr
        elif (
            isinstance(expr, nodes.Call)
            and isinstance(expr.func, nodes.Attribute)
            and expr.func.attrname in methods
        ):
            expr = expr.func.expr
        else:
            return expr


def chain_top(node: nodes.NodeNG, methods: FrozenSet[str]) -> nodes.NodeNG:
    """The last call of the chain of ``methods`` calls that continues ``node``: the
    ``.eval()`` call for ``m.half()`` in ``m.half().cuda().eval()`` (the counterpart of
    :func:`chain_root`)."""
    while isinstance(node.parent, nodes.Attribute) and node.parent.attrname in methods:
        call = node.parent.parent
        if not isinstance(call, nodes.Call) or call.func is not node.parent:
            break
        node = call
    return node


def keyword_value(call: nodes.Call, name: str) -> Optional[nodes.NodeNG]:
    for kw in call.keywords or ():
        if kw.arg == name:
            return kw.value
    return None


def call_argument(call: nodes.Call, position: int, name: str) -> Optional[nodes.NodeNG]:
    """The argument passed as ``name=`` or at ``position`` (not a ``*args`` spread)."""
    value = keyword_value(call, name)
    if value is None and position < len(call.args):
        if not isinstance(call.args[position], nodes.Starred):
            value = call.args[position]
    return value


def call_arguments(call: nodes.Call) -> Iterator[nodes.NodeNG]:
    """Every argument of ``call``, positional then keyword."""
    yield from call.args
    for keyword in call.keywords or ():
        yield keyword.value


def names_in(expr: Sequence[nodes.NodeNG]) -> List[str]:
    """Every identifier (names and attribute names) in the given expressions."""
    words: List[str] = []
    for node in expr:
        for sub in node.nodes_of_class((nodes.Name, nodes.Attribute)):
            words.append(sub.name if isinstance(sub, nodes.Name) else sub.attrname)
    return words
