"""GradScaler flow: what state scaled gradients are in when each call of a function runs.

Per function (or module body, for scripts): which objects are gradient scalers (built by
``torch.amp.GradScaler`` & co., or used as ``x.scale(loss)`` / ``x.unscale_(opt)``;
``enabled=False`` scalers do nothing and do not count), which backward passes are
scaled (``scaler.scale(loss).backward()``, or a name bound to ``scaler.scale(loss)``),
and, before every call, the set of states the program may be in along the paths that
reach it: no scaled gradients pending, scaled, unscaled by ``unscale_``, or handed to a
helper that receives the scaler (which may unscale, step and update for us).

Paths follow if/else, loops (one pass, in source order), try/except, ``with``,
``match`` and early ``return``/``raise``/``continue``/``break``. Conditions are
correlated: a path that took ``if use_amp:`` takes the same arm of a later
``if use_amp:``, and amp/scaler flags (``use_amp``, ``args.fp16``, ``scaler is not
None``, ``scaler.is_enabled()``) count as one condition, so the ``else`` of any of them
is the no-scaler path.
"""

from __future__ import annotations

import functools
import re
import weakref
from dataclasses import dataclass, replace
from typing import Dict, FrozenSet, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

from astroid import nodes

from flake8_amp.analysis.context import is_optimizer_class, name_words, parameters_receiver
from flake8_amp.analysis.names import (
    argument_for,
    bound_value,
    call_arguments,
    calls_in_order,
    code_frame,
    enclosing_class,
    is_self,
    keyword_value,
    method_call,
    returned_values,
)

GRAD_SCALERS = frozenset(
    {
        "torch.amp.GradScaler",
        "torch.cuda.amp.GradScaler",
        "torch.cpu.amp.GradScaler",
        "torch.GradScaler",
        "torch.distributed.fsdp.ShardedGradScaler",
        "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler",
    }
)

#: Vendor backends' scalers, ``torch.<backend>.amp.GradScaler`` (``torch.npu.amp`` of torch_npu,
#: ``torch.mlu.amp``, ``torch.xpu.amp``): subclasses of torch's, imported in a vendor dispatch.
_BACKEND_SCALER = re.compile(r"torch\.\w+\.amp\.GradScaler")

AUTOGRAD_BACKWARD = frozenset({"torch.autograd.backward"})

#: Phases of the gradients of the current iteration, along one path.
SCALED = "scaled"  # a scaled backward ran; gradients are multiplied by the loss scale
UNSCALED = "unscaled"  # scaler.unscale_(optimizer) ran after it
HELPED = "helped"  # a helper received the scaler: it may have unscaled/stepped/updated

#: How many names or call sites a scaler is followed through to its construction.
_MAX_PASSING_HOPS = 3
#: How many ``return`` hops a scaler built in a factory function is followed through.
_MAX_RETURN_HOPS = 3
#: Above this many distinct path states, conditions are forgotten (paths still merge).
_MAX_STATES = 64
_AMP_FLAG_WORDS = frozenset(
    {"amp", "apex", "fp16", "half", "mixed", "scaler", "scaling", "autocast", "float16"}
)
#: The condition key every amp/scaler flag shares (``use_amp``, ``args.fp16``, ``scaler``).
AMP_CONDITION = "<amp enabled>"


def expression_key(expr: nodes.NodeNG) -> Optional[str]:
    """``scaler`` / ``self.scaler`` / ``trainer.opt`` as text; None for other expressions."""
    parts = []
    while isinstance(expr, (nodes.Attribute, nodes.AssignAttr)):
        parts.append(expr.attrname)
        expr = expr.expr
    if not isinstance(expr, (nodes.Name, nodes.AssignName)):
        return None
    parts.append(expr.name)
    return ".".join(reversed(parts))


def _is_amp_flag(expr: nodes.NodeNG) -> bool:
    """``use_amp``, ``args.fp16``, ``self.scaler``, ``cfg.mixed_precision``, ``CFG['apex']``..."""
    if isinstance(expr, nodes.Subscript) and isinstance(expr.slice, nodes.Const):
        last = expr.slice.value if isinstance(expr.slice.value, str) else ""
    else:
        key = expression_key(expr)
        last = key.rsplit(".", 1)[-1] if key is not None else ""
    return bool(_AMP_FLAG_WORDS.intersection(name_words(last)))


def condition_key(test: nodes.NodeNG) -> Optional[Tuple[str, bool]]:
    """A condition as ``(key, truth)`` so that repeated tests can be correlated.

    ``not x`` -> ``(x, False)``; ``x is None`` -> ``(x, False)``; amp/scaler flags all
    share one key. None for tests that are not worth correlating (arithmetic, calls).
    """
    truth = True
    while isinstance(test, nodes.UnaryOp) and test.op == "not":
        truth, test = not truth, test.operand
    if isinstance(test, nodes.Compare) and len(test.ops) == 1:
        op, right = test.ops[0]
        if op in ("is", "is not") and isinstance(right, nodes.Const) and right.value is None:
            truth = truth if op == "is not" else not truth
            test = test.left
        elif isinstance(right, nodes.Const) and expression_key(test.left) is not None:
            return test.as_string(), truth
        else:
            return None
    if isinstance(test, nodes.Call) and not test.args and method_call(test)[0] == "is_enabled":
        test = test.func.expr
    if _is_amp_flag(test):
        return AMP_CONDITION, truth
    key = expression_key(test)
    return (key, truth) if key is not None else None


@dataclass(frozen=True)
class PathState:
    """What is known along one path through the function."""

    #: None (no scaled gradients pending), SCALED, UNSCALED or HELPED.
    phase: Optional[str] = None
    #: Keys of optimizers ``scaler.step`` has stepped since the last backward, updated or
    #: not: a plain step of one of them steps the same gradients again.
    stepped: FrozenSet[str] = frozenset()
    #: Keys of the objects whose ``zero_grad()`` ran since the last scaled backward
    #: (optimizers, models): an optimizer zeroed there, or whose models all were, steps
    #: only gradients of later plain backward passes.
    zeroed: FrozenSet[str] = frozenset()
    #: ``scaler.step(...)`` calls not yet followed by ``scaler.update()`` on this path.
    pending_steps: FrozenSet[nodes.Call] = frozenset()
    #: Names currently bound to a scaled loss (``loss = scaler.scale(loss)``).
    scaled_names: FrozenSet[str] = frozenset()
    #: ``scaler.update()`` ended a scaled backward's phase: the optimizers ``scaler.step``
    #: did not step (those in ``stepped`` did) still hold its scaled gradients.
    left_scaled: bool = False
    #: Conditions decided on this path: ``(key, truth)``.
    conditions: FrozenSet[Tuple[str, bool]] = frozenset()


States = FrozenSet[PathState]


@dataclass(frozen=True)
class Scaler:
    """A gradient scaler known by the key it is used through (``scaler``, ``self.scaler``)."""

    key: str
    #: The ``GradScaler(...)`` calls that build it (same function, class or module, or
    #: passed by the call sites of the function it is a parameter of).
    constructions: Tuple[nodes.Call, ...]

    @property
    def enabled_constructions(self) -> Tuple[nodes.Call, ...]:
        """The constructions built enabled (no ``enabled=``, or ``enabled=True``)."""
        return tuple(call for call in self.constructions if _literal_enabled(call) is True)


def _is_scaler_class(qualname: str) -> bool:
    return qualname in GRAD_SCALERS or _BACKEND_SCALER.fullmatch(qualname) is not None


def _literal_enabled(call: nodes.Call) -> Optional[bool]:
    value = keyword_value(call, "enabled")
    if value is None:
        return True
    if isinstance(value, nodes.Const) and isinstance(value.value, bool):
        return value.value
    return None


def other_arm(branch: nodes.NodeNG, child: nodes.NodeNG) -> List[nodes.NodeNG]:
    """The arm of an ``if`` statement or expression that does not hold ``child``."""
    body = branch.body if isinstance(branch.body, list) else [branch.body]
    orelse = branch.orelse if isinstance(branch.orelse, list) else [branch.orelse]
    if any(child is node for node in body):
        return orelse
    if any(child is node for node in orelse):
        return body
    return []


class ScalerFlow:
    """The scaler flow of one function or module body (see the module docstring)."""

    def __init__(
        self, analysis: "ScalerAnalysis", scope: nodes.NodeNG, entry: Optional[str] = None
    ):
        self.scope = scope
        self._analysis = analysis
        self.scalers: Dict[str, Scaler] = analysis.scalers_in(scope)
        #: The states that may hold just before each call of the scope runs.
        self.states_before: Dict[nodes.Call, States] = {}
        self.scaler_steps: List[nodes.Call] = []
        self.scaled_backwards: List[nodes.Call] = []
        self._updated_steps: Set[nodes.Call] = set()
        self._loop_exits: List[Set[PathState]] = []
        #: The states the scope may end in (its end, or a ``return``).
        self.exit_states: Set[PathState] = set()
        if self.scalers:
            body = scope.body if isinstance(scope, (nodes.FunctionDef, nodes.Module)) else []
            self.exit_states.update(self._block(body, frozenset({PathState(phase=entry)})))

    # -- queries -----------------------------------------------------------------------

    def phases_before(
        self, call: nodes.Call, unless_zeroed: Sequence[FrozenSet[str]] = ()
    ) -> FrozenSet[Optional[str]]:
        """The phases the paths to ``call`` may be in; with ``unless_zeroed``, a path on which
        every key of one of those sets had ``zero_grad()`` run since the last scaled backward
        counts as holding no scaled gradients (``opt.zero_grad(); loss.backward()`` before
        ``opt.step()``: what the scaled backward left in its parameters is gone)."""
        return frozenset(
            None if any(keys and keys <= state.zeroed for keys in unless_zeroed) else state.phase
            for state in self.states_before.get(call, ())
        )

    def stepped_before(self, call: nodes.Call, optimizer_key: str) -> bool:
        """Some path to ``call`` already ran ``scaler.step(<optimizer_key>)`` since the last
        backward and the last ``<optimizer_key>.zero_grad()`` (with or without
        ``scaler.update()`` after it): a plain step there applies the same gradients again."""
        return any(optimizer_key in state.stepped for state in self.states_before.get(call, ()))

    def stepped_another_before(self, call: nodes.Call, optimizer_key: Optional[str]) -> bool:
        """Every path to ``call`` ran ``scaler.step`` on an optimizer other than
        ``<optimizer_key>`` since the last backward: a plain step of ``<optimizer_key>``
        there applies the same backward's gradients, past the scaler."""
        states = self.states_before.get(call, ())
        return bool(states) and all(state.stepped - {optimizer_key} for state in states)

    def left_scaled_before(
        self, call: nodes.Call, optimizer_key: Optional[str],
        unless_zeroed: Sequence[FrozenSet[str]],
    ) -> bool:
        """Some path to ``call`` ran ``scaler.update()`` after a scaled backward without
        ``scaler.step(<optimizer_key>)`` or its ``zero_grad()`` (``unless_zeroed`` as for
        :meth:`phases_before`): that optimizer's gradients are still scaled (a second
        optimizer stepped directly after the scaler's ``step``/``update``)."""
        return any(
            state.left_scaled and optimizer_key not in state.stepped
            and not any(keys and keys <= state.zeroed for keys in unless_zeroed)
            for state in self.states_before.get(call, ())
        )

    def scaled_on_entry(self, call: nodes.Call) -> bool:
        """Gradients are scaled when ``call`` runs though no scaled backward precedes it here
        (``backward`` in one method, clip and step in another): a later ``scaler.step`` of a
        scaler built in this module expects scaled gradients, nothing between unscales them,
        and no code that can reach that scaler ever unscales it (:meth:`never_unscaled`)."""
        if self.phases_before(call) != {None}:
            return False
        order = {node: index for index, node in enumerate(self.states_before)}
        for step in self.scaler_steps:
            scaler = self.scalers[expression_key(step.func.expr) or ""]
            if (
                order[step] > order[call]
                and self.phases_before(step) == {None}
                and scaler.constructions
                and self._analysis.never_unscaled(scaler.key, self.scope)
            ):
                return True
        return False

    def steps_without_update(self) -> List[nodes.Call]:
        """``scaler.step`` calls that no path follows with ``scaler.update()``."""
        return [call for call in self.scaler_steps if call not in self._updated_steps]

    def is_scaler(self, expr: Optional[nodes.NodeNG]) -> bool:
        key = expression_key(expr) if expr is not None else None
        return key is not None and key in self.scalers

    def may_skip_scaler(self, call: nodes.Call) -> bool:
        """Some path to ``call`` took the no-scaler arm of an amp/scaler flag (the ``else``
        of ``if scaler is not None``, or the code after ``if use_amp: ...; continue``)."""
        return any(
            (AMP_CONDITION, False) in state.conditions for state in self.states_before.get(call, ())
        )

    def in_no_scaler_arm(self, node: nodes.NodeNG) -> bool:
        """``node`` is in one arm of an ``if`` on the amp switch or the scaler (``if scaler is
        not None``, ``if use_amp``) whose other arm uses the scaler; not an ``if`` on
        something else (``if cfg.CLIP_GRAD_VAL: clip ... elif ...: unscale_; clip``)."""
        child, parent = node, node.parent
        while parent is not None and parent is not self.scope:
            if isinstance(parent, nodes.If) and self._tests_amp(parent.test):
                if any(self._uses_scaler(statement) for statement in other_arm(parent, child)):
                    return True
            child, parent = parent, parent.parent
        return False

    def _tests_amp(self, test: nodes.NodeNG) -> bool:
        condition = condition_key(test)
        if condition is not None and condition[0] == AMP_CONDITION:
            return True
        return any(
            expression_key(sub) in self.scalers
            for sub in test.nodes_of_class((nodes.Name, nodes.Attribute))
        )

    def _uses_scaler(self, statement: nodes.NodeNG) -> bool:
        for call in calls_in_order(statement):
            method, receiver = method_call(call)
            if method in ("scale", "step", "unscale_", "update") and self.is_scaler(receiver):
                return True
        return False

    def only_scales_backward(self) -> bool:
        """The scope runs a scaled backward and leaves the gradients scaled on some path,
        touching the scaler no other way (``def backward(loss, scaler):
        scaler.scale(loss).backward()``): a call of it is a scaled backward."""
        phases = {state.phase for state in self.exit_states}
        return bool(self.scaled_backwards) and not self.scaler_steps and (
            SCALED in phases and phases <= {SCALED, None}
        )

    # -- statements --------------------------------------------------------------------

    def _block(self, statements: Sequence[nodes.NodeNG], states: States) -> States:
        for statement in statements:
            if not states:
                break  # the rest of the block is unreachable on every path
            states = self._statement(statement, states)
        return states

    def _statement(self, statement: nodes.NodeNG, states: States) -> States:
        if isinstance(statement, nodes.If):
            states = self._expression(statement.test, states)
            body, orelse = self._split(statement.test, states)
            return self._block(statement.body, body) | self._block(statement.orelse, orelse)
        if isinstance(statement, (nodes.For, nodes.While)):
            header = statement.iter if isinstance(statement, nodes.For) else statement.test
            return self._loop(statement, self._expression(header, states))
        if isinstance(statement, nodes.With):
            for expr, _ in statement.items:
                states = self._expression(expr, states)
            return self._block(statement.body, states)
        if isinstance(statement, (nodes.Try, nodes.TryStar)):
            return self._try(statement, states)
        if isinstance(statement, nodes.Match):
            states = self._expression(statement.subject, states)
            arms = [self._block(case.body, states) for case in statement.cases]
            return frozenset(states.union(*arms))
        if isinstance(statement, nodes.Return):
            self.exit_states.update(self._expression(statement, states))
            return frozenset()
        if isinstance(statement, nodes.Raise):
            self._expression(statement, states)
            return frozenset()
        if isinstance(statement, (nodes.Continue, nodes.Break)):
            if self._loop_exits:
                self._loop_exits[-1].update(states)
            return frozenset()
        if isinstance(statement, (nodes.FunctionDef, nodes.ClassDef)):
            return states
        states = self._expression(statement, states)
        if isinstance(statement, (nodes.Assign, nodes.AnnAssign)):
            states = self._bind(statement, states)
        return states

    def _loop(self, loop: nodes.NodeNG, states: States) -> States:
        self._loop_exits.append(set())
        after_body = self._block(loop.body, states)
        exits = self._loop_exits.pop()
        return self._limit(self._block(loop.orelse, states | after_body) | exits)

    def _try(self, statement: nodes.NodeNG, states: States) -> States:
        after_body = self._block(statement.body, states)
        out = self._block(statement.orelse, after_body)
        for handler in statement.handlers:
            out = out | self._block(handler.body, states | after_body)
        return self._block(statement.finalbody, out) if statement.finalbody else out

    def _split(self, test: nodes.NodeNG, states: States) -> Tuple[States, States]:
        """States entering the body and the else arm of ``if test``."""
        condition = condition_key(test)
        if condition is None:
            return states, states
        key, truth = condition
        body, orelse = set(), set()
        for state in states:
            decided = {value for k, value in state.conditions if k == key}
            if decided:
                (body if truth in decided else orelse).add(state)
            else:
                body.add(replace(state, conditions=state.conditions | {(key, truth)}))
                orelse.add(replace(state, conditions=state.conditions | {(key, not truth)}))
        return self._limit(body), self._limit(orelse)

    @staticmethod
    def _limit(states: Iterable[PathState]) -> States:
        states = frozenset(states)
        if len(states) > _MAX_STATES:
            states = frozenset(replace(state, conditions=frozenset()) for state in states)
        return states

    def _bind(self, statement: nodes.NodeNG, states: States) -> States:
        """Track names bound to a scaled loss (``loss = scaler.scale(loss)``)."""
        targets = statement.targets if isinstance(statement, nodes.Assign) else [statement.target]
        keys = {expression_key(target) for target in targets} - {None}
        if not keys:
            return states
        bound = set()
        for state in states:
            names = state.scaled_names - keys
            if self._is_scaled(statement.value, state):
                names |= keys
            bound.add(replace(state, scaled_names=names))
        return frozenset(bound)

    # -- calls -------------------------------------------------------------------------

    def _expression(self, node: nodes.NodeNG, states: States) -> States:
        for call in calls_in_order(node):
            self.states_before[call] = states
            states = self._call(call, states)
        return states

    def _call(self, call: nodes.Call, states: States) -> States:
        method, receiver = method_call(call)
        backpropagated = backpropagated_tensor(call, self._analysis.names)
        if backpropagated is not None:
            if any(self._is_scaled(backpropagated, state) for state in states):
                self.scaled_backwards.append(call)
            return frozenset(
                _scaled(state) if self._is_scaled(backpropagated, state)
                else replace(state, stepped=frozenset(), left_scaled=False)
                for state in states
            )
        if method == "zero_grad" and receiver is not None:
            key = expression_key(receiver)
            if key is not None:
                return frozenset(
                    replace(state, zeroed=state.zeroed | {key}, stepped=state.stepped - {key})
                    for state in states
                )
            return states
        if self.is_scaler(receiver):
            if method == "unscale_":
                return frozenset(replace(state, phase=UNSCALED) for state in states)
            if method == "step":
                self.scaler_steps.append(call)
                stepped = expression_key(call.args[0]) if call.args else None
                return frozenset(
                    replace(
                        state,
                        stepped=state.stepped | {stepped} - {None},
                        pending_steps=state.pending_steps | {call},
                    )
                    for state in states
                )
            if method == "update":
                return self._updated(states, phase=None)
            return states
        if any(
            self.is_scaler(arg) for arg in call_arguments(call)
        ) or self._analysis.is_scaler_helper(call):
            if self._analysis.scales_backward(call):
                return frozenset(_scaled(state) for state in states)
            return self._updated(states, phase=HELPED)
        return states

    def _updated(self, states: States, phase: Optional[str]) -> States:
        """``scaler.update()`` ran (or a helper that may run it received the scaler)."""
        for state in states:
            self._updated_steps.update(state.pending_steps)
        return frozenset(
            replace(state, phase=phase, pending_steps=frozenset(),
                    left_scaled=phase is None and (state.left_scaled or state.phase is not None))
            for state in states
        )

    def _is_scaled(self, expr: Optional[nodes.NodeNG], state: PathState) -> bool:
        """``expr`` is a scaled loss: ``scaler.scale(x)``, a name bound to one, or ``that / n``."""
        if isinstance(expr, nodes.Call):
            method, receiver = method_call(expr)
            return method == "scale" and bool(expr.args) and self.is_scaler(receiver)
        if isinstance(expr, nodes.BinOp):
            return self._is_scaled(expr.left, state) or self._is_scaled(expr.right, state)
        key = expression_key(expr) if expr is not None else None
        return key is not None and key in state.scaled_names


def _flow_scope(node: nodes.NodeNG) -> nodes.NodeNG:
    return node if isinstance(node, (nodes.FunctionDef, nodes.Module)) else node.scope()


def _scaled(state: PathState) -> PathState:
    """``state`` after a scaled backward: new scaled gradients, not yet stepped or zeroed."""
    return replace(state, phase=SCALED, stepped=frozenset(), zeroed=frozenset(), left_scaled=False)


#: Words of a receiver's last name that say it is an optimizer (``opt``, ``optimizer_g``...).
OPTIMIZER_WORDS = frozenset({"opt", "optim", "optimizer", "optimiser", "optimizers"})
#: Words that say it is something else with a ``step()`` (schedulers, EMA, SWA, samplers).
NOT_OPTIMIZER_WORDS = frozenset(
    {"sched", "scheduler", "lr", "warmup", "ema", "swa", "sampler", "env"}
)


def is_optimizer(expr: nodes.NodeNG, names) -> bool:
    """Built by a ``torch.optim`` class, or named like an optimizer (``optimizer``, ``opt_d``,
    ``self.optim``, ``optim_wrapper``; not a scheduler or an EMA)."""
    key = expression_key(expr)
    if key is None:
        return False
    if is_optimizer_class(names.instance_class(expr) or ""):
        return True
    words = name_words(key.rsplit(".", 1)[-1])
    if NOT_OPTIMIZER_WORDS.intersection(words):
        return False
    return any(word in OPTIMIZER_WORDS or word.startswith("optimi") for word in words)


def optimized_models(optimizer: nodes.NodeNG, names) -> FrozenSet[str]:
    """Keys of the models an optimizer steps the parameters of: the receivers of
    ``.parameters()`` in what builds it (``Adam(model.parameters())``, ``SGD(list(a.parameters())
    + list(b.parameters()))``, followed to the call sites of a parameter); empty when unknown
    or when anything else feeds it (``Adam([log_alpha])``)."""
    values = names.held_values(optimizer)
    models: Set[str] = set()
    for value in values or ():
        if isinstance(value, nodes.Name):
            value = next(iter(names.assigned_values(value) or ()), value)
        if not isinstance(value, nodes.Call) or not value.args:
            return frozenset()
        found = [
            expression_key(parameters_receiver(call))
            for call in value.args[0].nodes_of_class(nodes.Call)
            if parameters_receiver(call) is not None
        ]
        if not found or None in found:
            return frozenset()
        models.update(found)
    return frozenset(models)


def backpropagated_tensor(call: nodes.Call, names) -> Optional[nodes.NodeNG]:
    """The tensor a backward call backpropagates: ``x`` in ``x.backward()`` or
    ``torch.autograd.backward(x)``; None for other calls (wrappers such as
    ``accelerator.backward(loss)`` included)."""
    method, receiver = method_call(call)
    if method != "backward":
        return None
    if not call.args:
        return receiver
    return call.args[0] if names.qualname(call.func) in AUTOGRAD_BACKWARD else None


#: Calls that backpropagate their receiver or argument.
BACKWARD_METHODS = frozenset({"backward", "manual_backward"})


def _backpropagated_expressions(scope: nodes.NodeNG, names) -> Iterator[nodes.NodeNG]:
    """What the backward calls of ``scope`` backpropagate: ``x`` in ``x.backward()``,
    ``torch.autograd.backward(x)``, ``accelerator.backward(x)``, ``scaler.scale(x).backward()``,
    and what calls that step an optimizer receive (``loss_scaler(x, optimizer)``,
    ``optim_wrapper.update_params(x)``)."""
    for call in scope.nodes_of_class(nodes.Call):
        method, receiver = method_call(call)
        if method in BACKWARD_METHODS:
            if receiver is not None and not call.args:
                yield receiver
            yield from call.args
        elif (receiver is not None and is_optimizer(receiver, names)) or any(
            is_optimizer(arg, names) for arg in call.args
        ):
            yield from call.args


def reaches_backward(node: nodes.NodeNG, names) -> bool:
    """``node``'s result flows (through names and arithmetic in its function) into what a
    backward call backpropagates (``loss.backward()``, ``scaler.scale(loss)``,
    ``accelerator.backward(loss)``, ``loss_scaler(loss, optimizer)``)."""
    pending: List[nodes.NodeNG] = list(_backpropagated_expressions(code_frame(node), names))
    seen = set()
    while pending:
        expr = pending.pop()
        if expr in seen:
            continue
        seen.add(expr)
        if expr is node or any(sub is node for sub in expr.nodes_of_class(nodes.Call)):
            return True
        for name in expr.nodes_of_class(nodes.Name):
            for binding in names.reaching_bindings(name):
                value = bound_value(binding)
                if value is not None:
                    pending.append(value)
    return False


class ScalerAnalysis:
    """Scaler flows of one module, built on demand per function (see :func:`scaler_analysis`)."""

    def __init__(self, context):
        self.context = context
        self.names = context.names
        self._flows: Dict[nodes.NodeNG, ScalerFlow] = {}
        self._base_flows: Dict[nodes.NodeNG, ScalerFlow] = {}
        self._helpers: Dict[nodes.NodeNG, bool] = {}
        #: Functions whose flow is being built (a helper calling back its caller).
        self._building: Set[nodes.NodeNG] = set()

    def flow(self, node: nodes.NodeNG) -> ScalerFlow:
        """The flow of the function (or module body) that ``node`` runs in, entered in the
        phase its callers leave (:meth:`entry_phase`)."""
        scope = _flow_scope(node)
        if scope not in self._flows:
            base = self._base_flow(scope)
            entry = self.entry_phase(base)
            self._flows[scope] = base if entry is None else ScalerFlow(self, scope, entry)
        return self._flows[scope]

    def _base_flow(self, node: nodes.NodeNG) -> ScalerFlow:
        """The flow of ``node``'s scope entered with no scaled gradients: what the analyses
        of other functions ask (so no flow depends on another's entry phase)."""
        scope = _flow_scope(node)
        if scope not in self._base_flows:
            self._building.add(scope)
            try:
                self._base_flows[scope] = ScalerFlow(self, scope)
            finally:
                self._building.discard(scope)
        return self._base_flows[scope]

    def scalers_in(self, scope: nodes.NodeNG) -> Dict[str, Scaler]:
        """Scalers used in ``scope``: built by GradScaler, or used as ``.scale(x)``/``.unscale_``
        (or handed to a function that scales a backward with it) and not known to be built by
        some other class.

        Scalers whose every construction is ``enabled=False`` are left out: they do nothing.
        """
        receivers: Dict[str, nodes.NodeNG] = {}
        used_as_scaler: Set[str] = set()
        for call in calls_in_order(scope) if not isinstance(scope, nodes.Lambda) else ():
            method, receiver = method_call(call)
            uses = [(receiver, method == "scale" and len(call.args) == 1 or method == "unscale_")]
            uses += [(argument, True) for argument in self._scaled_backward_scalers(call)]
            for expr, as_scaler in uses:
                key = expression_key(expr) if expr is not None else None
                if key is not None:
                    receivers.setdefault(key, expr)
                    if as_scaler:
                        used_as_scaler.add(key)
        scalers = {}
        for key, receiver in receivers.items():
            # what call sites pass says which scaler a parameter is (``def optimizer_step(
            # model, opt, scaler, clip)`` called with a GradScaler: its clip is judged there)
            constructions = self.constructions(receiver)
            if not constructions and (
                key not in used_as_scaler or self.names.instance_class(receiver)
            ):
                continue  # not a scaler, or one of another library (``nne.LossScaler()``)
            if constructions and all(_literal_enabled(call) is False for call in constructions):
                continue
            scalers[key] = Scaler(key, tuple(constructions))
        return scalers

    def constructions(self, expr: nodes.NodeNG, _hops: int = 0) -> List[nodes.Call]:
        """The ``GradScaler(...)`` calls whose result ``expr`` (a name or ``self.x``) holds,
        through names bound to it, what a function of this module returns (``scaler =
        make_grad_scaler(args.amp)``) and, for a parameter, what its function's call sites
        in this module pass (``train_epoch(..., scaler)`` called from ``main`` after
        ``scaler = GradScaler("cuda")``)."""
        found = []
        for value in self.names.held_values(expr) or ():
            found.extend(self._value_constructions(value, _hops))
        return found

    def _value_constructions(self, value: nodes.NodeNG, hops: int) -> List[nodes.Call]:
        """The ``GradScaler(...)`` calls a value held or returned may be: the call itself, what a
        function of this module it calls returns, either arm of a conditional expression
        (``GradScaler("cuda") if args.amp else None``) and what a name holds."""
        if isinstance(value, nodes.Call):
            if self.builds_scaler(value):
                return [value]
            builder = self.names.local_function(value)
            if builder is None or hops >= _MAX_PASSING_HOPS:
                return []
            return [call for returned in returned_values(builder) or ()
                    for call in self._value_constructions(returned, hops + 1)]
        if isinstance(value, nodes.IfExp):
            return [call for arm in (value.body, value.orelse)
                    for call in self._value_constructions(arm, hops)]
        if isinstance(value, nodes.Name) and hops < _MAX_PASSING_HOPS:
            return self.constructions(value, hops + 1)
        return []

    def entry_phase(self, base: ScalerFlow) -> Optional[str]:
        """SCALED when ``base``'s scope is a function handed its scaler as a parameter and
        every call of it in this module may come right after a scaled backward, as a clip
        there would be judged (``optimizer_step(model, optimizer, scaler, clip)`` after
        ``scaler.scale(loss).backward()``, also after a loop of accumulation steps that
        might run no step): what it clips or steps first are scaled gradients, and the
        scaler to unscale them is at hand."""
        scope = base.scope
        if not isinstance(scope, nodes.FunctionDef):
            return None
        parameters = {argument.name for argument in scope.args.arguments}
        if not parameters & set(base.scalers):
            return None
        sites = self.names.call_sites(scope)
        for site in sites:
            caller = code_frame(site)
            if caller in self._building:
                return None
            phases = self._base_flow(caller).phases_before(site)
            if SCALED not in phases or not phases <= {SCALED, None}:
                return None
        return SCALED if sites else None

    def scales_backward(self, call: nodes.Call) -> bool:
        """``call`` calls a function of this module that only runs a scaled backward
        (:meth:`ScalerFlow.only_scales_backward`): the call is a scaled backward."""
        function = self.names.local_function(call)
        if function is None or function in self._building:
            return False
        return self._base_flow(function).only_scales_backward()

    def _scaled_backward_scalers(self, call: nodes.Call) -> List[nodes.NodeNG]:
        """The arguments ``call`` passes as the scaler of a function that only scales a
        backward (``backward(loss, scaler)``): the caller uses them as scalers."""
        if not call.args and not call.keywords or not self.scales_backward(call):
            return []
        function = self.names.local_function(call)
        return [
            argument
            for key in self._base_flow(function).scalers
            if (argument := argument_for(call, function.args, key)) is not None
        ]

    def is_scaler_helper(self, call: nodes.Call) -> bool:
        """``call`` calls a function or method of this module that unscales, steps or updates
        a scaler itself (``self._unscale_grads()``): after it, anything may have happened."""
        function = self.names.local_function(call)
        if function is None:
            return False
        if function not in self._helpers:
            scalers = self.scalers_in(function)
            self._helpers[function] = any(
                method in ("unscale_", "step", "update") and expression_key(receiver) in scalers
                for method, receiver in map(method_call, calls_in_order(function))
                if receiver is not None
            )
        return self._helpers[function]

    def scaler_reaches(self, scope: nodes.NodeNG) -> bool:
        """An enabled ``GradScaler(...)`` built in this module can be used by ``scope``: it is
        built at module or class level or in ``scope`` itself, kept in ``self.<x>`` of
        ``scope``'s class, or handed on (passed, stored elsewhere, returned by a function
        whose callers here hand it on or that has none). One kept in a local variable of
        another function, or in another class, cannot reach it."""
        return any(_reaches(call, scope, self.names) for call in self._enabled_constructions)

    @functools.cached_property
    def _enabled_constructions(self) -> List[nodes.Call]:
        return [
            call
            for call in self.names.module_calls
            if self.builds_scaler(call) and _literal_enabled(call) is not False
        ]

    def never_unscaled(self, key: str, scope: nodes.NodeNG) -> bool:
        """No code that can reach the scaler known as ``key`` in ``scope`` calls ``unscale_``
        or hands the scaler to a call (a helper could unscale it). For ``self.<x>`` that code
        is the methods that share ``self`` with ``scope`` (:meth:`_reach`); a base class
        from elsewhere could unscale unseen."""
        reach = self._reach(scope) if key.startswith("self.") else [self.context.module]
        if reach is None:
            return False
        calls = (
            self.names.module_calls
            if reach == [self.context.module]
            else [call for method in reach for call in method.nodes_of_class(nodes.Call)]
        )
        return not any(
            method_call(call)[0] == "unscale_"
            or any(expression_key(arg) == key for arg in call_arguments(call))
            for call in calls
        )

    def scaled_elsewhere(
        self, node: nodes.Call, clip: bool = False, after_own_step: bool = False
    ) -> bool:
        """The gradients ``node`` (a plain ``optimizer.step()`` or a clip) sees are scaled
        though its function runs no backward before it (``backward()`` scales in one method,
        ``step()`` clips and steps in another): code that can reach it (:meth:`_reach`) runs
        a scaled backward through a scaler built in this module, and none of it unscales
        one or hands one on, nor steps through one. With ``after_own_step`` (``node``'s own
        function stepped another optimizer through the scaler before it: the same
        backward's gradients, no fallback for a path without a scaler) the scaled backward
        is enough, unless that code also runs a plain one. A ``clip`` may sit in a method that
        every call in the module runs before the method that steps through the scaler
        (``opt.clip_grad_norm(1.0); opt.step()`` on a wrapper whose ``step`` runs
        ``self.scaler.step``): those gradients are still scaled."""
        function = node.scope()
        for call in calls_in_order(function):
            if call is node:
                break
            if method_call(call)[0] == "backward":
                return False
        reach = self._reach(function)
        if reach is None:
            return False
        functions = [f for code in reach for f in code.nodes_of_class(nodes.FunctionDef)]
        flows = [self.flow(function) for function in functions]
        if reach == [self.context.module]:
            flows.append(self.flow(self.context.module))
        # a scaler that only its own function can use (``scaler = GradScaler()`` as a local
        # of ``train_one_epoch``) scales nothing the code outside it sees; ``self.<scaler>``
        # is shared by the methods of ``reach``
        scaling = [
            flow
            for flow in flows
            if flow.scaled_backwards
            and any(
                scaler.key.startswith("self.") or _reaches(construction, function, self.names)
                for scaler in flow.scalers.values()
                for construction in scaler.constructions
            )
        ]
        if after_own_step:
            # scaled or unscaled (``unscale_`` checks nothing), unless the optimizer may step
            # gradients of a plain backward (a GAN's discriminator)
            return bool(scaling) and not any(_plain_backwards(f, self.names) for f in flows)
        stepping = [flow.scope for flow in flows if flow.scaler_steps]
        if stepping and not (clip and self._called_before(function, stepping)):
            return False
        return (
            bool(scaling)
            and all(
                scaler.constructions and self.never_unscaled(scaler.key, flow.scope)
                for flow in scaling
                for scaler in flow.scalers.values()
            )
        )

    def _called_before(self, function: nodes.NodeNG, later: List[nodes.NodeNG]) -> bool:
        """Every call of ``function`` in the module is followed, in its caller, by a call of
        one of the functions ``later``; there is at least one call."""
        if function in later or not isinstance(function, nodes.FunctionDef):
            return False
        sites = self.names.call_sites(function)
        for site in sites:
            following = False
            for call in calls_in_order(code_frame(site)):
                if call is site:
                    following = True
                elif following and self.names.possible_functions(call) & set(later):
                    break
            else:
                return False
        return bool(sites)

    def _reach(self, scope: nodes.NodeNG) -> Optional[List[nodes.NodeNG]]:
        """The code that shares ``self`` with ``scope``: the methods that can run on the
        objects it runs on (a mixin's, a subclass's that does not override it), or the
        module when ``scope`` is no method; None when a class from elsewhere does too."""
        if enclosing_class(scope) is None:
            return [self.context.module]
        return self.names.methods_sharing_self(code_frame(scope))

    def builds_scaler(self, call: nodes.Call) -> bool:
        """``call`` builds a GradScaler: torch's, FSDP's, a vendor backend's, also through a
        name each of whose imports gives one (``try: from torch.amp import GradScaler``
        ``except ImportError: from torch.cuda.amp import GradScaler``, a vendor dispatch)."""
        callee = self.names.callee(call)
        if callee is not None:
            return not callee.instance and _is_scaler_class(callee.qualname)
        if not isinstance(call.func, nodes.Name):
            return False
        possible = self.names.possible_qualnames(call.func)
        return len(possible) > 1 and all(q is not None and _is_scaler_class(q) for q in possible)

    def updated_elsewhere(self, scaler: nodes.NodeNG) -> bool:
        """The scaler comes from outside the function and is updated there: ``self.<scaler>``
        updated in another method that shares ``self`` (of the class, where a class
        from elsewhere does too), a module-level scaler updated anywhere in
        the module, or a parameter updated by a caller (a step helper that does not run the
        scaled backward itself and has no caller in this module is called from elsewhere,
        which may update). A local alias (``scaler = self.scaler``) stands for what it is
        bound to."""
        if isinstance(scaler, nodes.Name):
            values = self.names.assigned_values(scaler) or []
            if len(values) == 1 and isinstance(values[0], nodes.Attribute):
                return is_self(values[0].expr) and self.updated_elsewhere(values[0])
        if isinstance(scaler, nodes.Attribute) and is_self(scaler.expr):
            classdef = enclosing_class(scaler)
            if classdef is None:
                return False
            methods = self.names.methods_sharing_self(code_frame(scaler))
            return any(
                method == "update" and expression_key(receiver) == expression_key(scaler)
                for function in (classdef.mymethods() if methods is None else methods)
                for method, receiver in map(method_call, calls_in_order(function))
            )
        if isinstance(scaler, nodes.Name) and _is_parameter(scaler, self.names):
            function = scaler.scope()
            callers = {call.scope() for call in self.names.calls_by_name.get(function.name, ())}
            if not callers:
                return not self.flow(function).scaled_backwards
            return any(self._updates_a_scaler(caller) for caller in callers)
        if isinstance(scaler, nodes.Name) and _is_global(scaler, self.names):
            module = self.context.module
            scopes = [module, *self.context.nodes_of(nodes.FunctionDef)]
            return any(
                method == "update" and expression_key(receiver) == scaler.name
                for scope in scopes
                if scope is not scaler.scope()
                for method, receiver in map(method_call, calls_in_order(scope))
            )
        return False

    def _updates_a_scaler(self, scope: nodes.NodeNG) -> bool:
        scalers = self.scalers_in(scope)
        return any(
            method == "update" and expression_key(receiver) in scalers
            for method, receiver in map(method_call, calls_in_order(scope))
            if receiver is not None
        )


def _plain_backwards(flow: ScalerFlow, names) -> List[nodes.Call]:
    """The backward calls of ``flow``'s function that do not go through a scaler (not a
    method of this module named ``backward``: ``self.backward(loss)`` runs the code it
    holds)."""
    if not isinstance(flow.scope, nodes.FunctionDef):
        return []
    return [
        call for call in calls_in_order(flow.scope)
        if method_call(call)[0] in BACKWARD_METHODS and call not in flow.scaled_backwards
        and names.local_function(call) is None
    ]


def _reaches(construction: nodes.Call, scope: nodes.NodeNG, names, depth: int = 0) -> bool:
    """See :meth:`ScalerAnalysis.scaler_reaches`. A scaler a function returns goes where its
    calls in this module put it (``scaler = make_scaler(args)`` in ``run``); with no call
    here, anywhere."""
    owner = construction.scope()
    if owner is scope or isinstance(owner, (nodes.Module, nodes.ClassDef)):
        return True
    child, parent = construction, construction.parent
    while isinstance(parent, nodes.IfExp) and child is not parent.test:
        child, parent = parent, parent.parent  # ``GradScaler() if amp else None``
    if isinstance(parent, nodes.Return) and isinstance(owner, nodes.FunctionDef):
        sites = names.call_sites(owner)
        if not sites or depth >= _MAX_RETURN_HOPS:
            return True
        return any(_reaches(site, scope, names, depth + 1) for site in sites)
    if isinstance(parent, nodes.Assign):
        targets = parent.targets
    elif isinstance(parent, nodes.AnnAssign):
        targets = [parent.target]
    else:
        return True
    for target in targets:
        if isinstance(target, nodes.AssignAttr) and is_self(target.expr):
            classdef = enclosing_class(construction)
            if classdef is not None and enclosing_class(scope) is classdef:
                return True
        elif not isinstance(target, nodes.AssignName) or target.name in owner.root().globals:
            return True
    return False


def _is_global(name: nodes.Name, names) -> bool:
    """``name`` (used in a function) is bound at module level only."""
    bindings = names.bindings(name)
    return bool(bindings) and all(isinstance(b.scope(), nodes.Module) for b in bindings)


def _is_parameter(name: nodes.Name, names) -> bool:
    bindings = names.bindings(name)
    return bool(bindings) and all(isinstance(b.parent, nodes.Arguments) for b in bindings)


_ANALYSES: "weakref.WeakKeyDictionary[object, ScalerAnalysis]" = weakref.WeakKeyDictionary()


def scaler_analysis(context) -> ScalerAnalysis:
    """The module's :class:`ScalerAnalysis`, built once and shared by every rule."""
    analysis = _ANALYSES.get(context)
    if analysis is None:
        analysis = _ANALYSES[context] = ScalerAnalysis(context)
    return analysis
