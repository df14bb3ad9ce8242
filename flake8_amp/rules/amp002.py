"""AMP002 loss-outside-autocast: a loss computed after the autocast block on its outputs.

A loss is known by what it computes: a torch loss (``F.cross_entropy``, ``F.ctc_loss``, any
``*_loss``, an ``nn.*Loss``), an instance of any class named ``*Loss``, a callable named for
a loss or criterion whose definition is elsewhere (``criterion``, ``self.loss_fn``), or a
function or class of this module whose result (or first result) is computed by a loss or a
full reduction (``.mean()``, ``.sum()``), or is a dict of such, and is backpropagated
(``self.xent(score, pids)``, ``siglip_objective(img, txt)``), whatever its name -- or, named
for a loss (``SetCriterion``), wherever it runs. Backpropagated: reaching a backward
(``loss.backward()``, ``accelerator.backward(loss)``) or a call that steps an optimizer
(``loss_scaler(loss, optimizer)``, ``optim_wrapper.update_params(loss)``).

Its prediction (the first input; for a loss of this module, any input it does not upcast) is
traced back through indexing, attributes, arithmetic and tensor ops (``F.log_softmax(s /
T)``, ``torch.sigmoid``, ``.transpose``), names, unpacking and loop targets to a forward
output made in an autocast region that does not enclose the loss; an upcast anywhere on the
way (``.float()``), or in the loss's own definition, makes it fine.
"""

from __future__ import annotations

from typing import List, Optional

from astroid import nodes

from flake8_amp.analysis.context import name_words, named_for_loss
from flake8_amp.analysis.dtypes import CAST_METHODS, FP32, INT, PRESERVING, is_low
from flake8_amp.analysis.names import (
    chain_root,
    call_argument,
    keyword_value,
    last_part,
    assigned_value,
    bound_value,
    method_call,
    returned_values,
    simple_name,
)
from flake8_amp.analysis.scaler import reaches_backward
from flake8_amp.engine import Check, Options, mentions_autocast

#: Functional losses whose names do not end in ``_loss``.
LOSS_FUNCTIONS = frozenset(
    {
        "cross_entropy",
        "binary_cross_entropy",
        "binary_cross_entropy_with_logits",
        "kl_div",
        "nll_loss",
    }
)
#: Distances, symmetric in their two inputs: the prediction may come second.
SYMMETRIC_LOSSES = frozenset(
    {"l1_loss", "mse_loss", "smooth_l1_loss", "huber_loss", "L1Loss", "MSELoss", "SmoothL1Loss",
     "HuberLoss"}
)
#: Keyword names of a torch loss's prediction, its first parameter: ``F.ctc_loss(log_probs=...)``,
#: ``F.margin_ranking_loss(input1=...)``, ``F.triplet_margin_loss(anchor=...)``.
PREDICTION_KEYWORDS = ("input", "log_probs", "input1", "anchor")
#: Activation checkpointing: runs the forward of the function or model it is given.
ACTIVATION_CHECKPOINTS = frozenset(
    {"torch.utils.checkpoint.checkpoint", "torch.utils.checkpoint.checkpoint_sequential"}
)
#: Reductions that make a scalar of a whole tensor (no ``dim``): how a loss ends.
FULL_REDUCTIONS = frozenset({"mean", "sum"})
#: Methods returning models whose forward casts outputs to fp32 (accelerate, Lightning Fabric).
FP32_OUTPUT_WRAPPERS = frozenset({"prepare", "prepare_model", "setup", "setup_module"})
#: How many re-assignments (``out = out.view(...)``) are followed back.
_MAX_HOPS = 6
#: How deep a loss definition's return expression is searched.
_MAX_DEPTH = 10
#: Tensor methods that move or convert data; their results are not forward outputs.
DATA_METHODS = frozenset(
    {"to", "cuda", "cpu", "type", "numpy", "item", "tolist", "new_tensor"}
) | set(CAST_METHODS)
#: Methods leaving the tensor world: tracing a prediction stops there.
TO_PYTHON = frozenset({"numpy", "item", "tolist"})


class LossOutsideAutocast(Check):
    """Outside the region, autocast's fp32 handling of the loss is lost."""

    code = "AMP002"
    triggers = ("loss", "Loss", "cross_entropy", "kl_div", "criterion")

    @classmethod
    def applies(cls, source: str, options: Options) -> bool:
        loss_words = cls.triggers + tuple(last_part(name) for name in options.loss_functions)
        return mentions_autocast(source, options) and any(word in source for word in loss_words)

    def visit_call(self, node: nodes.Call) -> None:
        if self.context.regions.region_at(node) is not None:
            return
        if not node.args and not node.keywords:
            return
        definition = self._local_definition(node)
        kind = self._loss_kind(node, definition)
        if kind is None:
            return
        produced = self._produced_prediction(node, definition)
        if produced is None:
            return
        if kind == "computed" and not reaches_backward(node, self.context.names):
            return  # a metric (``accuracy(output, target)``), not a loss
        self.report(node, loss=self.source_text(node.func), arg=produced)

    def _produced_prediction(
        self, node: nodes.Call, definition: Optional[nodes.FunctionDef]
    ) -> Optional[str]:
        """The name of a prediction made under autocast that the loss receives. Only the
        prediction is judged: targets made in the region (``target =
        scheduler.get_velocity(...)``) are data. That is the first argument of a loss defined
        elsewhere; for one defined here, any argument whose parameter it does not upcast
        itself (``mae_loss(imgs, pred, mask)``), unless the call or the definition upcasts
        some of them (the author chose which inputs need fp32: ``clip_loss(img, txt, scale)``
        upcasting the embeddings and not the scalar temperature)."""
        if definition is None or not _parameters(definition) and definition.args.vararg:
            # defined elsewhere, or ``forward(self, *args)`` (a deep-supervision wrapper)
            first = _prediction(node)
            if first is None:
                return None
            produced = self._autocast_output_name(first)
            callee = self.context.names.callee(node)
            if (
                produced is None
                and callee is not None
                and callee.name in SYMMETRIC_LOSSES
                and self.context.dtypes.of(first) != FP32
            ):
                # ``F.mse_loss(noise, noise_pred)``: a distance may take the prediction second
                # (not after ``pred.float()`` first: the author upcast the prediction)
                produced = self._autocast_output_name(call_argument(node, 1, "target"))
            return produced
        if any(
            isinstance(arg, nodes.Call) and self.context.dtypes.cast_target(arg) == FP32
            for arg in node.args
        ):
            return None  # the call upcasts some inputs: ``mae_loss(imgs, pred.float(), mask)``
        pairs = []
        for param, arg in zip(_parameters(definition), node.args):
            if isinstance(arg, nodes.Starred):
                break
            pairs.append((self._upcasts(definition, param.name), arg))
        named = {param.name for param in _parameters(definition)[len(node.args):]}
        for keyword in node.keywords or ():
            if keyword.arg in named:
                pairs.append((self._upcasts(definition, keyword.arg), keyword.value))
        if any(upcast for upcast, _ in pairs):
            return None
        for _, arg in pairs:
            produced = self._autocast_output_name(arg)
            if produced is not None:
                return produced
        return None

    # -- what is a loss ----------------------------------------------------------------

    def _loss_kind(
        self, node: nodes.Call, definition: Optional[nodes.FunctionDef]
    ) -> Optional[str]:
        """"known" for a loss by its name or class, "computed" for a function or class of this
        module that computes one; None for anything else."""
        options = self.context.options.loss_functions
        name = simple_name(node.func)
        if name in {last_part(option) for option in options}:
            return "known"
        callee = self.context.names.callee(node)
        if callee is not None:
            if callee.qualname in options or _is_torch_loss(callee.qualname, callee.instance):
                return "known"
            if callee.instance and callee.name.endswith("Loss"):
                return "known"
        local_class = self.context.names.local_class(node.func)
        if local_class is not None and local_class.name.endswith("Loss"):
            return "known"
        if definition is not None:
            # Its name alone is not enough (``_update_losses(outputs, losses)`` records them);
            # named for a loss and computing one, it is a loss in evaluation code too.
            if not self._computes_loss(definition):
                return None
            named = local_class.name if local_class is not None else definition.name
            return "known" if named_for_loss(named) or named_for_loss(name) else "computed"
        if local_class is None and (callee is None or not callee.qualname.startswith("torch.")):
            # Built or defined elsewhere: ``criterion(out, y)``, ``self.loss = build_loss(cfg)``,
            # ``from .losses import focal_loss``.
            if named_for_loss(name) or (callee is not None and named_for_loss(callee.name)):
                return "known"
        return None

    def _local_definition(self, node: nodes.Call) -> Optional[nodes.FunctionDef]:
        """The function of this module ``node`` calls, or the ``forward``/``__call__`` of the
        class of this module whose instance it calls."""
        names = self.context.names
        function = names.local_function(node)
        if function is not None:
            return function
        cls = names.local_class(node.func)
        if cls is None:
            return None
        methods = [m for m in cls.mymethods() if m.name in ("forward", "__call__")]
        return methods[0] if methods else None

    def _computes_loss(self, function: nodes.FunctionDef) -> bool:
        """Every value ``function`` returns is computed by a loss or a full reduction."""
        returns = returned_values(function)
        return bool(returns) and all(self._loss_expression(v, _MAX_DEPTH) for v in returns)

    def _loss_expression(self, expr: nodes.NodeNG, depth: int) -> bool:
        if depth <= 0:
            return False
        if isinstance(expr, nodes.BinOp):
            return self._loss_expression(expr.left, depth - 1) or self._loss_expression(
                expr.right, depth - 1
            )
        if isinstance(expr, nodes.UnaryOp):
            return self._loss_expression(expr.operand, depth - 1)
        if isinstance(expr, (nodes.IfExp, nodes.Tuple)):
            parts = [expr.body, expr.orelse] if isinstance(expr, nodes.IfExp) else expr.elts[:1]
            return any(self._loss_expression(part, depth - 1) for part in parts)
        if isinstance(expr, nodes.Name):
            names = self.context.names
            values = names.assigned_values(expr) or [
                term for binding in names.reaching_bindings(expr)
                for term in _bound_terms(binding, names)
            ]
            return any(self._loss_expression(value, depth - 1) for value in values)
        if isinstance(expr, nodes.Dict):  # a dict of losses (DETR's, detectron2's)
            return any(self._loss_expression(value, depth - 1) for _, value in expr.items)
        if isinstance(expr, nodes.DictComp):
            return self._loss_expression(expr.value, depth - 1)
        if isinstance(expr, (nodes.ListComp, nodes.GeneratorExp)):
            return self._loss_expression(expr.elt, depth - 1)
        if isinstance(expr, nodes.List):
            return any(self._loss_expression(element, depth - 1) for element in expr.elts)
        if not isinstance(expr, nodes.Call):
            return False
        helper = self._local_definition(expr)
        if helper is not None:
            # ``losses = self.single(outputs, targets)``, ``masked_mean(x, m)``, a loss module
            return any(self._loss_expression(v, depth - 1) for v in returned_values(helper) or [])
        if self.context.names.builtin_name(expr.func) == "sum" and len(expr.args) == 1:
            return self._loss_expression(expr.args[0], depth - 1)  # ``sum(w * l for ...)``
        callee = self.context.names.callee(expr)
        if callee is not None and (
            _is_torch_loss(callee.qualname, callee.instance)
            or (callee.instance and callee.name.endswith("Loss"))
        ):
            return True
        method, receiver = method_call(expr)
        if callee is None and method in FULL_REDUCTIONS and not expr.args and not expr.keywords:
            return True  # ``x.mean()``, ``(...).sum()``
        if callee is not None and callee.name in FULL_REDUCTIONS and len(expr.args) == 1:
            return not expr.keywords  # ``torch.mean(x)``
        inner = receiver if callee is None else (expr.args[0] if expr.args else None)
        return inner is not None and self._loss_expression(inner, depth - 1)

    def _upcasts(self, function: nodes.FunctionDef, parameter: str, depth: int = 3) -> bool:
        """The loss definition casts ``parameter`` to fp32 itself (``logits =
        logits.float()``, ``F.kl_div(F.log_softmax(s.float() / T), ...)``), or hands it (or
        a slice of it) to a function of the module that does (``stft_mag(pred)`` computing on
        ``x.float()``, ``si_snr(est[:, i], ref[:, j])``)."""
        for call in function.nodes_of_class(nodes.Call):
            receiver = method_call(call)[1]
            if (self._names_parameter(receiver, parameter)
                    and self.context.dtypes.cast_target(call) == FP32
                    and not self._back_to_integers(call)):
                return True
            inner = self.context.names.local_function(call) if depth > 0 else None
            if inner is not None and inner is not function:
                for inner_parameter, arg in zip(_parameters(inner), call.args):
                    if _names(arg, parameter):
                        if self._upcasts(inner, inner_parameter.name, depth - 1):
                            return True
        return False

    def _names_parameter(self, expr: Optional[nodes.NodeNG], parameter: str) -> bool:
        """``expr`` is ``parameter``, a slice of it, or an element a loop takes from it
        (``logits`` in ``for logits in aux_logits``, also through ``zip``/``enumerate``)."""
        if _names(expr, parameter):
            return True
        while isinstance(expr, nodes.Subscript) and not _is_string(expr.slice):
            expr = expr.value
        if not isinstance(expr, nodes.Name):
            return False
        bindings = self.context.names.bindings(expr)
        return (len(bindings) == 1 and isinstance(bindings[0], nodes.AssignName)
                and _names(self.context.names.iterated(bindings[0]), parameter))

    def _back_to_integers(self, cast: nodes.Call) -> bool:
        """The fp32 value is made integer again in the same expression (``F.interpolate(
        target[:, None].float(), size)[:, 0].long()``): labels reshaped, not a precision
        chosen for the loss."""
        node = cast.parent
        while node is not None and not node.is_statement:
            if isinstance(node, nodes.Call) and self.context.dtypes.cast_target(node) == INT:
                return True
            node = node.parent
        return False

    # -- where the prediction comes from -----------------------------------------------

    def _autocast_output_name(self, arg: nodes.NodeNG) -> Optional[str]:
        """The name of ``arg``'s variable if it holds a forward output made inside an
        autocast region that does not enclose the loss, with no upcast since (not losses the
        forward returned: ``parse_losses(losses)`` only sums them)."""
        root = self._tensor_root(arg)
        if not isinstance(root, nodes.Name) or self.context.dtypes.of(arg) in (FP32, INT):
            return None
        if {"loss", "losses"} & set(name_words(root.name)):
            return None
        return root.name if self._made_under_autocast(root, _MAX_HOPS) else None

    def _made_under_autocast(self, name: nodes.Name, hops: int) -> bool:
        """Some assignment reaching ``name`` stores a forward output made in an autocast
        region, directly or through re-assignments (``out = out.view(-1, C)``,
        ``log_probs = logits.log_softmax(-1)``, ``for a in aux_outputs``)."""
        dtypes = self.context.dtypes
        statement = name.statement()
        for binding in self.context.names.reaching_bindings(name):
            value = bound_value(binding)
            if binding.statement() is statement and not isinstance(
                binding.parent, nodes.Comprehension
            ):
                continue  # ``out = out.view(-1)``: the right-hand ``out`` is the earlier value
            if value is None or dtypes.of(value) in (FP32, INT):
                continue
            if self._forward_output(value) and self._under_autocast(binding, value):
                return True
            source = self._tensor_root(value)
            if hops > 0 and isinstance(source, nodes.Name):
                if self._made_under_autocast(source, hops - 1):
                    return True
        return False

    def _under_autocast(self, binding: nodes.NodeNG, value: nodes.NodeNG) -> bool:
        """The assignment runs in an autocast region, or calls a function of this module
        that runs wholly under autocast (``@torch.autocast(...)`` on its ``def``) and does
        not upcast what it returns."""
        regions = self.context.regions
        if regions.autocast_at(binding) is not None:
            return True
        core = chain_root(value, PRESERVING, attributes=True)
        if not isinstance(core, nodes.Call) or regions.called_region(core) is None:
            return False
        returns = returned_values(self.context.names.local_function(core)) or []
        return any(self.context.dtypes.of(v) not in (FP32, INT) for v in returns)

    def _forward_output(self, value: nodes.NodeNG) -> bool:
        """``model(x)``, ``self.net(x)[0]``, ``ddp_model(x)``, ``x @ w``: low precision, or
        a call of a model, also through activation checkpointing (not a data move, not a
        library function or a loss)."""
        if is_low(self.context.dtypes.of(value)):
            return True
        core = chain_root(value, PRESERVING, attributes=True)
        if not isinstance(core, nodes.Call) or self._returns_fp32(core.func):
            return False
        callee = self.context.names.callee(core)
        if callee is None:
            return simple_name(core.func) not in DATA_METHODS
        if callee.qualname in ACTIVATION_CHECKPOINTS:
            return True  # ``checkpoint(block, x)`` runs the block's forward
        # Library objects wrapping a model (``DDP(net)``, ``torch.compile(net)``) run its
        # forward; library functions and loss modules do not.
        return callee.instance and not callee.name.endswith("Loss")

    def _tensor_root(self, expr: nodes.NodeNG) -> nodes.NodeNG:
        """The tensor ``expr`` is computed from: through indexing, attributes, arithmetic
        (the tensor operand), tensor methods (their receiver), torch functions (their
        first argument) and lists of tensors (the first) -- ``F.log_softmax(s / T, 1)`` ->
        ``s``."""
        names = self.context.names
        while True:
            if self.context.dtypes.of(expr) in (FP32, INT):
                return expr  # upcast on the way (``F.interpolate(pred.float(), ...)``)
            if isinstance(expr, nodes.Subscript):
                expr = expr.value
            elif isinstance(expr, nodes.Attribute):
                expr = expr.expr
            elif isinstance(expr, nodes.UnaryOp):
                expr = expr.operand
            elif isinstance(expr, (nodes.List, nodes.Tuple)) and expr.elts:
                expr = expr.elts[0]  # ``torch.cat([pos_scores, neg_scores], 1)``
            elif isinstance(expr, nodes.BinOp):
                expr = expr.right if self.context.dtypes.is_number(expr.left) else expr.left
            elif isinstance(expr, nodes.Call):
                callee = names.callee(expr)
                method, receiver = method_call(expr)
                if callee is None and receiver is not None and method not in TO_PYTHON:
                    expr = receiver
                elif (
                    callee is not None
                    and not callee.instance
                    and callee.qualname.startswith("torch.")
                    and call_argument(expr, 0, "input") is not None
                ):
                    first = call_argument(expr, 0, "input")
                    if _is_string(first) and len(expr.args) > 1:
                        first = expr.args[1]  # ``torch.einsum("bd,bd->b", q, k)``: q
                    expr = first
                else:
                    return expr
            else:
                return expr

    def _returns_fp32(self, model: nodes.NodeNG) -> bool:
        """``model`` comes from ``accelerator.prepare(...)`` or ``fabric.setup(...)``,
        which wrap its forward so that it returns fp32 outputs (accelerate's
        ``convert_outputs_to_fp32``, Fabric's ``convert_output``)."""
        if not isinstance(model, nodes.Name):
            return False
        for binding in self.context.names.reaching_bindings(model):
            value = bound_value(binding)
            if isinstance(value, nodes.Call) and method_call(value)[0] in FP32_OUTPUT_WRAPPERS:
                return True
        return False


def _names(expr: Optional[nodes.NodeNG], name: str) -> bool:
    """``expr`` is the variable ``name``, or a slice of it (``est[:, i]``; not an entry of a
    dict, ``targets["labels"]``, which is another tensor)."""
    while isinstance(expr, nodes.Subscript) and not _is_string(expr.slice):
        expr = expr.value
    return isinstance(expr, nodes.Name) and expr.name == name


def _bound_terms(binding: nodes.NodeNG, names) -> List[nodes.NodeNG]:
    """What a binding of a name puts in it, as loss terms: the value assigned, the term
    added (``loss += torch.mean(...)`` in HiFi-GAN's ``feature_loss``), or for a loop
    variable what it iterates (``v`` of ``{k: w[k] * v for k, v in losses.items()}``)."""
    parent = binding.parent
    if isinstance(parent, nodes.AugAssign) and parent.target is binding:
        return [parent.value]
    value = assigned_value(binding)
    if value is not None:
        return [value]
    iterated = names.iterated(binding) if isinstance(binding, nodes.AssignName) else None
    return [iterated] if iterated is not None else []


def _prediction(call: nodes.Call) -> Optional[nodes.NodeNG]:
    """The prediction a loss call receives: its first argument, positional or by keyword."""
    for name in PREDICTION_KEYWORDS:
        value = keyword_value(call, name)
        if value is not None:
            return value
    return call_argument(call, 0, "input")


def _parameters(function: nodes.FunctionDef) -> List[nodes.AssignName]:
    """The positional parameters a call fills (without ``self`` of a method)."""
    params = function.args.posonlyargs + function.args.args
    return params[1:] if isinstance(function.parent, nodes.ClassDef) else params


def _is_torch_loss(qualname: str, instance: bool) -> bool:
    """``torch.nn.functional.cross_entropy``, ``torch.nn.CTCLoss()``..."""
    if instance:
        return qualname.startswith("torch.nn.") and qualname.endswith("Loss")
    name = last_part(qualname)
    return (
        qualname.startswith(("torch.nn.functional.", "torch."))
        and qualname.count(".") <= 3
        and (name.endswith("_loss") or name in LOSS_FUNCTIONS)
    )


def _is_string(expr: nodes.NodeNG) -> bool:
    return isinstance(expr, nodes.Const) and isinstance(expr.value, str)
