"""Kept import path: ``roundpipe.estimate`` is ``roundpipe.planning.estimate``
(``roundpipe.estimate.estimate(...)`` in docs/long-context.md).
The very module object, not a copy, so its globals and monkeypatches are shared."""

import sys

# The real module, and the documented names for readers and type checkers:
from roundpipe.planning import estimate as _real
from roundpipe.planning.estimate import ModelShape, estimate, longest_context  # noqa: F401

sys.modules[__name__] = _real
