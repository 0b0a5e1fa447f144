"""Kept import path: ``roundpipe.run_config`` is ``roundpipe.runtime.run_config``
(``from roundpipe.run_config import RoundPipeRunConfig`` in the spec and the user docs).
The very module object, not a copy, so its globals and monkeypatches are shared."""

import sys

# The real module, and the documented names for readers and type checkers:
from roundpipe.runtime import run_config as _real
from roundpipe.runtime.run_config import FullRoundPipeRunConfig, RoundPipeRunConfig  # noqa: F401

sys.modules[__name__] = _real
