"""A user's own training script, as short as one writes it: build the model on the GPU, move it to the
host, wrap it with fp32 optimizer copies (``optim_dtype=torch.float32``, as the user guide writes it),
train with roundpipe.optim.Adam's defaults. Its tokens/s is compared with
bench/train_bench.py (the same workload) and the GPU-resident Liger baseline (docs/benchmarks.md): a
user's script should train as fast as the bench does.

    python bench/user_script.py --workload qwen3-1.7b --batch 8
    RPP_DEVICES=cpu:1 python bench/user_script.py --workload tiny --seq 64 --batch 2 --steps 3   # CPU smoke
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_bench import WORKLOADS, workload_config  # noqa: E402  (the workload shapes, nothing else)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=WORKLOADS, default="qwen3-1.7b")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=6, help="timed steps after 3 warm-up steps")
    p.add_argument(
        "--bf16-masters",
        dest="fp32_masters",
        action="store_false",
        help="leave optim_dtype out: Adam steps the bf16 weights themselves (the wrapper's default)",
    )
    p.add_argument(
        "--declared",
        action="store_true",
        help="declare the step function with roundpipe.optim.step_fn_zeroes_grads (docs/optimizer.md), as a user may",
    )
    p.add_argument(
        "--step-phases",
        action="store_true",
        help="time each optimizer step's phases on its thread (publish, hand-over, step_fn, staging)",
    )
    args = p.parse_args()

    from transformers import Qwen3ForCausalLM

    import roundpipe

    config = workload_config(args.workload)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = Qwen3ForCausalLM(config).to(device, dtype).to("cpu")  # built on the GPU and moved, as a user does
    model = roundpipe.wrap_model_to_roundpipe(model, optim_dtype=torch.float32 if args.fp32_masters else None)
    opt = roundpipe.optim.Adam(model.optim_parameters(), lr=1e-5)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq))

    phases = StepPhases() if args.step_phases else None
    step_fn = (lambda: (opt.step(), opt.zero_grad(), None)[-1]) if phases is None else phases.timed(opt)
    if args.declared:
        step_fn = roundpipe.optim.step_fn_zeroes_grads(step_fn)

    def step() -> None:
        model.train_step(input_ids=ids, labels=ids)
        model.step(step_fn)

    for _ in range(3):
        step()
    t0 = time.perf_counter()
    marks = []
    for _ in range(args.steps):
        step()
        marks.append(time.perf_counter())
    model.wait_optimizer()  # the last step's optimizer work (what a final synchronize() waits for first)
    waited = time.perf_counter()
    model.synchronize()  # then the optimizer copies into the model
    end = time.perf_counter()
    seconds = (end - t0) / args.steps
    print(
        f"user script: {args.workload} {args.batch} x {args.seq}: {ids.numel() / seconds:,.0f} tokens/s, "
        f"{seconds:.3f} s/step"
    )
    # Where the time goes: each step's return (the next one waits for nothing of it) and the final synchronize.
    steps = [b - a for a, b in zip([t0] + marks, marks)]
    print(
        f"step returns after (s): {[round(t, 3) for t in steps]}; final synchronize {end - marks[-1]:.3f} s "
        f"(optimizer {waited - marks[-1]:.3f} s, copies into the model {end - waited:.3f} s); "
        f"without it {ids.numel() * args.steps / (marks[-1] - t0):,.0f} tokens/s"
    )
    if phases is not None:
        phases.report()
    return 0


class StepPhases:
    """Diagnostic (``--step-phases``): where each optimizer step's time goes on the optimizer thread, from
    timestamps around the step protocol's parts (``roundpipe.host.step``, patched here, not in the package):
    the publish of the previous version, the gradients' hand-over (with its waits for the downloads), the
    user's ``step_fn`` and the staging of the new version in the model's dtype."""

    def __init__(self) -> None:
        from roundpipe.host import step as optim_step

        self.rows: List[Dict[str, float]] = []
        self.cur: Dict[str, float] = {}
        for name in ("_step_kernel", "copy_params_to_model", "stage_params"):
            setattr(optim_step, name, self._wrap(name, getattr(optim_step, name)))

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **k: Any) -> Any:
            if name == "_step_kernel":
                self.cur = {}
            elif not self.cur or "_step_kernel<" in self.cur:
                return fn(*a, **k)  # outside a step (synchronize's copy into the model)
            self.cur[name + ">"] = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.cur[name + "<"] = time.perf_counter()
                if name == "_step_kernel":
                    self.rows.append(self.cur)

        return timed

    def timed(self, opt: Any) -> Callable[[], None]:
        def step_fn() -> None:
            self.cur["step_fn>"] = time.perf_counter()
            opt.step()
            opt.zero_grad()
            self.cur["step_fn<"] = time.perf_counter()

        return step_fn

    def report(self) -> None:
        def ms(r: Dict[str, float], a: str, b: str) -> str:
            return f"{1e3 * (r[b] - r[a]):.0f}" if a in r and b in r else "-"

        print("optimizer step phases, ms (publish / hand-over / step_fn / staging / whole kernel), warm-up first:")
        for r in self.rows:
            print(
                "  "
                + " / ".join(
                    [
                        ms(r, "copy_params_to_model>", "copy_params_to_model<"),
                        ms(r, "copy_params_to_model<", "step_fn>"),
                        ms(r, "step_fn>", "step_fn<"),
                        ms(r, "stage_params>", "stage_params<"),
                        ms(r, "_step_kernel>", "_step_kernel<"),
                    ]
                )
            )


if __name__ == "__main__":
    raise SystemExit(main())
