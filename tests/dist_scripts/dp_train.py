"""One torchrun rank of a small data-parallel RoundPipe run, for tests/test_distributed.py.

    python -m torch.distributed.run --nproc-per-node 2 tests/dist_scripts/dp_train.py --model mlp --out r.json

Every rank builds the same model, draws the same global batch each step and trains on its contiguous
share (``roundpipe.distributed.shard``). At the end rank 0 checks that all replicas hold bit-identical
masters and, with ``--reference``, trains the same model in this process *without* data parallel on the
whole global batches, and reports the largest parameter difference (plus, to show the check can fail,
the difference to a run on rank 0's share only). Options inject failures and save/resume checkpoints.

Models:
* ``mlp``: an ``nn.Sequential`` RoundPipe whose first layer picks one of three weight matrices by the
  sign of input column 0 (rank 0's rows: ``a``, rank 1's rows: ``b``, nobody: ``c``), so each rank lacks
  a gradient another rank has, and one parameter has none anywhere (SGD with weight decay would move it
  if a zero gradient were invented). Loss: squared error over this process's rows.
* ``auto``: the same MLP as the RoundPipe body of an ``AutoRoundPipe`` whose output is scaled by a
  parameter used on the host (the host unit of the step protocol); ``model(x)`` + ``loss.backward()``.
* ``lora``: a tiny Qwen3 with LoRA adapters (peft) through ``wrap_model_to_roundpipe`` and ``train_step``;
  adapters are initialised with a per-rank seed, so the replicas agree only through the initial
  broadcast. With ``--uneven`` rank 0's share masks more labels than rank 1's, and ``normalize_by``
  makes the result the global token mean.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

os.environ.setdefault("RPP_DISABLE_TORCH_COMPILE", "1")

import torch
from torch import nn

import roundpipe
from roundpipe import AutoRoundPipe, RoundPipe, RoundPipeRunConfig
from roundpipe import distributed as rdist
from roundpipe.host import optim_thread
from roundpipe.models import configs

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
from common import finish  # noqa: E402
from helpers import with_lora  # noqa: E402

torch.set_num_threads(1)

IN, HID, OUT, ROWS = 8, 16, 4, 8  # mlp: global batch of ROWS rows
VOCAB, SEQ, LROWS = 64, 12, 4  # lora: global batch of LROWS sequences


class Branch(nn.Module):
    """``x @ a`` if the microbatch's column 0 is mostly +1, ``x @ b`` if mostly -1, else ``x @ c``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(IN, IN) * 0.3)
        self.b = nn.Parameter(torch.randn(IN, IN) * 0.3)
        self.c = nn.Parameter(torch.randn(IN, IN) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sel = float(x[:, 0].mean())
        w = self.a if sel > 0.5 else self.b if sel < -0.5 else self.c
        return x + torch.tanh(x @ w)


def build_mlp(extra_layer: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers = [Branch(), nn.Linear(IN, HID), nn.Tanh(), nn.Linear(HID, HID), nn.Tanh(), nn.Linear(HID, OUT)]
    return nn.Sequential(*layers, *([nn.Linear(OUT, OUT)] if extra_layer else []))


class HostScaled(nn.Module):
    """A RoundPipe body plus a parameter used on the host (the AutoRoundPipe host unit)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.body = RoundPipe(
            build_mlp().to(dtype),
            name="body",
            model_run_config=RoundPipeRunConfig(num_microbatch=2),
            optim_dtype=torch.float32,
        )
        self.scale = nn.Parameter(torch.ones(OUT, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale


def build_lora(adapter_seed: int) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = configs.tiny_config("qwen3", num_hidden_layers=2, vocab_size=VOCAB, tie_word_embeddings=True)
    base = transformers.AutoModelForCausalLM.from_config(config).float()
    torch.manual_seed(adapter_seed)
    return with_lora(base, ["q_proj", "v_proj", "down_proj"])


def mlp_batch(step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(ROWS, IN, generator=g)
    x[: ROWS // 2, 0], x[ROWS // 2 :, 0] = 1.0, -1.0  # the first half of the rows selects a, the rest b
    return x, torch.randn(ROWS, OUT, generator=g)


def lora_batch(step: int, uneven: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    ids = torch.randint(1, VOCAB, (LROWS, SEQ), generator=g)
    labels = ids.clone()
    if uneven:  # rank 0's rows (the first half) count far fewer loss tokens than rank 1's
        labels[: LROWS // 2, : SEQ - 3] = -100
        labels[LROWS // 2, 2] = -100
    return ids, labels


class Trainer:
    """A RoundPipe model, its optimizer and one ``train(step)`` call per step (DP or not)."""

    def __init__(self, args: argparse.Namespace, data_parallel: bool, adapter_seed: int) -> None:
        self.args = args
        self.dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
        cfg = RoundPipeRunConfig(num_microbatch=2)
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
        if args.model == "mlp":
            extra = args.mismatch and rdist.get_rank() == 1  # a rank that built another model
            self.model: Any = RoundPipe(
                build_mlp(extra).to(dtype), optim_dtype=torch.float32, model_run_config=cfg, name="mlp"
            )
        elif args.model == "auto":
            self.model = AutoRoundPipe(HostScaled(dtype), name="auto", optim_dtype=torch.float32)
        else:
            self.model = roundpipe.wrap_model_to_roundpipe(
                build_lora(adapter_seed), optim_dtype=torch.float32, model_run_config=cfg, name="lora"
            )
        reduce_dtype = {"": None, "fp32": torch.float32}[args.reduce_dtype]
        shard = args.shard and data_parallel
        self.dp = (
            rdist.enable_data_parallel(
                self.model, bucket_mb=args.bucket_mb, reduce_dtype=reduce_dtype, shard_optimizer=shard
            )
            if data_parallel
            else None
        )
        self.named = [(n, m) for n, m in self.model.optim_named_parameters()]
        masters = [m for _, m in self.named]
        if args.optim == "sgd":
            self.opt: torch.optim.Optimizer = torch.optim.SGD(masters, lr=args.lr, momentum=0.9, weight_decay=0.01)
        elif args.optim == "adamw":
            self.opt = torch.optim.AdamW(masters, lr=args.lr * 0.1, weight_decay=0.01)
        else:
            self.opt = roundpipe.optim.Adam(masters, lr=args.lr * 0.1, weight_decay=0.01, decoupled_weight_decay=True)
        self.losses: List[float] = []

    def step_fn(self) -> None:
        if self.args.clip:  # as the user guide writes it: the norm must be the global one on every rank
            torch.nn.utils.clip_grad_norm_(self.opt.param_groups[0]["params"], max_norm=self.args.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def train(self, step: int, rows: Callable[[Any], Any]) -> None:
        """One step on ``rows(global batch)``: the rank's share with DP, all of it (or a part) without."""
        if self.args.model == "mlp":
            x, y = rows(mlp_batch(step))
            n = x.shape[0]
            loss = self.model.forward_backward(
                input_args=(x.to(self.dtype),), label=y, loss_fn=lambda out, lab: ((out.float() - lab) ** 2).sum() / n
            )
        elif self.args.model == "auto":  # plain forward + loss.backward() through an AutoRoundPipe
            x, y = rows(mlp_batch(step))
            loss = ((self.model(x.to(self.dtype)).float() - y) ** 2).sum() / x.shape[0]
            loss.backward()
            loss = loss.detach()
        else:
            ids, labels = rows(lora_batch(step, self.args.uneven))
            loss = self.model.train_step(input_ids=ids, labels=labels)
            if self.dp is not None and self.args.uneven and not self.args.no_normalize:
                from roundpipe.models.loss import count_loss_tokens

                self.dp.normalize_by(count_loss_tokens(labels))
        self.losses.append(float(loss))
        self.model.step(self.step_fn, is_async=not self.args.sync)

    def masters(self) -> Dict[str, torch.Tensor]:
        self.model.synchronize()
        return {n: m.detach().clone() for n, m in self.named}

    # Checkpoints: fp32 masters, the model's weights as the devices compute with them (one step old in
    # async mode) and the optimizer state, so a resumed run repeats the uninterrupted one exactly.
    def save(self, path: str, step: int) -> None:
        """Every rank calls this (a sharded optimizer's state is gathered); rank 0 writes."""
        optim_thread.synchronize()  # the step kernels are done; model weights stay one step old
        assert self.dp is not None
        optim = self.dp.full_optimizer_state_dict(self.opt)
        if not rdist.is_main_process():
            return
        assert optim is not None
        state = {
            "step": step,
            "masters": {n: m.detach().clone() for n, m in self.named},
            "model": {n: p.detach().clone() for n, p in self.model.model.named_parameters() if p.requires_grad},
            "optim": optim,
        }
        tmp = path + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, path)

    def load(self, path: str) -> int:
        state = torch.load(path, weights_only=True)
        with torch.no_grad():
            for n, m in self.named:
                m.copy_(state["masters"][n])
            for n, p in self.model.model.named_parameters():
                if p.requires_grad:
                    p.copy_(state["model"][n])
        self.opt.load_state_dict(state["optim"])
        return int(state["step"])


def digest(tensors: Dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for n in sorted(tensors):
        h.update(n.encode())
        h.update(tensors[n].contiguous().numpy().tobytes())
    return h.hexdigest()


def max_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["mlp", "auto", "lora"], default="mlp")
    ap.add_argument(
        "--dtype", choices=["fp32", "bf16"], default="fp32", help="model weights and gradients (masters are fp32)"
    )
    ap.add_argument("--reduce-dtype", choices=["", "fp32"], default="")
    ap.add_argument("--mismatch", action="store_true", help="rank 1 builds a model with one more layer")
    ap.add_argument("--no-normalize", action="store_true", help="--uneven without normalize_by (must NOT match)")
    ap.add_argument("--shard", action="store_true", help="enable_data_parallel(shard_optimizer=True)")
    ap.add_argument("--optim", choices=["sgd", "adamw", "rpadam"], default="sgd", help="rpadam: roundpipe.optim.Adam")
    ap.add_argument(
        "--replace-master-at", type=int, default=None, help="give the first master new storage before this step"
    )
    ap.add_argument("--clip", type=float, default=0.0, help="clip_grad_norm_ to this in step_fn")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--sync", action="store_true", help="is_async=False")
    ap.add_argument("--uneven", action="store_true")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--bucket-mb", type=float, default=0.001, help="tiny: several buckets, packed and in place")
    ap.add_argument("--reference", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--save-at", type=int, default=None)
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--fail-at", type=int, default=None)
    ap.add_argument("--fail-rank", type=int, default=1)
    ap.add_argument("--fail-how", choices=["exit", "hang"], default="exit")
    args = ap.parse_args()

    env = rdist.init_from_env()
    rank, world = env.rank, env.world_size
    t0 = time.time()
    trainer = Trainer(args, data_parallel=True, adapter_seed=100 + rank)
    start = 0
    if args.resume:
        start = trainer.load(args.ckpt)
        rdist.assert_same_across_ranks(start, "resume step")
    for step in range(start, args.steps):
        if args.fail_at == step and rank == args.fail_rank:
            print(f"rank {rank}: injected failure ({args.fail_how}) at step {step}", file=sys.stderr, flush=True)
            if args.fail_how == "exit":
                os._exit(17)
            time.sleep(3600)
        if args.replace_master_at == step:  # the mistake the sharded step refuses: a master's storage swapped
            trainer.model.synchronize()
            trainer.named[0][1].data = trainer.named[0][1].data.clone()
        trainer.train(step, rdist.shard)
        if args.save_at is not None and step + 1 == args.save_at:
            trainer.save(args.ckpt, step + 1)
            rdist.barrier()  # the checkpoint is complete before any rank could read it
    masters = trainer.masters()
    rdist.assert_same_across_ranks(digest(masters), "parameters after training")
    assert trainer.dp is not None
    stats = trainer.dp.stats
    result: Dict[str, Any] = {
        "world": world,
        "start": start,
        "steps": args.steps,
        "losses": trainer.losses,
        "digest": digest(masters),
        "dp_steps": stats.steps,
        "collectives": stats.collectives,
        "seconds": time.time() - t0,
    }
    shard = trainer.dp.step_sync
    if shard is not None:
        # Each parameter's optimizer state on exactly one rank, the owned shares covering every parameter.
        n_state = sum(1 for m in trainer.opt.state.values() if m)
        result["state_entries"], result["owned"] = rdist.all_reduce_scalars([n_state, shard.owned_params])
        result["owned_here"], result["total_params"], result["hidden_steps"] = (
            shard.owned_params,
            shard.total_params,
            shard.hidden_steps,
        )
        result["masters"] = len([m for _, m in trainer.named])
    if args.reference and rank == 0:
        # One process, no data parallel, the whole global batch: the run DP must reproduce.
        ref = Trainer(args, data_parallel=False, adapter_seed=100)
        for step in range(args.steps):
            ref.train(step, lambda b: b)
        ref_masters = ref.masters()
        result["max_diff"] = max_diff(masters, ref_masters)
        # Sensitivity of the check: rank 0's share alone (what a broken reduction would train on).
        local = Trainer(args, data_parallel=False, adapter_seed=100)
        for step in range(args.steps):
            local.train(step, lambda b: rdist.shard(b, 0, world))
        result["local_only_diff"] = max_diff(local.masters(), ref_masters)
        if args.model in ("mlp", "auto"):
            prefix = "0" if args.model == "mlp" else "body.model.0"
            result["c_moved"] = float(
                (masters[f"{prefix}.c"] - build_mlp()[0].c.detach().to(masters[f"{prefix}.c"].dtype)).abs().max()
            )
    return finish(rank, args.out, result)


if __name__ == "__main__":
    sys.exit(main())
