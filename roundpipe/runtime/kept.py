"""What a kept stage computes (``ModelExecutePlan.keep``, chosen by ``roundpipe.planning.keep``): its forward
runs with autograd and leaves each microbatch's graph on the device; its backward back-propagates through that
graph instead of recomputing the stage from a saved input.

The same idea as the fused job (``jobs.run_forward_backward``), for a stage that is not last: the forward job
uploads the stage's layers with their gradients (seeded from the host, as a backward job's are) and hands them
to the stage's backward job instead of releasing them; the backward job uploads nothing and downloads the
gradients as any backward job does. Both jobs run on the call's one device (``planning.keep.keepable``), and on
its compute stream: the backward's first use of a graph is ordered after the forward that built it by that
stream alone, with no event between them. The layers' uploads and gradient seeds (parameter stream) are waited
for layer by layer on the forward's first microbatch (``transfer.wait_layer``), so the backward's accumulation
into the seeds and the gradient downloads (gradient stream, after the compute stream) follow them too. The
graph holds the forward job's device layers, which is why those are the ones the backward accumulates into.

Per microbatch the graph is (the stage input's leaves, made to require grad as a recompute's are; the stage
output's leaves). The forward hands on the output detached (a leaf that passed through unchanged as the input
tensor itself, so the host copy of the input serves it, ``jobs._download_reusing``), so the next stage never
extends this stage's graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional, Tuple

import torch
from torch.utils import _pytree as pytree

from roundpipe.runtime.compute import backward_through, call_layer, grad_leaves, input_grads, wrap
from roundpipe.runtime.run import Leaves, MicrobatchState, Run
from roundpipe.runtime.transfer import wait_layer

if TYPE_CHECKING:
    from roundpipe.devices.device import DeviceManager


def _at_kept_forward(run: Run, i: int, m: int) -> str:
    return f"model {run.model.name!r}: forward of {run.layer_name(i)} (graph kept), microbatch {m}"


def _at_kept_backward(run: Run, layers: range, m: int) -> str:
    return (
        f"model {run.model.name!r}: backward of layers {layers.start}-{layers.stop - 1} through the kept graph, "
        f"microbatch {m}"
    )


class KeptForward:
    """The forward of a kept stage per microbatch, with autograd; the graph goes to ``run.kept_graphs``.
    Called as ``compute.GroupForward`` is (eager only: a graph replay would keep no autograd graph)."""

    def __init__(
        self, run: Run, device: "DeviceManager", layers: range, gpu_layers: List[torch.nn.Module], ready: List[Any]
    ) -> None:
        self.run, self.device, self.layers, self.gpu_layers, self.ready = run, device, layers, gpu_layers, ready
        self.waited = False

    def __call__(self, ctx: MicrobatchState, m: int, dev_leaves: Leaves, spec: Any) -> Tuple[Leaves, Any, list]:
        """Microbatch ``m``'s forward: (output leaves, detached; output spec; no saved inputs)."""
        run, device = self.run, self.device
        flags = ctx.input_requires_grad if self.layers.start == 0 else None
        with torch.enable_grad():
            leaves = grad_leaves(dev_leaves, flags)
            x = pytree.tree_unflatten(leaves, spec)
            for k, (i, layer) in enumerate(zip(self.layers, self.gpu_layers)):
                device.where = (_at_kept_forward, (run, i, m))
                if not self.waited:
                    # The first microbatch: layer k's upload (and its gradient seed) must have landed.
                    wait_layer(device, self.ready, k)
                with run.timer.time_fwd("fwd", i, device.compute_stream):
                    x = wrap(call_layer(layer, x))
        self.waited = True
        out_leaves, out_spec = pytree.tree_flatten(x)
        run.kept_graphs[(self.layers.start, m)] = (leaves, out_leaves)
        same = {id(g): d for g, d in zip(leaves, dev_leaves)}
        handed = [same.get(id(t), t.detach()) if isinstance(t, torch.Tensor) else t for t in out_leaves]
        return handed, out_spec, []


def kept_backward(
    run: Run, device: "DeviceManager", layers: range, m: int, dev_grads: List[Optional[torch.Tensor]]
) -> List[Optional[torch.Tensor]]:
    """Microbatch ``m``'s backward of kept stage ``layers`` through the graph its forward left: the
    parameter gradients accumulate into the kept device layers' ``.grad`` (as a recompute's backward
    does into its layers'); returns the input gradients. The graph is dropped here (on the compute stream,
    which ran its forward and now its backward: freeing its tensors needs no other order)."""
    leaves, outputs = run.kept_graphs.pop((layers.start, m))
    device.where = (_at_kept_backward, (run, layers, m))
    with run.timer.time_bwd(layers, device.compute_stream):
        backward_through(outputs, dev_grads, device.describe_location())
    return input_grads(leaves)


def drop_kept(run: Run, layers: range, m: int) -> int:
    """Drop microbatch ``m``'s graph of kept stage ``layers`` (no gradient reached it) and return how many
    input leaves it had (the stage hands that many empty gradients on), as ``Run.drop_stage_input`` does."""
    leaves, _ = run.kept_graphs.pop((layers.start, m))
    return len(leaves)
