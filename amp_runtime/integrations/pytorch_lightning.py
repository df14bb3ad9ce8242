"""``AmpGuardCallback`` for Lightning under its ``pytorch_lightning`` package name::

    from amp_runtime.integrations.pytorch_lightning import AmpGuardCallback

    trainer = pytorch_lightning.Trainer(precision="16-mixed", callbacks=[AmpGuardCallback()])

The same callback as ``amp_runtime.integrations.lightning``, on ``pytorch_lightning.Callback``.
"""
from __future__ import annotations

from ._lightning import LightningGuardHooks
from .session import import_framework

_pl = import_framework("pytorch_lightning", __name__, "pytorch-lightning")


class AmpGuardCallback(LightningGuardHooks, _pl.Callback):
    __doc__ = LightningGuardHooks.__doc__


__all__ = ["AmpGuardCallback"]
