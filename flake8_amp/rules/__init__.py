"""The rule registry: every static rule, one module per code.

Adding a rule is one line here. Each rule is a :class:`flake8_amp.engine.Check`
subclass; the plugin runs them all in one walk.
"""
from flake8_amp.rules.amp001 import ManualCast
from flake8_amp.rules.amp002 import LossOutsideAutocast
from flake8_amp.rules.amp003 import BceUnderAutocast
from flake8_amp.rules.amp004 import LowPrecisionReduce
from flake8_amp.rules.amp005 import ClipBeforeUnscale
from flake8_amp.rules.amp006 import StepBypassesScaler

RULES = [
    ManualCast,
    LossOutsideAutocast,
    BceUnderAutocast,
    LowPrecisionReduce,
    ClipBeforeUnscale,
    StepBypassesScaler,
]
