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
from flake8_amp.rules.amp007 import Fp16OverflowLiteral
from flake8_amp.rules.amp008 import BackwardUnderAutocast
from flake8_amp.rules.amp009 import DeprecatedAmpApi
from flake8_amp.rules.amp010 import ScalerDtypeMismatch
from flake8_amp.rules.amp011 import TinyEpsilon

RULES = [
    ManualCast,
    LossOutsideAutocast,
    BceUnderAutocast,
    LowPrecisionReduce,
    ClipBeforeUnscale,
    StepBypassesScaler,
    Fp16OverflowLiteral,
    BackwardUnderAutocast,
    DeprecatedAmpApi,
    ScalerDtypeMismatch,
    TinyEpsilon,
]
