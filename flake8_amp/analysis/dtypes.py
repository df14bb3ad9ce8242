"""Dtype flow: what floating-point precision an expression's tensor has, when it is known.

Kinds: ``fp32`` (fp32 or wider), ``fp16``, ``bf16``, ``low`` (one of fp16/bf16, which one
unknown), ``int`` (not floating point), or None (unknown). Sources of knowledge: factory
calls with ``dtype=``, conversions (:meth:`Dtypes.cast_target`: ``.half()``, ``.float()``,
``.to(dtype)``, ``.to(other)``, ``.type("torch.cuda.HalfTensor")``, ``.type_as(other)``,
dtypes named by constants), and the per-op rules of autocast inside a region (matmul/
linear/conv and ``nn.Linear``/``nn.Conv*`` modules produce the region's dtype; ops on
autocast's fp32 list produce fp32 — per device, from PyTorch's published lists; a region
enabled by a flag counts as on, so kinds describe the run with mixed precision on).
Knowledge flows through names (per function, the assignments that reach the use),
``self.<x>`` attributes (when every assignment in the class agrees; a
``self.register_buffer("x", value)`` is one), tuple
unpacking (``top, idx = x.topk(k)``; ``out, h = decode(x)`` and ``a, b = self(x)`` take that
element of what the function or ``forward`` returns, also through a returned call such as
``return self.head(x)``; ``q, k, v = qkv(x).chunk(3)`` and a
``forward`` returning ``torch.split(x, n)`` give each element the one kind of the sequence),
in-place arithmetic (``x += y`` keeps
``x``'s dtype), arithmetic (Python numbers, also by name or as a
parameter's default, take the tensor's dtype; fp32 wins over any other operand),
indexing, dtype-preserving methods, the return values of the module's functions and their
parameters (in a function followed from a call, what that call passes; elsewhere the one
kind every call site in the module passes: ``self.mbstd(out)`` makes ``x`` of
``MinibatchStdDev.forward`` what ``out`` is). The
attributes of a parsed-arguments namespace (``args = parser.parse_args()``, also passed on
as a parameter or kept as ``self.args``) are Python numbers in arithmetic: a number (or a
0-dim tensor) does not promote a dimensioned low-precision tensor, a dimensioned fp32
tensor does, so an attribute of any other object stays unknown -- unless a class of the
module declares the field a number (``router_noise: float = 0.0`` in a config dataclass).

In-place ops keep their tensor's dtype (``F.relu_(x)``, ``x.mul_(s)``). A module built by
calling a class held in a variable or parameter (``norm_module(dim)`` with
``norm_module=nn.BatchNorm3d``, or ``get_norm(cfg)`` returning it) is that class. A name
carried round a loop (``x = stage(x)``) takes the kind its other bindings give. A dict of
outputs (a literal, or ``out = {}`` filled by ``out[k] = head(f)``) has the one kind of its
values, which ``out["depth"]`` reads back.

Calls of modules whose construction is known in the module (:meth:`Names.constructions`:
``Net(...)``, ``self.x = Net()``, ``model: Net``, ``DDP(model).module``, ``torch.compile``,
the elements of ``nn.ModuleList``/``nn.Sequential`` reached by iteration or indexing): a
class of this module runs its ``forward`` (and a function of this module its body) in the
region of the call -- autocast is dynamic: the followed code runs in its caller's region
unless it opens its own -- at most :data:`_MAX_FRAMES` deep and never recursively; ``nn``
modules are their op (``nn.Linear`` linear, ``nn.LayerNorm`` layer_norm: fp32 under CUDA
autocast, the input's dtype under CPU autocast, unknown where the device is unknown) or keep
their input's dtype (activations, dropout, batch norm); ``nn.Sequential`` feeds its elements
in turn (or, for a list built in a loop, needs every element to keep its input's dtype but
those producing one same kind). Where no region is known, a low-precision op on fp32 input
is unknown in a function that a caller elsewhere may run under autocast: one with no call
in the module, or called only from such functions (a model's layers under a Lightning
``training_step``). Regions are those the call sites with gradients on run a function in with
mixed precision on (the training run; :meth:`Regions.training_region`). A model from elsewhere
stays unknown.
"""

from __future__ import annotations

from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple, Union

from astroid import nodes

from flake8_amp.analysis.constants import numeric_constant
from flake8_amp.analysis.names import (
    MODULE_CONTAINERS,
    Callee,
    CutCache,
    argument_for,
    assigned_value,
    calls_in_order,
    code_frame,
    conditional_in,
    enclosing_class,
    is_abstract,
    is_self,
    keyword_value,
    last_part,
    literal_target,
    literal_value,
    method_call,
    named_argument,
    returned_values,
    unpacked_value,
)
from flake8_amp.analysis.regions import BF16, CPU, CUDA, FP16, Region

FP32, LOW, INT = "fp32", "low", "int"
LOW_KINDS = frozenset({FP16, BF16, LOW})
#: Comprehensions making sequences, whose element ``_tensors`` reads.
COMPREHENSIONS = (nodes.ListComp, nodes.GeneratorExp)

DTYPE_CONSTANTS: Dict[str, str] = {
    "torch.float16": FP16,
    "torch.half": FP16,
    "torch.bfloat16": BF16,
    "torch.float32": FP32,
    "torch.float": FP32,
    "torch.float64": FP32,
    "torch.double": FP32,
    "torch.int64": INT,
    "torch.long": INT,
    "torch.int32": INT,
    "torch.int": INT,
    "torch.int16": INT,
    "torch.int8": INT,
    "torch.uint8": INT,
    "torch.bool": INT,
    "torch.short": INT,
}
TENSOR_TYPES: Dict[str, str] = {
    "HalfTensor": FP16,
    "BFloat16Tensor": BF16,
    "FloatTensor": FP32,
    "DoubleTensor": FP32,
    "LongTensor": INT,
    "IntTensor": INT,
    "BoolTensor": INT,
    "ByteTensor": INT,
}
#: ``torch.float16`` spelled as a string (``x.type("torch.cuda.HalfTensor")``), less prefixes.
DTYPE_STRINGS: Dict[str, str] = {"float16": FP16, "half": FP16, "bfloat16": BF16, "float32": FP32}
CAST_METHODS: Dict[str, str] = {
    "half": FP16,
    "bfloat16": BF16,
    "float": FP32,
    "double": FP32,
    "long": INT,
    "int": INT,
    "bool": INT,
    "short": INT,
    "byte": INT,
    "char": INT,
}
#: Methods and torch functions whose result has their (first) input's dtype.
PRESERVING: FrozenSet[str] = frozenset(
    """view view_as reshape reshape_as transpose permute contiguous detach clone abs neg
    squeeze unsqueeze flatten unflatten expand expand_as repeat repeat_interleave t narrow
    select index_select gather masked_fill masked_fill_ where flip roll chunk split
    relu gelu silu elu leaky_relu selu celu mish hardtanh relu6 hardswish tanh sigmoid
    clamp clamp_ clip sqrt square sin cos dropout pad
    cuda cpu pin_memory requires_grad_ add add_ sub sub_ mul mul_ div div_ maximum minimum
    max min amax amin cat stack concat mean var std nanmean median logsumexp interpolate
    avg_pool1d avg_pool2d avg_pool3d max_pool1d max_pool2d max_pool3d adaptive_avg_pool1d
    adaptive_avg_pool2d adaptive_avg_pool3d adaptive_max_pool2d pixel_shuffle Parameter
    clamp_min clamp_max clamp_min_ clamp_max_ logsigmoid hardsigmoid softsign tanhshrink glu
    nan_to_num triu tril diagonal movedim swapaxes unbind tensor_split split_with_sizes hsplit
    vsplit dsplit diag diag_embed diagflat take_along_dim new_zeros new_ones new_empty new_full
    scatter scatter_ scatter_add scatter_add_ index_fill index_fill_ logcumsumexp logaddexp
    logaddexp2 lerp erf erfc sign sgn floor ceil trunc frac hypot fmod remainder digamma lgamma
    unfold fold
    polygamma""".split()
)
#: CUDA autocast runs these in fp32 (PyTorch AMP docs, "CUDA Ops that can autocast to float32").
CUDA_FP32_OPS: FrozenSet[str] = frozenset(
    """__pow__ __rdiv__ __rpow__ __rtruediv__ acos asin binary_cross_entropy_with_logits cosh
    cosine_embedding_loss cdist cosine_similarity cross_entropy cumprod cumsum dist erfinv exp
    expm1 group_norm hinge_embedding_loss kl_div l1_loss layer_norm log log_softmax log10 log1p
    log2 margin_ranking_loss mse_loss multilabel_margin_loss multi_margin_loss nll_loss norm
    normalize pdist poisson_nll_loss pow prod reciprocal rsqrt sinh smooth_l1_loss
    soft_margin_loss softmax softmin softplus sum renorm tan triplet_margin_loss""".split()
)
#: CPU autocast's fp32 list (the ops of it that appear in training code; reductions other
#: than ``prod`` and the exp/log/softmax family stay in low precision on CPU).
CPU_FP32_OPS: FrozenSet[str] = frozenset(
    """prod binary_cross_entropy binary_cross_entropy_with_logits mse_loss cross_entropy nll_loss
    nll_loss2d l1_loss smooth_l1_loss huber_loss kl_div margin_ranking_loss soft_margin_loss
    hinge_embedding_loss cosine_embedding_loss triplet_margin_loss multi_margin_loss
    multilabel_margin_loss poisson_nll_loss ctc_loss cdist quantile nanquantile trace""".split()
)
#: Autocast runs these in the region's low-precision dtype (both devices).
LOW_PRECISION_OPS: FrozenSet[str] = frozenset(
    """matmul __matmul__ mm bmm addmm addbmm baddbmm addmv addr mv linear bilinear einsum
    conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d prelu
    scaled_dot_product_attention chain_matmul multi_dot""".split()
)
#: ``nn`` modules whose forward is one of the ops above.
LOW_PRECISION_MODULES: FrozenSet[str] = frozenset(
    "torch.nn." + name
    for name in """Linear Bilinear LazyLinear Conv1d Conv2d Conv3d
    ConvTranspose1d ConvTranspose2d ConvTranspose3d""".split()
)
#: ``nn`` modules whose forward is one op of autocast's lists: their call is that op.
MODULE_OPS: Dict[str, str] = {
    **{qualname: "linear" for qualname in LOW_PRECISION_MODULES},
    "torch.nn.PReLU": "prelu",
    "torch.nn.LayerNorm": "layer_norm",
    "torch.nn.GroupNorm": "group_norm",
    "torch.nn.Softmax": "softmax",
    "torch.nn.LogSoftmax": "log_softmax",
    "torch.nn.Softmin": "softmin",
    "torch.nn.Softplus": "softplus",
    "torch.nn.CosineSimilarity": "cosine_similarity",
}
#: ``nn`` modules whose output has their input's dtype (on no autocast list; batch norm
#: takes fp16 input beside fp32 weights and returns fp16).
PRESERVING_MODULES: FrozenSet[str] = frozenset(
    "torch.nn." + name
    for name in """ReLU ReLU6 LeakyReLU ELU SELU CELU GELU SiLU Mish Tanh Sigmoid Hardtanh
    Hardswish Hardsigmoid Dropout Dropout1d Dropout2d Dropout3d AlphaDropout Identity Flatten
    Unflatten BatchNorm1d BatchNorm2d BatchNorm3d SyncBatchNorm InstanceNorm1d InstanceNorm2d
    InstanceNorm3d MaxPool1d MaxPool2d MaxPool3d AvgPool1d AvgPool2d AvgPool3d
    AdaptiveAvgPool1d AdaptiveAvgPool2d AdaptiveAvgPool3d AdaptiveMaxPool1d AdaptiveMaxPool2d
    AdaptiveMaxPool3d Upsample PixelShuffle""".split()
)
#: Tensor attributes of their tensor's dtype (views, the data, the gradient).
SAME_DTYPE_ATTRIBUTES = frozenset({"T", "mT", "H", "mH", "data", "grad"})
#: How many module forwards (and functions) deep a call's output is followed.
_MAX_FRAMES = 4
#: Methods converting to the dtype named by (or of) their argument.
CONVERSIONS = frozenset({"to", "type", "type_as"})
#: Ops returning ``(values, indices)``: values keep the input's dtype.
VALUES_AND_INDICES: FrozenSet[str] = frozenset(
    "topk max min sort kthvalue mode median nanmedian cummax cummin".split()
)
#: The fields of their results, by the index unpacking takes.
RESULT_FIELDS: Dict[str, int] = {"values": 0, "indices": 1}
#: Ops returning tensors of different dtypes (a mantissa and an int exponent, values and
#: counts or pivots).
MIXED_RESULTS: FrozenSet[str] = frozenset(
    "frexp unique unique_consecutive histogram histogramdd lu lu_factor lu_unpack eig eigh slogdet"
    .split()
)
#: Builtins and tensor methods returning Python numbers, which take a tensor's dtype.
NUMBER_BUILTINS = frozenset({"len", "float", "int", "round"})
NUMBER_METHODS = frozenset({"item", "size", "numel", "dim"})
#: Annotations of a class's fields that declare Python numbers.
NUMBER_ANNOTATIONS = frozenset({"float", "int", "bool", "Optional[float]", "Optional[int]"})
_ARITHMETIC = frozenset({"+", "-", "*", "/"})
_MAX_DEPTH = 32
#: A followed call's parameters take its arguments.
FROM_CALL = object()
#: :meth:`Dtypes._in_frames` keeps the receiver it runs with.
KEEP_RECEIVER = object()


def is_low(kind: Optional[str]) -> bool:
    return kind in LOW_KINDS


def autocast_fp32_op(op: str, region: Region) -> bool:
    """Autocast in ``region`` runs ``op`` in fp32 (device unknown: assume CUDA's list)."""
    return op in (CPU_FP32_OPS if region.device == CPU else CUDA_FP32_OPS)


class Dtypes:
    """Dtype queries for one module."""

    def __init__(self, context):
        self.context = context
        self.names = context.names
        self.regions = context.regions
        #: Kinds by (expression, frames followed).
        self._cache = CutCache()
        #: The functions being followed from a call (a module's ``forward``, a function of
        #: this module), each with the region its call runs in (autocast is dynamic, so
        #: their code runs in their caller's region unless it opens its own) and the call,
        #: which binds their parameters.
        #: Calls followed: ``(function, region, call, input)``, ``input`` the kind its first
        #: parameter takes when that is not the call's argument (an ``nn.Sequential``
        #: element is fed the one before it), else ``FROM_CALL``.
        self._frames: Tuple[Tuple[nodes.FunctionDef, Optional[Region], nodes.Call, object], ...]
        self._frames = ()
        #: The class of the object ``self`` is while a base class's method is read for a
        #: subclass's (``_TowerBase.forward`` calling ``self.encode`` for ``ConvImageTower``).
        self._receiver: Optional[nodes.ClassDef] = None

    def constant(self, expr: Optional[nodes.NodeNG]) -> Optional[str]:
        """The kind a dtype expression names (``torch.float16``, ``"torch.cuda.HalfTensor"``,
        a name bound to either) -> "fp16"; None if unknown."""
        if expr is None:
            return None
        if isinstance(expr, nodes.Const) and isinstance(expr.value, str):
            name = expr.value.removeprefix("torch.").removeprefix("cuda.")
            return DTYPE_STRINGS.get(name) or TENSOR_TYPES.get(name)
        qualname = self.names.qualname(expr) or ""
        if qualname in DTYPE_CONSTANTS:
            return DTYPE_CONSTANTS[qualname]
        if qualname.startswith("torch.") and last_part(qualname) in TENSOR_TYPES:
            return TENSOR_TYPES[last_part(qualname)]
        if isinstance(expr, nodes.Name) and not qualname:
            values = self.names.assigned_values(expr) or []
            if len(values) == 1 and isinstance(values[0], nodes.Const):
                return self.constant(values[0])
        return None

    def named_kind(self, expr: Optional[nodes.NodeNG], _depth: int = 0) -> Optional[str]:
        """The kind a dtype expression names: a constant (:meth:`constant`) or another
        tensor's ``.dtype`` (``x.to(h.dtype)``, ``torch.zeros(n, dtype=x.dtype)``)."""
        kind = self.constant(expr)
        if kind is None and isinstance(expr, nodes.Attribute) and expr.attrname == "dtype":
            return self._of(expr.expr, _depth)
        return kind

    def cast_target(self, call: nodes.Call, _depth: int = 0) -> Optional[str]:
        """The kind a conversion converts to: ``.half()``, ``.to(torch.float16)``, ``.to(device,
        dtype=HALF)``, ``.type("torch.cuda.HalfTensor")``, ``.to(other)`` / ``.type_as(other)``
        / ``.to(other.dtype)`` for a tensor of known dtype; None for moves (``.to(device)``)
        and other calls. The dtype flow passes its depth (``other``'s dtype is part of the
        query it is in)."""
        method, receiver = method_call(call)
        if receiver is None:
            return None
        if method in CAST_METHODS:
            return CAST_METHODS[method] if not call.args and not call.keywords else None
        if method not in CONVERSIONS:
            return None
        if method == "type_as":
            return self._of(call.args[0], _depth) if len(call.args) == 1 else None
        dtype = keyword_value(call, "dtype") or keyword_value(call, "dst_type")
        if dtype is not None:
            return self.named_kind(dtype, _depth)
        for arg in call.args:
            if method == "to" and isinstance(arg, nodes.Const):
                continue  # strings given to ``.to`` are devices
            kind = self.named_kind(arg, _depth)
            if kind is None and method == "to" and not _is_device(arg):
                kind = self._of(arg, _depth)  # ``x.to(other)``: other's dtype (and device)
            if kind is not None:
                return kind
        return None

    def module_kind_at(
        self, module: nodes.NodeNG, node: nodes.NodeNG
    ) -> Tuple[Optional[str], Optional[nodes.NodeNG]]:
        """``(kind, what decided it)`` for the parameters of ``module`` (a module expression,
        possibly a chain: ``model.head``, ``enc.get_input_embeddings()``) when ``node`` runs:
        the last cast before ``node`` in its function of ``module`` or of a module it is
        part of (modules cast in place: ``model.half()`` casts ``model.head``; a later
        ``model.float()`` undoes it; one behind a flag, ``if args.fp16: model.half()``,
        counts: kinds describe the run with that mode on), else the kind of the first of
        them whose dtype is known (``model = Net().half()``, ``self.model`` after
        ``self.model = m.half()``; for a name, the value it is bound to decided)."""
        parts = _module_parts(module)
        texts = {part.as_string() for part in parts}
        decided: Tuple[Optional[str], Optional[nodes.NodeNG]] = (None, None)
        for call in calls_in_order(code_frame(node)):
            if call is node:
                break
            receiver = method_call(call)[1]
            if receiver is not None and receiver.as_string() in texts:
                kind = self.cast_target(call)
                if kind is not None:
                    decided = (kind, call)
        if decided[1] is not None:
            return decided
        for part in parts:
            kind = self.of(part)
            if kind is not None:
                return kind, self._bound_value(part)
        return None, None

    def _bound_value(self, expr: nodes.NodeNG) -> Optional[nodes.NodeNG]:
        """The one value assigned to the name ``expr`` that reaches it, if so."""
        if not isinstance(expr, nodes.Name):
            return None
        values = [assigned_value(binding) for binding in self.names.earlier_bindings(expr)]
        return values[0] if len(values) == 1 else None

    def of(self, expr: nodes.NodeNG) -> Optional[str]:
        """The dtype kind of ``expr``'s value, or None when it is not known."""
        return self._of(expr, 0)

    def kinds(self, expr: nodes.NodeNG) -> Optional[FrozenSet[str]]:
        """Every kind ``expr`` may have when :meth:`of` cannot name one: a name bound on
        different paths (``q = q.float()``, then ``q = q.bfloat16()`` under an ``if``) or a
        conditional expression; None when some alternative is unknown."""
        kind = self.of(expr)
        if kind is not None:
            return frozenset({kind})
        if isinstance(expr, nodes.IfExp):
            alternatives = [self.of(expr.body), self.of(expr.orelse)]
        elif isinstance(expr, nodes.Name):
            alternatives = [
                self._binding_kind(binding, 0) for binding in self.names.earlier_bindings(expr)
            ]
        else:
            return None
        if not alternatives or None in alternatives:
            return None
        return frozenset(alternatives)

    def _of(self, expr: nodes.NodeNG, depth: int) -> Optional[str]:
        """:meth:`of` at ``depth``: a cycle or the depth limit makes an answer unknown, kept
        only for the outermost query (:class:`CutCache`)."""
        if self._too_deep(depth):
            return None
        # cycles through re-assignments or calls, cut as in :class:`CutCache`
        return self._cache.answer(
            (expr, self._frames, self._receiver), lambda: self._compute(expr, depth + 1))

    def _too_deep(self, depth: int) -> bool:
        """``depth`` is past the limit: the query is cut there (and counted as cut)."""
        if depth > _MAX_DEPTH:
            self._cache.cut()
            return True
        return False

    def region_at(self, node: nodes.NodeNG) -> Optional[Region]:
        """The active autocast region at ``node`` for the dtype flow: in a function followed
        from a call, its own region or else its caller's; elsewhere the region the module's
        call sites with gradients on run it in with mixed precision on (the training run: a
        function also called from ``no_grad`` evaluation, or from an fp32 branch of ``if
        use_amp:``, outside autocast still runs under autocast when it trains with it)."""
        frame = code_frame(node)
        for function, caller_region, _, _ in reversed(self._frames):
            if function is frame:
                found, region = self.regions.local_region(node)
                region = region if found else caller_region
                return region if region is not None and region.active else None
        return self.regions.training_region(node)

    def _autocast_known_off(self, node: nodes.NodeNG) -> bool:
        """No caller can have autocast on at ``node``: module-level code, code followed from a
        call outside regions, or a function whose every call in the module is inside an
        ``enabled=False`` island or itself in code known to be off -- up to code with no
        caller here, which someone elsewhere (a framework's ``training_step``) may run under
        autocast."""
        frame = code_frame(node)
        if any(entry[0] is frame for entry in self._frames):
            return True
        return self.regions.every_caller(frame, self._off_at, at_top=True)

    def _off_at(self, call: nodes.Call) -> Optional[bool]:
        """Autocast is off at ``call`` (in an ``enabled=False`` island), on (in an active
        region, of whatever dtype), or as in the code the call is in (None)."""
        region = self.regions.region_at(call)
        return None if region is None else not region.active

    def _followed(
        self, function: nodes.FunctionDef, call: nodes.Call, depth: int,
        element: Union[int, str] = -1, first_input: object = FROM_CALL,
    ) -> Optional[str]:
        """The kind ``function`` returns when ``call`` runs it (a module's ``forward``, a
        function of this module), in the region ``call`` runs in -- or, with ``element``, the
        kind of that element of what it returns (``out, hs = decode(h)``; also through a
        returned call, ``return self.head(x)`` of a head returning ``logits, z``); None if
        unknown, for recursion, or beyond :data:`_MAX_FRAMES` calls deep; with a field name,
        that field of the record it returns (:meth:`_field`). ``first_input``:
        the kind the first parameter takes instead of ``call``'s argument."""
        returns = returned_values(function)
        if not returns or len(self._frames) >= _MAX_FRAMES:
            return None
        if any(entry[0] is function for entry in self._frames):
            return None
        region = self.region_at(call)
        saved = self._frames
        self._frames = saved + ((function, region, call, first_input),)
        try:
            kinds = {self._returned(value, element, depth) for value in returns}
        finally:
            self._frames = saved
        return kinds.pop() if len(kinds) == 1 else None

    def _returned(self, value: nodes.NodeNG, element: Union[int, str], depth: int) -> Optional[str]:
        """The kind of a returned ``value``, of its element ``element`` (an index), or of
        its field (a name)."""
        if isinstance(element, str):
            return self._field(value, element, depth)
        return self._of(value, depth) if element < 0 else self._element(value, element, depth)

    def _forward_called(self, call: nodes.Call) -> Optional[nodes.FunctionDef]:
        """The ``forward`` (or ``__call__``) that calling an object of a class of this module
        runs: ``self(x)`` in a method of the class, ``model(x)`` for ``model = Net()``."""
        owner = enclosing_class(call) if is_self(call.func) else self.names.local_class(call.func)
        return self.names.call_method(owner) if owner is not None else None

    def _module_call(self, call: nodes.Call, depth: int) -> Optional[str]:
        """``module(x)`` for a module whose construction is known (:meth:`Names.constructions`):
        a class of this module runs its ``forward``; an ``nn`` module its op
        (:data:`MODULE_OPS`, :data:`PRESERVING_MODULES`); ``nn.Sequential`` its elements in
        turn. Every possible construction must agree."""
        built = self.names.constructions(call.func)
        if not built:
            return None
        first = call.args[0] if call.args and not isinstance(call.args[0], nodes.Starred) else None
        kinds = set()
        for construction in built:
            kinds.add(self._module_output(construction, call, first, depth))
            if None in kinds or len(kinds) > 1:
                return None
        return kinds.pop() if kinds else None

    def _module_output(
        self,
        construction: nodes.NodeNG,
        call: nodes.Call,
        first: Optional[nodes.NodeNG],
        depth: int,
        input_kind: Optional[str] = None,
        from_input: bool = True,
    ) -> Optional[str]:
        """The output kind of the module ``construction`` built, called at ``call``: its input
        is ``first`` or (inside an ``nn.Sequential``, ``from_input`` False) of ``input_kind``."""
        if self._too_deep(depth):
            return None
        if from_input:
            input_kind = self._of(first, depth) if first is not None else None
        classdef = self.names.construction_class(construction)
        if classdef is not None:
            forward = self.names.call_method(classdef)
            if forward is None:
                return None
            # inside an ``nn.Sequential`` its input is the previous element's output
            fed = FROM_CALL if from_input else (input_kind,)
            return self._followed(forward, call, depth, first_input=fed)
        qualname = self.names.class_qualname(construction.func) or ""
        if qualname in MODULE_OPS:
            return self._autocast_output(call, MODULE_OPS[qualname], input_kind)
        if qualname in PRESERVING_MODULES:
            return input_kind
        if qualname != "torch.nn.Sequential":
            return None
        items = self.names.container_items(construction)
        if not items:
            return None
        if not any(isinstance(argument, nodes.Starred) for argument in construction.args):
            kind = input_kind  # the elements in order, each fed the previous one's output
            for item in items:
                kind = self._element_output(item, call, depth, kind)
            return kind
        # Elements put into a list in an order the code does not show. The last one may be
        # known (``nn.Sequential(*blocks, head)``, a head appended after the loop) and
        # produce one kind whatever its input; else each either keeps its input's dtype
        # or produces one kind whatever its input, and one must produce it.
        last = construction.args[-1]
        last = self.names.last_item(last.value) if isinstance(last, nodes.Starred) else last
        # (not a class of the file: its forward may read its input)
        if last is not None and not self.names.local_classes(last) - {None}:
            kind = self._element_output(last, call, depth, None)
            if kind is not None:
                return kind
        produced = set()
        for item in items:
            for element in self.names.constructions(item) or [None]:
                if element is None:
                    return None
                if self.names.class_qualname(getattr(element, "func", None)) in PRESERVING_MODULES:
                    continue
                produced.add(self._module_output(element, call, None, depth + 1, None, False))
        return produced.pop() if len(produced) == 1 else None

    def _element_output(
        self, item: nodes.NodeNG, call: nodes.Call, depth: int, input_kind: Optional[str]
    ) -> Optional[str]:
        built = self.names.constructions(item)
        if not built:
            return None
        kinds = {
            self._module_output(element, call, None, depth + 1, input_kind, False)
            for element in built
        }
        return kinds.pop() if len(kinds) == 1 else None

    def _compute(self, expr: nodes.NodeNG, depth: int) -> Optional[str]:
        if isinstance(expr, nodes.AssignName):
            return self._binding_kind(expr, depth)
        if isinstance(expr, nodes.Name):
            return self._name(expr, depth)
        if isinstance(expr, nodes.Call):
            return self._call(expr, depth)
        if isinstance(expr, nodes.BinOp):
            return self._binop(expr, depth)
        if isinstance(expr, nodes.UnaryOp) and expr.op == "-":
            return self._of(expr.operand, depth)
        if isinstance(expr, nodes.Subscript):
            return self._of(expr.value, depth)
        if isinstance(expr, nodes.Attribute) and expr.attrname in SAME_DTYPE_ATTRIBUTES:
            return self._of(expr.expr, depth)
        if isinstance(expr, nodes.Attribute) and expr.attrname in RESULT_FIELDS:
            # ``x.max(dim=2).values``: the named fields of ``(values, indices)`` results
            if self.op_name(expr.expr) in VALUES_AND_INDICES:
                return self._element(expr.expr, RESULT_FIELDS[expr.attrname], depth)
        if (
            isinstance(expr, nodes.Attribute)
            and expr.attrname in self.names.record_field_names
            and not is_self(expr.expr)
        ):
            return self._field(expr.expr, expr.attrname, depth)
        if isinstance(expr, nodes.Attribute) and is_self(expr.expr):
            # ``self.model`` after ``self.model = model.half()``: every method must agree. In
            # ``self.queue = F.normalize(self.queue)`` the right-hand ``self.queue`` is the
            # earlier value, as for names.
            statement = expr.statement()
            kinds = {
                self._of(value, depth)
                for value in self.names.self_attribute_values(expr)
                if value is None or value.statement() is not statement
            }
            return kinds.pop() if len(kinds) == 1 else None
        if isinstance(expr, nodes.IfExp):
            kinds = {self._of(expr.body, depth), self._of(expr.orelse, depth)}
            return kinds.pop() if len(kinds) == 1 else None
        if isinstance(expr, nodes.Dict):
            return self._dict_kind(expr, depth)
        if isinstance(expr, nodes.DictComp):  # ``{name: head(x) for name, head in ...}``
            return self._of(expr.value, depth)
        if isinstance(expr, nodes.Compare):
            return INT  # a mask (``fg = prob > 0.5``), bool: the other operand's dtype wins
        if isinstance(expr, (nodes.List, nodes.Tuple)) and not expr.elts:
            return self._filled(expr, depth)
        if isinstance(expr, (nodes.List, nodes.Tuple, nodes.ListComp)):
            # the one kind of its tensors, as for a dict (``return outs + [p6, p7]``)
            return self._tensors(expr, depth)
        return None

    def _filled(self, empty: nodes.NodeNG, depth: int) -> Optional[str]:
        """The one kind of what a function appends to the empty list it binds to a name
        (``fmap = []`` ... ``fmap.append(x)``, also ``scores, fmaps = [], []``)."""
        target = literal_target(empty)
        if not isinstance(target, nodes.AssignName):
            return None
        items = self.names.list_items(target)
        return self._agreeing(items, depth) if items else None

    def _dict_kind(self, expr: nodes.Dict, depth: int) -> Optional[str]:
        """The one kind of the tensors a dict holds (a model's outputs): its literal values
        and, for one bound to a name, what its function stores into it (``out = {}``, then
        ``out[t] = head(f)``); what ``d["depth"]`` gives when they agree."""
        return self._agreeing([value for _, value in self.names.dict_entries(expr)], depth)

    def _agreeing(self, values: Sequence[nodes.NodeNG], depth: int) -> Optional[str]:
        """The one kind of ``values``; one that is unknown only because it depends on the
        value being computed (a cycle: ``x = stage(x)`` in a loop, ``out["seg"] =
        mask(out["seg"])``) takes the kind the others give."""
        kinds = set()
        cache = self._cache
        for value in values:
            cycles, cuts = cache.cycles, cache.cuts
            kind = self._of(value, depth)
            only_cycles = cache.cuts - cuts == cache.cycles - cycles
            if kind is None and cache.cycles > cycles and only_cycles:
                continue
            if kind is None:
                return None
            kinds.add(kind)
        return kinds.pop() if len(kinds) == 1 else None

    def _tensors(self, expr: nodes.NodeNG, depth: int) -> Optional[str]:
        """The one kind of the tensors in the sequence ``torch.cat``/``torch.stack`` take
        (``[a, b]``, ``[layer(x) for layer in self.layers]``, a list filled by appends);
        None if they differ."""
        if isinstance(expr, (nodes.List, nodes.Tuple)) and expr.elts:
            kinds = {self._of(element, depth) for element in expr.elts}
            return kinds.pop() if len(kinds) == 1 else None
        if isinstance(expr, (nodes.ListComp, nodes.GeneratorExp)):
            return self._of(expr.elt, depth)
        if isinstance(expr, nodes.Name):
            values = [assigned_value(b) for b in self.names.earlier_bindings(expr)]
            if values and all(isinstance(v, COMPREHENSIONS) for v in values):
                # ``outs = [conv(x) for ...]`` where it is read (``outs = [o + y for o in outs]``
                # after it holds other elements)
                if self.names.stored_into(expr):
                    return None  # ``outs[i] = outs[i].float()``: elements of other kinds
                kinds = {self._of(value.elt, depth) for value in values}
                return kinds.pop() if len(kinds) == 1 else None
            items = self.names.list_items(expr)  # ``heads = []``, ``heads.append(head)``
            if items:
                kinds = {self._of(item, depth) for item in items}
                return kinds.pop() if len(kinds) == 1 else None
        return self._of(expr, depth)

    def _name(self, name: nodes.Name, depth: int) -> Optional[str]:
        """The one kind of the bindings that reach ``name`` (cached like expressions, so a
        value carried round a loop is seen as a cycle, see :meth:`_agreeing`)."""
        bindings = self.names.earlier_bindings(name)
        return self._agreeing(self._after_layer_loops(name, bindings), depth)

    def _after_layer_loops(self, name: nodes.Name, bindings: List[nodes.NodeNG]
                           ) -> List[nodes.NodeNG]:
        """``bindings`` less those a loop over a model's layers replaces before ``name``: in
        ``h = obs`` / ``for layer in self.layers: h = act(layer(h))`` the loop runs at least
        once, so ``h`` after it is the layers' output, whatever ``obs`` was."""
        loops = [loop for loop in map(self._layer_loop, bindings) if loop is not None
                 and not loop.parent_of(name)]
        if not loops:
            return bindings
        return [b for b in bindings if not any(
            b.statement().lineno < loop.lineno and b.scope() is loop.scope()
            and not loop.parent_of(b) for loop in loops)]

    def _layer_loop(self, binding: nodes.NodeNG) -> Optional[nodes.For]:
        """The ``for`` over a module container (``self.layers``) whose body assigns
        ``binding`` unconditionally, if any."""
        statement = binding.statement()
        loop = statement.parent
        if not isinstance(loop, nodes.For) or statement not in loop.body or conditional_in(
                loop, loop.scope()):
            return None
        targets = loop.target.elts if isinstance(loop.target, nodes.Tuple) else [loop.target]
        iterables = [self.names.iterated(t) for t in targets if isinstance(t, nodes.AssignName)]
        iterable = next((it for it in iterables if is_self(getattr(it, "expr", None))), None)
        containers = self.names.constructions(iterable) if iterable is not None else None
        if not containers or not all(
                self.names.class_qualname(getattr(c, "func", None)) in MODULE_CONTAINERS
                for c in containers):
            return None
        return loop

    def _binding_kind(self, binding: nodes.NodeNG, depth: int) -> Optional[str]:
        """The kind of what ``binding`` binds: an assigned value, an unpacked element, or for
        ``x += y`` the kind ``x`` had (an in-place op writes into the tensor, keeping its
        dtype: ``dist = -2 * q @ k.T; dist += q.pow(2).sum(-1)`` stays low precision)."""
        value = assigned_value(binding)
        if value is not None:
            return self._of(value, depth)
        if isinstance(binding.parent, nodes.AugAssign) and binding.parent.target is binding:
            return self._before_augmented(binding, depth)
        if isinstance(binding.parent, nodes.Arguments):
            return self._parameter_kind(binding, depth)
        return self._unpacked(binding, depth)

    def _parameter_kind(
        self, parameter: nodes.AssignName, depth: int, element: Union[int, str] = -1
    ) -> Optional[str]:
        """What the call passes, in a function followed from a call; elsewhere the one kind
        every call site of the function in this module passes (``self.mbstd(out)`` with
        ``out`` fp16 makes ``x`` fp16 in ``MinibatchStdDev.forward``). With ``element``, the
        kind of that element of what is passed (``x_s, x_f = x`` for ``fuse([x_s, x_f])``),
        or of that field of the record passed (``outputs.pred_logits`` in a matcher handed the
        model's outputs)."""
        arguments = parameter.parent
        function = arguments.parent
        if not isinstance(function, nodes.FunctionDef):
            return None
        for index in range(len(self._frames) - 1, -1, -1):
            followed, _, call, first_input = self._frames[index]
            if followed is function:
                if first_input is not FROM_CALL and arguments.args[1:2] == [parameter]:
                    return first_input[0] if element == -1 else None
                argument = argument_for(call, arguments, parameter.name)
                return self._in_frames(self._frames[:index], argument, depth, element)
        kinds = set()
        forward = function.name == "forward" and isinstance(function.parent, nodes.ClassDef)
        for site in self._training_sites(function):
            if forward and element == -1 and not self.names.may_run(site.func, function):
                # an element of an ``nn.Sequential`` called at ``site``: fed by the one before
                kinds.add(self._sequence_input(site, function, arguments, parameter, depth))
            else:
                argument = argument_for(site, arguments, parameter.name)
                receiver = self._receiver_at(site, function)
                kinds.add(self._in_frames(self._frames, argument, depth, element, receiver))
            if None in kinds:
                return None
        return kinds.pop() if len(kinds) == 1 else None

    def _training_sites(self, function: nodes.FunctionDef) -> List[nodes.Call]:
        """The calls of ``function`` in the module, judged as the training run: those with
        gradients on, where there are any (``decoder(z, edges)`` in the training loop, not
        in a ``no_grad`` evaluation that feeds it fp32 outside autocast)."""
        return self.regions.gradient_sites(function) or self.regions.call_sites(function)

    def _sequence_input(
        self, site: nodes.Call, forward: nodes.FunctionDef, arguments: nodes.Arguments,
        parameter: nodes.AssignName, depth: int,
    ) -> Optional[str]:
        """The kind an element running ``forward`` of the ``nn.Sequential`` called at ``site``
        gets as its input (``parameter``, the first after ``self``): the output of the
        elements before it, fed the call's input (``nn.Sequential(nn.Conv2d(...),
        LayerNorm2d(c))`` feeds the norm the convolution's output); where it is held more
        than once, every place must agree."""
        if arguments.args[1:2] != [parameter] or len(site.args) != 1:
            return None
        kinds = set()
        for construction in self.names.constructions(site.func) or ():
            items = self.names.container_items(construction)
            if items is None and self._torch_layer(construction):
                continue  # the other arm of ``Sequential(conv, norm) if ... else nn.Identity()``
            if items is None:
                return None
            kind = self._in_frames(self._frames, site.args[0], depth)
            for item in items:
                if self.names.may_run(item, forward):
                    kinds.add(kind)
                kind = self._element_output(item, site, depth, kind)
        return kinds.pop() if len(kinds) == 1 else None

    def _torch_layer(self, construction: nodes.NodeNG) -> bool:
        """A ``torch.nn`` module that holds no other (``nn.Identity()``, ``nn.Conv2d(...)``)."""
        qualname = self.names.class_qualname(getattr(construction, "func", None)) or ""
        return qualname.startswith("torch.nn.") and qualname not in MODULE_CONTAINERS

    def _receiver_at(self, site: nodes.Call, method: nodes.FunctionDef) -> Optional[nodes.ClassDef]:
        """The class ``self`` is at ``site``, a ``self.<m>(...)`` call in a base class's method
        that runs ``method`` of a subclass: the subclass (``_TowerBase.forward`` calling
        ``self._pool(h, x)`` runs ``ConvImageTower._pool``, and its ``self.encode(x)`` is
        ``ConvImageTower.encode``); the receiver already known while ``site`` is in a method
        of its classes; else None."""
        owner, caller = method.parent, enclosing_class(site)
        if caller is None:
            return None
        if (
            isinstance(owner, nodes.ClassDef)
            and caller is not owner
            and isinstance(site.func, nodes.Attribute)
            and is_self(site.func.expr)
            and caller in (self.names.class_mro(owner) or ())
        ):
            return owner
        receiver = self._receiver
        if receiver is not None and caller in (self.names.class_mro(receiver) or ()):
            return receiver
        return None

    def _in_frames(
        self, frames: tuple, expr: Optional[nodes.NodeNG], depth: int,
        element: Union[int, str] = -1, receiver: object = KEEP_RECEIVER,
    ) -> Optional[str]:
        """The kind of ``expr`` (or of its element or field ``element``) evaluated with
        ``frames`` followed (its caller's view), ``self`` an object of ``receiver`` where
        given (:meth:`_receiver_at`)."""
        if expr is None:
            return None
        saved = self._frames, self._receiver
        self._frames = frames
        if receiver is not KEEP_RECEIVER:
            self._receiver = receiver
        try:
            return self._returned(expr, element, depth)
        finally:
            self._frames, self._receiver = saved

    def _before_augmented(self, binding: nodes.AssignName, depth: int) -> Optional[str]:
        """The one kind of the plain assignments of ``binding``'s name earlier in its scope."""
        position = (binding.lineno or 0, binding.col_offset or 0)
        kinds = {
            self._binding_kind(earlier, depth)
            for earlier in binding.scope().locals.get(binding.name, ())
            if (earlier.lineno or 0, earlier.col_offset or 0) < position
            and not isinstance(earlier.parent, nodes.AugAssign)
        }
        return kinds.pop() if len(kinds) == 1 else None

    def _unpacked(self, binding: nodes.NodeNG, depth: int) -> Optional[str]:
        """The kind of the element ``binding`` takes in an unpacking assignment or loop."""
        unpacked = unpacked_value(binding)
        if unpacked is not None:
            return self._element(*unpacked, depth)
        sequence = self.names.iterated(binding)
        return self._tensors(sequence, depth) if sequence is not None else None

    def _element(self, value: nodes.NodeNG, index: int, depth: int) -> Optional[str]:
        """The kind of element ``index`` of ``value`` unpacked: ``a, b = x.half(), y`` (the
        element), ``top, idx = x.topk(k)`` (x's dtype, ints), ``out, hs = decode(h)`` of a
        function of this module (that element of its return), or an element of a sequence of
        tensors of one kind (``q, k = self.qkv(x).chunk(2)``, ``f1, f2 = self.fnet([a, b])``
        whose ``forward`` returns ``torch.split(x, n)``)."""
        if isinstance(value, (nodes.Tuple, nodes.List)):
            if index >= len(value.elts) or any(isinstance(e, nodes.Starred) for e in value.elts):
                return None
            return self._of(value.elts[index], depth)
        if isinstance(value, nodes.Name):
            bindings = self.names.earlier_bindings(value)
            if len(bindings) == 1 and isinstance(bindings[0].parent, nodes.Arguments):
                return self._parameter_kind(bindings[0], depth, element=index)
        if not isinstance(value, nodes.Call):
            return self._of(value, depth)
        fields = self.names.record_fields(value.func)
        if fields is not None:  # ``logits, value, h = agent(obs)`` of a namedtuple's fields
            return self._field(value, fields[index], depth) if index < len(fields) else None
        function = self.names.local_function(value) or self._forward_called(value)
        if function is not None:
            element = self._followed(function, value, depth, element=index)
            if element is not None:
                return element
        name = self.op_name(value)
        if name in VALUES_AND_INDICES:
            source = self._op_input(value)
            if index >= 2 or source is None:
                return None
            return INT if index == 1 else self._of(source, depth)
        if name in MIXED_RESULTS or any(
            (kw.arg or "").startswith("return_") for kw in value.keywords or ()
        ):
            return None  # ``out, idx = F.max_pool2d(x, 2, return_indices=True)``
        return self._of(value, depth)

    def _op_input(self, call: nodes.Call) -> Optional[nodes.NodeNG]:
        """The tensor an op runs on: ``x`` of ``x.sort()`` and of ``torch.sort(x)``."""
        method, receiver = method_call(call)
        callee = self.names.callee(call)
        if method and not (callee is not None and callee.qualname.startswith("torch.")):
            return receiver
        return call.args[0] if call.args else None

    def op_name(self, call: nodes.NodeNG) -> Optional[str]:
        """``max`` for ``x.max(1)`` and ``torch.max(x, 1)``; None for other expressions."""
        if not isinstance(call, nodes.Call):
            return None
        method = method_call(call)[0]
        callee = self.names.callee(call) if method is None else None
        return method or (callee.name if callee is not None else None)

    def _field(self, value: nodes.NodeNG, field: str, depth: int) -> Optional[str]:
        """The kind of the field ``field`` of the record ``value`` holds: ``out.value`` for
        ``out = agent(obs)`` whose ``forward`` returns ``PolicyOutput(logits, value, h)`` (a
        record type of this module, :meth:`Names.record_fields`)."""
        if self._too_deep(depth):
            return None
        if isinstance(value, nodes.Name):
            kinds = set()
            for binding in self.names.earlier_bindings(value):
                if isinstance(binding.parent, nodes.Arguments):  # the record a caller passes
                    kinds.add(self._parameter_kind(binding, depth + 1, element=field))
                    continue
                assigned = literal_value(binding)  # also ``s1, s2 = net(a), net(b)``
                kinds.add(self._field(assigned, field, depth + 1) if assigned is not None else None)
            return kinds.pop() if len(kinds) == 1 else None
        if not isinstance(value, nodes.Call):
            return None
        fields = self.names.record_fields(value.func)
        if fields is not None:
            argument = named_argument(value, fields, field)
            return self._of(argument, depth) if argument is not None else None
        function = self.names.local_function(value) or self._forward_called(value)
        return self._followed(function, value, depth, element=field) if function else None

    def _binop(self, expr: nodes.BinOp, depth: int) -> Optional[str]:
        if expr.op == "@":
            return self._autocast_output(expr, "matmul", self._of(expr.left, depth))
        if expr.op == "**":
            # a base of unknown kind may be a Python number (``(C // heads) ** -0.5``)
            base = self._of(expr.left, depth)
            return self._autocast_output(expr, "pow", base) if base is not None else None
        if expr.op not in _ARITHMETIC:
            return None
        return self._promote(expr.left, expr.right, depth)

    def _promote(self, left: nodes.NodeNG, right: nodes.NodeNG, depth: int) -> Optional[str]:
        """Type promotion of a binary op: Python numbers take the tensor's dtype; fp32 wins
        over any other operand (taken to be a tensor of the same or a narrower dtype)."""
        if self.is_number(left):
            return self._of(right, depth)
        if self.is_number(right):
            return self._of(left, depth)
        kinds = {self._of(left, depth), self._of(right, depth)}
        if FP32 in kinds:
            return FP32
        if None in kinds:
            return None
        if len(kinds) == 1:
            return kinds.pop()
        if INT in kinds:
            return (kinds - {INT}).pop()
        return FP32 if kinds == {FP16, BF16} else None

    def is_number(self, expr: nodes.NodeNG, _depth: int = 8) -> bool:
        """A Python number (or 0-dim tensor of one): a literal, a name or ``self.<x>`` bound
        only to numbers, a parameter defaulting to one (``temperature=0.05``), sizes
        (``B, N, C = x.shape``, ``x.size(0)``, ``len()``), ``math.*``, arithmetic of these."""
        if _depth <= 0:
            return False
        if numeric_constant(expr, self.names) is not None:
            return True
        if isinstance(expr, nodes.Name):
            default = self.names.parameter_default(expr)
            if default is not None:
                return numeric_constant(default, self.names) is not None
            bindings = self.names.reaching_bindings(expr)
            return bool(bindings) and all(self._binds_number(b, _depth) for b in bindings)
        if isinstance(expr, nodes.Attribute):
            if self.parsed_arguments(expr.expr) or self._number_field(expr):
                return True
            values = self.names.bound_values(expr)
            return bool(values) and all(self.is_number(v, _depth - 1) for v in values)
        if isinstance(expr, nodes.Subscript):
            return _is_shape(expr.value)
        if isinstance(expr, nodes.BinOp):
            return self.is_number(expr.left, _depth - 1) and self.is_number(expr.right, _depth - 1)
        if isinstance(expr, nodes.Call):
            builtin = self.names.builtin_name(expr.func)
            if builtin is not None:
                return builtin in NUMBER_BUILTINS
            qualname = self.names.qualname(expr.func) or ""
            return qualname.startswith("math.") or method_call(expr)[0] in NUMBER_METHODS
        return False

    def _number_field(self, attribute: nodes.Attribute) -> bool:
        """``cfg.router_noise`` where ``cfg`` is an object of a class of this module that
        declares the field a number (``router_noise: float = 0.0`` in a config dataclass)."""
        owner = self.names.local_class(attribute.expr)
        if owner is None:
            return False
        for statement in owner.body:
            if (
                isinstance(statement, nodes.AnnAssign)
                and isinstance(statement.target, nodes.AssignName)
                and statement.target.name == attribute.attrname
            ):
                return statement.annotation.as_string() in NUMBER_ANNOTATIONS
        return False

    def parsed_arguments(self, expr: nodes.NodeNG, _depth: int = 4) -> bool:
        """``expr`` holds the namespace of parsed command-line arguments (``args =
        parser.parse_args()``, also as a parameter every call site in this module passes it
        to, or kept as ``self.args``): its attributes are Python values (numbers, strings,
        lists), never tensors; in arithmetic with a tensor, a Python number."""
        if _depth <= 0:
            return False
        if isinstance(expr, nodes.Subscript):  # ``args, unknown = parser.parse_known_args()``
            expr = expr.value
        if isinstance(expr, nodes.Call):
            return method_call(expr)[0] in ("parse_args", "parse_known_args")
        values: Optional[List[nodes.NodeNG]] = None
        if isinstance(expr, nodes.Name):
            values = self.names.held_values(expr)
        elif isinstance(expr, nodes.Attribute) and is_self(expr.expr):
            values = self.names.self_attribute_values(expr)
        return bool(values) and all(
            value is not None and self.parsed_arguments(value, _depth - 1) for value in values
        )

    def _binds_number(self, binding: nodes.NodeNG, depth: int) -> bool:
        value = assigned_value(binding)
        if value is not None:
            return self.is_number(value, depth - 1)
        unpacked = unpacked_value(binding)
        return unpacked is not None and _is_shape(unpacked[0])

    def _call(self, call: nodes.Call, depth: int) -> Optional[str]:
        # ``torch.zeros(n, dtype=...)``; ``from_pretrained(name, torch_dtype=...)`` loads in it
        given = keyword_value(call, "dtype") or keyword_value(call, "torch_dtype")
        explicit = self.named_kind(given, depth)
        if explicit is not None:
            return explicit
        func = call.func
        callee = self.names.callee(call)
        if callee is not None and callee.qualname.startswith("torch."):
            if callee.instance:
                return self._module_call(call, depth)
            return self._torch_function(call, callee, depth)
        function = self._dispatched(call, self.names.local_function(call))
        if function is not None and is_abstract(function):
            # ``self.encode(x)`` in a base class whose ``encode`` raises NotImplementedError:
            # what every subclass's ``encode`` returns, if they agree
            kinds = {self._followed(override, call, depth)
                     for override in self.names.overrides(function)}
            return kinds.pop() if len(kinds) == 1 else None
        if function is not None:
            # what a function of this module returns (``def build(): return Net().half()``)
            return self._followed(function, call, depth)
        if isinstance(func, nodes.Attribute) and callee is None:
            if self.names.constructions(func):
                return self._module_call(call, depth)  # ``self.norm(x)``: a module, not a method
            return self._method(call, func, depth)
        return self._module_call(call, depth)  # ``model(x)``, ``self.layers[-1](x)``

    def _dispatched(
        self, call: nodes.Call, function: Optional[nodes.FunctionDef]
    ) -> Optional[nodes.FunctionDef]:
        """The method ``self.<m>(...)`` runs on the receiver's object, where a base class's
        method is read for a subclass (:meth:`_parameter_kind`); else ``function``."""
        receiver, func = self._receiver, call.func
        if receiver is None or not isinstance(func, nodes.Attribute) or not is_self(func.expr):
            return function
        owner = enclosing_class(call)
        if owner is None or owner not in (self.names.class_mro(receiver) or ()):
            return function
        return self.names.method_of(receiver, func.attrname) or function

    def _torch_function(self, call: nodes.Call, callee: Callee, depth: int) -> Optional[str]:
        op = callee.name
        first = call.args[0] if call.args else None
        if op == "polygamma" and len(call.args) == 2:
            first = call.args[1]  # ``torch.polygamma(n, x)``
        if op in ("zeros", "ones", "empty", "rand", "randn", "linspace", "logspace", "eye", "full"):
            return FP32 if op != "full" else None
        if op.endswith("_like") and first is not None:
            return self._of(first, depth)
        if op in ("tensor", "as_tensor", "from_numpy"):
            return None
        if op in ("cat", "concat", "stack") and first is not None:
            return self._op(call, op, self._tensors(first, depth))
        if op == "where" and len(call.args) == 3 and not call.keywords:
            return self._promote(call.args[1], call.args[2], depth)  # not the condition's
        if op == "einsum":
            operands = call.args[1:]
            if len(operands) == 1 and isinstance(operands[0], (nodes.List, nodes.Tuple)):
                operands = operands[0].elts
            if len(operands) == 1 and not isinstance(operands[0], nodes.Starred):
                # one operand (``"nchpwq->nhwpqc"``): a permutation or sum, no matmul to cast
                return self._of(operands[0], depth)
        return self._op(call, op, self._of(first, depth) if first is not None else None)

    def _method(self, call: nodes.Call, func: nodes.Attribute, depth: int) -> Optional[str]:
        method = func.attrname
        if method in CAST_METHODS and not call.args:
            return CAST_METHODS[method]
        if method == "view" and len(call.args) == 1 and not call.keywords:
            reinterpreted = self.constant(call.args[0])  # ``x.view(torch.int32)``: the bits
            if reinterpreted is not None:
                return reinterpreted
        if method in CONVERSIONS:
            target = self.cast_target(call, depth)
            if target is None and method == "to" and all(_is_device(a) for a in call.args):
                return self._of(func.expr, depth)
            return target
        return self._op(call, method, self._of(func.expr, depth))

    def _op(self, call: nodes.Call, op: str, input_kind: Optional[str]) -> Optional[str]:
        if op.endswith("_") and not op.startswith("_"):
            return input_kind  # in place (``x.mul_(s)``, ``F.relu_(x)``): the tensor's own dtype
        if op in LOW_PRECISION_OPS or op in CUDA_FP32_OPS or op in CPU_FP32_OPS:
            return self._autocast_output(call, op, input_kind)
        if op in PRESERVING:
            return input_kind
        return None

    def _autocast_output(
        self, node: nodes.NodeNG, op: str, input_kind: Optional[str]
    ) -> Optional[str]:
        """Output kind of ``op`` at ``node``: autocast's choice in a region (one enabled by a
        flag counts as on: kinds describe the program with mixed precision on), else the
        input's."""
        region = self.region_at(node)
        if region is None:
            if op in LOW_PRECISION_OPS and input_kind == FP32:
                # fp32 unless a caller elsewhere runs it under autocast
                return FP32 if self._autocast_known_off(node) else None
            return input_kind
        if op in LOW_PRECISION_OPS:
            return region.dtype or LOW
        if region.device not in (CUDA, CPU) and (op in CUDA_FP32_OPS) != (op in CPU_FP32_OPS):
            return None  # fp32 on one device, the input's dtype on the other
        if autocast_fp32_op(op, region):
            return FP32
        return input_kind


def _module_parts(module: nodes.NodeNG) -> List[nodes.NodeNG]:
    """``module`` and the objects it is reached from, to its root: ``[a.b.c(), a.b, a]``."""
    parts = [module]
    while True:
        current = parts[-1]
        if isinstance(current, nodes.Attribute):
            parts.append(current.expr)
        elif isinstance(current, nodes.Call) and isinstance(current.func, nodes.Attribute):
            parts.append(current.func.expr)
        elif isinstance(current, nodes.Subscript):
            parts.append(current.value)
        else:
            return parts


def _is_shape(expr: nodes.NodeNG) -> bool:
    """``x.shape`` or ``x.size()``: sizes are Python ints."""
    if isinstance(expr, nodes.Attribute):
        return expr.attrname == "shape"
    return isinstance(expr, nodes.Call) and method_call(expr)[0] == "size" and not expr.args


def _is_device(arg: nodes.NodeNG) -> bool:
    """Arguments of ``.to(...)`` that move a tensor without changing its dtype."""
    if isinstance(arg, nodes.Const) and isinstance(arg.value, str):
        return True
    if isinstance(arg, nodes.Attribute) and arg.attrname == "device":
        return True
    if isinstance(arg, nodes.Name) and "device" in arg.name.lower():
        return True
    if (
        isinstance(arg, nodes.Call)
        and getattr(arg.func, "attrname", getattr(arg.func, "name", "")) == "device"
    ):
        return True
    return False
