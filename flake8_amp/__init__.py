"""flake8-amp: a flake8 plugin that finds PyTorch mixed-precision (AMP) misuse.

Never imports torch: it must run in lint-only environments.
"""
__version__ = "0.1.0"
