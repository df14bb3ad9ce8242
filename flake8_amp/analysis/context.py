"""Grad mode and purpose of code: no_grad / inference_mode blocks, inference/export code.

Casting to fp16 or computing without gradients is legitimate outside training, so rules
about training steps ask here first. Code counts as inference when it runs under
``torch.no_grad()`` / ``torch.inference_mode()`` / ``torch.set_grad_enabled(False)`` (as
``with`` or decorator), when an enclosing function or class, or the file, is named with
an inference word (export, infer, inference, predict, deploy, serve, generate, and the
evaluation and test words below, plus ``--amp-inference-words``; whole words of
snake_case or CamelCase names; file names count only for the first group), or when its
scope calls ``.eval()`` and never ``.train()`` / ``.backward()`` (an evaluation script).
Objects without gradients (detached tensors, models frozen in the function, such as a
distillation teacher or a frozen encoder) may be cast freely, also in training code.
"""

from __future__ import annotations

import os
import re
from typing import Callable, Dict, FrozenSet, Iterator, List, Optional, Tuple

from astroid import nodes

from flake8_amp.analysis.names import (
    assign_target,
    assigned_value,
    call_argument,
    call_arguments,
    chain_root,
    chain_top,
    code_frame,
    enclosing_class,
    keyword_value,
    last_part,
    method_call,
    simple_name,
)

NO_GRAD_CONTEXTS = frozenset(
    {
        "torch.no_grad",
        "torch.inference_mode",
        "torch.autograd.no_grad",
        "torch.autograd.inference_mode",
        "torch.autograd.grad_mode.no_grad",
        "torch.autograd.grad_mode.inference_mode",
    }
)
SET_GRAD_ENABLED = frozenset(
    {
        "torch.set_grad_enabled",
        "torch.autograd.set_grad_enabled",
        "torch.autograd.grad_mode.set_grad_enabled",
    }
)

INFERENCE_WORDS: FrozenSet[str] = frozenset(
    {
        "export",
        "exporter",
        "exporting",
        "onnx",
        "tensorrt",
        "trt",
        "torchscript",
        "jit",
        "infer",
        "inference",
        "predict",
        "prediction",
        "predictor",
        "deploy",
        "deployment",
        "serve",
        "serving",
        "server",
        "generate",
        "generation",
        "sample",
        "sampling",
        "eval",
        "evaluate",
        "evaluation",
        "evaluator",
        "validate",
        "validation",
        "val",
        "test",
        "tests",
        "testing",
        "demo",
        "benchmark",
        "bench",
        "profile",
    }
)

#: File names mark inference code only with these (``export_onnx.py``, ``predict.py``);
#: evaluation words are too common in file names (``test_train.py``) to count there.
FILE_INFERENCE_WORDS: FrozenSet[str] = frozenset(
    {"export", "infer", "inference", "predict", "deploy", "serve", "serving", "generate", "demo"}
)

#: Words in function/class names that mark training code.
TRAINING_WORDS: FrozenSet[str] = frozenset(
    {"train", "trainer", "training", "fit", "finetune", "pretrain"}
)
#: Method calls that only training code makes.
TRAINING_CALLS: FrozenSet[str] = frozenset({"backward", "manual_backward", "zero_grad"})
#: Methods that return the object they are called on (a chain ``m.cuda().half().eval()``).
CHAIN_METHODS: FrozenSet[str] = frozenset(
    {"to", "cuda", "cpu", "type", "half", "bfloat16", "float", "eval", "train", "requires_grad_"}
)

COMPREHENSIONS = (nodes.ListComp, nodes.SetComp, nodes.DictComp, nodes.GeneratorExp)

#: Methods returning a module's parameters.
PARAMETER_METHODS: FrozenSet[str] = frozenset({"parameters", "named_parameters"})
#: Calls passing the parameters they are given on (``filter`` a part, ``dict`` as a group).
PARAMETER_PASSING: FrozenSet[str] = frozenset(
    {"list", "tuple", "filter", "dict", "itertools.chain"}
)
#: In the name of a wrapper that steps fp32 master copies of fp16 parameters instead of
#: the parameters themselves (apex's ``FP16_Optimizer``, fairseq's ``FP16Optimizer``,
#: Megatron's ``Float16OptimizerWithFloat16Params``, ``MixedPrecisionOptimizer``), lower
#: case without underscores.
MASTER_WEIGHT_MARKS: Tuple[str, ...] = ("fp16", "float16", "half", "master", "mixedprecision")
#: How many names and wrappers the parameters of an optimizer are followed through.
_MAX_PARAMETER_HOPS = 6
#: How many helper calls a returned value is followed up through (``prepare`` -> ``train``).
_MAX_RETURN_HOPS = 3

_WORD = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")


def name_words(name: str) -> List[str]:
    """``export_onnx`` -> [export, onnx]; ``ONNXExporter`` -> [onnx, exporter]."""
    return [word.lower() for word in _WORD.findall(name)]


#: Words naming a loss (``criterion``, ``loss_fn``, ``compute_loss``, ``FocalLoss``).
LOSS_WORDS = frozenset({"loss", "losses", "criterion"})
#: Words naming something else that takes a loss (``loss_scaler(loss, optimizer)``).
NOT_LOSS_WORDS = frozenset({"scaler", "scale", "meter", "logger", "log", "record"})


def named_for_loss(name: str) -> bool:
    """``criterion``, ``self.loss_fn``, ``SetCriterion``; not ``loss_scaler``."""
    words = set(name_words(name))
    return bool(words & LOSS_WORDS) and not words & NOT_LOSS_WORDS


def is_optimizer_class(qualname: str) -> bool:
    """``torch.optim.AdamW`` and the other ``torch.optim`` optimizers (not its schedulers
    or SWA helpers)."""
    return qualname.startswith("torch.optim.") and not any(
        part in qualname for part in ("lr_scheduler", "swa_utils")
    )


def parameters_receiver(expr: Optional[nodes.NodeNG]) -> Optional[nodes.NodeNG]:
    """``m`` for ``m.parameters()`` / ``m.named_parameters()``; None otherwise."""
    if isinstance(expr, nodes.Call):
        method, receiver = method_call(expr)
        if method in PARAMETER_METHODS:
            return receiver
    return None


def named_for_training(name: str) -> bool:
    """``train_one_epoch``, ``Trainer``, ``finetune``, ``fit`` / ``fit_one_cycle`` -- "fit"
    only as the first word (``get_best_fit``, ``curve_fit`` fit something else)."""
    words = name_words(name)
    return words[:1] == ["fit"] or any(w in TRAINING_WORDS and w != "fit" for w in words)


class GradContext:
    """Queries about grad mode and the purpose of code, for one module."""

    def __init__(self, context):
        self.context = context
        self.names = context.names
        self.words = INFERENCE_WORDS | context.options.inference_words
        self._forward_paths: Dict[nodes.ClassDef, set] = {}
        stem = os.path.splitext(os.path.basename(context.filename or ""))[0]
        file_words = FILE_INFERENCE_WORDS | context.options.inference_words
        self.file_is_inference = any(word in file_words for word in name_words(stem))
        #: pytest's naming of test modules (``test_x.py``, ``x_test.py``).
        self.file_is_test = stem.startswith("test_") or stem.endswith("_test")
        self._eval_scopes: Dict[nodes.NodeNG, bool] = {}
        self._training_scopes: Dict[nodes.NodeNG, bool] = {}
        self._scope_calls: Dict[nodes.NodeNG, FrozenSet[str]] = {}
        self._frozen_objects: Dict[
            nodes.NodeNG, Tuple[FrozenSet[str], FrozenSet[str], list, FrozenSet[str]]
        ] = {}

    def no_grad_at(self, node: nodes.NodeNG) -> bool:
        """``node`` runs under no_grad / inference_mode / set_grad_enabled(False)."""
        return self._inside(node, self._disables_grad)

    def inference_mode_at(self, node: nodes.NodeNG) -> bool:
        """``node`` runs under ``torch.inference_mode()``: inference by its own declaration."""
        return self._inside(node, self._is_inference_mode)

    @staticmethod
    def _inside(node: nodes.NodeNG, opens: Callable[[nodes.NodeNG], bool]) -> bool:
        """A ``with`` item or a decorator of an enclosing function ``opens`` the context."""
        child, parent = node, node.parent
        while parent is not None:
            if isinstance(parent, nodes.With) and not any(child is e for e, _ in parent.items):
                if any(opens(expr) for expr, _ in parent.items):
                    return True
            elif isinstance(parent, nodes.FunctionDef) and parent.decorators is not None:
                if child is not parent.decorators and any(
                    opens(d) for d in parent.decorators.nodes
                ):
                    return True
            child, parent = parent, parent.parent
        return False

    def inference_at(self, node: nodes.NodeNG) -> bool:
        """``node`` is in code meant for inference, evaluation or export (see module doc)."""
        if self.file_is_inference:
            return True
        scope = code_frame(node)
        current: Optional[nodes.NodeNG] = scope
        while current is not None:
            if isinstance(current, (nodes.FunctionDef, nodes.ClassDef)) and not (
                    self.in_forward_pass(current)):
                # the innermost name that says decides, by its first word that says
                # (``train_link_prediction`` trains, ``test_cast_in_training`` tests)
                purpose = self._named_purpose(current.name)
                if purpose is not None:
                    if purpose == "inference":
                        return True
                    break
            current = current.parent
        return self._is_eval_scope(scope)

    def in_forward_pass(self, function: Optional[nodes.NodeNG]) -> bool:
        """A method a model's ``forward`` runs (Mask2Former's ``forward_prediction_heads``):
        its name describes the model, not what the code is for."""
        owner = getattr(function, "parent", None)
        if not isinstance(function, nodes.FunctionDef) or not isinstance(owner, nodes.ClassDef):
            return False
        if owner not in self._forward_paths:
            names = self.names
            self._forward_paths[owner] = (
                names.forward_path(owner) if names.is_model(owner) else set()
            )
        return function in self._forward_paths[owner]

    def _named_purpose(self, name: str) -> Optional[str]:
        """"training" or "inference" by the first word of ``name`` that names either."""
        for index, word in enumerate(name_words(name)):
            if word in self.words:
                return "inference"
            if word in TRAINING_WORDS and (word != "fit" or index == 0):
                return "training"
        return None

    def training_at(self, node: nodes.NodeNG, _hops: int = _MAX_RETURN_HOPS) -> bool:
        """There is positive evidence that ``node`` is training code: its function is named
        for training, calls ``.backward()`` / ``.zero_grad()``, or calls something named for
        training (``train_one_epoch()``, ``model.train()``); for an object kept on ``self``
        (``self.model = model.half()`` in ``__init__``), any method of its class counts. A
        local value in a method of a class that trains elsewhere (a mask cast for
        communication in a pipeline engine) is not judged by the class. A value the
        function returns is judged where it is received: a helper whose caller here is
        training code (``model = build_model(args)``, ``x, y = prepare(batch)`` in the loop),
        outside no_grad/inference there, hands its value to training."""
        if self._returned_to_training(node, _hops):
            return True
        scope = code_frame(node)
        current: Optional[nodes.NodeNG] = scope
        while current is not None:
            if isinstance(current, nodes.FunctionDef) or (
                isinstance(current, nodes.ClassDef) and _kept_on_self(node)
            ):
                if named_for_training(current.name):
                    return True
            current = current.parent
        if self._calls_training(scope):
            return True
        owner = scope.parent if isinstance(scope, nodes.FunctionDef) else None
        if isinstance(owner, nodes.ClassDef) and _kept_on_self(node):
            return any(
                self._calls_training(method)
                or named_for_training(method.name)
                for method in owner.mymethods()
            )
        return False

    def _returned_to_training(self, node: nodes.NodeNG, hops: int) -> bool:
        scope = code_frame(node)
        if hops <= 0 or not isinstance(scope, nodes.FunctionDef) or not _returned(node, scope):
            return False
        return any(
            not (self.not_training_at(site) or self.fed_to_inference(site))
            and self.training_at(site, hops - 1)
            for site in self.names.call_sites(scope)
        )

    def _calls_training(self, scope: nodes.NodeNG) -> bool:
        """``scope`` calls backward/zero_grad, or a function or method named for training
        (``train_one_epoch(...)``, ``model.train()``)."""
        if scope not in self._training_scopes:
            called = self.called_names(scope)
            self._training_scopes[scope] = bool(TRAINING_CALLS.intersection(called)) or any(
                named_for_training(name) for name in called
            )
        return self._training_scopes[scope]

    def called_names(self, scope: nodes.NodeNG) -> FrozenSet[str]:
        """Names called directly in ``scope``: ``x.eval()`` -> "eval", ``save(...)`` -> "save"."""
        if scope not in self._scope_calls:
            self._scope_calls[scope] = frozenset(_called_names(scope))
        return self._scope_calls[scope]

    def frozen(self, expr: nodes.NodeNG) -> bool:
        """The object in the method chain ``expr`` belongs to has no gradients: the chain
        detaches it or freezes it (``x.detach().half()``, ``x.data``, ``t.half().eval()``),
        or its function freezes the object it starts from, is assigned to or is fed to
        (``m.requires_grad_(False)``, ``p.requires_grad = False`` for ``p`` in
        ``m.parameters()``, ``freeze_params(m.parameters())``, ``set_requires_grad(m,
        False)``, ``m.eval()`` with no ``m.train()``; ``m(x.half())``,
        ``m.encode(x.half())``, ``m.load_state_dict({k: v.half() ...})``). A ``self.<x>``
        object may be frozen when it is built (``self.target.eval()`` in ``__init__``) if
        no method of the class trains it."""
        expr = chain_top(expr, CHAIN_METHODS)
        objects = {object_key(assign_target(expr))}
        fed = expr
        while isinstance(fed.parent, COMPREHENSIONS) and fed is not fed.parent.generators[0].iter:
            fed = fed.parent  # ``{k: v.half() for ...}`` is fed as a whole
        consumer = fed.parent
        if isinstance(consumer, nodes.Call) and fed in consumer.args:
            objects.add(object_key(consumer.func))
            if isinstance(consumer.func, nodes.Attribute):
                objects.add(object_key(consumer.func.expr))
        link = expr
        while True:
            if isinstance(link, nodes.Attribute) and link.attrname == "data":
                return True
            if not _chain_call(link) and not _is_detach(link):
                break
            if _is_detach(link) or _freezes(link):
                return True
            link = link.func.expr
        objects.add(object_key(link))
        scope = code_frame(expr)
        frozen = self._frozen_in(scope)
        for branch, keys in self._freezing(scope)[2]:
            if any(statement.parent_of(expr) for statement in branch):
                frozen = frozen | keys
        if any(key in frozen for key in objects if key):
            return True
        return any(key in self._frozen_when_built(expr) for key in objects if key)

    def _frozen_when_built(self, node: nodes.NodeNG) -> FrozenSet[str]:
        """``self.<x>`` objects that the ``__init__`` of ``node``'s class freezes and none of
        its methods trains or puts back in train mode."""
        owner = enclosing_class(node)
        if owner is None or "__init__" not in owner.locals:
            return frozenset()
        methods = list(owner.mymethods())
        built = [m for m in methods if m.name == "__init__"]
        frozen = set().union(*(self._frozen_in(m) for m in built))
        trained = set().union(*(self.trained_in(m) for m in methods))
        return frozenset(key for key in frozen - trained if key.startswith("self."))

    def _frozen_in(self, scope: nodes.NodeNG) -> FrozenSet[str]:
        """Objects (as source text) that ``scope`` freezes and never trains: no
        ``m.train()``, no ``train_one_epoch(m, ...)``, no ``AdamW(m.parameters())``."""
        return self._freezing(scope)[0]

    def trained_in(self, scope: nodes.NodeNG) -> FrozenSet[str]:
        """Objects (as source text) that ``scope`` trains: ``m.train()``,
        ``train_one_epoch(m, ...)``, ``AdamW(m.parameters())``."""
        return self._freezing(scope)[1]

    def builds_optimizer(self, call: nodes.Call) -> bool:
        """``call`` builds a ``torch.optim`` optimizer (:func:`is_optimizer_class`)."""
        callee = self.names.callee(call)
        return callee is not None and not callee.instance and is_optimizer_class(callee.qualname)

    def _trained_arguments(self, call: nodes.Call, named: bool = True) -> Iterator[str]:
        """Objects ``call`` trains: the modules a ``torch.optim`` optimizer it builds steps
        (:meth:`optimized_modules`), ``m`` in any call given ``m.parameters()``
        (``optimizer_cls(m.parameters())``) but one only passing them on
        (``filter(fn, m.parameters())``: what receives that decides), and with ``named``
        the arguments of a call named for training (``train_one_epoch(m, loader)``; also a
        frozen model handed along with the one trained: ``train(unet, controlnet, ...)``)."""
        if self.builds_optimizer(call):
            stepped = self.optimized_modules(call, frozen_too=False)
            yield from (object_key(module) for module in stepped)
        if self._passing(call) is not None:
            return
        training = named and named_for_training(simple_name(call.func))
        for arg in call.args:
            if training or parameters_receiver(arg) is not None:
                yield object_key(_receiver_or_itself(arg))

    def optimized_modules(self, call: nodes.Call, frozen_too: bool = True) -> List[nodes.NodeNG]:
        """The modules whose own parameters the optimizer that ``call`` builds steps (its
        ``params`` argument, see :meth:`parameter_owners`); none when the optimizer is
        handed to a wrapper that steps fp32 master copies instead (``FP16_Optimizer(opt)``).
        ``frozen_too=False`` leaves out parameters picked by ``requires_grad``
        (``filter(lambda p: p.requires_grad, m.parameters())`` steps none that are frozen)."""
        callee = self.names.callee(call)
        params = (
            callee.argument(0, "params") if callee is not None else call_argument(call, 0, "params")
        )
        owners = self.parameter_owners(params, frozen_too)
        if owners and self._wrapped_for_master_weights(call):
            return []
        return owners

    def parameter_owners(
        self, params: Optional[nodes.NodeNG], frozen_too: bool = True, _hops: int = 0
    ) -> List[nodes.NodeNG]:
        """The modules whose own parameters ``params`` (what an optimizer is given) holds, as
        expressions: ``m`` for ``m.parameters()`` / ``m.named_parameters()`` (``m`` may be a
        chain: ``enc.get_input_embeddings()``), through the names bound to it where it is
        used, ``list`` / ``filter`` / ``itertools.chain``, ``+``, comprehensions that keep each
        parameter itself (``[p for n, p in m.named_parameters() if ...]``; ``[p.float() for
        ...]`` builds fp32 copies, and a condition on ``dtype`` picks some) and param groups
        (dicts with a ``"params"`` entry, in a list). Only what is known: possibly a part."""
        if params is None or _hops > _MAX_PARAMETER_HOPS:
            return []
        hops = _hops + 1
        receiver = parameters_receiver(params)
        if receiver is not None:
            return [receiver]
        if isinstance(params, nodes.Name):
            return [
                owner
                for binding in self.names.earlier_bindings(params)
                for owner in self.parameter_owners(assigned_value(binding), frozen_too, hops)
            ]
        if isinstance(params, (nodes.List, nodes.Tuple)):
            return [
                owner
                for element in params.elts
                for owner in self.parameter_owners(element, frozen_too, hops)
            ]
        if isinstance(params, nodes.Dict):
            return [
                owner
                for key, value in params.items
                if isinstance(key, nodes.Const) and key.value == "params"
                for owner in self.parameter_owners(value, frozen_too, hops)
            ]
        if isinstance(params, nodes.BinOp) and params.op == "+":
            return [
                owner
                for side in (params.left, params.right)
                for owner in self.parameter_owners(side, frozen_too, hops)
            ]
        if isinstance(params, (nodes.ListComp, nodes.GeneratorExp)):
            return self._comprehension_owners(params, frozen_too, hops)
        if isinstance(params, nodes.Call):
            return self._passed_owners(params, frozen_too, hops)
        return []

    def _comprehension_owners(
        self, comprehension: nodes.NodeNG, frozen_too: bool, hops: int
    ) -> List[nodes.NodeNG]:
        """``[p for p in X if ...]`` / ``[p for n, p in X]``: the owners of X's parameters."""
        if len(comprehension.generators) != 1 or not isinstance(comprehension.elt, nodes.Name):
            return []
        generator = comprehension.generators[0]
        target = generator.target
        targets = target.elts if isinstance(target, nodes.Tuple) else [target]
        if not any(
            isinstance(t, nodes.AssignName) and t.name == comprehension.elt.name for t in targets
        ):
            return []  # ``[p.float() for p in ...]`` builds new (fp32 master) tensors
        if any(not _keeps(condition, frozen_too) for condition in generator.ifs):
            return []
        return self.parameter_owners(generator.iter, frozen_too, hops)

    def _passed_owners(
        self, call: nodes.Call, frozen_too: bool, hops: int
    ) -> List[nodes.NodeNG]:
        """``list(X)``, ``filter(fn, X)``, ``itertools.chain(X, Y)``, ``dict(params=X)``."""
        name = self._passing(call)
        if name == "dict":
            return self.parameter_owners(keyword_value(call, "params"), frozen_too, hops)
        if name == "filter":
            if len(call.args) != 2 or not _keeps(call.args[0], frozen_too):
                return []
            return self.parameter_owners(call.args[1], frozen_too, hops)
        if name is not None:
            return [
                owner for arg in call.args for owner in self.parameter_owners(arg, frozen_too, hops)
            ]
        return []

    def _passing(self, call: nodes.Call) -> Optional[str]:
        """The name of a call that passes the parameters it is given on (``list``,
        ``filter``, ``itertools.chain``, ``dict``); None for other calls."""
        name = self.names.builtin_name(call.func) or self.names.qualname(call.func)
        return name if name in PARAMETER_PASSING else None

    def _wrapped_for_master_weights(self, call: nodes.Call) -> bool:
        """The optimizer ``call`` builds is handed, directly or by the name it is bound to in
        its function, to a call named for fp16 master weights (``FP16_Optimizer(opt)``)."""
        receiver = _receiving_call(call)
        wrappers = [receiver] if receiver is not None else []
        key = object_key(assign_target(call))
        if key:
            wrappers.extend(
                node
                for node in scope_nodes(code_frame(call))
                if isinstance(node, nodes.Call)
                and any(object_key(arg) == key for arg in call_arguments(node))
            )
        return any(
            mark in simple_name(wrapper.func).lower().replace("_", "")
            for wrapper in wrappers
            for mark in MASTER_WEIGHT_MARKS
        )

    def _freezing(
        self, scope: nodes.NodeNG
    ) -> Tuple[FrozenSet[str], FrozenSet[str], list, FrozenSet[str]]:
        """(frozen, trained) objects of ``scope``: ``m.train()`` undoes ``m.eval()`` but not
        ``m.requires_grad_(False)`` (LoRA freezes the base model and trains adapters in it);
        an optimizer over ``m.parameters()`` undoes both, ``train_one_epoch(m)`` only the
        first (a frozen UNet is handed to ``train(unet, controlnet, ...)`` to run it). Third, the
        freezes of a branch that leaves the function (``if cfg.lora: model.requires_grad_(
        False); ...; return model``), as (its statements, objects): they hold in that branch
        only, not on the path that falls through it (``return model.to(torch.bfloat16)``).
        Fourth, the objects whose ``requires_grad`` it turns off, trained or not."""
        if scope not in self._frozen_objects:
            without_grad, in_eval, in_train_mode, trained = set(), set(), set(), set()
            optimized = set()  # given to an optimizer: undoes requires_grad_(False) too
            leaving: Dict[Tuple[nodes.NodeNG, ...], set] = {}
            for node in scope_nodes(scope):
                if _chain_call(node) and _freezes(node):
                    branch = _leaving_branch(node, scope)
                    if branch is not None:
                        frozen = leaving.setdefault(branch, set())
                    else:
                        frozen = in_eval if node.func.attrname == "eval" else without_grad
                    root = chain_root(node.func.expr, CHAIN_METHODS)
                    frozen.update(
                        {
                            node.func.expr.as_string(),
                            object_key(root),
                            object_key(assign_target(node)),
                            *_loop_elements(root),
                        }
                    )
                elif isinstance(node, nodes.Call) and _freezing_helper(node):
                    without_grad.update(
                        object_key(_receiver_or_itself(arg)) for arg in node.args
                    )
                elif _chain_call(node) and node.func.attrname == "train":
                    in_train_mode.add(node.func.expr.as_string())
                elif isinstance(node, nodes.Call):
                    trained.update(self._trained_arguments(node))
                    optimized.update(self._trained_arguments(node, named=False))
                elif isinstance(node, nodes.For) and _freezes_parameters(node):
                    receiver = node.iter.func.expr
                    without_grad.update({receiver.as_string(), *_loop_elements(receiver)})
            frozen_objects = (without_grad - optimized) | (in_eval - trained - in_train_mode)
            self._frozen_objects[scope] = (
                frozenset(frozen_objects - {""}),
                frozenset(trained | in_train_mode),
                [(branch, frozenset(keys - trained - {""})) for branch, keys in leaving.items()],
                frozenset(without_grad - {""}),
            )
        return self._frozen_objects[scope]

    def grads_turned_off(self, node: nodes.NodeNG) -> bool:
        """The function of ``node`` turns off ``requires_grad`` of the object ``node`` is
        assigned to (``model.requires_grad_(False)``, ``p.requires_grad = False`` over its
        parameters), whatever it optimizes later: what an optimizer then picks from it is
        what was added since (LoRA adapters)."""
        key = object_key(assign_target(chain_top(node, CHAIN_METHODS)))
        return bool(key) and key in self._freezing(code_frame(node))[3]

    def not_training_at(self, node: nodes.NodeNG) -> bool:
        """Gradients are off, the code is not training code, or ``node`` only checks values
        (:meth:`checking_at`)."""
        return self.no_grad_at(node) or self.inference_at(node) or self.checking_at(node)

    def checking_at(self, node: nodes.NodeNG) -> bool:
        """``node`` computes a value to compare: inside an ``assert`` statement or an argument
        of an assertion (``assert_close(state["exp_avg"].half(), ref)``), or anywhere in a
        test of a pytest test module (``test_x.py``) -- a function that asserts -- where
        dtypes are chosen on purpose."""
        parent = node.parent
        while parent is not None and not isinstance(parent, (nodes.FunctionDef, nodes.Module)):
            if isinstance(parent, nodes.Assert):
                return True
            if isinstance(parent, nodes.Call) and _is_assertion(parent):
                return True
            parent = parent.parent
        if not self.file_is_test:
            return False
        scope = code_frame(node)
        return any(
            isinstance(sub, nodes.Assert) or (isinstance(sub, nodes.Call) and _is_assertion(sub))
            for sub in scope_nodes(scope)
        )

    def fed_to_inference(self, expr: nodes.NodeNG) -> bool:
        """``expr``'s object (the whole method chain) is handed to a call named for inference
        or evaluation (``validate.run(model=attempt_load(f).half())``, ``evaluate(m.half(),
        loader)``): it is used there, without gradients."""
        consumer = _receiving_call(chain_top(expr, CHAIN_METHODS))
        if consumer is None:
            return False
        func = consumer.func
        words = name_words(simple_name(func))
        if isinstance(func, nodes.Attribute):
            words += name_words(simple_name(func.expr))
        return any(word in self.words for word in words)

    def _disables_grad(self, expr: nodes.NodeNG) -> bool:
        target = expr.func if isinstance(expr, nodes.Call) else expr
        qualname = self.names.qualname(target) or ""
        if qualname in NO_GRAD_CONTEXTS or last_part(qualname) in ("no_grad", "inference_mode"):
            return True
        if isinstance(target, (nodes.Name, nodes.Attribute)) and not qualname:
            simple = target.name if isinstance(target, nodes.Name) else target.attrname
            if simple in ("no_grad", "inference_mode"):
                return True
        if isinstance(expr, nodes.Call) and qualname in SET_GRAD_ENABLED:
            mode = expr.args[0] if expr.args else keyword_value(expr, "mode")
            return isinstance(mode, nodes.Const) and mode.value is False
        return False

    def _is_inference_mode(self, expr: nodes.NodeNG) -> bool:
        target = expr.func if isinstance(expr, nodes.Call) else expr
        name = last_part(self.names.qualname(target) or "") or simple_name(target)
        return name == "inference_mode"

    def _is_eval_scope(self, scope: nodes.NodeNG) -> bool:
        """``scope`` calls ``.eval()`` and trains nothing itself (no ``.step()``, nothing
        from :meth:`_calls_training`, such as ``train_one_epoch(model)``). Not a constructor:
        an ``__init__`` that puts a part in eval mode (``self.teacher = t.half().eval()``)
        freezes that part (:meth:`frozen`) and builds the rest for its class's methods."""
        if scope not in self._eval_scopes:
            called = self.called_names(scope)
            self._eval_scopes[scope] = (
                "eval" in called
                and "step" not in called
                and not self._calls_training(scope)
                and not (isinstance(scope, nodes.FunctionDef) and scope.name == "__init__")
            )
        return self._eval_scopes[scope]


def scope_nodes(scope: nodes.NodeNG) -> Iterator[nodes.NodeNG]:
    """The nodes of ``scope``'s own code, not of scopes nested in it."""
    stack = list(scope.get_children())
    while stack:
        node = stack.pop()
        if isinstance(node, (nodes.FunctionDef, nodes.ClassDef, nodes.Lambda)):
            continue
        yield node
        stack.extend(node.get_children())


def _called_names(scope: nodes.NodeNG) -> List[str]:
    """Names of functions and methods called in ``scope``, not in nested scopes."""
    return [simple_name(node.func) for node in scope_nodes(scope) if isinstance(node, nodes.Call)]


def _chain_call(node: Optional[nodes.NodeNG]) -> bool:
    """``node`` is ``<object>.<method>(...)`` with a method that returns the object."""
    return isinstance(node, nodes.Call) and method_call(node)[0] in CHAIN_METHODS


def _receiving_call(expr: nodes.NodeNG) -> Optional[nodes.Call]:
    """The call that ``expr`` is an argument of, by position or keyword
    (``evaluate(m.half())``, ``run(model=m.half())``); None otherwise."""
    parent = expr.parent.parent if isinstance(expr.parent, nodes.Keyword) else expr.parent
    return parent if isinstance(parent, nodes.Call) and parent.func is not expr else None


def _is_assertion(call: nodes.Call) -> bool:
    """``assert_close``, ``self.assertEqual``, ``np.testing.assert_allclose``, ``allclose``."""
    name = simple_name(call.func)
    return name.startswith("assert") or name in ("allclose", "isclose", "equal")


def _returned(node: nodes.NodeNG, function: nodes.FunctionDef) -> bool:
    """The value of ``node``'s method chain leaves ``function`` through ``return``: the
    return statement holds it (``return x.half()``, ``return {k: v.half() ...}``, ``return
    a, b``) or a name it is assigned to or casts in place (``model = model.half()`` /
    ``model.half()`` ... ``return model``), other than through a comparison (``return buf >
    0`` hands over booleans)."""
    top = chain_top(node, CHAIN_METHODS)
    statement = top.statement()
    if isinstance(statement, nodes.Return):
        return code_frame(statement) is function
    if isinstance(statement, nodes.Expr) and statement.value is top:
        target = object_key(chain_root(node, CHAIN_METHODS))
    else:
        target = object_key(assign_target(_scaled_by_numbers(top)))
    if not target or "." in target:
        return False
    return any(
        isinstance(sub, nodes.Name) and sub.name == target and not _compared(sub, ret)
        for ret in function.nodes_of_class(nodes.Return, skip_klass=nodes.FunctionDef)
        if ret.value is not None
        for sub in ret.value.nodes_of_class(nodes.Name)
    )


def _scaled_by_numbers(expr: nodes.NodeNG) -> nodes.NodeNG:
    """The arithmetic with Python numbers ``expr`` is part of (``x.half() / 255.0``): the
    value keeps ``expr``'s dtype."""
    parent = expr.parent
    while isinstance(parent, nodes.BinOp):
        other = parent.right if parent.left is expr else parent.left
        if not (isinstance(other, nodes.Const) and isinstance(other.value, (int, float))):
            break
        expr, parent = parent, parent.parent
    return expr


def _compared(node: nodes.NodeNG, within: nodes.NodeNG) -> bool:
    """``node`` is an operand of a comparison inside ``within``."""
    while node is not within and node is not None:
        if isinstance(node.parent, nodes.Compare):
            return True
        node = node.parent
    return False


def _kept_on_self(node: nodes.NodeNG) -> bool:
    """The object of ``node``'s method chain starts from, or is stored in, ``self.<x>``."""
    top = chain_top(node, CHAIN_METHODS)
    keys = (object_key(chain_root(node, CHAIN_METHODS)), object_key(assign_target(top)))
    return any(key.startswith("self.") for key in keys)


def _is_detach(node: nodes.NodeNG) -> bool:
    return isinstance(node, nodes.Call) and method_call(node)[0] in ("detach", "detach_")


def _is_false(node: Optional[nodes.NodeNG]) -> bool:
    return isinstance(node, nodes.Const) and node.value is False


def _freezes(call: nodes.Call) -> bool:
    """``m.eval()`` or ``m.requires_grad_(False)``."""
    method = call.func.attrname
    if method == "requires_grad_":
        flag = call.args[0] if call.args else keyword_value(call, "requires_grad")
        return _is_false(flag)
    return method == "eval"


def _leaving_branch(
    node: nodes.NodeNG, scope: nodes.NodeNG
) -> Optional[Tuple[nodes.NodeNG, ...]]:
    """The statements of the innermost ``if``/``else`` branch around ``node`` (inside
    ``scope``) that ends in ``return`` or ``raise``; None if there is none."""
    child, parent = node, node.parent
    while parent is not None and parent is not scope:
        if isinstance(parent, nodes.If) and child is not parent.test:
            branch = parent.body if child in parent.body else parent.orelse
            if branch and isinstance(branch[-1], (nodes.Return, nodes.Raise)):
                return tuple(branch)
        child, parent = parent, parent.parent
    return None


def _freezing_helper(call: nodes.Call) -> bool:
    """A project helper that freezes its arguments: ``freeze_params(vae.parameters())``,
    ``set_requires_grad(net_d, False)``."""
    words = name_words(simple_name(call.func))
    if {"bn", "norm", "batchnorm"} & set(words):
        return False  # ``freeze_bn(model)``: normalisation statistics only
    if "freeze" in words or "frozen" in words:
        return True
    flags = list(call.args[1:]) + [kw.value for kw in call.keywords or ()]
    return {"requires", "grad"} <= set(words) and any(_is_false(flag) for flag in flags)


def _loop_elements(expr: nodes.NodeNG) -> List[str]:
    """The objects a loop variable stands for, in a loop over a literal tuple or list
    (``for m in (vae, text_encoder): m.requires_grad_(False)`` freezes both)."""
    if not isinstance(expr, nodes.Name):
        return []
    parent = expr.parent
    while parent is not None and not isinstance(parent, (nodes.FunctionDef, nodes.Module)):
        if (
            isinstance(parent, nodes.For)
            and isinstance(parent.target, nodes.AssignName)
            and parent.target.name == expr.name
            and isinstance(parent.iter, (nodes.Tuple, nodes.List))
        ):
            return [key for key in map(object_key, parent.iter.elts) if key]
        parent = parent.parent
    return []


def _receiver_or_itself(arg: nodes.NodeNG) -> nodes.NodeNG:
    """``m`` for ``m.parameters()``; the argument itself otherwise."""
    receiver = parameters_receiver(arg)
    return receiver if receiver is not None else arg


def _keeps(selection: nodes.NodeNG, frozen_too: bool) -> bool:
    """A condition picking parameters keeps the modules' own ones for the question asked:
    not one on ``dtype`` (``p.dtype == torch.float32`` picks by the dtype asked about), nor,
    unless ``frozen_too``, one on ``requires_grad``."""
    words = {sub.attrname for sub in selection.nodes_of_class(nodes.Attribute)}
    if words & {"dtype", "is_floating_point"}:
        return False
    return frozen_too or "requires_grad" not in words


def _freezes_parameters(loop: nodes.For) -> bool:
    """``for p in m.parameters(): p.requires_grad = False`` (or ``p.requires_grad_(False)``)."""
    if parameters_receiver(loop.iter) is None:
        return False
    for statement in loop.body:
        if isinstance(statement, nodes.Assign) and _is_false(statement.value):
            if any(getattr(t, "attrname", "") == "requires_grad" for t in statement.targets):
                return True
        if isinstance(statement, nodes.Expr) and _chain_call(statement.value):
            if _freezes(statement.value) and statement.value.func.attrname != "eval":
                return True
    return False


def object_key(expr: Optional[nodes.NodeNG]) -> str:
    """``teacher`` / ``self.teacher`` as written (assignment targets included); '' else."""
    if isinstance(expr, (nodes.Name, nodes.AssignName)):
        return expr.name
    if isinstance(expr, (nodes.Attribute, nodes.AssignAttr)):
        base = object_key(expr.expr)
        return f"{base}.{expr.attrname}" if base else ""
    return ""
