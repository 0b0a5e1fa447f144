"""What every rank script here ends with: rank 0 writes the run's result for the test to read, then each
rank leaves the process group. The scripts run as files (their folder is first on ``sys.path``)."""

from __future__ import annotations

import json
from typing import Any, Optional

from roundpipe import distributed as rdist


def finish(rank: int, out: Optional[str], result: Any) -> int:
    """Rank 0 writes ``result`` as JSON to ``out`` (when given); every rank leaves the process group. Returns
    the exit status, 0."""
    if rank == 0 and out:
        with open(out, "w") as f:
            json.dump(result, f)
    rdist.destroy()
    return 0
