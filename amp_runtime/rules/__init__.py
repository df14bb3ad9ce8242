"""Runtime halves of the code-pattern rules, one module per code.

``amp_runtime/rules/ampNNN.py`` enforces while the program runs what
``flake8_amp/rules/ampNNN.py`` finds in the source. Each module offers
``monitors(guard)`` and is listed in ``amp_runtime.guard.MONITOR_MODULES``.
"""
