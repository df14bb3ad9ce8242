"""AMP001 manual-cast: ``.half()`` / ``.bfloat16()`` / ``.to(torch.float16)`` in training code."""

from __future__ import annotations

from astroid import nodes

from flake8_amp.analysis.context import (
    CHAIN_METHODS,
    name_words,
    object_key,
    scope_nodes,
)
from flake8_amp.analysis.dtypes import FP32, LOW
from flake8_amp.analysis.names import (
    assign_target,
    assigned_value,
    calls_in_order,
    chain_root,
    chain_top,
    code_frame,
    is_self,
    keyword_value,
    last_part,
    loop_of,
    simple_name,
)
from flake8_amp.analysis.regions import BF16, FP16
from flake8_amp.engine import Check

DTYPE_NAMES = {FP16: "float16", BF16: "bfloat16", LOW: "float16/bfloat16"}
#: A cast inside ``if args.fp16:`` / ``x.half() if half else x`` is a deliberate precision mode.
FLAG_WORDS = frozenset(
    {"fp16", "half", "bf16", "bfloat16", "float16", "pure", "precision", "dtype"}
)
#: Calls whose ``enabled=`` flag switches mixed precision on.
AMP_SWITCHES = frozenset({"autocast", "GradScaler"})
#: Methods whose definitions legitimately call the cast (``Module.half`` overrides).
CAST_DEFINITIONS = frozenset({"half", "bfloat16", "to", "type", "_apply"})
#: Loaders that build a model in the dtype they are given (``torch_dtype=`` / ``dtype=``).
LOADERS = frozenset({"from_pretrained", "from_config"})


class ManualCast(Check):
    """Pure low-precision training: fp32 master weights and per-op precision are lost."""

    code = "AMP001"
    triggers = ("half", "bfloat16", "float16", "HalfTensor", "BFloat16")

    def visit_call(self, node: nodes.Call) -> None:
        func = node.func
        if not isinstance(func, nodes.Attribute):
            return
        if func.attrname in LOADERS:
            self._check_load(node, func)
            return
        kind = self.context.dtypes.cast_target(node)
        if kind not in DTYPE_NAMES or self._legitimate(node, func):
            return
        self.report(node, target=self.source_text(func.expr), dtype=DTYPE_NAMES[kind])

    def _check_load(self, node: nodes.Call, func: nodes.Attribute) -> None:
        """``AutoModel.from_pretrained(name, torch_dtype=torch.float16)`` and then an optimizer
        over its weights: the model trains in low precision as a cast one does. Loading
        for inference, or frozen under an adapter (LoRA, QLoRA: the optimizer steps the
        adapter's weights), is the idiom, so only such an optimizer in the function counts."""
        kind = self.context.dtypes.of(node)
        if kind not in (FP16, BF16) or self._behind_precision_flag(node):
            return
        grad = self.context.grad
        if grad.frozen(node) or grad.grads_turned_off(node):
            return
        if not self._stepped_after(node, frozen_too=False):
            return
        self.report(node, target=f"model loaded by {func.attrname}()", dtype=DTYPE_NAMES[kind])

    def _legitimate(self, node: nodes.Call, func: nodes.Attribute) -> bool:
        grad = self.context.grad
        return (
            self._round_trip(node)
            or _in_cast_definition(node)
            or _self_cast(func)
            or _to_tensor_dtype(node)
            or self._of_state_dict(func.expr)
            or self._user_method(func)
            or self._behind_precision_flag(node)
            or self._checkpoint_copy(node, func)
            or grad.frozen(node)
            or grad.fed_to_inference(node)
            or grad.not_training_at(node)
            or not (grad.training_at(node) or self._stepped_after(node))
        )

    def _round_trip(self, node: nodes.Call) -> bool:
        """``x.half().float()``, ``w.half().to(w.dtype)``: the cast is undone at once (a
        rounding simulation). A move that follows (``model.half().to(device)``) is not."""
        parent = node.parent
        if not (isinstance(parent, nodes.Attribute) and isinstance(parent.parent, nodes.Call)):
            return False
        following = parent.parent
        target = self.context.dtypes.cast_target(following)
        if target is not None:
            return target == FP32
        if parent.attrname == "type_as":
            return True  # the type of another tensor, known at run time
        arguments = [*following.args, *(kw.value for kw in following.keywords or ())]
        return parent.attrname in ("to", "type") and any(
            "dtype" in argument.as_string() for argument in arguments
        )

    def _stepped_after(self, node: nodes.Call, frozen_too: bool = True) -> bool:
        """A ``torch.optim`` optimizer built later in the function steps the parameters this
        cast made low precision: the cast is what decides their dtype there (the last cast
        of the module or of one it is part of; ``model.float()`` in between undoes it).
        ``frozen_too=False``: not through parameters picked by ``requires_grad``."""
        grad, dtypes = self.context.grad, self.context.dtypes
        top = chain_top(node, CHAIN_METHODS)
        after = False
        for call in calls_in_order(code_frame(node)):
            after = after or call is top
            if not after or not grad.builds_optimizer(call):
                continue
            for module in grad.optimized_modules(call, frozen_too):
                decided_by = dtypes.module_kind_at(module, call)[1]
                if decided_by is node or decided_by is top:
                    return True
        return False

    def _user_method(self, func: nodes.Attribute) -> bool:
        """The receiver is an object of a class defined here that has this method itself."""
        cls = self.context.names.local_class(func.expr)
        return cls is not None and func.attrname in cls.locals

    def _behind_precision_flag(self, node: nodes.NodeNG) -> bool:
        """Inside ``if args.fp16:`` / ``x.half() if half else x``: a deliberate precision
        mode -- unless that same flag switches autocast or a GradScaler on in the same
        function (``GradScaler(enabled=args.fp16)``): then it means mixed precision, which the
        cast defeats (a GradScaler refuses fp16 gradients)."""
        child, parent = node, node.parent
        while parent is not None and not isinstance(
            parent, (nodes.FunctionDef, nodes.ClassDef, nodes.Module)
        ):
            if isinstance(parent, (nodes.If, nodes.IfExp)) and child is not parent.test:
                if any(word in FLAG_WORDS for word in _identifier_words(parent.test)):
                    return parent.test.as_string() not in self._amp_switches(code_frame(node))
            child, parent = parent, parent.parent
        return False

    def _amp_switches(self, scope: nodes.NodeNG) -> set:
        """The ``enabled=`` flags of the torch autocast and GradScaler calls of ``scope``."""
        names = self.context.names
        switches = set()
        for call in calls_in_order(scope):
            enabled = keyword_value(call, "enabled")
            if enabled is None:
                continue
            qualname = names.qualname(call.func) or ""
            if qualname.startswith("torch.") and last_part(qualname) in AMP_SWITCHES:
                switches.add(enabled.as_string())
        return switches

    def _of_state_dict(self, receiver: nodes.NodeNG) -> bool:
        """``v`` of ``for k, v in model.state_dict().items()``, ``sd[k]`` of ``sd =
        model.state_dict()``: a state dict holds detached tensors, and casting them trains
        nothing (a half-precision checkpoint, an EMA's copy)."""
        if isinstance(receiver, nodes.Subscript):
            receiver = receiver.value
        if not isinstance(receiver, nodes.Name):
            return False
        bindings = self.context.names.bindings(receiver)
        for binding in bindings:
            loop, _ = loop_of(binding) if isinstance(binding, nodes.AssignName) else (None, [])
            source = loop.iter if loop is not None else assigned_value(binding)
            if source is None or not any(
                simple_name(call.func) == "state_dict"
                for call in source.nodes_of_class(nodes.Call)
            ):
                return False
        return bool(bindings)

    def _checkpoint_copy(self, node: nodes.Call, func: nodes.Attribute) -> bool:
        """A copy cast for a checkpoint and not trained by its function: inside a save call
        (``torch.save({"model": deepcopy(model).half()})``), an object that is then saved
        (``x["model"].half(); torch.save(x, f)``), or a ``deepcopy`` not kept under a name
        that the function trains (``model16 = deepcopy(model).half()`` then trained, or an
        optimizer built over ``model16.actor.parameters()``, is training in fp16)."""
        scope = code_frame(node)
        root = chain_root(func.expr, CHAIN_METHODS)
        keys = {object_key(assign_target(chain_top(node, CHAIN_METHODS))), object_key(root)}
        keys.discard("")
        trained = self.context.grad.trained_in(scope)
        if keys & _run_before_backward(scope) or any(
                _part_of(module, key) for module in trained for key in keys):
            return False
        if _inside_save(node) or keys & _saved_objects(scope):
            return True
        receiver = func.expr
        return isinstance(receiver, nodes.Call) and simple_name(receiver.func) == "deepcopy"


def _part_of(module: str, key: str) -> bool:
    """``module`` is the object ``key`` or one of its submodules (``bc_policy.actor``)."""
    return module == key or module.startswith(key + ".")


def _run_before_backward(scope: nodes.NodeNG) -> set:
    """Objects ``scope`` calls (runs forward) when it also calls ``.backward()``."""
    calls = [node for node in scope_nodes(scope) if isinstance(node, nodes.Call)]
    if not any(simple_name(call.func) == "backward" for call in calls):
        return set()
    return {object_key(call.func) for call in calls}


def _is_save(call: nodes.NodeNG) -> bool:
    """``torch.save``, ``save_checkpoint``, ``model.save_pretrained``..."""
    return isinstance(call, nodes.Call) and "save" in name_words(simple_name(call.func))


def _inside_save(node: nodes.NodeNG) -> bool:
    parent = node.parent
    while parent is not None and not parent.is_statement:
        if _is_save(parent):
            return True
        parent = parent.parent
    return False


def _saved_objects(scope: nodes.NodeNG) -> set:
    """Objects (as source text) that ``scope`` passes to a save call (``x`` for
    ``torch.save(x, f)``, also ``m`` for ``torch.save(m.state_dict(), f)``)."""
    saved = set()
    for call in scope_nodes(scope):
        if _is_save(call):
            for arg in [*call.args, *(kw.value for kw in call.keywords or ())]:
                saved.update(
                    object_key(sub) for sub in arg.nodes_of_class((nodes.Name, nodes.Attribute))
                )
    return saved


def _in_cast_definition(node: nodes.NodeNG) -> bool:
    scope = code_frame(node)
    return isinstance(scope, nodes.FunctionDef) and scope.name in CAST_DEFINITIONS


def _self_cast(func: nodes.Attribute) -> bool:
    """``self.half()`` / ``super().half()`` inside a class: the object's own method."""
    receiver = func.expr
    if isinstance(receiver, nodes.Call) and simple_name(receiver.func) == "super":
        return True
    return is_self(receiver)


def _to_tensor_dtype(node: nodes.Call) -> bool:
    """``mask.to(x.dtype)``: matching another tensor's dtype, whatever it is at run time."""
    dtype = keyword_value(node, "dtype")
    arguments = [dtype] if dtype is not None else node.args
    return any(isinstance(a, nodes.Attribute) and a.attrname == "dtype" for a in arguments)


def _identifier_words(expr: nodes.NodeNG):
    for sub in expr.nodes_of_class((nodes.Name, nodes.Attribute, nodes.Const)):
        if isinstance(sub, nodes.Const):
            if isinstance(sub.value, str):
                yield from name_words(sub.value)
        else:
            yield from name_words(sub.name if isinstance(sub, nodes.Name) else sub.attrname)
