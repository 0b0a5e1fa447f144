"""Contiguous cuts of a layer sequence: the fewest groups within a time cap and a memory cap, the slowest group
as fast as possible. Pure functions over per-layer costs, used by ``roundpipe.planning.planner``."""

from __future__ import annotations

from typing import List, Optional, Sequence

#: Relative slack for comparing sums of floats against a bound, so that rounding in prefix sums never turns an
#: allowed group (say, exactly 1.1 x the slowest layer) into a forbidden one; also the bisection's tolerance.
REL_TOL = 1e-9


def partition(
    times: Sequence[float],
    sizes: Sequence[float],
    min_groups: int,
    upper_threshold: float,
    mem_cap: float,
    slowest: Optional[float] = None,
) -> List[range]:
    """Cut ``len(times)`` layers into the fewest contiguous groups within the time cap (``upper_threshold``
    x ``slowest``, by default the slowest of these layers) and the memory cap, but at least ``min_groups``
    where the layer count allows; among those, make the slowest group as fast as possible."""
    n = len(times)
    t_prefix = prefix(times)
    m_prefix = prefix(sizes)
    slowest = max(times) if slowest is None else slowest
    time_cap = upper_threshold * slowest

    k = max(fewest_groups(t_prefix, m_prefix, time_cap, mem_cap), min(min_groups, n))

    # Smallest bottleneck T that still allows k groups: bisection on T, since "the greedy packing under T
    # needs at most k groups" is monotone in T. The cap itself is feasible by the choice of k.
    lo = max(max(times), t_prefix[n] / k)
    hi = min(time_cap, t_prefix[n])  # no group exceeds the total, so this bound changes nothing
    if fewest_groups(t_prefix, m_prefix, lo, mem_cap) <= k:
        hi = lo
    else:
        for _ in range(100):
            if hi - lo <= REL_TOL * hi:
                break
            mid = (lo + hi) / 2
            if fewest_groups(t_prefix, m_prefix, mid, mem_cap) <= k:
                hi = mid
            else:
                lo = mid
    return balanced_cut(t_prefix, m_prefix, k, hi, mem_cap)


def balanced_cut(t_prefix: List[float], m_prefix: List[float], k: int, time_cap: float, mem_cap: float) -> List[range]:
    """Cut into exactly k groups under the caps, each group's time as close as possible to an even share
    of the time left, so the slack under the bottleneck is spread instead of piling up at the end.
    Requires that k groups are feasible under the caps and ``k <= n``."""
    n = len(t_prefix) - 1
    reach = farthest_reach(t_prefix, m_prefix, time_cap, mem_cap)
    # groups_from[i]: fewest groups that can hold layers [i, n) (greedy packing is optimal for this).
    groups_from = [0] * (n + 1)
    for i in range(n - 1, -1, -1):
        groups_from[i] = 1 + groups_from[reach[i]]

    plan: List[range] = []
    start = 0
    for g in range(k):
        left = k - g
        if left == 1:
            plan.append(range(start, n))
            break
        # Any end in [first, last] keeps the rest feasible: the group fits the caps (end <= reach),
        # the rest needs at most left - 1 groups, and leaves at least one layer per remaining group.
        last = min(reach[start], n - (left - 1))
        first = start + 1
        while groups_from[first] > left - 1:
            first += 1
        target = t_prefix[start] + (t_prefix[n] - t_prefix[start]) / left
        even = start + (n - start) / left  # tie-break (e.g. all times 0): an even share of the layers
        end = min(range(first, last + 1), key=lambda e: (abs(t_prefix[e] - target), abs(e - even), e))
        plan.append(range(start, end))
        start = end
    return plan


def fewest_groups(t_prefix: List[float], m_prefix: List[float], time_cap: float, mem_cap: float) -> int:
    """Fewest contiguous groups within the caps, by greedy packing (optimal for contiguous groups)."""
    reach = farthest_reach(t_prefix, m_prefix, time_cap, mem_cap)
    n = len(t_prefix) - 1
    count, i = 0, 0
    while i < n:
        i = reach[i]
        count += 1
    return count


def farthest_reach(t_prefix: List[float], m_prefix: List[float], time_cap: float, mem_cap: float) -> List[int]:
    """reach[i]: the largest end such that layers [i, end) fit both caps (always > i: a single layer fits
    because time_cap >= the slowest layer and layer sizes were checked). Two pointers, O(n)."""
    n = len(t_prefix) - 1
    t_lim = time_cap * (1 + REL_TOL)
    m_lim = mem_cap * (1 + REL_TOL)
    reach = [0] * n
    end = 0
    for i in range(n):
        end = max(end, i + 1)
        while end < n and t_prefix[end + 1] - t_prefix[i] <= t_lim and m_prefix[end + 1] - m_prefix[i] <= m_lim:
            end += 1
        reach[i] = end
    return reach


def prefix(values: Sequence[float]) -> List[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + float(v))
    return out


# ---------------------------------------------------------------------------------------------------------
# Checks and messages
