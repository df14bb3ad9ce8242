"""AMP002 loss-outside-autocast: a loss runs with autocast off on low-precision inputs.

Autocast would run the loss in fp32; outside the region it runs in the inputs' fp16/bf16.
The input must be part of a training graph (``requires_grad`` with grad mode on) that reaches an
fp32 parameter, as autocast's graphs do (it casts fp32 weights on the fly): the outputs of a model
cast with ``.half()`` are low precision without autocast, and that is AMP001's finding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..monitors import LOW_PRECISION, Monitor, OpHandler, autocast_on, autograd_nodes, dtype_name

LOSS_FUNCTIONS = (
    F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss,
    F.binary_cross_entropy, F.binary_cross_entropy_with_logits, F.kl_div, F.soft_margin_loss,
    F.multilabel_soft_margin_loss, F.poisson_nll_loss, F.gaussian_nll_loss,
)
#: Autograd nodes searched for an fp32 parameter behind a loss's input.
GRAPH_NODES = 256


def reaches_fp32_parameter(tensor: torch.Tensor) -> bool:
    """Whether the graph behind ``tensor`` accumulates into an fp32 leaf (a parameter)."""
    for node in autograd_nodes([tensor.grad_fn], GRAPH_NODES):
        leaf = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if isinstance(leaf, torch.Tensor) and leaf.dtype == torch.float32:
            return True
    return False


class LossOutsideAutocast(Monitor):
    codes = ("AMP002",)

    def op_handlers(self):
        return {func: OpHandler(before=self._check_loss) for func in LOSS_FUNCTIONS}

    def _check_loss(self, func, args, kwargs) -> None:
        prediction = args[0] if args else kwargs.get("input")
        if not isinstance(prediction, torch.Tensor) or prediction.dtype not in LOW_PRECISION:
            return
        if autocast_on(prediction.device.type):
            return
        if not (prediction.requires_grad and torch.is_grad_enabled()):
            return
        if reaches_fp32_parameter(prediction):
            self.guard.emit("AMP002", op=func, loss=func.__name__,
                            arg=f"its {dtype_name(prediction.dtype)} input")


def monitors(guard):
    return [LossOutsideAutocast()]
