"""AMP005 clip-before-unscale: clipping gradients that a GradScaler scaled and did not unscale."""

from __future__ import annotations

from astroid import nodes

from typing import Optional

from flake8_amp.analysis.names import last_part, method_call
from flake8_amp.analysis.scaler import HELPED, SCALED, UNSCALED, calls_in_order, scaler_analysis
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


#: Models whose own ``clip_grad_norm_`` method clips the gradients as they are (FSDP's); the
#: methods of that name of accelerate's and DeepSpeed's objects unscale first.
CLIPPING_MODELS = frozenset(
    {
        "torch.distributed.fsdp.FullyShardedDataParallel",
        "torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel",
    }
)


class ClipBeforeUnscale(Check):
    """The clip threshold is compared with gradients still multiplied by the loss scale."""

    code = "AMP005"
    triggers = ("clip_grad",)

    @classmethod
    def applies(cls, source, options):
        return super().applies(source, options) and ".scale(" in source

    def visit_call(self, node: nodes.Call) -> None:
        clip = clip_kind(self.context, node)
        if clip is None:
            return
        analysis = scaler_analysis(self.context)
        flow = analysis.flow(node)
        phases = flow.phases_before(node)
        scaled = _scaled_on_its_path(phases)
        if not scaled and phases <= {None}:
            scaled = flow.scaled_on_entry(node) or (
                analysis.scaled_elsewhere(node, clip=True) and not self._reported_at_calls(node)
            )
        if scaled and not flow.in_no_scaler_arm(node):
            self.report(node, func=clip)

    def _reported_at_calls(self, node: nodes.Call) -> bool:
        """``node`` clips inside a helper that touches no scaler, and every call of that helper
        follows its caller's own scaled backward: each is reported there, where ``unscale_``
        goes (a ``ClipMixin.clip_gradients()`` called from each trainer's step)."""
        function = node.scope()
        if not isinstance(function, nodes.FunctionDef):
            return False
        sites = self.context.names.call_sites(function)
        analysis = scaler_analysis(self.context)
        return bool(sites) and all(
            clip_kind(self.context, site) is not None
            and _scaled_on_its_path(analysis.flow(site).phases_before(site))
            for site in sites
        )


def _scaled_on_its_path(phases) -> bool:
    """``phases`` (a call's :meth:`ScalerFlow.phases_before`) say a scaled backward of its own
    function precedes it, and no path unscaled the gradients or handed the scaler on since."""
    return SCALED in phases and not phases & {UNSCALED, HELPED}


def clip_kind(context, node: nodes.Call) -> Optional[str]:
    """How ``node`` clips gradients, if it does: a ``torch.nn.utils`` clip function,
    ``model.clip_grad_norm_()`` of an FSDP model, or a function of this module that
    clips and touches no scaler (``grad_norm = self._clip()``)."""
    names = context.names
    method, receiver = method_call(node)
    if method and not method.startswith("clip_grad") and names.local_function(node) is None:
        return None  # cheap test before name resolution (names may be import aliases)
    qualname = names.qualname(node.func)
    if qualname in CLIP_FUNCTIONS:
        return last_part(qualname)
    if method == "clip_grad_norm_" and names.instance_class(receiver) in CLIPPING_MODELS:
        return f"{receiver.as_string()}.clip_grad_norm_"
    helper = names.local_function(node)
    analysis = scaler_analysis(context)
    # a helper that scales its own backward has its clip judged inside it
    if (
        helper is not None
        and not analysis.is_scaler_helper(node)
        and not analysis.flow(helper).scaled_backwards
    ):
        if any(names.qualname(call.func) in CLIP_FUNCTIONS for call in calls_in_order(helper)):
            return f"{node.func.as_string()}()"
    return None
