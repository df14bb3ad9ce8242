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
from typing import Dict, FrozenSet, Iterator, List, Optional, Tuple

from astroid import nodes

from flake8_amp.analysis.names import (
    chain_root,
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

_WORD = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")


def name_words(name: str) -> List[str]:
    """``export_onnx`` -> [export, onnx]; ``ONNXExporter`` -> [onnx, exporter]."""
    return [word.lower() for word in _WORD.findall(name)]


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
        stem = os.path.splitext(os.path.basename(context.filename or ""))[0]
        file_words = FILE_INFERENCE_WORDS | context.options.inference_words
        self.file_is_inference = any(word in file_words for word in name_words(stem))
        #: pytest's naming of test modules (``test_x.py``, ``x_test.py``).
        self.file_is_test = stem.startswith("test_") or stem.endswith("_test")
        self._eval_scopes: Dict[nodes.NodeNG, bool] = {}
        self._training_scopes: Dict[nodes.NodeNG, bool] = {}
        self._scope_calls: Dict[nodes.NodeNG, FrozenSet[str]] = {}
        self._frozen_objects: Dict[nodes.NodeNG, Tuple[FrozenSet[str], FrozenSet[str]]] = {}

    def no_grad_at(self, node: nodes.NodeNG) -> bool:
        """``node`` runs under no_grad / inference_mode / set_grad_enabled(False)."""
        child, parent = node, node.parent
        while parent is not None:
            if isinstance(parent, nodes.With) and not any(child is e for e, _ in parent.items):
                if any(self._disables_grad(expr) for expr, _ in parent.items):
                    return True
            elif isinstance(parent, nodes.FunctionDef) and parent.decorators is not None:
                if child is not parent.decorators and any(
                    self._disables_grad(d) for d in parent.decorators.nodes
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
            if isinstance(current, (nodes.FunctionDef, nodes.ClassDef)):
                if any(word in self.words for word in name_words(current.name)):
                    return True
            current = current.parent
        return self._is_eval_scope(scope)

    def training_at(self, node: nodes.NodeNG) -> bool:
        """There is positive evidence that ``node`` is training code: its function is named
        for training, calls ``.backward()`` / ``.zero_grad()``, or calls something named for
        training (``train_one_epoch()``, ``model.train()``); for an object kept on ``self``
        (``self.model = model.half()`` in ``__init__``), any method of its class counts. A
        local value in a method of a class that trains elsewhere (a mask cast for
        communication in a pipeline engine) is not judged by the class."""
        scope = code_frame(node)
        current: Optional[nodes.NodeNG] = scope
        while current is not None:
            if isinstance(current, (nodes.FunctionDef, nodes.ClassDef)):
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
        while isinstance(expr.parent, nodes.Attribute) and _chain_call(expr.parent.parent):
            expr = expr.parent.parent
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
        frozen = self._frozen_in(code_frame(expr))
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

    def _freezing(self, scope: nodes.NodeNG) -> Tuple[FrozenSet[str], FrozenSet[str]]:
        """(frozen, trained) objects of ``scope``: ``m.train()`` undoes ``m.eval()`` but not
        ``m.requires_grad_(False)`` (LoRA freezes the base model and trains adapters in it);
        an optimizer over ``m.parameters()`` or ``train_one_epoch(m)`` undoes both."""
        if scope not in self._frozen_objects:
            without_grad, in_eval, in_train_mode, trained = set(), set(), set(), set()
            for node in scope_nodes(scope):
                if _chain_call(node) and _freezes(node):
                    frozen = in_eval if node.func.attrname == "eval" else without_grad
                    frozen.update(
                        {
                            node.func.expr.as_string(),
                            object_key(chain_root(node.func.expr, CHAIN_METHODS)),
                            object_key(assign_target(node)),
                        }
                    )
                elif isinstance(node, nodes.Call) and _freezing_helper(node):
                    without_grad.update(object_key(_parameters_owner(arg)) for arg in node.args)
                elif _chain_call(node) and node.func.attrname == "train":
                    in_train_mode.add(node.func.expr.as_string())
                elif isinstance(node, nodes.Call):
                    trained.update(_trained_arguments(node))
                elif isinstance(node, nodes.For) and _freezes_parameters(node):
                    without_grad.add(node.iter.func.expr.as_string())
            frozen_objects = (without_grad - trained) | (in_eval - trained - in_train_mode)
            self._frozen_objects[scope] = (
                frozenset(frozen_objects - {""}),
                frozenset(trained | in_train_mode),
            )
        return self._frozen_objects[scope]

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
        while isinstance(expr.parent, nodes.Attribute) and _chain_call(expr.parent.parent):
            expr = expr.parent.parent
        consumer = expr.parent.parent if isinstance(expr.parent, nodes.Keyword) else expr.parent
        if not isinstance(consumer, nodes.Call) or consumer.func is expr:
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

    def _is_eval_scope(self, scope: nodes.NodeNG) -> bool:
        """``scope`` calls ``.eval()`` and trains nothing itself (no ``.step()``, nothing
        from :meth:`_calls_training`, such as ``train_one_epoch(model)``)."""
        if scope not in self._eval_scopes:
            called = self.called_names(scope)
            self._eval_scopes[scope] = (
                "eval" in called and "step" not in called and not self._calls_training(scope)
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


def _is_assertion(call: nodes.Call) -> bool:
    """``assert_close``, ``self.assertEqual``, ``np.testing.assert_allclose``, ``allclose``."""
    name = simple_name(call.func)
    return name.startswith("assert") or name in ("allclose", "isclose", "equal")


def _kept_on_self(node: nodes.NodeNG) -> bool:
    """The object of ``node``'s method chain starts from, or is stored in, ``self.<x>``."""
    top = node
    while isinstance(top.parent, nodes.Attribute) and _chain_call(top.parent.parent):
        top = top.parent.parent
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


def _trained_arguments(call: nodes.Call) -> Iterator[str]:
    """Objects ``call`` trains: ``m`` in ``optimizer_cls(m.parameters())`` or in a call
    named for training (``train_one_epoch(m, loader)``)."""
    training = named_for_training(simple_name(call.func))
    for arg in call.args:
        owner = _parameters_owner(arg)
        if owner is not arg or training:
            yield object_key(owner)


def _parameters_owner(arg: nodes.NodeNG) -> nodes.NodeNG:
    """``m`` for ``m.parameters()``; the argument itself otherwise."""
    if isinstance(arg, nodes.Call):
        method, receiver = method_call(arg)
        if method in ("parameters", "named_parameters"):
            return receiver
    return arg


def _freezes_parameters(loop: nodes.For) -> bool:
    """``for p in m.parameters(): p.requires_grad = False`` (or ``p.requires_grad_(False)``)."""
    if _parameters_owner(loop.iter) is loop.iter:
        return False
    for statement in loop.body:
        if isinstance(statement, nodes.Assign) and _is_false(statement.value):
            if any(getattr(t, "attrname", "") == "requires_grad" for t in statement.targets):
                return True
        if isinstance(statement, nodes.Expr) and _chain_call(statement.value):
            if _freezes(statement.value) and statement.value.func.attrname != "eval":
                return True
    return False


def assign_target(expr: nodes.NodeNG) -> Optional[nodes.NodeNG]:
    """``t`` in ``t = expr`` (a name or attribute), if ``expr`` is assigned to one."""
    parent = expr.parent
    if isinstance(parent, nodes.Assign) and parent.value is expr and len(parent.targets) == 1:
        return parent.targets[0]
    return None


def object_key(expr: Optional[nodes.NodeNG]) -> str:
    """``teacher`` / ``self.teacher`` as written (assignment targets included); '' else."""
    if isinstance(expr, (nodes.Name, nodes.AssignName)):
        return expr.name
    if isinstance(expr, (nodes.Attribute, nodes.AssignAttr)):
        base = object_key(expr.expr)
        return f"{base}.{expr.attrname}" if base else ""
    return ""
