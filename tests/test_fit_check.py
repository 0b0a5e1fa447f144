"""The planner's host fit check leaves out the fused stage's input (roundpipe.planning.planner).

A backward stage's input waits on the host from the forward to the backward: the planner counts it
against the host budget (``ActivationCosts.host_limit``, from ``RPP_HOST_MEMORY``). The fused stage of a
``forward_backward`` call is the exception: its forward and backward run in one job, so its input is
handed over and consumed at once (``jobs.run_forward`` saves no copy of it for the backward), and
counting it would give up the time-balanced plan for another, or refuse a call that fits. A ``train``
call's last stage keeps its input like any other. Each test puts the host limit between the checkpoint
bytes with and without the fused stage's input, through both ways the planner decides: the time-balanced
plan's fit check, and the search over plans under host pressure. Under host pressure, of the plans that keep
the fewest bytes on the host, the search takes the most even one.

Four layers: 0 (the embedding), 1 and 2 (decoder layers), 3 (the head). A stage input at layer 1 or 2
takes 1 GiB on the host, at the head 10 GiB.
"""

from __future__ import annotations

from typing import List, Tuple

import pytest

from roundpipe.planning.planner import ActivationCosts, ActivationMemoryError, plan_stages, validate_plan

G = float(1 << 30)
CHECKPOINT = [10 * G, G, G, 10 * G]  # layer 0's is never counted (the model input is on the host anyway)
HOST = 5 * G  # the fused plans below need 0 or 2 GiB (fused input left out), 10 or 12 GiB if it counted


def _plan(run_type: str, kept: float, peak: float) -> Tuple[List[range], List[range]]:
    """Backward times 1, 1, 1, 10 (the head slowest), every layer ``kept`` / ``peak`` GiB of activations,
    6 GiB per stage, 1 KiB of weights each."""
    costs = ActivationCosts([kept * G] * 4, [peak * G] * 4, CHECKPOINT, 6 * G, HOST)
    times = [1.0, 1.0, 1.0, 10.0]
    plan = plan_stages(
        run_type,
        times,
        times,
        [1024] * 4,
        min_stages=2,
        upper_threshold=3.0,
        memory_limit_bytes=1e9,
        activations=costs,
    )
    validate_plan(*plan, 4, run_type)
    return plan


def test_the_time_balanced_fused_plan_fits_without_its_fused_input() -> None:
    """Small activations: the time-balanced plan (layers 0-2, then the head fused) keeps no stage input
    on the host, 0 GiB against 5; counting the fused input (10 GiB) would send the planner to more, smaller
    stages (4, whose inputs at layers 1 and 2 fit in 2 GiB). A ``train`` call would keep the head's input (10 GiB):
    it gets the most stages whose inputs fit, the head beside layer 2."""
    assert _plan("fused", kept=1.0, peak=2.0)[1] == [range(0, 3), range(3, 4)]
    assert _plan("train", kept=1.0, peak=2.0)[1] == [range(0, 1), range(1, 2), range(2, 4)]


def test_under_host_pressure_a_fused_plan_leaves_out_its_fused_input() -> None:
    """Activations that allow one layer per stage (4 GiB kept, 5 GiB peak: two layers would need 9 of 6
    GiB): the only plan's inputs at layers 1 and 2 take 2 GiB of the 5, and the fused head's would take 10
    more. The fused call is planned; a ``train`` call, whose head input waits on the host, is refused and
    told the 12 GiB it needs."""
    assert _plan("fused", kept=4.0, peak=5.0)[1] == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    with pytest.raises(ActivationMemoryError) as err:
        _plan("train", kept=4.0, peak=5.0)
    assert err.value.host_needed == 12 * G


def test_under_host_pressure_equal_inputs_give_even_stages() -> None:
    """Nine layers whose inputs take 1 GiB each and a host of 3 GiB: the most stages whose inputs fit is four,
    and every four-stage plan keeps the same 3 GiB on the host. The plan taken is one whose largest stage keeps
    the fewest activation bytes (3 layers: 1 + 1 + 2 GiB), so the device keeps room for the stage inputs;
    not six layers in one stage, which the first-found plan of those bytes was. A fused call's last stage
    keeps no input on the host, so it gets five stages."""
    n = 9
    costs = ActivationCosts([G] * n, [2 * G] * n, [G] * n, 20 * G, 3 * G)
    times = [1.0] * n
    for run_type in ("train", "fused"):
        fwd, bwd = plan_stages(
            run_type,
            times,
            times,
            [1024] * n,
            min_stages=1,
            upper_threshold=1.0,
            memory_limit_bytes=1e9,
            activations=costs,
        )
        validate_plan(fwd, bwd, n, run_type)
        assert len(bwd) == (4 if run_type == "train" else 5), bwd
        assert max(len(r) for r in bwd) == (3 if run_type == "train" else 2), bwd
