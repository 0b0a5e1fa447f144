"""Kept import path: ``roundpipe.timer`` is ``roundpipe.planning.timer``
(``from roundpipe.timer import ModelTimer`` in the user docs (logging)).
The very module object, not a copy, so its globals and monkeypatches are shared."""

import sys

# The real module, and the documented names for readers and type checkers:
from roundpipe.planning import timer as _real
from roundpipe.planning.timer import ModelTimer  # noqa: F401

sys.modules[__name__] = _real
