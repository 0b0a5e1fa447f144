"""Kept import path: ``roundpipe.plan`` is ``roundpipe.planning.plan``
(``from roundpipe.plan import ModelExecutePlan`` in docs/execute-plans.md).
The very module object, not a copy, so its globals and monkeypatches are shared."""

import sys

# The real module, and the documented names for readers and type checkers:
from roundpipe.planning import plan as _real
from roundpipe.planning.plan import ModelExecutePlan  # noqa: F401

sys.modules[__name__] = _real
