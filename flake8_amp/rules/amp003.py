"""AMP003 bce-under-autocast: binary_cross_entropy / nn.BCELoss inside an autocast region."""

from __future__ import annotations

from astroid import nodes

from flake8_amp.engine import Check, Options, mentions_autocast

BCE_FUNCTIONS = frozenset(
    {"torch.nn.functional.binary_cross_entropy", "torch.binary_cross_entropy"}
)
BCE_MODULES = frozenset({"torch.nn.BCELoss"})


class BceUnderAutocast(Check):
    """CUDA autocast raises on binary_cross_entropy; CPU autocast only works by accident."""

    code = "AMP003"
    triggers = ("binary_cross_entropy", "BCELoss")

    @classmethod
    def applies(cls, source: str, options: Options) -> bool:
        return super().applies(source, options) and mentions_autocast(source, options)

    def visit_call(self, node: nodes.Call) -> None:
        callee = self.context.names.callee(node)
        if callee is None:
            return
        if callee.instance and callee.qualname in BCE_MODULES:
            func = "nn.BCELoss"
        elif not callee.instance and callee.qualname in BCE_FUNCTIONS:
            func = "binary_cross_entropy"
        else:
            return
        regions = self.context.regions
        # every caller runs it under autocast, or every caller with gradients on does (the
        # training call raises; an evaluation call after the block is AMP002's)
        if regions.autocast_at(node) is not None or regions.autocast_at(node, with_grad=True):
            self.report(node, func=func)
