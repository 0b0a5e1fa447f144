"""One torchrun rank of a run of the sharded host optimizer step (``optim_shard.OptimizerShard``) under
adverse timing and irregular call patterns, for tests/test_optim_shard.py.

    python -m torch.distributed.run --nproc-per-node 2 tests/dist_scripts/shard_step.py --shard --out r.json

Every rank trains the same small ``nn.Sequential`` (six optimizer units, so each rank owns some) on the
same whole global batch each step, so the replicas see identical gradients with or without a gradient
reduction; the run reports every rank's losses and a digest of every rank's masters and weights, which
a test compares bit for bit with the same run without ``--shard`` (every rank steps everything).

* ``--sync-via dp``: ``enable_data_parallel(shard_optimizer=--shard)``: the real data-parallel step,
  whose gradient reduction (one collective at the start of every step) also orders the ranks.
* ``--sync-via shard-only``: no gradient reduction at all: the model's ``grad_sync`` only carries an
  ``OptimizerShard`` as its ``step_sync`` (with ``--shard``), so the shard's own barriers are all that
  orders one rank's reads of the shared masters against another rank's writes.
* ``--slow-rank R --slow-s S``: rank R copies the masters into its model slowly (S seconds before each
  unit of ``stage_params`` and ``copy_params_to_model``), as a rank on a busy core would.
* ``--schedule``: per step, its training calls and evaluations, e.g. ``1,1e1,2,e,3s``: a digit is a
  training call, ``e`` an evaluation forward (no grad) at that point, ``s`` a synchronous step.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

os.environ.setdefault("RPP_DISABLE_TORCH_COMPILE", "1")

import torch
import torch.distributed as dist
from common import finish  # this folder: first on sys.path
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe import distributed as rdist
from roundpipe.distributed.optim_shard import OptimizerShard
from roundpipe.host import step as optim_step

torch.set_num_threads(1)

WIDTH, ROWS = 12, 8


class ShardOnly:
    """A ``grad_sync`` (``roundpipe.runtime.grad_sync.GradSync``) that reduces nothing and carries the sharded
    step: every rank computes the same gradients itself."""

    def __init__(self, step_sync: Optional[OptimizerShard]) -> None:
        self.step_sync = step_sync

    def on_step_launch(self) -> None:
        pass

    def reduce_host(self, params: List[nn.Parameter]) -> None:
        pass

    def agree_plan(self, model: Any, run_type: Any, plan: Any) -> Any:
        return plan

    def layer_reducer(self, model: Any, layer_id: int) -> None:
        return None


def build(dtype: torch.dtype) -> RoundPipe:
    torch.manual_seed(0)
    layers: List[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    net = nn.Sequential(*layers).to(dtype)
    cfg = RoundPipeRunConfig(num_microbatch=2)
    return RoundPipe(net, optim_dtype=torch.float32, model_run_config=cfg, name="shard")


def batch(step: int, call: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + call)
    return torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, WIDTH, generator=g)


def slow_per_unit(fn: Callable[..., None], delay_s: float) -> Callable[..., None]:
    """``fn(units, ...)`` applied one unit at a time, ``delay_s`` before each (both functions treat the
    units independently, so this changes their timing only)."""

    def slow(units: List[Any], *args: Any, **kwargs: Any) -> None:
        for unit in units:
            time.sleep(delay_s)
            fn([unit], *args, **kwargs)

    return slow


def parse_schedule(text: str) -> List[Tuple[List[str], bool]]:
    """``"1,1e1,3s"`` -> per step: its actions (``"t"`` training call, ``"e"`` evaluation) and whether
    the step is asynchronous."""
    steps = []
    for item in text.split(","):
        actions: List[str] = []
        for ch in item.rstrip("s"):
            actions += ["e"] if ch == "e" else ["t"] * int(ch)
        steps.append((actions, not item.endswith("s")))
    return steps


def digest(tensors: List[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shard", action="store_true", help="share the host step among the ranks (else replicated)")
    ap.add_argument("--sync-via", choices=["dp", "shard-only"], default="dp")
    ap.add_argument("--schedule", default="1,1,1,1,1,1")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--slow-rank", type=int, default=None)
    ap.add_argument("--slow-s", type=float, default=0.05)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    env = rdist.init_from_env()
    rank = env.rank
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = build(dtype)
    masters = list(model.optim_parameters())
    shard: Optional[OptimizerShard] = None
    if args.sync_via == "dp":
        dp = rdist.enable_data_parallel(model, shard_optimizer=args.shard)
        shard = dp.step_sync
    else:
        shard = OptimizerShard(model, None) if args.shard else None
        model.grad_sync = ShardOnly(shard)
    opt = torch.optim.AdamW(masters, lr=0.02, weight_decay=0.01)
    if args.slow_rank == rank:
        # The step kernel looks both up in the module at each step.
        optim_step.stage_params = slow_per_unit(optim_step.stage_params, args.slow_s)  # type: ignore
        optim_step.copy_params_to_model = slow_per_unit(optim_step.copy_params_to_model, args.slow_s)  # type: ignore

    def step_fn() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    # Every master's version counter must move at each step on every rank, also where another rank wrote
    # it (ParamAttribute.weights_current compares them).
    versions = [m._version for m in masters]
    losses: List[float] = []
    evals: List[float] = []
    for step, (actions, is_async) in enumerate(parse_schedule(args.schedule)):
        for call, action in enumerate(actions):
            x, y = batch(step, call)
            if action == "e":
                with torch.no_grad():
                    evals.append(float(((model(x.to(dtype)).float() - y) ** 2).mean()))
                continue
            n = sum(a == "t" for a in actions)
            loss = model.forward_backward(
                input_args=(x.to(dtype),), label=y, loss_fn=lambda o, t: ((o.float() - t) ** 2).mean() / n
            )
            losses.append(float(loss))
        model.step(step_fn, is_async=is_async)
    model.synchronize()
    weights = [p for p in model.model.parameters()]
    moved = min(m._version - v for m, v in zip(masters, versions))
    mine = {"losses": losses, "evals": evals, "masters": digest(masters), "weights": digest(weights)}
    mine["version_moves"] = moved
    ranks: List[Any] = [None] * env.world_size
    dist.all_gather_object(ranks, mine)
    result: Dict[str, Any] = {"ranks": ranks}
    if shard is not None:
        result["owned_here"], result["total_params"] = shard.owned_params, shard.total_params
    return finish(rank, args.out, result)


if __name__ == "__main__":
    sys.exit(main())
