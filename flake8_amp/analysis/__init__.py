"""Shared analyses, each written once and used by every rule through the engine's Context.

- :mod:`~flake8_amp.analysis.names` — qualified names, call targets, instances, partials.
- :mod:`~flake8_amp.analysis.regions` — autocast regions (device, dtype, enabled).
- :mod:`~flake8_amp.analysis.context` — no_grad blocks, inference/export and training code.
- :mod:`~flake8_amp.analysis.dtypes` — fp32/fp16/bf16/low/unknown per expression.
- :mod:`~flake8_amp.analysis.constants` — numbers an expression always evaluates to.
- :mod:`~flake8_amp.analysis.scaler` — GradScaler usage in training loops.
"""
