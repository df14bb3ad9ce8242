"""AMP008 backward-under-autocast: ``.backward()`` or ``torch.autograd.backward`` under autocast,
also through a function of the module that runs the backward (``accumulate(loss, scaler)``)."""

from __future__ import annotations

from astroid import nodes

from flake8_amp.analysis.names import is_self, method_call
from flake8_amp.analysis.scaler import AUTOGRAD_BACKWARD, calls_in_order
from flake8_amp.engine import Check, mentions_autocast


class BackwardUnderAutocast(Check):
    """Autocast belongs around the forward pass and the loss only."""

    code = "AMP008"
    triggers = ("backward",)

    @classmethod
    def applies(cls, source, options):
        return super().applies(source, options) and mentions_autocast(source, options)

    def visit_call(self, node: nodes.Call) -> None:
        if self.context.grad.no_grad_at(node):
            return
        if self._is_backward(node):
            if self._reported_here(node):
                self.report(node)
        elif (self.context.regions.autocast_at(node) is not None
              and self._runs_backward_unreported(node)):
            self.report(node)

    def _reported_here(self, backward: nodes.Call) -> bool:
        """``backward`` runs under autocast and is reported where it is: not in an object's
        ``__call__`` that only its callers' regions reach (the object's call is the line)."""
        regions = self.context.regions
        if regions.autocast_at(backward, with_grad=True) is None:
            return False
        frame = backward.frame()
        return frame.name != "__call__" or regions.local_region(backward)[0]

    def _runs_backward_unreported(self, call: nodes.Call) -> bool:
        """``call`` calls a function of this module that runs a backward (``accumulate(loss,
        scaler)``), or an object whose class here runs one in the method called
        (``loss_scaler(loss, optimizer)`` of a class whose ``__call__`` scales the backward,
        every class it may be of doing so; ``wrapper.backward(loss)``), which is not reported
        inside it: its other callers leave autocast first, so the call inside a region is the
        line to change."""
        names = self.context.names
        function = names.local_function(call)
        helpers = [function] if function is not None else names.object_methods(call)
        return bool(helpers) and all(map(self._backward_unreported_in, helpers))

    def _backward_unreported_in(self, helper: nodes.FunctionDef) -> bool:
        grad = self.context.grad
        backwards = [
            inner
            for inner in calls_in_order(helper)
            if self._is_backward(inner) and not grad.no_grad_at(inner)
        ]
        return bool(backwards) and not any(self._reported_here(inner) for inner in backwards)

    def _is_backward(self, node: nodes.Call) -> bool:
        qualname = self.context.names.qualname(node.func)
        if qualname is not None:
            return qualname in AUTOGRAD_BACKWARD
        method, receiver = method_call(node)
        # ``self.backward(loss)`` is a project method of unknown behaviour.
        return method == "backward" and not is_self(receiver)
