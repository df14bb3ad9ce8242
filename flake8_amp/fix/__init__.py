"""``python -m flake8_amp fix``: mechanical fixes for what the linter reports, with libcst.

libcst (the optional extra ``flake8-amp[fix]``) rewrites code while keeping its comments
and layout. The flake8 plugin never imports this package, so the linter keeps its two
dependencies, flake8 and astroid.

- :mod:`~flake8_amp.fix.command` — the command line (diff, ``--write``, exit codes).
- :mod:`~flake8_amp.fix.driver` — one file: lint, plan, rewrite, check the result.
- :mod:`~flake8_amp.fix.base` — the file as the linter and libcst see it; edits.
- :mod:`~flake8_amp.fix.amp005`, :mod:`~flake8_amp.fix.amp007`,
  :mod:`~flake8_amp.fix.amp009` — one fixer per code.
"""

#: The codes with a fixer. Kept here, free of libcst, for ``--help`` and ``--select``.
FIXABLE = ("AMP005", "AMP007", "AMP009")
#: How a left-alone reason starts when a fix was made and then undone by the driver's check.
WITHDRAWN = "fix withdrawn"
