"""AMP010 scaler-dtype-mismatch: fp16 autocast without a GradScaler, or a GradScaler with bf16.

Judged per function (and per module body, for scripts) from regions whose dtype is known:
- an fp16 region (its own, or one that a function of the module it calls for the loss
  opens: ``loss = forward_step(model, batch)``) and a plain ``backward()`` (not
  ``accelerator.backward(loss)`` or other wrappers, not a manually scaled loss), in a
  function that uses and names no scaler
  (``loss_scaler(loss, optimizer)``) and that no ``GradScaler`` of the file can reach
  (one kept in another function's local variable cannot);
- in a function that uses a GradScaler (builds one, or scales or unscales with it) or that
  one of the file's can reach while it names none, an
  fp16 region of its own whose loss a plain backward backpropagates: every assignment of
  the name that reaches the backward is in the region, and the backward runs whatever the
  flags say (no ``if``/``else`` around it, not after ``if use_amp: ...; continue``);
- a ``GradScaler(...)`` built enabled (no ``enabled=``, ``enabled=True``, or the
  ``enabled=`` flag that also enables the bf16 autocasts it serves:
  ``GradScaler(enabled=CFG["apex"])`` beside ``autocast(enabled=CFG["apex"],
  dtype=torch.bfloat16)``; ``enabled=dtype == "float16"`` is fine) when every function
  scaling a backward with it computes its loss in bf16 regions only: its own (or, for a
  helper that only scales, its callers'), and those of the module's functions it calls for
  the loss (as for fp16); a function with none known keeps it silent. A scaler parameter is
  built where its function's call sites here pass it
  (``ScalerAnalysis.constructions``).
Each finding sits on the line to change: the ``GradScaler(...)`` construction to delete for
bf16; for fp16, the autocast expression that names the dtype (``torch.autocast(...)``, or
the ``ctx = torch.autocast(...) if args.amp else nullcontext()`` that ``with ctx:`` uses).
A backward of a manually scaled loss (``(loss * 1024.0).backward()``) is not plain, nor one of a
surrogate carrying a gradient already computed (gradient caching).
"""

from __future__ import annotations

from typing import Dict, Iterable, Iterator, List, Optional, Set, Tuple

from astroid import nodes

from flake8_amp.analysis.constants import numeric_constant
from flake8_amp.analysis.names import (
    NESTED_SCOPES,
    assigned_value,
    bound_value,
    calls_in_order,
    code_frame,
    conditional_in,
    keyword_value,
    names_in,
)
from flake8_amp.analysis.regions import BF16, FP16, Region
from flake8_amp.analysis.scaler import backpropagated_tensor, reaches_backward, scaler_analysis
from flake8_amp.engine import Check, mentions_autocast


NO_SCALER = "fp16 autocast and backward() with no GradScaler: small gradients flush to zero"


class ScalerDtypeMismatch(Check):
    """fp16 gradients underflow without loss scaling; bf16 does not need it."""

    code = "AMP010"
    triggers = ("autocast",)

    @classmethod
    def applies(cls, source, options):
        return mentions_autocast(source, options)

    def __init__(self, context, findings):
        super().__init__(context, findings)
        #: Every scope with the regions it opens: which scalers a scope uses is only worth
        #: finding (``finish``) in a file with a bf16 region.
        self._scopes: List[Tuple[nodes.NodeNG, List[Tuple[nodes.NodeNG, Region]]]] = []

    def visit_module(self, node: nodes.Module) -> None:
        self._check_scope(node)

    def visit_functiondef(self, node: nodes.FunctionDef) -> None:
        self._check_scope(node)

    def _check_scope(self, scope: nodes.NodeNG) -> None:
        entries = list(self._region_entries(scope))
        backwards = self._plain_backwards(scope)
        own = self._fp16_with_grad(entries) if backwards else []
        fp16 = own + self._fp16_with_grad(self._helper_regions(scope)) if backwards else []
        if fp16 and not self._mentions_scaler(scope):
            opener, region = fp16[0]
            self.report(region.source or opener, detail=NO_SCALER)
        elif own:
            uses_one = bool(scaler_analysis(self.context).flow(scope).scalers)
            for opener, region in self._bypassing_the_scaler(scope, own, backwards):
                self.report(
                    region.source or opener,
                    detail="fp16 autocast whose loss goes through a plain backward() "
                    "though a GradScaler is used here: small gradients flush to zero"
                    if uses_one else NO_SCALER,
                )
        self._scopes.append((scope, entries))

    def _fp16_with_grad(
        self, entries: Iterable[Tuple[nodes.NodeNG, Region]]
    ) -> List[Tuple[nodes.NodeNG, Region]]:
        """The fp16 regions among ``entries`` whose code has gradients (a teacher's forward
        under ``torch.no_grad()`` produces nothing to backpropagate)."""
        grad = self.context.grad
        return [
            (opener, fp16)
            for opener, region in entries
            for fp16 in [_fp16_choice(region)]
            if fp16 is not None and not grad.no_grad_at(_opened_by(opener).body[0])
        ]

    def _helper_regions(self, scope: nodes.NodeNG) -> List[Tuple[nodes.NodeNG, Region]]:
        """The regions of the module's functions that ``scope`` calls for what it
        backpropagates, which its loss is computed in too (``loss = forward_step(model,
        batch); loss.backward()``; ``logits = encode(model, x)`` with ``encode`` decorated
        ``@torch.autocast(...)``)."""
        names = self.context.names
        found = []
        for call in calls_in_order(scope):
            helper = names.local_function(call)
            if helper is None or helper is scope:
                continue
            entries = list(self._region_entries(helper))
            if entries and reaches_backward(call, names):
                found.extend(entries)
        return found

    def finish(self) -> None:
        if not any(region.dtype == BF16 for _, entries in self._scopes for _, region in entries):
            return
        # enabled GradScaler(...) calls -> dtypes of the regions that the scopes scaling a
        # backward with them compute their loss in (None: a scope with none known)
        analysis = scaler_analysis(self.context)
        scaler_uses: Dict[nodes.Call, Set[Optional[str]]] = {}
        for scope, entries in self._scopes:
            flow = analysis.flow(scope)
            if not flow.scaled_backwards:
                continue
            regions = entries + self._helper_regions(scope) or self._callers_regions(scope)
            dtypes = {region.dtype for _, region in regions} or {None}
            for scaler in flow.scalers.values():
                for construction in scaler.constructions:
                    if construction in scaler.enabled_constructions or _switched_together(
                        construction, [region for _, region in regions]
                    ):
                        scaler_uses.setdefault(construction, set()).update(dtypes)
        for construction, dtypes in scaler_uses.items():
            if dtypes == {BF16}:
                self.report(
                    construction,
                    detail="GradScaler used with bf16 autocast, which needs no loss scaling",
                )

    def _callers_regions(self, scope: nodes.NodeNG) -> List[Tuple[nodes.NodeNG, Region]]:
        """For a function that scales a backward but computes nothing in a region of its
        own (``def backward(self, loss): self.scaler.scale(loss).backward()``), the regions
        its callers compute that loss in."""
        if not isinstance(scope, nodes.FunctionDef):
            return []
        found: List[Tuple[nodes.NodeNG, Region]] = []
        for site in self.context.names.call_sites(scope):
            caller = code_frame(site)
            found.extend(list(self._region_entries(caller)) + self._helper_regions(caller))
        return found

    def _region_entries(self, scope: nodes.NodeNG) -> Iterator[Tuple[nodes.NodeNG, Region]]:
        """``(expression that opens it, region)`` for each active region opened in ``scope``."""
        regions = self.context.regions
        if isinstance(scope, nodes.FunctionDef) and scope.decorators is not None:
            for decorator in scope.decorators.nodes:
                region = regions.spec(decorator)
                if region is not None and region.active:
                    yield decorator, region
        for with_node in _own_nodes(scope, nodes.With):
            for expr, _ in with_node.items:
                region = regions.spec(expr)
                if region is not None and region.active:
                    yield expr, region

    def _bypassing_the_scaler(
        self,
        scope: nodes.NodeNG,
        fp16: List[Tuple[nodes.NodeNG, Region]],
        backwards: List[Tuple[nodes.Call, nodes.NodeNG]],
    ) -> List[Tuple[nodes.NodeNG, Region]]:
        """The regions of ``fp16`` (opened in ``scope``, which uses a GradScaler or one of
        the file's can reach) whose loss a plain backward backpropagates: a name whose every
        reaching binding is made, unscaled, inside the region, by a backward that runs
        whatever the flags say (``if scaler: ... else: loss.backward()`` is the no-scaler
        path). A scaler that only reaches ``scope`` can scale a loss made outside the region
        (``loss = self.scale_loss(loss)``), not one made and backpropagated here."""
        flow = scaler_analysis(self.context).flow(scope)
        if not flow.scalers and self._names_scaler(scope):
            return []
        names = self.context.names
        by_statement = {_opened_by(opener): (opener, region) for opener, region in fp16}
        found: List[Tuple[nodes.NodeNG, Region]] = []
        for call, tensor in backwards:
            if (
                not isinstance(tensor, nodes.Name)
                or call in flow.scaled_backwards
                or conditional_in(call, scope)
                or flow.may_skip_scaler(call)
            ):
                continue
            made_in = [
                self._made_in(binding, by_statement) for binding in names.reaching_bindings(tensor)
            ]
            if made_in and None not in made_in and made_in[0] not in found:
                found.append(made_in[0])
        return found

    def _made_in(
        self, binding: nodes.NodeNG, by_statement: Dict[nodes.NodeNG, Tuple[nodes.NodeNG, Region]]
    ) -> Optional[Tuple[nodes.NodeNG, Region]]:
        """The entry of ``by_statement`` whose region is the innermost one around ``binding``,
        if the value it binds is not manually scaled."""
        value = bound_value(binding)
        if value is None or self._manually_scaled(value):
            return None
        region = self.context.regions.region_at(binding)
        return by_statement.get(region.node) if region is not None else None

    def _plain_backwards(self, scope: nodes.NodeNG) -> List[Tuple[nodes.Call, nodes.NodeNG]]:
        """Unscaled backwards and their tensors: ``loss.backward()`` or
        ``torch.autograd.backward(loss)``, not of ``scaler.scale(loss)`` or a manually scaled
        loss (wrappers take the loss as an argument: ``engine.backward(loss)``)."""
        found = []
        for call in calls_in_order(scope):
            tensor = backpropagated_tensor(call, self.context.names)
            if tensor is not None and not self._manually_scaled(tensor):
                found.append((call, tensor))
        return found

    def _manually_scaled(self, tensor: nodes.NodeNG) -> bool:
        """``scaler.scale(loss)``, ``loss * loss_scale`` or ``loss * 1024.0``, or a surrogate
        carrying a gradient already computed (:meth:`_carries_gradient`)."""
        if any("scale" in word.lower() for word in names_in([tensor])):
            return True
        if isinstance(tensor, nodes.BinOp) and tensor.op == "*":
            for operand in (tensor.left, tensor.right):
                factor = numeric_constant(operand, self.context.names)
                if factor is not None and factor > 1:
                    return True
        return self._carries_gradient(tensor)

    def _carries_gradient(self, expr: nodes.NodeNG, depth: int = 3) -> bool:
        """``expr`` is built from a ``.grad`` (gradient caching: ``torch.dot(reps,
        cached.grad)`` per chunk after a scaled backward of the whole batch's loss): its
        backward carries that gradient, scale included."""
        if depth <= 0:
            return False
        names = self.context.names
        for sub in expr.nodes_of_class((nodes.Attribute, nodes.Name)):
            if isinstance(sub, nodes.Attribute) and sub.attrname == "grad":
                return True
            if not isinstance(sub, nodes.Name):
                continue
            for binding in names.reaching_bindings(sub):
                value = bound_value(binding)
                if value is None and isinstance(binding, nodes.AssignName):
                    # a tuple loop target: its own sequence (``grad`` in ``zip(.., g.split(n))``)
                    value = names.iterated(binding)
                if value is not None and self._carries_gradient(value, depth - 1):
                    return True
        return False

    def _mentions_scaler(self, scope: nodes.NodeNG) -> bool:
        """The function uses or names a scaler (``loss_scaler``...), or a ``GradScaler`` of the
        file can reach it."""
        analysis = scaler_analysis(self.context)
        return bool(analysis.flow(scope).scalers) or analysis.scaler_reaches(scope) \
            or self._names_scaler(scope)

    def _names_scaler(self, scope: nodes.NodeNG) -> bool:
        """An identifier of ``scope`` names a scaler (``loss_scaler(loss, optimizer)``). A name
        that holds only objects of this file's classes that scale no loss (a data normaliser:
        ``self.scaler = StandardScaler(...)``) does not count, nor a parameter the function
        never reads (``def step_fp16(model, opt, x, y, _scaler=None)`` of a benchmark table)."""
        return any("scaler" in word.lower() and not _parameter(node)
                   and not self._holds_no_loss_scaler(node)
                   for word, node in _identifiers(scope))

    def _holds_no_loss_scaler(self, expr: nodes.NodeNG) -> bool:
        """``expr`` (a name, an attribute, or an assignment's target) is built only by classes
        of this file whose code scales no loss."""
        if isinstance(expr, (nodes.AssignName, nodes.AssignAttr)):
            expr = assigned_value(expr)
        if not isinstance(expr, (nodes.Name, nodes.Attribute, nodes.Subscript, nodes.Call)):
            return False
        classes = self.context.names.local_classes(expr)
        return bool(classes) and None not in classes and not any(
            word == "scale" or "scaler" in word.lower()
            for classdef in classes for word, _ in _identifiers(classdef))


def _identifiers(node: nodes.NodeNG) -> Iterator[Tuple[str, nodes.NodeNG]]:
    """Every name, attribute name and imported name in ``node``, with the node naming it."""
    for sub in node.nodes_of_class(
        (nodes.Name, nodes.Attribute, nodes.AssignName, nodes.AssignAttr, nodes.Import,
         nodes.ImportFrom)
    ):
        if isinstance(sub, (nodes.Import, nodes.ImportFrom)):
            yield from ((name, sub) for pair in sub.names for name in pair if name)
        elif isinstance(sub, (nodes.Name, nodes.AssignName)):
            yield sub.name, sub
        else:
            yield sub.attrname, sub


def _parameter(node: nodes.NodeNG) -> bool:
    """``node`` declares a parameter: its reads, if any, are names of their own."""
    return isinstance(node, nodes.AssignName) and isinstance(node.parent, nodes.Arguments)


def _fp16_choice(region: Region) -> Optional[Region]:
    """The fp16 autocast ``region`` is or may be: itself, or the fp16 one of the autocasts a
    context chosen at run time may be (the ``case "fp16":`` arm, the line to change)."""
    if region.dtype == FP16:
        return region
    return next((r for r in region.alternatives if r.dtype == FP16 and r.active), None)


def _opened_by(opener: nodes.NodeNG) -> nodes.NodeNG:
    """The ``with`` statement or decorated function whose item or decorator ``opener`` is."""
    parent = opener.parent
    return parent.parent if isinstance(parent, nodes.Decorators) else parent


def _own_nodes(scope: nodes.NodeNG, kind: type) -> Iterator[nodes.NodeNG]:
    """Nodes of ``kind`` in ``scope``, not in nested functions, classes or lambdas."""
    stack = list(scope.get_children())
    while stack:
        node = stack.pop()
        if isinstance(node, NESTED_SCOPES):
            continue
        if isinstance(node, kind):
            yield node
        stack.extend(node.get_children())


def _switched_together(construction: nodes.Call, regions: List[Region]) -> bool:
    """``construction`` is enabled by the flag that enables every one of ``regions``
    (``GradScaler(enabled=CFG["apex"])`` and ``autocast(enabled=CFG["apex"], ...)``)."""
    flag = keyword_value(construction, "enabled")
    if flag is None or not regions:
        return False
    return all(
        isinstance(region.source, nodes.Call)
        and _flag_text(keyword_value(region.source, "enabled")) == _flag_text(flag)
        for region in regions
    )


def _flag_text(expr: Optional[nodes.NodeNG]) -> Optional[str]:
    """A flag as written, ``self.`` aside (``cfg.amp`` in ``__init__`` is ``self.cfg.amp``
    in the methods once ``self.cfg = cfg``)."""
    return expr.as_string().removeprefix("self.") if expr is not None else None
