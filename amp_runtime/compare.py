"""How much precision each module loses under autocast, measured against float32.

``compare(model, inputs, dtype=torch.bfloat16)`` runs the same inputs twice — in
float32 and under ``torch.autocast`` with ``dtype`` — and compares every module's
output. Errors accumulate downstream, so the output error of a late layer says little
about where the precision went; each module is therefore also re-run on its exact
input values (in the dtypes autocast gave them) with its submodules kept in float32:
the error of its *own* code. Modules whose own error is well beyond the rounding of
``dtype``, or that amplify the rounding error they receive, are named as the ones to
keep in float32, with a snippet that does it.

The comparison is deterministic (a fixed seed before every run) and leaves the model
as it found it: training flags, parameters, buffers and the global RNG state.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

#: An element counts as a mismatch when its relative error exceeds this (0.1 %).
MISMATCH_RELATIVE = 1e-3
#: Default tolerance on a module's own relative L2 error, in units of the dtype's epsilon.
TOLERANCE_EPS = 4.0
#: A module whose output error exceeds its inputs' error this many times amplifies it.
AMPLIFICATION = 4.0
_SEED = 0
_ROOT = "(model)"
_SNIPPET = '''\
import torch


def keep_fp32(module):
    """Run this module in float32 even inside an autocast region."""
    forward = module.forward

    def upcast(value):
        return value.float() if torch.is_tensor(value) and value.is_floating_point() else value

    def fp32_forward(*args, **kwargs):
        with torch.autocast(device_type={device_type}, enabled=False):
            return forward(*map(upcast, args), **{{k: upcast(v) for k, v in kwargs.items()}})

    module.forward = fp32_forward


for name in [
{names}]:
    keep_fp32(model if name == "" else model.get_submodule(name))
'''


@dataclass(frozen=True)
class ErrorStats:
    """Low-precision output against the float32 reference, over all its float elements."""

    numel: int
    max_abs: float
    max_rel: float
    #: ||low - ref|| / ||ref||: the single number modules are ranked by.
    rel_l2: float
    cosine: float
    #: Fraction of elements whose relative error exceeds 0.1 %.
    mismatch_fraction: float
    #: The low-precision output holds NaN/Inf where the float32 one was finite.
    nonfinite: bool

    @classmethod
    def between(cls, reference: torch.Tensor, low: torch.Tensor) -> "ErrorStats":
        ref = reference.double()
        approx = low.double()
        finite_ref = torch.isfinite(ref)
        nonfinite = bool((finite_ref & ~torch.isfinite(approx)).any())
        ref = torch.where(finite_ref, ref, 0.0)
        approx = torch.where(finite_ref & torch.isfinite(approx), approx, 0.0)
        if not ref.numel():
            return cls(0, 0.0, 0.0, 0.0, 1.0, 0.0, nonfinite)
        diff = (approx - ref).abs()
        magnitude = ref.abs()
        # Exact zeros in the reference would make every ratio infinite; measure those
        # against a floor one millionth of the largest reference value instead.
        floor = max(float(magnitude.max()) * 1e-6, torch.finfo(torch.float32).tiny)
        rel = diff / magnitude.clamp_min(floor)
        ref_norm = float(ref.norm())
        diff_norm = float(diff.norm())
        denom = ref_norm * float(approx.norm())
        return cls(
            numel=ref.numel(),
            max_abs=float(diff.max()),
            max_rel=float(rel.max()),
            rel_l2=diff_norm / ref_norm if ref_norm else (0.0 if diff_norm == 0 else math.inf),
            cosine=float((ref * approx).sum()) / denom if denom else float(diff_norm == 0),
            mismatch_fraction=float((rel > MISMATCH_RELATIVE).double().mean()),
            nonfinite=nonfinite,
        )


@dataclass
class ModuleError:
    name: str
    kind: str
    #: End to end: this module's output in the autocast run against the float32 run.
    output: ErrorStats
    #: This module's own code: re-run under autocast on its exact input values (in the
    #: dtypes they had under autocast) with its submodules kept in float32.
    own: Optional[ErrorStats]
    #: The inputs it received in the autocast run against those of the float32 run.
    inputs: Optional[ErrorStats] = None
    calls: int = 1
    #: Why it should stay in float32; "" when it need not.
    reason: str = ""

    def badness(self) -> Tuple[bool, bool, float]:
        stats = self.own or self.output
        return (bool(self.reason), stats.nonfinite, stats.rel_l2)


@dataclass
class CompareResult:
    dtype: str
    device_type: str
    #: The relative L2 error above which a module's own error is "too much".
    tolerance: float
    #: Ranked: worst own error first.
    modules: List[ModuleError]
    keep_fp32: List[str] = field(default_factory=list)
    #: The model's output with ``keep_fp32`` applied, against float32 (None: nothing to keep).
    kept_output: Optional[ErrorStats] = None

    def module(self, name: str) -> ModuleError:
        for entry in self.modules:
            if entry.name == name:
                return entry
        raise KeyError(name)

    def output(self) -> Optional[ErrorStats]:
        """The model's own output against float32 (None when it has no float output)."""
        root = [m for m in self.modules if m.name == _ROOT]
        return root[0].output if root else None

    def snippet(self) -> str:
        """Python code that keeps the recommended modules in float32 under autocast."""
        if not self.keep_fp32:
            return ""
        names = "".join(f"    {json.dumps(n)},\n" for n in self.keep_fp32)
        return _SNIPPET.format(device_type=json.dumps(self.device_type), names=names)

    def table(self, limit: Optional[int] = 20) -> str:
        header = ("module", "type", "own rel-L2", "out rel-L2", "max abs", "max rel", "cosine",
                  ">0.1%")
        rows = []
        for entry in self.modules[:limit]:
            own = entry.own
            out = entry.output
            rows.append((
                entry.name, entry.kind,
                "-" if own is None else _fmt_err(own),
                _fmt_err(out), f"{out.max_abs:.3g}", f"{out.max_rel:.3g}",
                f"{out.cosine:.6f}", f"{out.mismatch_fraction:.1%}",
            ))
        widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(header)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
                 for cells in [header, *rows]]
        lines.insert(1, "  ".join("-" * w for w in widths))
        if limit is not None and len(self.modules) > limit:
            lines.append(f"... {len(self.modules) - limit} more module(s)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def summary(self, limit: Optional[int] = 20) -> str:
        """The ranked table (``limit`` rows), the modules to keep in float32 and the snippet."""
        output = self.output()
        parts = [
            f"{self.dtype} autocast on {self.device_type} against float32, "
            f"{len(self.modules)} module(s), tolerance rel-L2 {self.tolerance:.3g}"
            + ("" if output is None else f"; model output rel-L2 {_fmt_err(output)}"),
            self.table(limit),
        ]
        if self.keep_fp32:
            reasons = {m.name: m.reason for m in self.modules}
            kept = "" if self.kept_output is None else (
                f"\nWith these in float32 the model output rel-L2 is {_fmt_err(self.kept_output)}.")
            parts.append("Keep in float32:\n" + "\n".join(
                f"  {n or _ROOT}: {reasons[n or _ROOT]}" for n in self.keep_fp32) + kept)
            parts.append(self.snippet())
        elif not self.modules:
            parts.append("No module produced a floating-point output: nothing to compare.")
        else:
            parts.append(f"Every module stays within tolerance in {self.dtype}.")
        return "\n\n".join(parts)

    def to_json(self) -> Dict[str, Any]:
        return {
            "dtype": self.dtype,
            "device_type": self.device_type,
            "tolerance": self.tolerance,
            "keep_fp32": list(self.keep_fp32),
            "kept_output": None if self.kept_output is None else asdict(self.kept_output),
            "modules": [asdict(m) for m in self.modules],
        }


def _fmt_err(stats: ErrorStats) -> str:
    return "NaN/Inf" if stats.nonfinite else f"{stats.rel_l2:.3g}"


def compare(
    model: nn.Module,
    inputs: Any,
    dtype: torch.dtype = torch.bfloat16,
    device_type: Optional[str] = None,
    *,
    tolerance: Optional[float] = None,
    train: bool = False,
) -> CompareResult:
    """Compare every module of ``model`` under ``autocast(dtype)`` against float32.

    ``inputs`` is one tensor, a tuple/list of positional arguments, or a dict of
    keyword arguments. ``device_type`` defaults to the inputs' (else the parameters')
    device. ``tolerance`` is the own relative L2 error above which a module is named
    to keep in float32 (default: 4 × the dtype's epsilon). ``train=True`` compares in
    training mode (dropout draws the same mask in both runs).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"compare() needs an nn.Module, got {type(model).__name__}")
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    args, kwargs = _as_call(inputs)
    data_device = _device_type(model, args, kwargs)
    if device_type not in (None, data_device):  # autocast would not touch the model's ops
        raise ValueError(f"device_type {device_type!r} does not match the model and inputs, "
                         f"which are on {data_device!r}")
    device_type = data_device
    if not torch.amp.is_autocast_available(device_type):
        raise ValueError(f"autocast is not available for device type {device_type!r}")
    if tolerance is None:
        tolerance = TOLERANCE_EPS * torch.finfo(dtype).eps
    elif not tolerance > 0:
        raise ValueError(f"tolerance must be a positive relative L2 error, got {tolerance}")

    names = {module: (name or _ROOT) for name, module in model.named_modules()}
    cuda = {t.device.index or 0 for t in _tensors((args, kwargs)) if t.device.type == "cuda"}
    devices = sorted(cuda)
    with _preserved(model, train), torch.random.fork_rng(devices=devices), torch.no_grad():
        try:
            ref_outputs, ref_inputs = _record(model, names, args, kwargs, device_type, None)
        except RuntimeError as err:
            raise RuntimeError(f"the model fails in float32 on these inputs: {err}") from err
        try:
            low_outputs, low_inputs = _record(model, names, args, kwargs, device_type, dtype)
        except RuntimeError as err:
            raise RuntimeError(f"the model fails under autocast({device_type!r}, "
                               f"dtype={dtype}): {err}") from err
        results = []
        for module, name in names.items():
            if name not in ref_outputs or name not in low_outputs:
                continue  # never called, or no floating-point output
            (ref_out, calls), (low_out, _) = ref_outputs[name], low_outputs[name]
            if ref_out.shape != low_out.shape:
                continue
            m_args, m_kwargs = ref_inputs[name]
            own_ref = _flat_output(_run(module, m_args, m_kwargs, device_type, None))
            # exact values, in the dtypes they arrive in under autocast
            low_args, low_kwargs = _cast_like(ref_inputs[name], low_inputs[name])
            with _in_fp32(list(module.children()), device_type):
                own_low = _flat_output(_run(module, low_args, low_kwargs, device_type, dtype))
            both = own_ref is not None and own_low is not None
            own = ErrorStats.between(own_ref, own_low) if both else None
            ref_in, low_in = _flat_output(ref_inputs[name]), _flat_output(low_inputs[name])
            both = ref_in is not None and low_in is not None
            inputs = ErrorStats.between(ref_in, low_in) if both else None
            results.append(ModuleError(
                name, type(module).__name__, ErrorStats.between(ref_out, low_out), own, inputs,
                calls,
            ))
        for entry in results:
            entry.reason = _reason(entry, tolerance)
        results.sort(key=lambda m: m.badness(), reverse=True)
        keep = _keep_fp32(results)
        kept_error = None
        if keep and _ROOT in ref_outputs:  # check the advice: rerun with those in float32
            with _in_fp32([model.get_submodule(name) for name in keep], device_type):
                kept = _flat_output(_run(model, args, kwargs, device_type, dtype))
            kept_error = ErrorStats.between(ref_outputs[_ROOT][0], kept)
    return CompareResult(
        dtype=str(dtype).replace("torch.", ""),
        device_type=device_type,
        tolerance=tolerance,
        modules=results,
        keep_fp32=keep,
        kept_output=kept_error,
    )


def _reason(entry: ModuleError, tolerance: float) -> str:
    """Why this module should stay in float32, or "" when it need not."""
    own, out = entry.own, entry.output
    input_error = entry.inputs.rel_l2 if entry.inputs else 0.0
    if entry.inputs is not None and entry.inputs.nonfinite:
        return ""  # NaN/Inf arrived from upstream
    if own is not None and own.nonfinite:
        return "its own code overflows to NaN/Inf"
    if own is not None and own.rel_l2 > tolerance:
        return f"its own code loses precision (rel-L2 {own.rel_l2:.3g} > {tolerance:.3g})"
    if out.nonfinite:
        return "its output turns NaN/Inf on finite inputs"
    received = max(input_error, tolerance / AMPLIFICATION)
    if out.rel_l2 > tolerance and out.rel_l2 > AMPLIFICATION * received:
        return f"amplifies its inputs' rounding error {out.rel_l2 / max(input_error, 1e-12):.0f}x"
    return ""


def _keep_fp32(results: Sequence[ModuleError]) -> List[str]:
    """The modules to keep in float32: each flagged module, except one flagged only
    for its output whose submodule is flagged (that submodule explains it), and except
    those inside another named module (keeping a module in float32 covers them)."""
    flagged = {m.name: m for m in results if m.reason}

    def inside(child: str, parent: str) -> bool:
        return child != parent and (parent == _ROOT or child.startswith(parent + "."))

    def own_ok(entry: ModuleError) -> bool:
        return not entry.reason.startswith("its own code")

    explained = {n for n, m in flagged.items() if own_ok(m) and any(inside(o, n) for o in flagged)}
    chosen = [n for n in flagged if n not in explained]
    chosen = [n for n in chosen if not any(inside(n, o) for o in chosen)]
    return ["" if n == _ROOT else n for n in chosen]


def _fp32_forward(forward, device_type):
    """``forward`` run with autocast off and floating-point arguments upcast."""

    def cast(value):
        return value.float() if torch.is_tensor(value) and value.is_floating_point() else value

    def run(*args, **kwargs):
        with torch.autocast(device_type=device_type, enabled=False):
            return forward(*map(cast, args), **{k: cast(v) for k, v in kwargs.items()})

    return run


class _in_fp32:
    """Temporarily run some modules (and so all their submodules) in float32."""

    def __init__(self, modules: Sequence[nn.Module], device_type: str):
        self.modules = modules
        self.device_type = device_type

    def __enter__(self):
        # A forward already set on the instance (a user's own wrapper) is put back on exit.
        self.saved = [vars(module).get("forward") for module in self.modules]
        for module in self.modules:
            module.forward = _fp32_forward(module.forward, self.device_type)

    def __exit__(self, *exc):
        for child, saved in zip(self.modules, self.saved):
            if saved is None:
                del child.forward  # the class's forward shows again
            else:
                child.forward = saved
        return False


def _record(model, names, args, kwargs, device_type, dtype):
    """One forward pass; every module's output flattened to one float vector (several
    calls of the same module are concatenated), and the first call's inputs."""
    outputs: Dict[str, Tuple[torch.Tensor, int]] = {}
    inputs_seen: Dict[str, Tuple[tuple, dict]] = {}

    def before(module, m_args, m_kwargs):
        name = names.get(module)
        if name is not None and name not in inputs_seen:
            inputs_seen[name] = _clone((m_args, m_kwargs))

    def after(module, m_args, m_kwargs, output):
        name = names.get(module)
        flat = _flat_output(output)
        if name is None or flat is None:
            return
        previous, calls = outputs.get(name, (None, 0))
        outputs[name] = (flat if previous is None else torch.cat([previous, flat]), calls + 1)

    handles = []
    for module in names:
        handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(module.register_forward_hook(after, with_kwargs=True))
    try:
        _run(model, args, kwargs, device_type, dtype)
    finally:
        for handle in handles:
            handle.remove()
    return outputs, inputs_seen


def _run(module, args, kwargs, device_type, dtype):
    torch.manual_seed(_SEED)
    if torch.cuda.is_available() and device_type == "cuda":
        torch.cuda.manual_seed_all(_SEED)
    if dtype is None:
        with torch.autocast(device_type=device_type, enabled=False):
            return module(*args, **kwargs)
    with torch.autocast(device_type=device_type, dtype=dtype):
        return module(*args, **kwargs)


def _as_call(inputs) -> Tuple[tuple, dict]:
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def _tensors(value) -> Iterator[torch.Tensor]:
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _flat_output(output) -> Optional[torch.Tensor]:
    """All floating-point tensors of an output (tensor, tuple, list, dict), as one vector."""
    parts = [t.detach().reshape(-1).float() for t in _tensors(output) if t.is_floating_point()]
    if not parts:
        return None
    return torch.cat(parts).cpu()


def _clone(value):
    """Deep copy of tensors in a call's arguments, so later in-place ops don't alter them."""
    if torch.is_tensor(value):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*map(_clone, value))
    if isinstance(value, (list, tuple)):
        return type(value)(map(_clone, value))
    return value


def _cast_like(reference, low):
    """``reference``'s tensors cast to the dtypes of the matching tensors in ``low``."""
    if torch.is_tensor(reference) and torch.is_tensor(low):
        both_float = reference.is_floating_point() and low.is_floating_point()
        return reference.to(low.dtype) if both_float else reference
    if isinstance(reference, dict) and isinstance(low, dict):
        return {k: _cast_like(v, low.get(k)) for k, v in reference.items()}
    if isinstance(reference, tuple) and hasattr(reference, "_fields"):  # namedtuple
        return type(reference)(*(_cast_like(r, x) for r, x in zip(reference, low)))
    sequences = isinstance(reference, (list, tuple)) and isinstance(low, (list, tuple))
    if sequences and len(reference) == len(low):
        return type(reference)(_cast_like(r, x) for r, x in zip(reference, low))
    return reference


def _device_type(model, args, kwargs) -> str:
    for tensor in _tensors((args, kwargs)):
        return tensor.device.type
    for param in model.parameters():
        return param.device.type
    return "cpu"


class _preserved:
    """Set eval (or train) mode for the comparison; restore every module's training
    flag and every buffer (e.g. BatchNorm running stats) afterwards."""

    def __init__(self, model: nn.Module, train: bool):
        self.model = model
        self.train = train

    def __enter__(self):
        self.flags = [(m, m.training) for m in self.model.modules()]
        self.buffers = [(b, b.detach().clone()) for b in self.model.buffers()]
        self.model.train(self.train)
        return self

    def __exit__(self, *exc):
        for module, flag in self.flags:
            module.training = flag
        with torch.no_grad():
            for buffer, saved in self.buffers:
                buffer.copy_(saved)
        return False
