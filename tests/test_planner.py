"""Tests for roundpipe.planning.planner: automatic stage planning and plan validation."""

import itertools
import math
import random
import time

import pytest

from roundpipe.planning.planner import plan_stages, validate_plan
from roundpipe.utils import GiB


def group_sums(plan, values):
    return [math.fsum(values[i] for i in r) for r in plan]


def fewest_groups(times, sizes, time_cap, mem_cap):
    """Independent reference: fewest contiguous groups under both caps, by dynamic programming."""
    n = len(times)
    best = [0] + [math.inf] * n  # best[j]: fewest groups for layers [0, j)
    for j in range(1, n + 1):
        for i in range(j):
            if sum(times[i:j]) <= time_cap * (1 + 1e-9) and sum(sizes[i:j]) <= mem_cap:
                best[j] = min(best[j], best[i] + 1)
    return best[n]


def best_bottleneck(times, sizes, k, mem_cap):
    """Independent reference: smallest possible slowest-group time with exactly k groups under mem_cap."""
    n = len(times)
    best = {0: 0.0}
    for _ in range(k):
        nxt = {}
        for i, worst in best.items():
            for j in range(i + 1, n + 1):
                if sum(sizes[i:j]) <= mem_cap:
                    v = max(worst, sum(times[i:j]))
                    nxt[j] = min(nxt.get(j, math.inf), v)
        best = nxt
    return best[n]


def assert_covers(plan, start, stop):
    assert all(isinstance(r, range) and r.step == 1 and len(r) > 0 for r in plan)
    assert [i for r in plan for i in r] == list(range(start, stop))


@pytest.mark.parametrize("seed", range(150))
def test_random_train_plans_meet_every_rule_and_are_optimal(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 11)
    fwd = [0.0 if rng.random() < 0.05 else rng.uniform(0.1, 10.0) for _ in range(n)]  # some free layers
    bwd = [3 * f + rng.uniform(0, 1) for f in fwd]
    sizes = [rng.randint(1, 100) for _ in range(n)]
    min_stages = rng.randint(1, 6)
    threshold = rng.choice([1.0, 1.1, 1.5, 3.0])
    limit = 2 * max(sizes) * rng.choice([1.0, 1.5, 3.0, 100.0])

    fwd_plan, bwd_plan = plan_stages(
        "train", fwd, bwd, sizes, min_stages=min_stages, upper_threshold=threshold, memory_limit_bytes=limit
    )
    validate_plan(fwd_plan, bwd_plan, n, "train")
    for plan, times in ((fwd_plan, fwd), (bwd_plan, bwd)):
        assert_covers(plan, 0, n)
        cap = threshold * max(times)
        assert max(group_sums(plan, times)) <= cap * (1 + 1e-9)
        assert max(group_sums(plan, sizes)) <= limit / 2
        # As few groups as the caps allow, but at least min_stages where the layers allow.
        k = max(fewest_groups(times, sizes, cap, limit / 2), min(min_stages, n))
        assert len(plan) == k
        # Among plans with k groups, the slowest group is as fast as possible.
        assert max(group_sums(plan, times)) <= best_bottleneck(times, sizes, k, limit / 2) * (1 + 1e-6)


def test_uniform_layers_merge_up_to_the_threshold():
    fwd_plan, _ = plan_stages(
        "infer", [1.0] * 12, [], [1] * 12, min_stages=1, upper_threshold=3.0, memory_limit_bytes=1e9
    )
    assert fwd_plan == [range(0, 3), range(3, 6), range(6, 9), range(9, 12)]


def test_a_slow_head_lets_the_body_form_bigger_groups():
    # The head (layer 8) takes 4 ms, so body groups may take up to 1.1 x 4 = 4.4 ms: 4 layers each.
    fwd = [1.0] * 8 + [4.0]
    fwd_plan, _ = plan_stages("infer", fwd, [], [1] * 9, min_stages=1, upper_threshold=1.1, memory_limit_bytes=1e9)
    assert fwd_plan == [range(0, 4), range(4, 8), range(8, 9)]


def test_min_stages_splits_evenly_and_is_capped_by_the_layer_count():
    fwd_plan, _ = plan_stages(
        "infer", [1.0] * 8, [], [1] * 8, min_stages=4, upper_threshold=100.0, memory_limit_bytes=1e9
    )
    assert fwd_plan == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    fwd_plan, _ = plan_stages(
        "infer", [1.0] * 3, [], [1] * 3, min_stages=8, upper_threshold=100.0, memory_limit_bytes=1e9
    )
    assert fwd_plan == [range(0, 1), range(1, 2), range(2, 3)]


def test_memory_limit_splits_groups():
    # Time alone would allow one group; with 10 / 2 = 5 bytes per group it takes 3: [3, 2] [2, 3] [1, 1].
    fwd_plan, _ = plan_stages(
        "infer", [1.0] * 6, [], [3, 2, 2, 3, 1, 1], min_stages=1, upper_threshold=100.0, memory_limit_bytes=10
    )
    assert fwd_plan == [range(0, 2), range(2, 4), range(4, 6)]


def test_a_layer_larger_than_half_the_limit_warns_and_raises_the_limit():
    """As the public implementation does: a warning naming the layer and the sizes, then a plan made
    with the limit raised to twice that layer (its stage holds it alone)."""
    sizes = [1 * GiB, 1 * GiB, 3 * GiB, 1 * GiB]
    with pytest.warns(RuntimeWarning) as record:
        fwd_plan, bwd_plan = plan_stages(
            "train", [1.0] * 4, [3.0] * 4, sizes, min_stages=1, upper_threshold=100.0, memory_limit_bytes=4 * GiB
        )
    message = str(record[0].message)
    for expected in ("layer 2", "3.00 GiB", "2.00 GiB", "4.00 GiB", "6.00 GiB", "model_memory_limit", "split"):
        assert expected in message
    # With the raised limit (3 GiB per stage) the large layer is a stage of its own; the others pair up.
    for plan in (fwd_plan, bwd_plan):
        assert range(2, 3) in plan
        assert all(sum(sizes[i] for i in r) <= 3 * GiB for r in plan)
    validate_plan(fwd_plan, bwd_plan, 4, "train")


def test_infer_has_no_backward_plan():
    fwd_plan, bwd_plan = plan_stages(
        "infer", [1.0, 2.0, 3.0], [], [1, 1, 1], min_stages=2, upper_threshold=1.1, memory_limit_bytes=1e9
    )
    assert bwd_plan == []
    assert_covers(fwd_plan, 0, 3)


def test_fused_forward_plan_stops_where_the_fused_group_starts():
    # Body layers: fwd 1, bwd 3. Head: fwd 4, bwd 12 (the fused group: forward + backward of the head).
    fwd = [1.0] * 10 + [4.0]
    bwd = [3.0] * 10 + [12.0]
    fwd_plan, bwd_plan = plan_stages(
        "fused", fwd, bwd, [1] * 11, min_stages=2, upper_threshold=1.1, memory_limit_bytes=1e9
    )
    validate_plan(fwd_plan, bwd_plan, 11, "fused")
    assert bwd_plan[-1] == range(10, 11)  # 3 + 12 > 1.1 x 12: the head is fused alone
    assert fwd_plan[-1].stop == bwd_plan[-1].start
    assert_covers(fwd_plan, 0, 10)
    # The backward groups before the fused head pace the forward groups, the head does not: a forward
    # group may take as long as a typical (median) one of those backward groups (3: one body layer
    # each), so at most three body layers (forward 1 each), and the 10 body layers take the fewest such
    # groups. (By the head's 1.1 x 12 they would be one group; by 1.1 x a body layer's forward, ten.)
    assert max(group_sums(fwd_plan, fwd)) <= 3
    assert len(fwd_plan) == 4
    # Likewise the backward groups before the fused head: capped by 1.1 x a body layer's backward.
    assert max(group_sums(bwd_plan[:-1], bwd)) <= 1.1 * 3
    assert len(bwd_plan) == 11


def test_forward_groups_follow_the_median_backward_group_not_a_noisy_slowest_one():
    # qwen3-1.7b's timings on 2 H200s, one backward layer timed at 18 ms among 10.5 ms ones.
    fwd = [1.2] + [3.2] * 28 + [54.0]
    bwd = [2.0] + [10.5] * 13 + [18.0] + [10.5] * 14 + [57.0]
    fwd_plan, bwd_plan = plan_stages(
        "fused", fwd, bwd, [1] * 30, min_stages=2, upper_threshold=1.1, memory_limit_bytes=1e9
    )
    validate_plan(fwd_plan, bwd_plan, 30, "fused")
    body = group_sums(bwd_plan[:-1], bwd)
    median = sorted(body)[len(body) // 2]
    assert max(group_sums(fwd_plan, fwd)) <= median  # three body layers (9.6 ms) at most, not six
    assert max(len(r) for r in fwd_plan) == 3


def test_backward_groups_follow_a_typical_layer_not_a_noisy_slowest_one():
    # Body layers of 9.5-10.5 ms backward, one timed at 20 ms (a one-off stall),
    # the head fused. Capped by 1.1 x 20 ms, neighbours would pair (9.5 + 10.5 = 20 ms); capped by 1.1 x
    # the median, no two decoder layers share a backward group (the 2 ms embedding may join the first),
    # and the slow one is a group of its own.
    fwd = [1.2] + [3.2] * 28 + [54.0]
    bwd = [2.0] + [9.5, 10.5] * 7 + [20.0] + [10.5, 9.5] * 6 + [10.5] + [57.0]
    fwd_plan, bwd_plan = plan_stages(
        "fused", fwd, bwd, [1] * 30, min_stages=2, upper_threshold=1.1, memory_limit_bytes=1e9
    )
    validate_plan(fwd_plan, bwd_plan, 30, "fused")
    assert all(sum(bwd[i] >= 9.5 for i in r) == 1 for r in bwd_plan), bwd_plan
    assert range(15, 16) in bwd_plan


def test_fused_group_obeys_the_backward_threshold():
    fwd = [1.0] * 6
    bwd = [3.0] * 6
    fwd_plan, bwd_plan = plan_stages(
        "fused", fwd, bwd, [1] * 6, min_stages=1, upper_threshold=2.0, memory_limit_bytes=1e9
    )
    assert bwd_plan == [range(0, 2), range(2, 4), range(4, 6)]
    # Forward groups as long as the median backward group (6): the four forward layers (1 each) are one.
    assert fwd_plan == [range(0, 4)]


def test_fused_whole_model_in_one_group_leaves_no_forward_groups():
    fwd_plan, bwd_plan = plan_stages(
        "fused", [1.0] * 3, [3.0] * 3, [1] * 3, min_stages=1, upper_threshold=10.0, memory_limit_bytes=1e9
    )
    assert (fwd_plan, bwd_plan) == ([], [range(0, 3)])
    validate_plan(fwd_plan, bwd_plan, 3, "fused")


def test_fused_forward_groups_leave_one_stage_for_the_fused_group():
    fwd_plan, bwd_plan = plan_stages(
        "fused", [1.0] * 8, [3.0] * 8, [1] * 8, min_stages=4, upper_threshold=100.0, memory_limit_bytes=1e9
    )
    assert len(bwd_plan) == 4
    assert len(fwd_plan) == 3  # plus the fused group: 4 forward stages


def test_planning_is_deterministic_and_fast_for_200_layers():
    rng = random.Random(0)
    fwd = [rng.uniform(1, 2) for _ in range(199)] + [20.0]
    bwd = [3 * f for f in fwd]
    sizes = [rng.randint(100, 200) for _ in range(200)]
    kwargs = dict(min_stages=8, upper_threshold=1.1, memory_limit_bytes=4000)
    start = time.perf_counter()
    first = plan_stages("fused", fwd, bwd, sizes, **kwargs)
    elapsed = time.perf_counter() - start
    assert first == plan_stages("fused", fwd, bwd, sizes, **kwargs)
    validate_plan(*first, 200, "fused")
    assert elapsed < 1.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(fwd_times=[1.0, 2.0], layer_bytes=[1]), "layer_bytes has 1 entries"),
        (dict(upper_threshold=0.9), "upper_threshold must be >= 1"),
        (dict(fwd_times=[1.0, -1.0]), "fwd_times[1] = -1.0"),
        (dict(fwd_times=[1.0, float("nan")]), "fwd_times[1] = nan"),
        (dict(fwd_times=[], layer_bytes=[]), "no layers"),
    ],
)
def test_bad_inputs_are_rejected(kwargs, message):
    args = dict(fwd_times=[1.0, 2.0], layer_bytes=[1, 1], upper_threshold=1.1)
    args.update(kwargs)
    with pytest.raises(ValueError) as info:
        plan_stages(
            "infer",
            args["fwd_times"],
            [],
            args["layer_bytes"],
            min_stages=1,
            upper_threshold=args["upper_threshold"],
            memory_limit_bytes=100,
        )
    assert message in str(info.value)


# ---------------------------------------------------------------------------------------------------------
# validate_plan

FULL = [range(0, 4), range(4, 10)]


@pytest.mark.parametrize(
    "fwd_plan, bwd_plan, run_type",
    [
        (FULL, [], "infer"),
        (FULL, [range(0, 10)], "train"),
        ([range(0, 5), range(5, 8)], [range(0, 8), range(8, 10)], "fused"),
        ([], [range(0, 10)], "fused"),
        ((range(0, 10),), [range(0, 10)], "train"),
    ],
)
def test_valid_plans_pass(fwd_plan, bwd_plan, run_type):
    validate_plan(fwd_plan, bwd_plan, 10, run_type)


@pytest.mark.parametrize(
    "fwd_plan, bwd_plan, run_type, message",
    [
        ([range(0, 3), range(4, 10)], [], "infer", "fwd_plan: layer 3 not covered"),
        ([range(0, 5), range(3, 10)], [], "infer", "fwd_plan: layers 3..4 covered twice"),
        ([range(0, 12)], [], "infer", "layers 10..11 out of range"),
        ([range(-1, 10)], [], "infer", "layer -1 out of range"),
        ([range(0, 0), range(0, 10)], [], "infer", "fwd_plan[0] = range(0, 0) is empty"),
        ([range(5, 10), range(0, 5)], [], "infer", "out of order"),
        ([[0, 1, 2], range(3, 10)], [], "infer", "fwd_plan[0] is [0, 1, 2] (list)"),
        ([range(0, 10, 2)], [], "infer", "step 2"),
        ([range(0, 8)], [], "infer", "fwd_plan: layers 8..9 not covered"),
        (range(0, 10), [], "infer", "must be a list of ranges"),
        (FULL, [range(0, 9)], "train", "bwd_plan: layer 9 not covered"),
        (FULL, [], "train", "bwd_plan: layers 0..9 not covered (the plan is empty)"),
        ([range(0, 9)], FULL, "train", "fwd_plan: layer 9 not covered"),
        (FULL, [range(0, 8), range(8, 10)], "fused", "fwd_plan: layers 8..9 must not be in fwd_plan"),
        ([range(0, 6)], [range(0, 8), range(8, 10)], "fused", "fwd_plan: layers 6..7 not covered"),
        (FULL, [range(0, 8)], "fused", "bwd_plan: layers 8..9 not covered"),
    ],
)
def test_invalid_plans_name_the_layers(fwd_plan, bwd_plan, run_type, message):
    with pytest.raises(ValueError) as info:
        validate_plan(fwd_plan, bwd_plan, 10, run_type)
    assert message in str(info.value)


def test_fused_violation_explains_the_fused_rule():
    with pytest.raises(ValueError, match=r"range\(8, 10\) runs forward \+ loss \+ backward"):
        validate_plan(FULL, [range(0, 8), range(8, 10)], 10, "fused")


def test_every_plan_of_a_small_model_is_accepted_or_rejected_correctly():
    # All ways to cut 5 layers into groups are valid for train; shifting any cut breaks coverage.
    n = 5
    for cuts in itertools.product([False, True], repeat=n - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
        plan = [range(a, b) for a, b in zip(bounds, bounds[1:])]
        validate_plan(plan, plan, n, "train")
        if len(plan) > 1:
            broken = plan[:1] + [range(plan[1].start + 1, plan[1].stop)] + plan[2:]
            if len(broken[1]) > 0:
                with pytest.raises(ValueError, match="not covered"):
                    validate_plan(broken, plan, n, "train")


def test_zero_costs_are_split_evenly_by_layer_count():
    # Size-based estimates of parameter-free layers are all 0; min_stages still gets even groups.
    fwd_plan, _ = plan_stages(
        "infer", [0.0] * 6, [], [0] * 6, min_stages=3, upper_threshold=1.1, memory_limit_bytes=float("inf")
    )
    assert fwd_plan == [range(0, 2), range(2, 4), range(4, 6)]


def test_embedding_tables_count_little_in_the_first_time_estimates() -> None:
    from torch import nn

    from roundpipe.utils import get_model_compute_size

    emb, lin = nn.Embedding(1000, 16), nn.Linear(16, 16, bias=False)
    assert get_model_compute_size(emb) == pytest.approx(0.01 * 1000 * 16 * 4)
    assert get_model_compute_size(lin) == 16 * 16 * 4
    head = nn.Linear(16, 1000, bias=False)
    head.weight = emb.weight  # tied: the head's matmul reads the whole table
    assert get_model_compute_size(head) == 1000 * 16 * 4


# ---------------------------------------------------------------------------------------------------------
# Several devices: the simulated round-robin pipeline and the refinement against it

from roundpipe.planning.simulate import simulate_iteration  # noqa: E402


def test_simulation_of_one_device_is_the_sum_of_all_costs():
    fwd, bwd = [1.0, 2.0, 3.0], [3.0, 5.0, 7.0]
    plan = [range(0, 1), range(1, 3)]
    assert simulate_iteration("train", plan, plan, fwd, bwd, 1, 4) == pytest.approx(4 * (6 + 15))
    # fused: the last backward group replaces its forward groups
    assert simulate_iteration("fused", [range(0, 1)], plan, fwd, bwd, 1, 2) == pytest.approx(2 * (1 + 15))


def test_simulation_of_two_devices_by_hand():
    # Jobs f0 (cost 1, device A), f1 (cost 3, device B), two microbatches:
    # A: mb0 0-1, mb1 1-2. B: mb0 1-4, mb1 4-7.
    assert simulate_iteration("infer", [range(0, 1), range(1, 2)], [], [1.0, 3.0], [], 2, 2) == pytest.approx(7)
    # Then a job of cost 1 on A waits for B microbatch by microbatch: mb0 4-5, mb1 7-8.
    assert simulate_iteration(
        "infer", [range(0, 1), range(1, 2), range(2, 3)], [], [1.0, 3.0, 1.0], [], 2, 2
    ) == pytest.approx(8)
    # Three devices: the third job runs on its own device as soon as its inputs are ready.
    assert simulate_iteration(
        "infer", [range(0, 1), range(1, 2), range(2, 3)], [], [1.0, 3.0, 1.0], [], 3, 2
    ) == pytest.approx(8)


def test_simulation_of_a_split_fused_job_by_hand():
    # f0 (cost 1) and the fused group (cost 10), then b0 (cost 2); two devices, two microbatches.
    fwd, bwd = [1.0, 0.0], [2.0, 10.0]
    fwd_plan, bwd_plan = [range(0, 1)], [range(0, 1), range(1, 2)]
    # One fused job on B: mb0 1-11, mb1 11-21; b0 on A waits for it: mb0 11-13, mb1 21-23.
    assert simulate_iteration("fused", fwd_plan, bwd_plan, fwd, bwd, 2, 2) == pytest.approx(23)
    # Two parts, part 0 (on B) taking the last microbatch: mb1 on B 2-12, mb0 on A (after f0) 2-12; b0 on B:
    # mb0 12-14, mb1 14-16.
    assert simulate_iteration("fused", fwd_plan, bwd_plan, fwd, bwd, 2, 2, fused_parts=2) == pytest.approx(16)


def test_simulation_of_a_split_first_backward_job_by_hand():
    # 'train': forward f0 (1) and f1 (0), then the first backward job b1 (10) and b0 (2); two devices.
    fwd, bwd = [1.0, 0.0], [2.0, 10.0]
    plan = [range(0, 1), range(1, 2)]
    # f0 on A 0-1, 1-2; f1 on B 1-1, 2-2; b1 on A: 2-12, 12-22; b0 on B: 12-14, 22-24.
    assert simulate_iteration("train", plan, plan, fwd, bwd, 2, 2) == pytest.approx(24)
    # b1 in two parts: mb0 on A 2-12, mb1 on B 2-12; b0 on A: 12-14, 14-16.
    assert simulate_iteration("train", plan, plan, fwd, bwd, 2, 2, fused_parts=2) == pytest.approx(16)


def test_a_merged_stage_counts_its_weights_against_the_activation_budget():
    """Under host pressure the backward stages merge; a stage of several layers holds their weights and
    the next stage's prefetched ones beside its activations. Six 1 GiB layers, 1 GiB kept and 2 GiB
    peak each, 6 GiB for a stage's activations: three layers would need 4 GiB of activations and 4 GiB
    of weights beyond the budget's reserve (too much), two need 3 + 2. Room for one checkpoint: no plan
    fits, and the call is refused instead of planned into an out-of-memory."""
    from roundpipe.planning.planner import ActivationCosts, ActivationMemoryError

    G = float(1 << 30)
    n = 6
    times = [1.0] * n
    sizes = [int(G)] * n

    def costs(host_checkpoints: int) -> ActivationCosts:
        return ActivationCosts([G] * n, [2 * G] * n, [10 * G] * n, 6 * G, host_checkpoints * 10 * G)

    fwd, bwd = plan_stages(
        "train",
        times,
        times,
        sizes,
        min_stages=1,
        upper_threshold=1.1,
        memory_limit_bytes=100 * G,
        activations=costs(2),
    )
    assert [len(r) for r in bwd] == [2, 2, 2], bwd
    with pytest.raises(ActivationMemoryError) as err:
        plan_stages(
            "train",
            times,
            times,
            sizes,
            min_stages=1,
            upper_threshold=1.1,
            memory_limit_bytes=100 * G,
            activations=costs(1),
        )
    assert err.value.host_needed == 20 * G
    assert err.value.gpu_needed == 5 * G  # the two-layer stages: 3 GiB of activations + 2 GiB of weights


def test_forward_groups_keep_their_weights_within_the_room_the_backward_leaves():
    """Forward groups are cut by time, and a group of several layers (with the next one, prefetched) holds
    twice its weights beyond the largest layer, which the GPU budget does not reserve. Under budgeted
    activations that excess must fit what the largest backward stage and the device-kept stage inputs leave
    (``forward_weight_cap``): with little room every forward group is one layer; with room, cheap forward
    layers still group by time. Six 1 GiB layers, forward 1 and backward 6 time units each, 'fused'."""
    from roundpipe.planning.planner import DEVICE_SAVED_SHARE, ActivationCosts, forward_weight_cap

    G = float(1 << 30)
    n = 6
    sizes = [int(G)] * n

    def plan(gpu_limit: float):
        a = ActivationCosts([0.5 * G] * n, [2 * G] * n, [G] * n, gpu_limit, 100 * G)
        fwd, bwd = plan_stages(
            "fused",
            [1.0] * n,
            [6.0] * n,
            sizes,
            min_stages=1,
            upper_threshold=1.1,
            memory_limit_bytes=100 * G,
            activations=a,
        )
        return a, fwd, bwd

    a, fwd, bwd = plan(2.5 * G)  # one layer's backward peak (2 GiB) nearly fills it
    assert [len(r) for r in fwd] == [1] * len(fwd), fwd
    worst = max(a.stage_bytes(r.start, r.stop, sizes) for r in bwd)
    for r in fwd:
        assert 2 * (len(r) - 1) * G <= (1 - DEVICE_SAVED_SHARE) * (a.gpu_limit - worst) + 1
    assert forward_weight_cap(a, sizes, bwd, 50 * G) < 2 * G
    _, fwd, _ = plan(60 * G)  # room: the time cap groups the forward
    assert max(len(r) for r in fwd) > 1, fwd
