"""Tests for roundpipe.planning.timer: size-based start, warm-up drop, bias-corrected moving average, threads."""

import gc
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import roundpipe.planning.timer as timer_mod
from roundpipe.planning.timer import IterTimer, LayerTimingContext, ModelTimer, WallClockEvent

CPU = object()  # what the integrator passes as the "stream" of a CPU worker


class FakeTime:
    """Replaces the timer module's ``time`` so each timed block lasts exactly what the test says."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr(timer_mod, "time", fake)
    return fake


def run_iter(mt, clock, fwd=None, re=None, bwd=None):
    """Record one iteration; each value is a list of per-microbatch milliseconds."""
    it = IterTimer(mt)
    for action, table in (("fwd", fwd or {}), ("re", re or {})):
        for layer, runs in table.items():
            for ms in runs:
                with it.time_fwd(action, layer, CPU):
                    clock.now += ms / 1000
    for group, runs in (bwd or {}).items():
        for ms in runs:
            with it.time_bwd(group, CPU):
                clock.now += ms / 1000
    it.finish()
    return it


def test_estimates_start_from_layer_sizes():
    mt = ModelTimer(3, [1.0, 2.0, 4.0])
    source, fwd, bwd = mt.get_estimate("train")
    assert source == "memory"
    assert fwd == [1.0, 2.0, 4.0]
    assert bwd == [(1 + ModelTimer.BACKWARD_MULTIPLIER) * s for s in (1.0, 2.0, 4.0)]
    assert not mt.has_measurements("infer")


def test_first_iteration_is_dropped_then_the_average_is_bias_corrected(clock, monkeypatch):
    monkeypatch.setattr(ModelTimer, "SMOOTH_RATE", 0.5)
    mt = ModelTimer(2, [1.0, 1.0])

    run_iter(mt, clock, fwd={0: [100.0], 1: [100.0]})  # warm-up: dropped
    assert mt.get_estimate("infer")[:2] == ("memory", [1.0, 1.0])
    assert mt.stage["fwd"] == 1 and mt.version == 0

    run_iter(mt, clock, fwd={0: [4.0], 1: [2.0]})
    assert mt.update_times()
    # estimate = 0.5 * 0 + 0.5 * m = [2, 1]; scale = 0.5; corrected = [2, 1] / (1 - 0.5) = [4, 2]
    assert mt.estimate["fwd"] == pytest.approx([2.0, 1.0])
    assert mt.scale["fwd"] == 0.5
    source, fwd, _ = mt.get_estimate("infer")
    assert source == "time" and fwd == pytest.approx([4.0, 2.0])
    assert mt.version == 1

    run_iter(mt, clock, fwd={0: [10.0], 1: [2.0]})
    # estimate = 0.5 * [2, 1] + 0.5 * [10, 2] = [6, 1.5]; scale = 0.25; corrected = [8, 2]
    assert mt.get_estimate("infer")[1] == pytest.approx([8.0, 2.0])
    assert mt.scale["fwd"] == 0.25
    assert mt.version == 2


def test_default_smoothing_matches_a_hand_computation(clock):
    b = ModelTimer.SMOOTH_RATE
    mt = ModelTimer(1, [1.0])
    for ms in (50.0, 3.0, 5.0, 4.0):
        run_iter(mt, clock, fwd={0: [ms]})
    expected = ((1 - b) * b * b * 3.0 + (1 - b) * b * 5.0 + (1 - b) * 4.0) / (1 - b**3)
    assert mt.get_estimate("infer")[1] == pytest.approx([expected], rel=1e-9)


def test_microbatches_are_averaged(clock):
    mt = ModelTimer(1, [1.0])
    run_iter(mt, clock, fwd={0: [1.0]})
    run_iter(mt, clock, fwd={0: [1.0, 3.0, 5.0]})
    assert mt.get_estimate("infer")[1] == pytest.approx([3.0])


def test_backward_group_time_is_spread_by_current_estimates(clock):
    mt = ModelTimer(3, [1.0, 3.0, 1.0])
    train = dict(
        fwd={0: [1.0], 1: [3.0], 2: [2.0]},
        re={0: [1.0], 1: [3.0], 2: [2.0]},
        bwd={range(0, 2): [8.0], range(2, 3): [4.0]},
    )
    run_iter(mt, clock, **train)  # warm-up of every kind: dropped
    assert mt.get_estimate("train")[0] == "memory"
    run_iter(mt, clock, **train)
    assert mt.has_measurements("train")
    source, fwd, bwd = mt.get_estimate("train")
    assert source == "time"
    assert fwd == pytest.approx([1.0, 3.0, 2.0])
    # 8 ms over layers 0 and 1 in the ratio of their forward times 1 : 3 -> 2 and 6; plus recompute.
    assert bwd == pytest.approx([1.0 + 2.0, 3.0 + 6.0, 2.0 + 4.0])
    assert mt.stage["re"] == mt.stage["bwd"] == 2 and mt.scale["re"] == mt.scale["bwd"]


def test_each_kind_drops_its_own_first_iteration(clock):
    mt = ModelTimer(2, [1.0, 1.0])
    run_iter(mt, clock, fwd={0: [9.0], 1: [9.0]})  # inference only: fwd warm-up
    train = dict(fwd={0: [1.0], 1: [2.0]}, re={0: [1.0], 1: [2.0]}, bwd={range(0, 2): [6.0]})
    run_iter(mt, clock, **train)  # fwd measured; backward warm-up dropped
    assert mt.has_measurements("infer") and not mt.has_measurements("train")
    source, fwd, bwd = mt.get_estimate("train")
    assert source == "time"
    assert bwd == pytest.approx([(1 + ModelTimer.BACKWARD_MULTIPLIER) * f for f in fwd])
    run_iter(mt, clock, **train)
    assert mt.has_measurements("train")
    assert mt.get_estimate("train")[2] == pytest.approx([1.0 + 2.0, 2.0 + 4.0])


def test_unmeasured_layers_keep_their_estimates_and_fused_layers_get_forward_as_recompute(clock):
    mt = ModelTimer(3, [1.0, 1.0, 1.0])
    # Fused run: layers 0-1 are a backward group with recompute; layer 2 is the fused group (no recompute).
    fused = dict(
        fwd={0: [1.0], 1: [1.0], 2: [5.0]},
        re={0: [1.0], 1: [1.0]},
        bwd={range(0, 2): [4.0], range(2, 3): [10.0]},
    )
    run_iter(mt, clock, **fused)
    run_iter(mt, clock, **fused)
    _, fwd, bwd = mt.get_estimate("fused")
    assert bwd == pytest.approx([1.0 + 2.0, 1.0 + 2.0, 5.0 + 10.0])  # fused layer: forward + backward
    run_iter(mt, clock, fwd={0: [3.0]})  # only layer 0 measured
    assert mt.get_estimate("fused")[1] == pytest.approx([_ema2(1.0, 3.0), 1.0, 5.0])


def _ema2(first, second, b=ModelTimer.SMOOTH_RATE):
    return ((1 - b) * b * first + (1 - b) * second) / (1 - b**2)


def test_pending_device_events_are_not_waited_for():
    class Event:
        def __init__(self, t):
            self.t, self.done = t, False

        def query(self):
            return self.done

        def elapsed_time(self, end):
            return end.t - self.t

    mt = ModelTimer(1, [1.0])
    first = (Event(0.0), Event(7.0))
    second = (Event(0.0), Event(2.0))
    mt.add_iteration({("fwd", 0): [first]}, {})
    mt.add_iteration({("fwd", 0): [second]}, {})
    first[1].done = True
    assert not mt.update_times()  # first (warm-up) folded in, second still running
    assert len(mt.iter_results) == 1 and mt.stage["fwd"] == 1
    second[1].done = True
    assert mt.update_times()
    assert mt.get_estimate("infer") == ("time", [2.0], [pytest.approx(2.0 * (1 + ModelTimer.BACKWARD_MULTIPLIER))])


def test_several_threads_record_into_one_iteration():
    n_layers, n_threads = 6, 8
    mt = ModelTimer(n_layers, [1.0] * n_layers)
    it = IterTimer(mt)
    barrier = threading.Barrier(n_threads)

    def microbatch():
        barrier.wait()
        for layer in range(n_layers):
            with it.time_fwd("fwd", layer, CPU):
                time.sleep(0.002 if layer == 3 else 0)
        with it.time_bwd(range(0, n_layers), CPU):
            pass

    threads = [threading.Thread(target=microbatch) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    it.finish()
    assert sorted(it.fwd_events) == [("fwd", i) for i in range(n_layers)]
    assert all(len(pairs) == n_threads for pairs in it.fwd_events.values())
    assert len(it.bwd_events[range(0, n_layers)]) == n_threads
    assert len(mt.iter_results) == 1


def test_cpu_wall_clock_measures_real_time():
    mt = ModelTimer(2, [1.0, 1.0])
    for _ in range(2):
        it = mt.new_iter()
        with it.time_fwd("fwd", 0, CPU):
            pass
        with it.time_fwd("fwd", 1, CPU):
            time.sleep(0.03)
        it.finish()
    source, fwd, _ = mt.get_estimate("infer")
    assert source == "time"
    assert fwd[1] >= 30.0 and fwd[0] < fwd[1]


def test_failed_blocks_and_records_after_finish_are_dropped():
    mt = ModelTimer(2, [1.0, 1.0])
    it = mt.new_iter()
    with pytest.raises(RuntimeError):
        with it.time_fwd("fwd", 0, CPU):
            raise RuntimeError("boom")
    with it.time_fwd("fwd", 1, CPU):
        pass
    it.finish()
    it.finish()  # idempotent
    with it.time_fwd("fwd", 1, CPU):
        pass
    assert list(it.fwd_events) == [("fwd", 1)]
    assert len(it.fwd_events[("fwd", 1)]) == 1
    assert len(mt.iter_results) == 1


def test_an_unfinished_iteration_is_handed_over_when_collected():
    mt = ModelTimer(1, [1.0])
    it = mt.new_iter()
    with it.time_fwd("fwd", 0, CPU):
        pass
    del it
    gc.collect()
    assert len(mt.iter_results) == 1


def test_bad_layers_and_actions_are_rejected():
    it = ModelTimer(2, [1.0, 1.0]).new_iter()
    with pytest.raises(ValueError):
        it.time_fwd("bwd", 0, CPU)
    with pytest.raises(ValueError):
        it.time_fwd("fwd", 2, CPU)
    with pytest.raises(ValueError):
        it.time_bwd(range(1, 3), CPU)


def test_layer_timing_context_records_on_the_stream():
    seen = []

    class Event:
        def __init__(self, name):
            self.name = name

        def record(self, stream):
            seen.append((self.name, stream))

    stream = object()
    with LayerTimingContext(Event("start"), Event("end"), stream):
        seen.append(("body", None))
    assert seen == [("start", stream), ("body", None), ("end", stream)]
    assert isinstance(timer_mod._new_event(CPU), WallClockEvent)


def test_verbose_prints_updates(clock, monkeypatch, capsys):
    monkeypatch.setattr(ModelTimer, "VERBOSE", True)
    mt = ModelTimer(1, [1.0])
    run_iter(mt, clock, fwd={0: [5.0]})
    run_iter(mt, clock, fwd={0: [2.0]})
    mt.update_times()
    err = capsys.readouterr().err
    assert "dropped the first measured iteration" in err and "fwd: total 2.000 ms" in err


def test_verbose_comes_from_the_environment():
    code = "from roundpipe.planning.timer import ModelTimer; print(ModelTimer.VERBOSE)"
    env = dict(os.environ, RPP_DEBUG_TIMER="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_events_on_a_stream():
    mt = ModelTimer(2, [1.0, 1.0])
    stream = torch.cuda.Stream()
    x = torch.randn(2048, 2048, device="cuda")
    for _ in range(2):
        it = mt.new_iter()
        with torch.cuda.stream(stream):
            with it.time_fwd("fwd", 0, stream):
                x.add_(1)
            with it.time_fwd("fwd", 1, stream):
                for _ in range(20):
                    x = x @ x / 2048
        it.finish()
    assert isinstance(next(iter(it.fwd_events.values()))[0][0], torch.cuda.Event)
    mt.update_times()  # does not block; the events may still be running
    stream.synchronize()
    source, fwd, _ = mt.get_estimate("infer")
    assert source == "time" and fwd[1] > fwd[0] > 0
