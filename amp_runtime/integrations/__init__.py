"""The guard switched on from the trainers that drive the loop.

- ``amp_runtime.integrations.lightning.AmpGuardCallback``: a Lightning ``Callback``
  (``import lightning.pytorch``); ``amp_runtime.integrations.pytorch_lightning`` has the same
  callback for the ``pytorch_lightning`` package name.
- ``amp_runtime.integrations.transformers.AmpGuardCallback``: a Hugging Face
  ``TrainerCallback``.

Each module imports its framework when it is imported itself, and says what to install
when the framework is missing; neither framework is a dependency of flake8-amp.
"""
