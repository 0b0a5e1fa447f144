"""The peer-copy budget of a split fused job (roundpipe.runtime.partial_grads) bounds all secondary parts together.

With peer hand-overs every secondary part copies its share of the fused group's gradients to the primary's
device, and those copies stay there until the primary's download completes: with P parts, P - 1 shares are
alive at once on one device. So the copies are made only while the P - 1 shares together take at most
``PEER_SHARE_FRACTION`` of the primary's room; a budget that bounds one share alone lets 3 shares onto the
device on 4 GPUs (7 on 8) where one was allowed for. Here 4 CPU workers run the fused job in 4 parts, and
the primary's room is set so that the budget lies between the right value and a wrong one:

* 2 shares' worth: above one share (a per-share check would copy), below the 3 shares (through the host);
* 3.5 shares' worth: above the 3 secondaries' shares (peer copies), below 4 (a check that also counted
  the primary's own gradients would not copy).

Whether the copies went peer to peer shows in the model's host buffers for the parts' gradients: they are
made only on the way through the host.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_core import _train_both, check_grads
from torch import nn

from roundpipe import RoundPipe, settings
from roundpipe.devices import backend
from roundpipe.planning.plan import ModelExecutePlan
from roundpipe.runtime import partial_grads
from roundpipe.runtime.run_config import RoundPipeRunConfig

PARTS = 4
SHARE = (16 * 5 + 5) * 8  # bytes: one part's gradients of the fused group, Linear(16, 5) in float64


@pytest.mark.parametrize("shares,peer", [(2.0, False), (3.5, True)])
@pytest.mark.parametrize("workers", [f"cpu:{PARTS}"], indirect=True)
def test_peer_copies_fit_the_primary_only_with_every_secondarys_share(
    workers: str, shares: float, peer: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """4 parts, the primary's room such that ``PEER_SHARE_FRACTION`` of it is ``shares`` shares: the 3
    secondaries' gradients go peer to peer only when 3 shares fit (no host buffer of any part), else all
    through the host; either way the gradients equal plain PyTorch's over two calls."""
    room = int(shares * SHARE / partial_grads.PEER_SHARE_FRACTION)
    monkeypatch.setattr(backend, "capacity_bytes", lambda device: room)
    monkeypatch.setenv("RPP_DEBUG_PEER_HANDOFF", "1")
    with settings.overridden(debug_split_fused="1"):
        torch.manual_seed(3)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 5)).double()
        ref = copy.deepcopy(model)
        plan = ModelExecutePlan([range(0, 2), range(2, 3)], [range(0, 2), range(2, 3), range(3, 5)])
        rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=PARTS, execute_plan=plan))
        _train_both(rp, ref, fused=True, rows=12, num_microbatch=PARTS)
    check_grads(model, ref, 1e-10)
    store = rp.partial_grad_store
    through_host = {part for (_, _, part) in store}
    assert through_host == (set() if peer else set(range(1, PARTS))), f"{shares} shares: {through_host} via the host"
    if not peer:  # what a part's buffers hold is one share (the Linear's weight and bias): SHARE is right
        assert sum(b.numel() * b.element_size() for (_, _, part), b in store.items() if part == 1) == SHARE
