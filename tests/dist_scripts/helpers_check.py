"""One torchrun rank exercising the main-thread helpers of roundpipe.distributed (tests/test_distributed.py)."""

from __future__ import annotations

import sys

import torch

from roundpipe import distributed as rdist


def main() -> int:
    env = rdist.init_from_env()
    r, w = env.rank, env.world_size
    assert env.distributed and w == 2 and rdist.get_rank() == r and rdist.is_main_process() == (r == 0)
    assert rdist.broadcast_object({"path": f"from-rank-{r}"}) == {"path": "from-rank-0"}
    assert rdist.all_reduce_scalars([r + 1.0, 10.0], "sum") == [3.0, 20.0]
    assert rdist.all_reduce_scalars([r + 1.0], "mean") == [1.5]
    assert rdist.all_reduce_scalars([float(r)], "max") == [1.0]
    assert rdist.any_across_ranks(r == 1) and not rdist.any_across_ranks(False)
    rdist.assert_same_across_ranks(42, "the answer")
    try:
        rdist.assert_same_across_ranks(r, "this rank")
    except rdist.DataParallelError as exc:
        assert "this rank differs between ranks (rank 0: 0, rank 1: 1)" in str(exc), exc
    else:
        raise AssertionError("differing values were not detected")
    # The global batch, split and gathered back in rank order, is the batch.
    batch = torch.arange(10).reshape(5, 2)
    mine = rdist.shard(batch)
    sizes = [0, 0]
    sizes[r] = mine.shape[0]
    assert rdist.all_reduce_scalars(sizes, "sum") == [2.0, 3.0]
    rdist.barrier()
    print(f"rank {r}: helpers ok", flush=True)
    rdist.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
