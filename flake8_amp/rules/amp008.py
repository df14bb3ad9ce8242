"""AMP008 backward-under-autocast: ``.backward()`` or ``torch.autograd.backward`` under autocast."""

from __future__ import annotations

from astroid import nodes

from flake8_amp.analysis.names import is_self, method_call
from flake8_amp.analysis.scaler import AUTOGRAD_BACKWARD
from flake8_amp.engine import Check, mentions_autocast


class BackwardUnderAutocast(Check):
    """Autocast belongs around the forward pass and the loss only."""

    code = "AMP008"
    triggers = ("backward",)

    @classmethod
    def applies(cls, source, options):
        return super().applies(source, options) and mentions_autocast(source, options)

    def visit_call(self, node: nodes.Call) -> None:
        if not self._is_backward(node):
            return
        if self.context.grad.no_grad_at(node):
            return
        if self.context.regions.autocast_at(node, with_grad=True) is not None:
            self.report(node)

    def _is_backward(self, node: nodes.Call) -> bool:
        qualname = self.context.names.qualname(node.func)
        if qualname is not None:
            return qualname in AUTOGRAD_BACKWARD
        method, receiver = method_call(node)
        # ``self.backward(loss)`` is a project method of unknown behaviour.
        return method == "backward" and not is_self(receiver)
