"""One torchrun rank of ``roundpipe train`` that fails on purpose, for tests/cli/test_distributed.py.

    python -m torch.distributed.run --nproc-per-node 2 tests/dist_scripts/cli_fail.py RANK STEP train [options]

Rank ``RANK`` raises in its forward of optimizer step ``STEP`` (the step's first batch); the other
ranks must stop with one line naming it instead of waiting for it.
"""

from __future__ import annotations

import os
import sys

from roundpipe.cli import main
from roundpipe.cli.pipeline import PipelineModel


def inject(rank: int, step: int) -> None:
    """Make ``PipelineModel.forward_backward`` raise on ``rank`` at its first call of ``step``."""
    original = PipelineModel.forward_backward
    calls = {"n": 0}
    grad_accum = int(sys.argv[sys.argv.index("--grad-accum") + 1]) if "--grad-accum" in sys.argv else 1

    def failing(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if int(os.environ["RANK"]) == rank and calls["n"] == (step - 1) * grad_accum + 1:
            raise RuntimeError(f"injected failure on rank {rank} at step {step}")
        return original(self, *args, **kwargs)

    PipelineModel.forward_backward = failing  # type: ignore[method-assign]


if __name__ == "__main__":
    fail_rank, fail_step, argv = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    inject(fail_rank, fail_step)
    sys.exit(main(argv))
