"""Kept import path: ``roundpipe.batch`` is ``roundpipe.runtime.batch``
(``from roundpipe.batch import avg_reducer`` in docs/user-guide.md).
The very module object, not a copy, so its globals and monkeypatches are shared."""

import sys

# The real module, and the documented names for readers and type checkers:
from roundpipe.runtime import batch as _real
from roundpipe.runtime.batch import avg_reducer  # noqa: F401

sys.modules[__name__] = _real
