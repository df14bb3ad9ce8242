"""The rule catalog: every AMP code, shared by the linter and the runtime guard.

This module must stay importable without torch (lint-only installs use it), so it
holds plain data only. ``docs/rules/AMPxxx.md`` and the README table are checked
against it by the test suite.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, FrozenSet, Iterable, Tuple

STATIC = "static"
RUNTIME = "runtime"

#: P0 training is broken, P1 training is degraded, P2 a hint.
SEVERITIES: Tuple[str, ...] = ("P0", "P1", "P2")

#: The largest finite float16 value; anything beyond it becomes inf.
FP16_MAX = 65504.0
#: float16's smallest positive subnormal; smaller magnitudes flush to zero.
FP16_TINY_SUBNORMAL = 5.960464477539063e-08


@dataclass(frozen=True)
class Rule:
    code: str
    name: str
    #: One line for the README and docs tables.
    title: str
    #: ``str.format`` template for the finding; fields are documented per rule.
    message: str
    severity: str
    rationale: str
    fix: str
    #: Short fix hint that ends every flake8 message of this code.
    hint: str
    enforcers: FrozenSet[str]

    def format(self, **fields: object) -> str:
        """The message text (without the code), with the fix hint appended."""
        try:
            text = self.message.format(**fields)
            hint = self.hint.format(**fields)
        except KeyError as missing:
            raise KeyError(f"{self.code} message needs field {missing}") from None
        return f"{text} ({hint})" if hint else text


def severity_rank(severity: str) -> int:
    """0 for P0 (worst) .. 2 for P2; unknown severities rank last."""
    return SEVERITIES.index(severity) if severity in SEVERITIES else len(SEVERITIES)


def _rule(code, name, severity, enforcers, message, hint, title, rationale, fix):
    return Rule(
        code=code,
        name=name,
        title=title,
        message=message,
        severity=severity,
        rationale=" ".join(rationale.split()),
        fix=" ".join(fix.split()),
        hint=hint,
        enforcers=frozenset(enforcers),
    )


_BOTH = (STATIC, RUNTIME)

_RULES: Tuple[Rule, ...] = (
    _rule(
        "AMP000", "analysis-skipped", "P2", (STATIC,),
        "flake8-amp could not analyse this file: {reason}", "",
        "the file could not be analysed",
        """The linter never crashes flake8. When a file cannot be analysed (recursion
        too deep, an astroid failure, an undecodable file) it reports nothing for it and
        at most this one line, so that a silent gap in coverage is visible.""",
        """Usually nothing to do. If the reason is a bug in flake8-amp, report it with
        the file attached.""",
    ),
    _rule(
        "AMP001", "manual-cast", "P1", _BOTH,
        "{target} cast to {dtype} in training code bypasses autocast",
        "keep fp32 weights and let torch.autocast pick per-op precision",
        "manual .half()/.bfloat16() cast in training code",
        """Casting a model or its inputs to fp16/bf16 by hand trains in pure low
        precision: weights, optimizer state and every op including reductions and
        losses run in fp16/bf16. Small updates are lost to rounding (fp16 has 10
        mantissa bits, bf16 7) and ops that autocast would have run in fp32 overflow or
        lose accuracy. Autocast keeps fp32 master weights and casts per op.""",
        """Remove the cast and wrap the forward pass in ``torch.autocast(device_type,
        dtype=...)``. Casting a model for inference, evaluation or export is fine.""",
    ),
    _rule(
        "AMP002", "loss-outside-autocast", "P1", _BOTH,
        "loss {loss} computed outside the autocast region that produced {arg}",
        "compute the loss inside the autocast block, or upcast its inputs with .float()",
        "loss computed outside autocast on low-precision outputs",
        """Autocast runs losses in fp32 (they are on its fp32 list on CUDA). Outside
        the region the fp16/bf16 outputs of the forward pass reach the loss as they
        are, so the loss and the log-probabilities inside it are computed in low
        precision: large logits overflow fp16 and small probabilities vanish.""",
        """Compute the loss inside the ``with torch.autocast(...)`` block, as the
        PyTorch AMP examples do, or upcast the inputs explicitly (``logits.float()``).""",
    ),
    _rule(
        "AMP003", "bce-under-autocast", "P0", _BOTH,
        "{func} under autocast is unsafe in low precision (CUDA autocast raises)",
        "use binary_cross_entropy_with_logits / nn.BCEWithLogitsLoss on the logits",
        "binary_cross_entropy / nn.BCELoss under autocast",
        """``binary_cross_entropy`` takes probabilities and computes log(p) and
        log(1-p); in fp16, p rounds to exactly 0 or 1 and the loss becomes inf. CUDA
        autocast therefore refuses it with a RuntimeError; CPU autocast happens to
        run it in fp32, so code that works on a laptop fails on the GPU.""",
        """Drop the sigmoid and call ``F.binary_cross_entropy_with_logits`` /
        ``nn.BCEWithLogitsLoss`` on the logits; it is numerically stable and
        autocast-safe.""",
    ),
    _rule(
        "AMP004", "low-precision-reduce", "P1", _BOTH,
        "{op} on a {dtype} tensor returns {dtype} "
        "(few significant bits; fp16 overflows past 65504)",
        "upcast first (x.float().{op}()) or pass dtype=torch.float32",
        "sum/mean/var/... reduction in fp16/bf16",
        """A reduction of fp16/bf16 values returns fp16/bf16: PyTorch accumulates in fp32
        internally, but the result is stored with 11 (fp16) or 8 (bf16) significant bits and,
        in fp16, overflows past 65504 (a sum of 1024 values of 64 is already inf).
        Autocast upcasts some reductions on some devices (``sum``, ``prod``,
        ``cumsum``, ``norm`` on CUDA) but not ``mean``/``var``/``std``, and CPU fp16
        autocast keeps ``sum`` in fp16.""",
        """Upcast the input (``x.float().mean()``) or ask for an fp32 accumulator
        (``x.sum(dtype=torch.float32)``) and cast the result back if needed.""",
    ),
    _rule(
        "AMP005", "clip-before-unscale", "P0", _BOTH,
        "{func} clips gradients that GradScaler has scaled",
        "call scaler.unscale_(optimizer) before clipping",
        "gradient clipping before scaler.unscale_",
        """After ``scaler.scale(loss).backward()`` every gradient is multiplied by the
        loss scale (65536 by default). Clipping them then compares the scaled norm
        with the threshold, so clipping either always fires (gradients shrink by the
        scale and training crawls) or means nothing.""",
        """Call ``scaler.unscale_(optimizer)`` before ``clip_grad_norm_`` /
        ``clip_grad_value_``; ``scaler.step`` then knows not to unscale again.""",
    ),
    _rule(
        "AMP006", "step-bypasses-scaler", "P0", _BOTH,
        "{detail}",
        "use scaler.step(optimizer) followed by scaler.update()",
        "optimizer.step() on scaled gradients / scaler.step without update",
        """``optimizer.step()`` after a scaled backward applies gradients that are
        still multiplied by the loss scale, and never skips steps whose gradients hold
        inf/NaN. ``scaler.step`` without ``scaler.update`` never adjusts the scale, so
        one overflow skips every later step.""",
        """Call ``scaler.step(optimizer)`` then ``scaler.update()`` once per
        iteration.""",
    ),
    _rule(
        "AMP007", "fp16-overflow-literal", "P0", _BOTH,
        "{value} is outside the fp16 range (+-65504) in {op}",
        "use torch.finfo(x.dtype).min or float('-inf')",
        "fill/constant beyond ±65504 on a possibly-fp16 tensor",
        """fp16's largest finite value is 65504. ``masked_fill(mask, -1e9)`` on an
        fp16 tensor raises "value cannot be converted to type at::Half without
        overflow", and constants that do convert become inf, which turns softmax rows
        into NaN.""",
        """Use ``torch.finfo(x.dtype).min`` (or ``float('-inf')`` where whole rows are
        never masked), or a value within range such as ``-1e4``.""",
    ),
    _rule(
        "AMP008", "backward-under-autocast", "P1", _BOTH,
        "backward() called inside an autocast region",
        "leave the autocast block before calling backward()",
        "backward() inside an autocast region",
        """Autocast should wrap only the forward pass and the loss. Backward ops run in
        the dtype their forward ops chose; running backward under autocast is not
        recommended by PyTorch and can cast ops of custom autograd functions
        unexpectedly.""",
        """Dedent the backward call (and the optimizer step) out of the ``with
        torch.autocast(...)`` block.""",
    ),
    _rule(
        "AMP009", "deprecated-amp-api", "P2", (STATIC,),
        "{old} is deprecated",
        "use {new}",
        "deprecated torch.cuda.amp / torch.cpu.amp API",
        """``torch.cuda.amp.autocast``, ``torch.cuda.amp.GradScaler``,
        ``torch.cpu.amp.autocast`` and ``torch.cuda.amp.custom_fwd/custom_bwd`` are
        deprecated since PyTorch 2.4 in favour of the device-generic ``torch.amp``
        API and emit FutureWarning.""",
        """Use ``torch.amp.autocast("cuda", ...)``, ``torch.amp.GradScaler("cuda")``,
        ``torch.amp.custom_fwd(device_type="cuda")``.""",
    ),
    _rule(
        "AMP010", "scaler-dtype-mismatch", "P1", _BOTH,
        "{detail}",
        "fp16 needs torch.amp.GradScaler; bf16 needs none",
        "fp16 autocast without GradScaler, or GradScaler with bf16",
        """fp16 has a narrow exponent range: gradients below 6e-8 flush to zero, so fp16
        training needs loss scaling (GradScaler). bf16 has fp32's exponent range and
        needs no scaling; a scaler there only costs time.""",
        """Use ``torch.amp.GradScaler(device)`` with ``dtype=torch.float16``; drop the
        scaler (or ``enabled=False``) with ``torch.bfloat16``.""",
    ),
    _rule(
        "AMP011", "tiny-epsilon", "P1", _BOTH,
        "epsilon {value} flushes to zero in fp16 (smallest subnormal 5.96e-8)",
        "use an epsilon >= 1e-7, or compute this in fp32",
        "epsilon below fp16's smallest subnormal",
        """fp16's smallest positive value is 5.96e-8. An epsilon such as 1e-8 added to
        an fp16 tensor is exactly zero, so the division or log it guards produces
        inf/NaN; ``Adam(eps=1e-8)`` over fp16 parameters loses its guard the same
        way.""",
        """Use an epsilon representable in the dtype (``1e-7`` or more for fp16,
        ``torch.finfo(dtype).tiny``), or do the computation in fp32.""",
    ),
    _rule(
        "AMP100", "guard-failure", "P2", (RUNTIME,),
        "amp_runtime's {component} failed ({error}): {what} off for the rest of the run",
        "the training goes on unchanged; report it with details['traceback']",
        "the guard's own code failed; that part is switched off",
        """The guard never breaks the run it watches. When its own code raises (a bug in a
        check, a value it cannot read, a full disk under ``log_dir``), the part that failed is
        switched off for the rest of the run: its hooks are removed and its handlers dropped.
        The training goes on with unchanged numerics, and this event, reported once per part,
        says what is no longer checked. It never raises, also under ``policy="raise"``, and the
        ``amp_guard`` fixture does not fail a test for it.""",
        """Nothing to change in your code. The checks of the part named in ``details["component"]``
        are missing for the rest of the run; report the failure to flake8-amp with
        ``details["traceback"]``. For ``events.jsonl`` on a full disk, free space: the events stay
        in ``guard.report``.""",
    ),
    _rule(
        "AMP101", "nonfinite-forward", "P0", (RUNTIME,),
        "{op} produced {kind} from finite inputs",
        "look at this op's inputs: too large for fp16, or outside its domain (log or sqrt of "
        "0 or less, division by 0); keep it in fp32, rescale, or use a stable form",
        "first op that turns finite inputs into NaN/Inf",
        """The first op whose output holds NaN or Inf while its inputs were finite is
        where the run broke; every later NaN is a consequence. In fp16 this is most
        often an overflow past 65504 in a matmul, an exp or a sum; otherwise an input
        outside the op's domain, often one that low precision rounded there (a bf16
        ``sigmoid`` of 8 is exactly 1.0, so ``log(1 - p)`` is ``-inf``).""",
        """Inspect the named module: keep it in fp32 (``torch.autocast(...,
        enabled=False)`` plus ``.float()``), normalise its inputs, or use bf16; for a
        domain error, the stable form (``F.logsigmoid``, ``F.binary_cross_entropy_with_logits``,
        ``torch.log1p``) or a clamp.""",
    ),
    _rule(
        "AMP102", "near-overflow", "P1", (RUNTIME,),
        "{op} output reached |x|={value:.4g} in fp16 (limit 65504)",
        "this op is close to overflowing; keep it in fp32 or use bf16",
        "fp16 output close to 65504",
        """An fp16 output above 60000 is one small step away from inf. Activations
        grow during training, so an op close to the limit today overflows later.""",
        """Keep the op in fp32, add normalisation, or train in bf16.""",
    ),
    _rule(
        "AMP103", "nonfinite-grad", "P0", (RUNTIME,),
        "non-finite gradients in {where} reached the optimizer",
        "fix the op that made them non-finite (this step's AMP101, or the backward named "
        "here); in fp16 a GradScaler skips such steps",
        "NaN/Inf gradients the optimizer stepped on",
        """Gradients holding NaN or Inf that no GradScaler caught are applied to the
        weights, which then become NaN for good.""",
        """Fix the op that made them non-finite: the replay of the failing step
        (``trace="auto"``) names the overflowing op (AMP101) or the layer whose gradient
        first turned non-finite; ``details["replay"]`` says why when it could not run
        (then ``trace="always"`` traces every step). With fp16, ``torch.amp.GradScaler``
        skips such steps instead of applying them.""",
    ),
    _rule(
        "AMP104", "grad-explosion", "P0", (RUNTIME,),
        "total gradient norm {norm:.4g} (unscaled) exceeds {limit:g}",
        "clip gradients (after scaler.unscale_) or lower the learning rate",
        "total unscaled gradient norm too large",
        """A total gradient norm above 100 (P1) or 1000 (P0) usually precedes
        divergence; in fp16 it is also on its way to overflow.""",
        """Clip with ``clip_grad_norm_`` (after ``scaler.unscale_``), lower the
        learning rate, or add warm-up.""",
    ),
    _rule(
        "AMP105", "grad-vanishing", "P1", (RUNTIME,),
        "{detail}",
        "check the loss's magnitude (a tiny loss gives tiny gradients everywhere), then "
        "initialisation, activations and normalisation (of the layers named, if any), and "
        "weights that grew until their activations saturate",
        "gradients vanishing (total or per layer)",
        """A total gradient norm below 1e-6, or a layer whose gradients are all below
        1e-10 (including exactly zero), means those weights no longer learn.""",
        """Check activations (saturating sigmoid/tanh), initialisation and
        normalisation; in fp16 check the loss scale (AMP106).""",
    ),
    _rule(
        "AMP106", "grad-underflow", "P1", (RUNTIME,),
        "{fraction:.1%} of {layer}'s nonzero gradients flush to zero in fp16 "
        "at loss scale {scale:g}",
        "raise the loss scale (init_scale) or use bf16",
        "gradients underflowing fp16 at the current loss scale",
        """Gradients smaller than fp16's smallest subnormal (5.96e-8) after scaling
        become exactly zero; when more than 1% of a layer's nonzero gradients do, carrying
        more than 0.1% of its gradient norm, that layer learns on a fraction of its signal.
        Exact zeros (embedding rows not in the batch, dead units) are sparsity, not
        underflow.""",
        """Raise ``init_scale`` / keep the scaler growing, or train in bf16.""",
    ),
    _rule(
        "AMP107", "loss-scale-collapse", "P0", (RUNTIME,),
        "loss scale collapsed to {scale:g} and is not rising{cause}",
        "fix the op or parameter this message or an AMP101 names; where none is named, the "
        "overflow is in the scaled backward only: look for a loss with large gradients "
        "(a term weighted by a large constant, unnormalised regression targets)",
        "loss scale at or below 1 and not recovering",
        """GradScaler halves the scale on every overflow. At a scale of 1 or less,
        every step still overflows: no step is taken and training has stalled.""",
        """Fix the op that overflows in every step: the replay of the first skipped
        step names it (AMP101; ``trace="always"`` traces every step). Keep it in fp32,
        normalise its inputs, or use bf16.""",
    ),
    _rule(
        "AMP108", "loss-scale-decline", "P1", (RUNTIME,),
        "loss scale fell to {scale:g} ({reason}){cause}",
        "repeated overflows: fix the op or parameter this message or an AMP101/AMP102 names; "
        "where none is named, the overflow is in the scaled backward only: look for a loss "
        "with large gradients (unnormalised regression targets, a sum instead of a mean)",
        "loss scale declining",
        """Five consecutive decreases once a step has gone through, a scale below 1/100
        of its initial value, or below 128 and falling means overflows keep happening
        and the scale is on its way to collapse.""",
        """Look for the op that overflows (AMP101/AMP102 events); lower the learning
        rate or keep the op in fp32.""",
    ),
    _rule(
        "AMP109", "overflow-rate", "P1", (RUNTIME,),
        "{skipped} of the last {window} steps were skipped for inf/NaN gradients",
        "frequent overflows waste steps; look for AMP101/AMP102 events",
        "too many skipped (overflowing) steps",
        """A few skipped steps while the scale settles are normal. More than 1% of
        recent steps, and rising, means overflows are frequent and each skipped step
        wastes a batch.""",
        """Find the overflowing op (AMP101/AMP102), lower ``growth_factor`` or raise
        ``growth_interval`` of the scaler, or use bf16.""",
    ),
    _rule(
        "AMP110", "absorption", "P1", (RUNTIME,),
        "{op}: an operand is absorbed (magnitude ratio {ratio:.3g} beyond {dtype} precision)",
        "accumulate this sum in fp32",
        "low-precision add where one operand is absorbed",
        """In fp16 (11 significant bits) adding a value more than 2^11 times smaller
        leaves the larger unchanged; bf16 (8 bits) absorbs at 2^8. Running sums and
        residual streams in low precision silently stop accumulating.""",
        """Accumulate in fp32 (``acc = acc.float() + x``) or rescale.""",
    ),
    _rule(
        "AMP111", "imbalanced-reduce", "P1", (RUNTIME,),
        "{op} over {dtype} values whose magnitudes differ by {ratio:.3g}x",
        "reduce in fp32 (dtype=torch.float32)",
        "low-precision reduction over values of very different magnitude",
        """A low-precision reduction over values whose magnitudes differ by more than
        1e4 loses the small ones entirely to rounding.""",
        """Pass ``dtype=torch.float32`` to the reduction or upcast the input.""",
    ),
    _rule(
        "AMP112", "nonfinite-loss", "P0", (RUNTIME,),
        "loss is {kind} when backward starts{cause}",
        "fix the first non-finite value: this step's AMP101 where the model made it, a "
        "parameter or a model input (the batch) already non-finite, else the loss or its "
        "inputs (labels, targets)",
        "NaN/Inf loss at backward",
        """A NaN/Inf loss propagates into every gradient. Without a GradScaler the
        step corrupts the weights; with one, it is skipped and the scale drops.""",
        """Fix the first op producing NaN/Inf: where the model's forward made it, the
        replay of this step names it (AMP101), or the trained parameter that was already
        NaN/Inf before the forward (a checkpoint saved after an overflow), or the input of
        the model call that was (a batch with a missing value); where the replay finds none
        of these, look at the loss and what it was given (a NaN label).
        ``details["replay"]`` says why when it could not run (then ``trace="always"`` traces
        every step).""",
    ),
)

RULES: Dict[str, Rule] = {rule.code: rule for rule in _RULES}


def rule(code: str) -> Rule:
    try:
        return RULES[code]
    except KeyError:
        raise KeyError(f"unknown flake8-amp code {code!r}; known: {', '.join(RULES)}") from None


def rules_for(enforcer: str) -> Iterable[Rule]:
    return (r for r in _RULES if enforcer in r.enforcers)


def matches(code: str, select: Iterable[str] | None, ignore: Iterable[str] | None) -> bool:
    """flake8-style prefix selection: the longest matching prefix wins."""
    best_select = max((len(p) for p in select or ("AMP",) if code.startswith(p)), default=-1)
    best_ignore = max((len(p) for p in ignore or () if code.startswith(p)), default=-1)
    return best_select >= 0 and best_select > best_ignore


def markdown_table() -> str:
    """The README's rule table, generated from the catalog (a test keeps them equal)."""
    lines = [
        "| code | name | severity | static | runtime | what it catches |",
        "|---|---|---|---|---|---|",
    ]
    for r in _RULES:
        marks = ["✓" if e in r.enforcers else "" for e in (STATIC, RUNTIME)]
        link = f"[{r.code}](docs/rules/{r.code}.md)"
        lines.append(f"| {link} | {r.name} | {r.severity} | {marks[0]} | {marks[1]} | {r.title} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
