"""``AmpGuardCallback`` for Lightning (``import lightning.pytorch``)::

    from amp_runtime.integrations.lightning import AmpGuardCallback

    trainer = lightning.pytorch.Trainer(precision="bf16-mixed", callbacks=[AmpGuardCallback()])
    trainer.fit(model)

With the ``pytorch_lightning`` package name, import it from
``amp_runtime.integrations.pytorch_lightning``: each package's Trainer accepts only its own
``Callback`` class.
"""
from __future__ import annotations

from ._lightning import LightningGuardHooks
from .session import import_framework

_pl = import_framework("lightning.pytorch", __name__, "lightning")


class AmpGuardCallback(LightningGuardHooks, _pl.Callback):
    __doc__ = LightningGuardHooks.__doc__


__all__ = ["AmpGuardCallback"]
