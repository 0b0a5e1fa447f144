"""The model of a call with the host's costs (``roundpipe.planning.simulate``), the timer's fit of those costs,
and the planner's choice of longer groups where a job's host cost dominates."""

from __future__ import annotations

import pytest

from roundpipe.planning.plan import ModelExecutePlan, choose_by_host_cost
from roundpipe.planning.simulate import HostCosts, call_jobs, round_robin, simulate_iteration
from roundpipe.planning.timer import ModelTimer

ONE = [range(0, 1)]


def test_no_host_costs_is_the_compute_pipeline() -> None:
    """Two one-layer forward jobs of 1 ms on two devices, 3 microbatches: the second job runs one
    microbatch behind the first (fill), 4 ms in all; one device: the sum, 6 ms."""
    fwd = [range(0, 1), range(1, 2)]
    assert simulate_iteration("infer", fwd, [], [1.0, 1.0], [], 2, 3) == pytest.approx(4.0)
    assert simulate_iteration("infer", fwd, [], [1.0, 1.0], [], 1, 3) == pytest.approx(6.0)


def test_the_host_is_one_resource_shared_by_the_device_threads() -> None:
    """Free compute, 1 ms of host time per job and microbatch: 2 jobs x 3 microbatches take 6 ms on
    one device and on two (the interpreter lock runs one thread at a time)."""
    fwd = [range(0, 1), range(1, 2)]
    host = HostCosts(job_ms=1.0)
    for devices in (1, 2):
        assert simulate_iteration("infer", fwd, [], [0.0, 0.0], [], devices, 3, host=host) == pytest.approx(6.0)


def test_host_work_overlaps_compute_on_gpus_not_on_cpu_workers() -> None:
    """One job, 2 microbatches of 2 ms compute and 1 ms host: a GPU computes microbatch 0 while its
    thread issues microbatch 1 (1 + 2 + 2 = 5 ms); a CPU worker computes on the issuing thread (6)."""
    host = HostCosts(job_ms=1.0)
    assert simulate_iteration("infer", ONE, [], [2.0], [], 1, 2, host=host) == pytest.approx(5.0)
    serial = HostCosts(job_ms=1.0, serial_compute=True)
    assert simulate_iteration("infer", ONE, [], [2.0], [], 1, 2, host=serial) == pytest.approx(6.0)


def test_serial_compute_gains_nothing_from_more_devices() -> None:
    fwd = [range(i, i + 1) for i in range(4)]
    serial = HostCosts(serial_compute=True)
    one = simulate_iteration("infer", fwd, [], [1.0] * 4, [], 1, 4, host=serial)
    four = simulate_iteration("infer", fwd, [], [1.0] * 4, [], 4, 4, host=serial)
    assert one == pytest.approx(16.0) and four == pytest.approx(16.0)
    assert simulate_iteration("infer", fwd, [], [1.0] * 4, [], 4, 4) == pytest.approx(7.0)  # GPUs overlap


def test_handoff_delays_a_microbatch_that_changes_device() -> None:
    """Two jobs of 1 ms, one microbatch: on one device no hand-over (2 ms), on two the input waits 0.5 ms."""
    fwd = [range(0, 1), range(1, 2)]
    host = HostCosts(handoff_ms=0.5)
    assert simulate_iteration("infer", fwd, [], [1.0, 1.0], [], 1, 1, host=host) == pytest.approx(2.0)
    assert simulate_iteration("infer", fwd, [], [1.0, 1.0], [], 2, 1, host=host) == pytest.approx(2.5)


def test_layer_cost_is_paid_once_per_job() -> None:
    """0.5 ms per layer per job: one job of 3 layers over 4 microbatches pays 1.5 ms once."""
    host = HostCosts(layer_ms=0.5)
    assert simulate_iteration("infer", [range(0, 3)], [], [1.0, 1.0, 1.0], [], 1, 4, host=host) == pytest.approx(
        1.5 + 12.0
    )


def test_jobs_and_dispatch_policy() -> None:
    jobs = call_jobs(
        "fused", [range(0, 2)], [range(0, 2), range(2, 3)], [1.0, 1.0, 0.0], [3.0, 3.0, 5.0], 4, fused_parts=2
    )
    assert [(c, list(m), n) for c, m, n in jobs] == [
        (2.0, [0, 1, 2, 3], 2),
        (5.0, [1, 3], 1),  # part 0 ends on the last microbatch (it waits for the others' gradients)
        (5.0, [0, 2], 1),
        (6.0, [0, 1, 2, 3], 2),
    ]
    assert round_robin(5, 2) == [0, 1, 0, 1, 0]
    # Another policy: every job on device 0 equals one device.
    fwd = [range(0, 1), range(1, 2)]
    same = simulate_iteration("infer", fwd, [], [1.0, 1.0], [], 2, 3, assign=lambda n, d: [0] * n)
    assert same == pytest.approx(simulate_iteration("infer", fwd, [], [1.0, 1.0], [], 1, 3))


def test_part_0_of_a_split_group_runs_the_last_microbatch() -> None:
    """The parts of a split group take every K-th microbatch; part 0, which waits for the others'
    gradients, ends on the call's last microbatch; each microbatch belongs to exactly one part."""
    from roundpipe.planning.fused_split import part_microbatches, part_of

    assert [list(part_microbatches(p, 4, 8)) for p in range(4)] == [[3, 7], [2, 6], [1, 5], [0, 4]]
    assert [list(part_microbatches(p, 4, 5)) for p in range(4)] == [[0, 4], [3], [2], [1]]
    for parts, mbs in [(2, 2), (2, 7), (3, 8), (4, 4), (5, 13)]:
        seen = sorted(m for p in range(parts) for m in part_microbatches(p, parts, mbs))
        assert seen == list(range(mbs))
        assert part_microbatches(0, parts, mbs)[-1] == mbs - 1
        assert all(part_of(m, parts, mbs) == p for p in range(parts) for m in part_microbatches(p, parts, mbs))


def test_timer_fits_a_cost_per_microbatch_and_one_per_layer() -> None:
    """Jobs of several sizes with host = 0.3 ms x microbatches + 0.1 ms x layers: the fit finds both;
    the first jobs (kernels compiling) are left out."""
    t = ModelTimer(4, [1.0] * 4)
    for _ in range(t.JOBS_SKIPPED):
        t.note_job(1000.0, 4, 1)  # warm-up outliers
    for m, n in [(4, 1), (4, 3), (2, 2), (8, 1), (1, 4)] * 4:
        t.note_job(0.3 * m + 0.1 * n, m, n)
    costs = t.host_costs(serial_compute=True)
    assert costs.job_ms == pytest.approx(0.3, rel=1e-6) and costs.layer_ms == pytest.approx(0.1, rel=1e-6)
    assert costs.serial_compute


def test_timer_with_one_kind_of_job_puts_it_all_per_microbatch() -> None:
    t = ModelTimer(4, [1.0] * 4)
    for _ in range(t.JOBS_SKIPPED + 5):
        t.note_job(2.0, 4, 2)
    assert t.job_ms == pytest.approx(0.5) and t.layer_ms == 0.0


def _cut(threshold: float) -> ModelExecutePlan:
    """Eight equal layers in groups of 1 (threshold < 2), 2 or 4 layers, or one group."""
    size = 1 if threshold < 2 else 2 if threshold < 4 else 4 if threshold < 8 else 8
    groups = [range(i, i + size) for i in range(0, 8, size)]
    return ModelExecutePlan(groups, groups)


def test_planner_takes_longer_groups_when_the_host_cost_dominates() -> None:
    """Layers of 0.01 ms and 1 ms of host per job and microbatch on CPU workers: one group. With no host
    cost the one-layer groups stay (they pipeline over two devices)."""
    times, bwd = [0.01] * 8, [0.03] * 8
    base = _cut(1.1)
    heavy = HostCosts(job_ms=1.0, serial_compute=True)
    chosen = choose_by_host_cost("train", base, _cut, 1.1, times, bwd, 2, 4, heavy)
    assert len(chosen.fwd_plan) == 1 and len(chosen.bwd_plan) == 1
    light = HostCosts(job_ms=1e-6)
    assert choose_by_host_cost("train", base, _cut, 1.1, [1.0] * 8, [3.0] * 8, 2, 4, light) == base
