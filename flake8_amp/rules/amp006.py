"""AMP006 step-bypasses-scaler: optimizer.step() on scaled grads; scaler.step without update.

Optimizers are recognised by their ``torch.optim`` class or by name (``optimizer``, ``opt_d``,
``self.optim``; not schedulers or EMA objects). A plain step is fine in the no-scaler arm of
an ``if``, after a helper that received the scaler, and for an optimizer built around the
scaler; after ``scaler.step`` stepped the same optimizer (with or without ``update()`` in
between) it steps the same gradients a second time. ``torch.autograd.backward(
scaler.scale(loss))`` is a scaled backward too. A step whose function runs no backward is
reported when the code sharing its ``self`` (its class, the bases and the subclasses that
inherit it, when all are in the module; the module for a function) scales the backward
elsewhere and never steps through the scaler, unscales it or hands it on; or, right after
its own ``scaler.step`` of another optimizer, when that code scales the backward and runs
no plain one. ``scaler.step``
needs an update later in its function, in a method sharing ``self`` (``self.<scaler>``),
or in its caller (a scaler parameter).
"""

from __future__ import annotations

from typing import Optional

from astroid import nodes

from flake8_amp.analysis.names import method_call, names_in
from flake8_amp.analysis.scaler import (
    HELPED,
    SCALED,
    UNSCALED,
    ScalerFlow,
    expression_key,
    is_optimizer,
    optimized_models,
    scaler_analysis,
)
from flake8_amp.engine import Check


class StepBypassesScaler(Check):
    """Stepping past the scaler applies scaled, unchecked gradients; no update freezes the scale."""

    code = "AMP006"
    triggers = (".scale(",)

    def visit_call(self, node: nodes.Call) -> None:
        method, receiver = method_call(node)
        if method != "step" or receiver is None:
            return
        flow = scaler_analysis(self.context).flow(node)
        if flow.is_scaler(receiver):
            self._check_update(node, receiver, flow)
        elif len(node.args) <= 1 and is_optimizer(receiver, self.context.names):
            self._check_plain_step(node, receiver, flow)

    def _check_plain_step(self, node: nodes.Call, receiver: nodes.NodeNG, flow: ScalerFlow) -> None:
        key = expression_key(receiver)
        # an optimizer (or all its models) zeroed after the scaled backward steps only the
        # gradients of a later plain backward
        zeroed = [frozenset({key} - {None}), optimized_models(receiver, self.context.names)]
        phases = flow.phases_before(node, unless_zeroed=zeroed)
        if HELPED in phases or flow.in_no_scaler_arm(node) or self._wraps_scaler(receiver):
            return
        if key is not None and flow.stepped_before(node, key):
            self.report(
                node,
                detail=f"{receiver.as_string()}.step() after scaler.step({key}) steps the same "
                "gradients again (inf/NaN steps are not skipped)",
            )
            return
        if not phases & {SCALED, UNSCALED} and not (
            phases <= {None} and self._scaled_elsewhere(node, key, flow)
        ) and not flow.left_scaled_before(node, key, zeroed):
            return
        self.report(
            node,
            detail=f"{receiver.as_string()}.step() applies gradients scaled by GradScaler "
            "(inf/NaN steps are not skipped)",
        )

    def _scaled_elsewhere(self, node: nodes.Call, key: Optional[str], flow: ScalerFlow) -> bool:
        """The backward ran in another function and scaled these gradients; also when this
        function steps another optimizer through the scaler first (``scaler.step(opt);
        scaler.update(); weight_optimizer.step()``: both hold that backward's gradients)."""
        after_own_step = flow.stepped_another_before(node, key)
        return scaler_analysis(self.context).scaled_elsewhere(node, after_own_step=after_own_step)

    def _wraps_scaler(self, optimizer: nodes.NodeNG) -> bool:
        """The optimizer was built around the scaler (``AmpOptimizer(opt, scaler)``)."""
        names = self.context.names
        values = names.bound_values(optimizer) or []
        return any(
            "scaler" in word.lower()
            for value in values
            if isinstance(value, nodes.Call)
            for word in names_in([*value.args, *(kw.value for kw in value.keywords or ())])
        )

    def _check_update(self, node: nodes.Call, receiver: nodes.NodeNG, flow: ScalerFlow) -> None:
        if node not in flow.steps_without_update():
            return
        if scaler_analysis(self.context).updated_elsewhere(receiver):
            return
        scaler = receiver.as_string()
        self.report(
            node,
            detail=f"{scaler}.step() with no {scaler}.update() after it: "
            "the loss scale never adapts",
        )
