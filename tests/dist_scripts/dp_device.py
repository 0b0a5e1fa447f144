"""Data parallel with the gradients reduced on the devices (``reduce_on="device"``), for
tests/test_distributed_device.py. One torchrun launch runs several scenarios one after the other:

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/dist_scripts/dp_device.py \\
        --scenarios mlp,qwen-2dev --out r.json

For each scenario every rank builds the same model, enables data parallel, trains ``--steps`` steps on
its contiguous share of the same global batches (``shard``) and checks that the replicas hold
bit-identical masters; rank 0 then trains the same model without data parallel on the whole global
batches (the reference, same device count) and on its own share only (to show the check is sensitive),
and reports the largest parameter differences. ``--out`` gets ``{scenario: result}`` from rank 0.

Scenario names: ``MODEL[-Ndev][-sync][-accum][-uneven][-skew]`` plus the special ones below.

* models: ``mlp`` (an ``nn.Sequential`` full fine-tune whose first layer has one weight used by no rank,
  see dp_train.py), ``qwen`` (a tiny Qwen3 full fine-tune with tied input/output embeddings: a shared
  parameter reduced by two layers), ``lora`` (the tiny Qwen3 with LoRA, dp_train.py), ``auto`` (an
  ``AutoRoundPipe`` whose host parameter is reduced on the host while its body reduces on the devices);
* ``-Ndev``: N CPU workers per rank (default 1); ``-sync``: synchronous steps (default asynchronous);
* ``-accum``: two ``forward_backward`` calls per step, on two different global batches;
* ``-uneven``: (lora) uneven loss-token counts, with ``normalize_by`` before the backward;
* ``-skew``: rank 1's automatic plan is forced to differ from rank 0's (one layer per stage), so the
  ranks only agree through the plan agreement.

Special scenarios (expected to fail cleanly; the result holds the error text):

* ``late-normalize``: ``normalize_by`` with unequal counts after the backward;
* ``order-check``: the plan agreement switched off and the ranks' plans made to differ on a model
  whose layers all have the same size, so mismatched gradients would pair up silently: the step's
  order check must refuse the step.

``--fail dead|skip`` (one ``mlp`` scenario): at step 2 rank 1 dies (``os._exit`` in its loss function, so
rank 0's devices are waiting in their gradient all-reduce) or skips its training call.
``--cuda``: GPU comparison for the lead (``--scenarios gpu``): NCCL device reduction vs host reduction
vs one process, bf16, on one GPU per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

os.environ.setdefault("RPP_DISABLE_TORCH_COMPILE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dp_train as base  # noqa: E402  (models and batches of the host-reduction tests)
import torch  # noqa: E402
from common import finish  # noqa: E402
from torch import nn  # noqa: E402

import roundpipe  # noqa: E402
from roundpipe import AutoRoundPipe, RoundPipe, RoundPipeRunConfig  # noqa: E402
from roundpipe import distributed as rdist  # noqa: E402
from roundpipe.devices import device as device_mod
from roundpipe.models import configs
from roundpipe.planning.plan import ModelExecutePlan  # noqa: E402


def build_qwen(hidden: int = 32, layers: int = 2, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A tiny Qwen3, full fine-tune, tied embeddings (the head and the embedding share a weight)."""
    import transformers

    torch.manual_seed(0)
    sizes = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, head_dim=hidden // 4)
    config = configs.tiny_config("qwen3", **sizes, vocab_size=base.VOCAB, tie_word_embeddings=True)
    return transformers.AutoModelForCausalLM.from_config(config).to(dtype)


class SameSize(nn.Module):
    """A layer of the ``order-check`` model: every layer has the same parameter shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(base.IN, base.IN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Scenario:
    def __init__(self, name: str) -> None:
        self.name = name
        parts = name.split("-")
        self.model = parts[0]
        self.devices = 1
        self.sync = "sync" in parts
        self.accum = 2 if "accum" in parts else 1
        self.uneven = "uneven" in parts
        self.skew = "skew" in parts
        for p in parts:
            if p.endswith("dev") and p[:-3].isdigit():
                self.devices = int(p[:-3])


class Trainer:
    """A model, its optimizer and ``train(step, rows)`` (data parallel with ``reduce_on`` or not)."""

    def __init__(self, sc: Scenario, args: argparse.Namespace, reduce_on: Optional[str], adapter_seed: int) -> None:
        self.sc, self.args = sc, args
        self.dtype = torch.bfloat16 if args.cuda else torch.float32
        cfg = RoundPipeRunConfig(num_microbatch=2)
        if sc.model == "mlp":
            self.model: Any = RoundPipe(
                base.build_mlp().to(self.dtype), optim_dtype=torch.float32, model_run_config=cfg, name="mlp"
            )
        elif sc.model == "same":
            torch.manual_seed(0)
            self.model = RoundPipe(
                nn.Sequential(*[SameSize() for _ in range(6)]),
                optim_dtype=torch.float32,
                model_run_config=cfg,
                name="same",
            )
        elif sc.model == "auto":
            self.model = AutoRoundPipe(base.HostScaled(self.dtype), name="auto", optim_dtype=torch.float32)
        elif sc.model == "qwen":
            self.model = roundpipe.wrap_model_to_roundpipe(
                build_qwen(dtype=self.dtype), optim_dtype=torch.float32, model_run_config=cfg, name="qwen"
            )
        elif sc.model == "gpu":
            self.model = roundpipe.wrap_model_to_roundpipe(
                build_qwen(hidden=256, layers=4, dtype=self.dtype),
                optim_dtype=torch.float32,
                model_run_config=cfg,
                name="gpu",
            )
        elif sc.model == "lora":
            self.model = roundpipe.wrap_model_to_roundpipe(
                base.build_lora(adapter_seed).to(self.dtype),
                optim_dtype=torch.float32,
                model_run_config=cfg,
                name="lora",
            )
        else:
            raise SystemExit(f"unknown model {sc.model!r}")
        self.dp = (
            rdist.enable_data_parallel(self.model, bucket_mb=args.bucket_mb, reduce_on=reduce_on) if reduce_on else None
        )
        self.named = list(self.model.optim_named_parameters())
        self.opt = torch.optim.SGD([m for _, m in self.named], lr=args.lr, momentum=0.9, weight_decay=0.01)
        self.losses: List[float] = []

    def step_fn(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def _call(self, batch_index: int, rows: Callable[[Any], Any]) -> float:
        """One forward + backward on ``rows`` of global batch ``batch_index``; returns the loss."""
        sc = self.sc
        if sc.model in ("mlp", "same"):
            x, y = rows(base.mlp_batch(batch_index))
            n = x.shape[0]
            die = (
                self.args.fail == "dead"
                and batch_index == 2 * sc.accum
                and rdist.get_rank() == 1
                and self.dp is not None
            )

            def loss_fn(out: torch.Tensor, lab: torch.Tensor) -> torch.Tensor:
                if die:  # in the middle of the backward pass: rank 0's devices wait in their all-reduce
                    print(
                        f"rank 1: injected failure (dead) in the backward of step {batch_index // sc.accum}",
                        file=sys.stderr,
                        flush=True,
                    )
                    os._exit(17)
                return ((out.float()[:, : base.OUT] - lab) ** 2).sum() / n

            return float(self.model.forward_backward(input_args=(x.to(self.dtype),), label=y, loss_fn=loss_fn))
        if sc.model == "auto":  # plain forward + loss.backward() through an AutoRoundPipe
            x, y = rows(base.mlp_batch(batch_index))
            loss = ((self.model(x.to(self.dtype)).float() - y) ** 2).sum() / x.shape[0]
            loss.backward()
            return float(loss.detach())
        ids, labels = rows(base.lora_batch(batch_index, sc.uneven))
        return float(self.model.train_step(input_ids=ids, labels=labels))

    def train(self, step: int, rows: Callable[[Any], Any]) -> None:
        sc = self.sc
        if self.dp is not None and sc.uneven:
            from roundpipe.models.loss import count_loss_tokens

            # Before the backward: the device reduction applies the weight on the device.
            self.dp.normalize_by(
                sum(count_loss_tokens(rows(base.lora_batch(step * sc.accum + j, True))[1]) for j in range(sc.accum))
            )
        loss = sum(self._call(step * sc.accum + j, rows) for j in range(sc.accum))
        self.losses.append(loss)
        self.model.step(self.step_fn, is_async=not sc.sync)

    def masters(self) -> Dict[str, torch.Tensor]:
        self.model.synchronize()
        return {n: m.detach().clone().float() for n, m in self.named}


def use_devices(n: int, cuda: bool) -> None:
    """Re-create this process's RoundPipe devices (every scenario picks its own count)."""
    if not cuda:
        os.environ["RPP_DEVICES"] = f"cpu:{n}"
        device_mod.reset_devices()


class PlanSkew:
    """Make this rank's automatic plans differ from the other ranks' (restored on exit)."""

    def __init__(self, how: str) -> None:
        self.how = how

    def __enter__(self) -> "PlanSkew":
        self.saved = ModelExecutePlan.__dict__["auto"]
        how = self.how

        def auto(cls: Any, run_type: Any, *models: Any, **kw: Any) -> ModelExecutePlan:
            n = models[0].num_layers
            if how == "layerwise":
                return cls.layerwise(n, run_type)
            half = max(1, n // 2)  # two stages
            return cls([range(0, half), range(half, n)], [range(0, half), range(half, n)]).for_run_type(run_type, n)

        ModelExecutePlan.auto = classmethod(auto)  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        ModelExecutePlan.auto = self.saved  # type: ignore[assignment]


def run_scenario(sc: Scenario, args: argparse.Namespace, rank: int, world: int) -> Dict[str, Any]:
    use_devices(sc.devices, args.cuda)
    t0 = time.time()
    skew = PlanSkew("layerwise") if sc.skew and rank == 1 else None
    if skew:
        skew.__enter__()
    try:
        trainer = Trainer(sc, args, "device", adapter_seed=100 + rank)
        assert trainer.dp is not None and trainer.dp.reduce_on == "device" and trainer.dp.device is not None
        for step in range(args.steps):
            if args.fail == "skip" and step == 2 and rank == 1:
                print(f"rank {rank}: skipping the training call of step {step}", file=sys.stderr, flush=True)
                trainer.model.step(trainer.step_fn, is_async=not sc.sync)
                continue
            trainer.train(step, rdist.shard)
        masters = trainer.masters()
    finally:
        if skew:
            skew.__exit__()
    rdist.assert_same_across_ranks(base.digest(masters), f"parameters after scenario {sc.name}")
    dp = trainer.dp
    adopted = [0] * world
    import torch.distributed as dist

    dist.all_gather_object(adopted, dp.device.adopted_plans)
    result: Dict[str, Any] = {
        "world": world,
        "losses": trainer.losses,
        "dp_steps": dp.stats.steps,
        "collectives": dp.stats.collectives,
        "adopted_plans": adopted,
    }
    dp.close()
    if rank == 0:
        ref = Trainer(sc, args, None, adapter_seed=100)
        for step in range(args.steps):
            ref.train(step, lambda b: b)
        ref_masters = ref.masters()
        result["max_diff"] = base.max_diff(masters, ref_masters)
        local = Trainer(sc, args, None, adapter_seed=100)
        for step in range(args.steps):
            local.train(step, lambda b: rdist.shard(b, 0, world))
        result["local_only_diff"] = base.max_diff(local.masters(), ref_masters)
        if sc.model in ("mlp", "auto"):
            prefix = "0" if sc.model == "mlp" else "body.model.0"
            result["c_moved"] = float((masters[f"{prefix}.c"] - base.build_mlp()[0].c.detach().float()).abs().max())
    result["seconds"] = time.time() - t0
    rdist.barrier()
    return result


def run_late_normalize(args: argparse.Namespace, rank: int, world: int) -> Dict[str, Any]:
    """normalize_by with unequal counts after the backward: every rank raises the same clear error."""
    use_devices(1, args.cuda)
    trainer = Trainer(Scenario("mlp"), args, "device", adapter_seed=100)
    assert trainer.dp is not None
    trainer._call(0, rdist.shard)
    try:
        trainer.dp.normalize_by(3 + 2 * rank)
        error = ""
    except rdist.DataParallelError as exc:
        error = str(exc)
    # Equal counts after the backward are accepted (the default weight 1/W was the right one).
    trainer.model.step(trainer.step_fn)
    trainer._call(1, rdist.shard)
    trainer.dp.normalize_by(4)
    trainer.model.step(trainer.step_fn)
    trainer.masters()
    trainer.dp.close()
    rdist.barrier()
    return {"error": error}


def run_order_check(args: argparse.Namespace, rank: int, world: int) -> Dict[str, Any]:
    """Plan agreement off, plans differ, all layers of one size: the step must be refused."""
    use_devices(1, args.cuda)
    with PlanSkew("layerwise" if rank == 1 else "halves"):
        trainer = Trainer(Scenario("same"), args, "device", adapter_seed=100)
        assert trainer.dp is not None and trainer.dp.device is not None
        trainer.dp.device.index_of.clear()  # test only: no plan agreement
        error = ""
        try:
            trainer.train(0, rdist.shard)
            trainer.model.synchronize()
        except Exception as exc:  # noqa: BLE001 - the step kernel's error, re-raised here
            error = f"{type(exc).__name__}: {exc}"
    rdist.barrier()
    return {"error": error}


def run_gpu(args: argparse.Namespace, rank: int, world: int) -> Dict[str, Any]:
    """bf16 tiny Qwen3 on one GPU per rank: device (NCCL) vs host (gloo) reduction vs one process."""
    sc = Scenario("gpu")
    out: Dict[str, Any] = {"world": world, "device": torch.cuda.get_device_name()}
    masters: Dict[str, Dict[str, torch.Tensor]] = {}
    for mode in ("device", "host"):
        t0 = time.time()
        trainer = Trainer(sc, args, mode, adapter_seed=100)
        assert trainer.dp is not None and trainer.dp.reduce_on == mode
        for step in range(args.steps):
            trainer.train(step, rdist.shard)
        masters[mode] = trainer.masters()
        rdist.assert_same_across_ranks(base.digest(masters[mode]), f"parameters after {mode} reduction")
        out[f"{mode}_losses"] = rdist.all_reduce_scalars(trainer.losses, "mean")
        out[f"{mode}_backend"] = trainer.dp.device.backend if trainer.dp.device is not None else "gloo"
        out[f"{mode}_seconds"] = time.time() - t0
        out[f"{mode}_reduce_s"] = list(trainer.dp.stats.history)
        trainer.dp.close()
        del trainer
    if rank == 0:
        ref = Trainer(sc, args, None, adapter_seed=100)
        for step in range(args.steps):
            ref.train(step, lambda b: b)
        out["ref_losses"] = ref.losses
        ref_m = ref.masters()
        del ref
        out["device_vs_ref"] = base.max_diff(masters["device"], ref_m)
        out["host_vs_ref"] = base.max_diff(masters["host"], ref_m)
        out["device_vs_host"] = base.max_diff(masters["device"], masters["host"])
        # Sensitivity: rank 0's share alone (what a broken reduction would train on).
        local = Trainer(sc, args, None, adapter_seed=100)
        for step in range(args.steps):
            local.train(step, lambda b: rdist.shard(b, 0, world))
        out["local_only_vs_ref"] = base.max_diff(local.masters(), ref_m)
    rdist.barrier()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenarios", default="mlp")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument(
        "--bucket-mb", type=float, default=0.001, help="tiny: several buckets per layer, packed and in place"
    )
    ap.add_argument("--fail", choices=["dead", "skip"], default=None)
    ap.add_argument("--cuda", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    env = rdist.init_from_env()
    rank, world = env.rank, env.world_size
    results: Dict[str, Any] = {}
    for name in args.scenarios.split(","):
        try:
            if name == "late-normalize":
                results[name] = run_late_normalize(args, rank, world)
            elif name == "order-check":
                results[name] = run_order_check(args, rank, world)
            elif name == "gpu":
                results[name] = run_gpu(args, rank, world)
            else:
                results[name] = run_scenario(Scenario(name), args, rank, world)
        except BaseException:
            print(f"rank {rank}: scenario {name} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            raise
        if rank == 0:
            print(f"scenario {name}: {json.dumps(results[name])}", flush=True)
    return finish(rank, args.out, results)


if __name__ == "__main__":
    sys.exit(main())
