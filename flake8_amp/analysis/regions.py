"""Autocast regions: where in a module autocast is on, off, or depends on a flag.

A region is opened by a ``with`` statement or a decorator whose context manager is
autocast (``torch.autocast``, ``torch.amp.autocast``, the deprecated ``torch.cuda.amp``
/ ``torch.cpu.amp`` spellings, ``--amp-autocast-functions``, ``functools.partial``
aliases of these, project wrappers and methods whose name contains ``autocast`` such as
``accelerator.autocast()``), or by a context variable bound to one
(``ctx = nullcontext() if cpu else torch.amp.autocast(...)``; ``with ctx:``), or by a
context parameter that every call site in the module passes one (``def train(...,
amp_ctx): with amp_ctx:``). A function defined in the module and called only from inside
regions inherits the region (so does ``Net.forward`` when every ``model = Net(...)``
instance is called only inside regions; asked ``with_grad``, only call sites where
gradients are on count). Each region knows its ``source``: the autocast expression whose
arguments name its dtype, the line to change.
``enabled=False`` opens an island where autocast is off (tensors arriving in fp16 stay
fp16), as do wrappers named for turning it off (``disable_autocast()``). A variable
merely named ``ctx`` is not autocast.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Set, Tuple

from astroid import nodes

from flake8_amp.analysis.context import name_words
from flake8_amp.analysis.names import (
    Callee,
    CutCache,
    code_frame,
    is_inert,
    keyword_value,
    last_part,
    returned_values,
    simple_name,
)

AUTOCAST_FUNCTIONS = frozenset(
    {"torch.autocast", "torch.amp.autocast", "torch.cuda.amp.autocast", "torch.cpu.amp.autocast"}
)
#: Context managers that do nothing; the "off" branch of a conditional autocast.
NULL_CONTEXTS = frozenset(
    {"contextlib.nullcontext", "contextlib.suppress", "nullcontext", "suppress"}
)
#: ``custom_fwd(cast_inputs=...)`` runs the decorated forward with autocast disabled.
CUSTOM_FWD = frozenset({"torch.amp.custom_fwd", "torch.cuda.amp.custom_fwd"})

#: Words in a wrapper's name that say it turns autocast off.
DISABLING_WORDS = frozenset({"no", "not", "disable", "disabled", "disabling", "without", "off"})

CUDA, CPU = "cuda", "cpu"
FP16, BF16 = "fp16", "bf16"
_DTYPE_NAMES = {"torch.float16": FP16, "torch.half": FP16, "torch.bfloat16": BF16}
_DEFAULT_DTYPE = {CUDA: FP16, CPU: BF16}


@dataclass(frozen=True)
class Region:
    """An autocast region (or an ``enabled=False`` island inside one)."""

    #: The ``with`` statement or decorated function that opens the region.
    node: nodes.NodeNG
    #: True (on), False (an ``enabled=False`` island) or None (decided at run time by a flag).
    enabled: Optional[bool]
    #: "cuda", "cpu", another device string, or None when unknown.
    device: Optional[str]
    #: "fp16", "bf16", or None when unknown.
    dtype: Optional[str]
    #: The autocast expression where its arguments are written (the ``torch.autocast(...)``
    #: call, the ``partial(...)`` holding ``dtype=``): the line to change.
    source: Optional[nodes.NodeNG] = None
    #: For a context chosen at run time among autocasts that differ (``match precision:``
    #: binding an fp16 and a bf16 autocast), each autocast it may be.
    alternatives: Tuple["Region", ...] = ()

    @property
    def active(self) -> bool:
        """Autocast is, or may be, on here (True or flag-dependent)."""
        return self.enabled is not False


class Regions:
    """Autocast region queries for one module."""

    def __init__(self, context):
        self.context = context
        self.names = context.names
        self._opened: Dict[nodes.NodeNG, Optional[Region]] = {}
        #: The region every caller of a function runs it in; a call cycle reads as no region.
        self._inherited = CutCache()
        #: The region the callers that run a function under autocast run it in.
        self._on_amp_path = CutCache()
        self._sites: Dict[nodes.FunctionDef, List[nodes.Call]] = {}
        extra = context.options.autocast_functions
        self._extra_qualnames = frozenset(name for name in extra if "." in name)
        self._extra_names = frozenset(last_part(name) for name in extra)

    # -- public queries ----------------------------------------------------------------

    def region_at(self, node: nodes.NodeNG, with_grad: bool = False) -> Optional[Region]:
        """The innermost region enclosing ``node`` (including ``enabled=False`` islands).

        ``with_grad``: a region a function inherits from its callers counts only through
        call sites where gradients are on (a backward reached from ``no_grad`` code only
        cannot run; a BCE call there still raises, so this is the caller's choice)."""
        return self._region_at(node, with_grad)

    def autocast_at(self, node: nodes.NodeNG, with_grad: bool = False) -> Optional[Region]:
        """The region if autocast is (or may be) on at ``node``; None if off or outside."""
        region = self.region_at(node, with_grad)
        return region if region is not None and region.active else None

    def training_region(self, node: nodes.NodeNG) -> Optional[Region]:
        """The active region a training step with mixed precision on runs ``node`` in: its own,
        or that of the call sites with gradients on that run its function under autocast. A
        function also called outside autocast (``if use_amp: with autocast(...): out =
        model(x)`` / ``else: out = model(x)``) runs in the region on the mixed-precision path;
        the other path runs it in fp32 or in the weights' own dtype. None where no such path
        is known, and inside an ``enabled=False`` island."""
        region, function = self._opened_around(node, lambdas_are_functions=True)
        if region is None and isinstance(function, nodes.FunctionDef):
            return self._on_amp_path.answer(function, lambda: _merged_active(
                [self.training_region(call) for call in self.gradient_sites(function)]))
        return region if region is not None and region.active else None

    def local_region(self, node: nodes.NodeNG) -> Tuple[bool, Optional[Region]]:
        """``(True, region)`` when a region opened inside ``node``'s own function (a
        ``with`` there, or a decorator of the function) encloses it; ``(False, None)`` when
        the region at ``node`` is the one its caller runs it in. A lambda is part of the
        function it is written in (the dtype flow follows it there)."""
        region, _ = self._opened_around(node, lambdas_are_functions=False)
        return region is not None, region

    def opened_by(self, node: nodes.NodeNG) -> Optional[Region]:
        """The region a ``with`` statement or a decorated function opens, if any."""
        if node not in self._opened:
            self._opened[node] = self._compute_opened(node)
        return self._opened[node]

    def called_region(self, call: nodes.Call) -> Optional[Region]:
        """The active region that the same-module function ``call`` calls opens around its
        whole body (``@torch.autocast(...)`` on its ``def``): what it returns was made
        under autocast, wherever the call is."""
        definition = self.names.local_function(call)
        region = self.opened_by(definition) if definition is not None else None
        return region if region is not None and region.active else None

    def spec(self, expr: nodes.NodeNG) -> Optional[Region]:
        """The region the context-manager expression ``expr`` would open, if autocast."""
        return self._spec(expr, expr, 0)

    # -- enclosure ---------------------------------------------------------------------

    def _region_at(self, node: nodes.NodeNG, with_grad: bool) -> Optional[Region]:
        region, function = self._opened_around(node, lambdas_are_functions=True)
        if region is None and function is not None:
            return self._inherited_region(function, with_grad)
        return region

    def _opened_around(
        self, node: nodes.NodeNG, lambdas_are_functions: bool
    ) -> Tuple[Optional[Region], Optional[nodes.NodeNG]]:
        """The innermost region opened around ``node`` in its own code (a ``with``, or a
        decorator of its function): ``(region, None)``; else ``(None, function)``, the
        function whose callers decide, or ``(None, None)`` at class or module level."""
        scopes = (nodes.FunctionDef, nodes.Lambda) if lambdas_are_functions else nodes.FunctionDef
        child, parent = node, node.parent
        while parent is not None:
            if isinstance(parent, nodes.With) and not _is_with_item(parent, child):
                region = self.opened_by(parent)
                if region is not None:
                    return region, None
            elif isinstance(parent, scopes) and _in_body(parent, child):
                region = self.opened_by(parent)
                return (region, None) if region is not None else (None, parent)
            elif isinstance(parent, nodes.ClassDef):
                return None, None
            child, parent = parent, parent.parent
        return None, None

    def _inherited_region(self, function: nodes.NodeNG, with_grad: bool) -> Optional[Region]:
        """The region of every same-module call site of ``function``, if they all agree."""
        if not isinstance(function, nodes.FunctionDef):
            return None
        return self._inherited.answer(
            (function, with_grad), lambda: self._compute_inherited(function, with_grad))

    def _compute_inherited(self, function: nodes.FunctionDef, with_grad: bool) -> Optional[Region]:
        sites = self.gradient_sites(function) if with_grad else self.call_sites(function)
        regions = [self._region_at(call, with_grad) for call in sites]
        if regions and all(r is not None and r.active for r in regions):
            return _merged(regions)
        return None

    def gradient_sites(self, function: nodes.FunctionDef) -> List[nodes.Call]:
        """The calls of ``function`` in the module that run with gradients on: neither under
        ``no_grad`` nor in code only ``no_grad`` code calls (a sampling loop's ``inverse``)."""
        return [call for call in self.call_sites(function)
                if not self.context.grad.no_grad_at(call)
                and not self._runs_without_grad(code_frame(call))]

    def _runs_without_grad(self, function: nodes.NodeNG) -> bool:
        """Every call of ``function`` in the module runs with gradients off (``block.step``
        called only from a ``@torch.no_grad()`` generation loop); False without calls."""
        return self.every_caller(
            function, lambda call: True if self.context.grad.no_grad_at(call) else None,
            at_top=False)

    def every_caller(
        self, function: nodes.NodeNG, verdict: Callable[[nodes.Call], Optional[bool]],
        at_top: bool, _visiting: Optional[Set[nodes.NodeNG]] = None,
    ) -> bool:
        """Whether every call of ``function`` in the module holds by ``verdict(call)``: True
        or False, or None for "as the code the call is in holds", asked of that code's own
        callers in turn. ``at_top`` answers for module-level code and for a call cycle; a
        function with no call here does not hold (callers elsewhere are unseen)."""
        visiting = set() if _visiting is None else _visiting
        if not isinstance(function, nodes.FunctionDef) or function in visiting:
            return at_top
        sites = self.call_sites(function)
        if not sites:
            return False
        visiting.add(function)
        for site in sites:
            holds = verdict(site)
            if holds is None:
                holds = self.every_caller(code_frame(site), verdict, at_top, visiting)
            if not holds:
                return False
        return True

    def call_sites(self, function: nodes.FunctionDef) -> List[nodes.Call]:
        """The calls that run ``function`` (:meth:`Names.call_sites`; for a module's
        ``forward``, also the calls of its objects). Cached: the dtype flow asks it for
        every parameter it follows."""
        if function not in self._sites:
            self._sites[function] = self._compute_call_sites(function)
        return self._sites[function]

    def _compute_call_sites(self, function: nodes.FunctionDef) -> List[nodes.Call]:
        sites = self.names.call_sites(function)
        owner = function.parent
        if function.name in ("forward", "__call__") and isinstance(owner, nodes.ClassDef):
            # ``model(x)`` runs ``Net.forward`` when ``model = Net(...)`` in this module
            # (``compute_loss(p, t)`` a ``ComputeLoss.__call__``; ``self.criterion(...)`` after
            # ``self.criterion = DiceLoss()``, and
            # ``self.se(x)`` after ``self.se = SE(c) if use_se else nn.Identity()``), and so
            # does calling an ``nn.Sequential`` that holds one (``self.tcn(x)``) or an
            # element of a container (``self.blocks[i](x)``).
            sites.extend(
                call
                for call in self.names.module_calls
                if isinstance(call.func, (nodes.Name, nodes.Attribute, nodes.Subscript))
                and (self.names.may_run(call.func, function)
                     or self._sequence_holds(call.func, function))
            )
        return sites

    def _sequence_holds(self, func: nodes.NodeNG, method: nodes.FunctionDef) -> bool:
        """``func`` is an ``nn.Sequential`` one of whose elements runs ``method``."""
        names = self.names
        for construction in names.constructions(func) or ():
            if names.qualname(getattr(construction, "func", None)) != "torch.nn.Sequential":
                continue
            if any(names.may_run(item, method)
                   for item in names.container_items(construction) or ()):
                return True
        return False

    # -- what opens a region -----------------------------------------------------------

    def _compute_opened(self, node: nodes.NodeNG) -> Optional[Region]:
        if isinstance(node, nodes.With):
            found = None
            for expr, _ in node.items:
                region = self._spec(expr, node, 0)
                if region is not None:
                    found = region
            return found
        if isinstance(node, nodes.FunctionDef) and node.decorators is not None:
            found = None
            for decorator in node.decorators.nodes:
                region = self._spec(decorator, node, 0) or self._custom_fwd(decorator, node)
                if region is not None:
                    found = region
            return found
        return None

    def _custom_fwd(self, decorator: nodes.NodeNG, owner: nodes.NodeNG) -> Optional[Region]:
        if isinstance(decorator, nodes.Call) and self.names.qualname(decorator.func) in CUSTOM_FWD:
            if any(kw.arg == "cast_inputs" for kw in decorator.keywords or ()):
                return Region(owner, False, None, None, decorator)
        return None

    def _spec(self, expr: nodes.NodeNG, owner: nodes.NodeNG, depth: int) -> Optional[Region]:
        if depth > 4:
            return None
        if isinstance(expr, nodes.IfExp):
            return self._alternatives([expr], owner, depth)
        if isinstance(expr, nodes.Call):
            return self._call_spec(expr, owner, depth)
        if isinstance(expr, (nodes.Name, nodes.Attribute)):
            values = self._values(expr)
            if values:
                region = self._alternatives(values, owner, depth)
                if region is not None:
                    return region
            if "autocast" in simple_name(expr).lower():
                # A decorator such as ``@torch.autocast`` is not a region without a call.
                if _is_decorator(expr):
                    return None
                return Region(owner, _wrapper_enabled(simple_name(expr), None), None, None, expr)
        return None

    def _values(self, expr: nodes.NodeNG, hops: int = 3) -> Optional[List[nodes.NodeNG]]:
        """What a variable (``ctx``) or ``self`` attribute (``self.ctx``) is assigned, or what
        a parameter (``def train(..., amp_ctx)``) receives at its call sites; through names
        (``amp_ctx, scaler = build_amp(p)`` gives what ``build_amp``'s ``amp_ctx`` is)."""
        values = self.names.held_values(expr)
        if not values or hops <= 0:
            return values
        found: List[nodes.NodeNG] = []
        for value in values:
            further = self._values(value, hops - 1) if isinstance(value, nodes.Name) else None
            found.extend(further or [value])
        return found

    def _returned_values(self, call: nodes.Call) -> Optional[List[nodes.NodeNG]]:
        """The values the function or method of this module that ``call`` calls returns (a
        context factory such as ``def get_ctx(): return nullcontext() if cpu else
        torch.autocast(...)``, or a trainer's ``def autocast(self): return
        torch.autocast(...)``)."""
        function = self.names.local_function(call)
        return returned_values(function) if function is not None else None

    def _alternatives(
        self,
        values: List[nodes.NodeNG],
        owner: nodes.NodeNG,
        depth: int,
        called: Optional[nodes.Call] = None,
    ) -> Optional[Region]:
        """A variable bound to autocast on one path and to a null context on another.

        ``called``: the variable holds a context-manager factory and this is the call the
        ``with`` statement makes (``amp_ctx = suppress`` / ``amp_ctx = partial(
        torch.autocast, ...)``, then ``with amp_ctx():``).
        """
        branches: List[nodes.NodeNG] = []
        for value in values:
            branches.extend(
                [value.body, value.orelse] if isinstance(value, nodes.IfExp) else [value]
            )
        regions = []
        for value in branches:
            if value is None:
                region = None
            elif called is not None:
                region = self._factory_spec(value, called, owner)
            else:
                region = self._spec(value, owner, depth + 1)
            if region is None and not self._is_null_context(value):
                return None
            regions.append(region)
        found = [r for r in regions if r is not None]
        if not found:
            return None
        if len(found) == len(regions) and len({(r.enabled, r.device, r.dtype) for r in found}) == 1:
            return replace(found[0], node=owner)
        return _union(owner, found, False if all(r.enabled is False for r in found) else None)

    def _factory_spec(
        self, value: nodes.NodeNG, call: nodes.Call, owner: nodes.NodeNG
    ) -> Optional[Region]:
        """The region ``call`` opens when its callee is ``value``: ``torch.autocast`` or a
        ``partial`` of it."""
        if isinstance(value, nodes.Call):
            bound = self.names.partial_target(value)
        else:
            qualname = self.names.qualname(value)
            bound = Callee(qualname) if qualname else None
        if bound is None:
            return None
        callee = Callee(
            bound.qualname,
            False,
            bound.args + tuple(call.args),
            bound.keywords + tuple(call.keywords or ()),
        )
        written = value if isinstance(value, nodes.Call) else call
        if callee.qualname in AUTOCAST_FUNCTIONS:
            return _torch_autocast_region(callee, owner, self.names, written)
        if callee.qualname in self._extra_qualnames:
            enabled = _literal_enabled(callee.keyword("enabled"), None)
            return Region(owner, enabled, None, None, written)
        return None

    def _is_null_context(self, value: Optional[nodes.NodeNG]) -> bool:
        """``nullcontext()``, ``suppress()``..., or a class of this module whose ``__enter__``
        and ``__exit__`` do nothing (nnU-Net's ``dummy_context``)."""
        target = value.func if isinstance(value, nodes.Call) else value
        if not isinstance(target, (nodes.Name, nodes.Attribute)):
            return False
        qualname = self.names.qualname(target) or simple_name(target)
        if qualname in NULL_CONTEXTS:
            return True
        classdef = self.names.local_class(value) if isinstance(value, nodes.Call) else None
        return classdef is not None and all(
            _does_nothing(self.names.method_of(classdef, method))
            for method in ("__enter__", "__exit__")
        )

    def _call_spec(self, call: nodes.Call, owner: nodes.NodeNG, depth: int) -> Optional[Region]:
        callee = self.names.callee(call)
        if callee is not None and not callee.instance:
            if callee.qualname in AUTOCAST_FUNCTIONS:
                return _torch_autocast_region(callee, owner, self.names, call)
            if callee.qualname in self._extra_qualnames:
                enabled = _literal_enabled(callee.keyword("enabled"), None)
                return Region(owner, enabled, None, None, call)
        elif callee is None:
            values = self._values(call.func)
            region = self._alternatives(values, owner, depth, called=call) if values else None
            returned = self._returned_values(call)
            if region is None and returned:
                region = self._alternatives(returned, owner, depth + 1)
            if region is not None:
                return region
        name = simple_name(call.func)
        if name in self._extra_names or "autocast" in name.lower():
            enabled = _literal_enabled(keyword_value(call, "enabled"), None)
            return Region(owner, _wrapper_enabled(name, enabled), None, None, call)
        return None


def _merged_active(regions: List[Optional[Region]]) -> Optional[Region]:
    """:func:`_merged` of the regions that are there (None: no region at all)."""
    present = [region for region in regions if region is not None]
    return _merged(present) if present else None


def _merged(regions: List[Region]) -> Region:
    """The region a function runs in when its callers run it in ``regions`` (all active):
    the first where they agree; else one whose device and dtype are known only where all
    agree, each distinct caller region kept as an alternative (a helper called under a bf16
    autocast in one place and an fp16 one in another can run in fp16)."""
    first = regions[0]
    if all((r.enabled, r.device, r.dtype) == (first.enabled, first.device, first.dtype)
           for r in regions):
        return first
    alternatives: List[Region] = []
    for region in regions:
        for option in region.alternatives or (region,):
            if option not in alternatives:
                alternatives.append(option)
    enabled = True if all(r.enabled is True for r in alternatives) else None
    return _union(first.node, alternatives, enabled)


def _union(owner: nodes.NodeNG, options: List[Region], enabled: Optional[bool]) -> Region:
    """One region standing for ``options`` (the autocasts a context may be, or the regions a
    function's callers run it in): device and dtype where all agree, and where the dtypes
    differ each option kept as an alternative."""
    devices = {r.device for r in options}
    dtypes = {r.dtype for r in options}
    return Region(
        owner,
        enabled,
        devices.pop() if len(devices) == 1 else None,
        dtypes.pop() if len(dtypes) == 1 else None,
        options[0].source,
        tuple(options) if len(dtypes) > 1 else (),
    )


def _torch_autocast_region(
    callee: Callee, owner: nodes.NodeNG, names, call: nodes.Call
) -> Region:
    """Device, dtype and enabled of a ``torch.autocast``-family ``call`` (its source is the
    call, or the ``partial(...)`` that wrote its ``dtype=``)."""
    if callee.qualname.startswith("torch.cuda."):
        device: Optional[str] = CUDA
        enabled_node, dtype_node = callee.argument(0, "enabled"), callee.argument(1, "dtype")
    elif callee.qualname.startswith("torch.cpu."):
        device = CPU
        enabled_node, dtype_node = callee.argument(0, "enabled"), callee.argument(1, "dtype")
    else:
        device_node = callee.argument(0, "device_type")
        device = _string_constant(device_node, names)
        enabled_node, dtype_node = callee.argument(2, "enabled"), callee.argument(1, "dtype")
    if dtype_node is None:
        dtype = _DEFAULT_DTYPE.get(device or "")
    else:
        dtype = _DTYPE_NAMES.get(names.qualname(dtype_node) or "")
    written = dtype_node.parent if dtype_node is not None else call
    source = written.parent if isinstance(written, nodes.Keyword) else written
    return Region(owner, _literal_enabled(enabled_node, True, names), device, dtype, source)


def _wrapper_enabled(name: str, enabled: Optional[bool]) -> Optional[bool]:
    """A project wrapper named for turning autocast off (``disable_autocast()``,
    ``no_autocast``) opens an ``enabled=False`` island, whatever its arguments."""
    return False if DISABLING_WORDS.intersection(name_words(name)) else enabled


def _literal_enabled(
    node: Optional[nodes.NodeNG], default: Optional[bool], names=None
) -> Optional[bool]:
    """``enabled=`` as a literal; also a parameter (``def forward(..., enable_autocast=False)``)
    that every call site in the module passes the same literal, or, with no call site here,
    whose default is ``False``: autocast is off unless a caller elsewhere opts in."""
    if node is None:
        return default
    if isinstance(node, nodes.Const) and isinstance(node.value, bool):
        return node.value
    if names is not None and isinstance(node, nodes.Name):
        values = names.argument_values(node)
        if values is not None:
            found = {_literal_enabled(value, None) for value in values}
            return found.pop() if len(found) == 1 else None
        off_by_default = _literal_enabled(names.parameter_default(node), None) is False
        return False if off_by_default and not names.parameter_call_sites(node) else None
    return None


def _string_constant(node: Optional[nodes.NodeNG], names) -> Optional[str]:
    """A device string such as "cuda" or "cuda:0" reduced to its type; None if not literal."""
    if isinstance(node, nodes.Name):
        values = names.assigned_values(node)
        node = values[0] if values and len(values) == 1 else None
    if isinstance(node, nodes.Const) and isinstance(node.value, str):
        return node.value.split(":")[0]
    return None


def _is_with_item(with_node: nodes.With, child: nodes.NodeNG) -> bool:
    return any(child is expr or child is target for expr, target in with_node.items)


def _in_body(function: nodes.NodeNG, child: nodes.NodeNG) -> bool:
    """``child`` runs when ``function`` is called (not its decorators, defaults, annotations)."""
    if isinstance(function, nodes.Lambda) and not isinstance(function, nodes.FunctionDef):
        return child is function.body
    return any(child is statement for statement in function.body)


def _is_decorator(expr: nodes.NodeNG) -> bool:
    return isinstance(expr.parent, nodes.Decorators)


def _does_nothing(method: Optional[nodes.FunctionDef]) -> bool:
    """A method whose body is only ``pass``, a docstring, or returns None/False/self."""
    if method is None:
        return False
    for statement in method.body:
        if is_inert(statement):
            continue
        if isinstance(statement, nodes.Return) and (
            statement.value is None
            or isinstance(statement.value, nodes.Const) and statement.value.value in (None, False)
            or isinstance(statement.value, nodes.Name) and statement.value.name == "self"
        ):
            continue
        return False
    return True
