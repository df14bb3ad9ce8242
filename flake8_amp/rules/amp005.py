"""AMP005 clip-before-unscale: clipping gradients that a GradScaler scaled and did not unscale."""

from __future__ import annotations

from astroid import nodes

from flake8_amp.analysis.names import last_part
from flake8_amp.analysis.scaler import HELPED, SCALED, UNSCALED, scaler_analysis
from flake8_amp.engine import Check

CLIP_FUNCTIONS = frozenset(
    "torch.nn.utils." + name
    for name in (
        "clip_grad_norm_",
        "clip_grad_value_",
        "clip_grad_norm",
        "clip_grads_with_norm_",
        "clip_grad.clip_grad_norm_",
        "clip_grad.clip_grad_value_",
        "clip_grad.clip_grads_with_norm_",
    )
)


class ClipBeforeUnscale(Check):
    """The clip threshold is compared with gradients still multiplied by the loss scale."""

    code = "AMP005"
    triggers = ("clip_grad",)

    @classmethod
    def applies(cls, source, options):
        return super().applies(source, options) and ".scale(" in source

    def visit_call(self, node: nodes.Call) -> None:
        func = node.func
        if isinstance(func, nodes.Attribute) and not func.attrname.startswith("clip_grad"):
            return  # cheap test before name resolution (names may be import aliases)
        if self.context.names.qualname(node.func) not in CLIP_FUNCTIONS:
            return
        analysis = scaler_analysis(self.context)
        flow = analysis.flow(node)
        phases = flow.phases_before(node)
        scaled = SCALED in phases and not phases & {UNSCALED, HELPED}
        if not scaled and phases <= {None}:
            scaled = flow.scaled_on_entry(node) or analysis.scaled_elsewhere(node)
        if scaled and not flow.in_no_scaler_arm(node):
            self.report(node, func=last_part(self.context.names.qualname(node.func)))
