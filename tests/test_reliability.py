"""Failures never hang: watchdog stack dumps, Ctrl-C, worker crashes; threads and memory stay bounded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _script(body: str) -> str:
    return textwrap.dedent(
        """
        import os, sys, time, threading
        import torch
        from torch import nn
        from roundpipe import RoundPipe, RoundPipeRunConfig
        """
    ) + textwrap.dedent(body)


def _env(**extra: str) -> dict:
    env = dict(os.environ)
    env.update({"RPP_DEVICES": "cpu:2", "PYTHONUNBUFFERED": "1", **extra})
    return env


@pytest.mark.timeout(60)
def test_ctrl_c_during_training_stops_cleanly() -> None:
    code = _script(
        """
        class Slow(nn.Module):
            def forward(self, x):
                time.sleep(0.05)
                return x * 1.0
        rp = RoundPipe(nn.Sequential(nn.Linear(8, 8), Slow(), nn.Linear(8, 8), Slow()))
        opt = torch.optim.SGD(rp.optim_parameters(), lr=0.1)
        import signal
        print("ready", signal.getsignal(signal.SIGINT) is signal.default_int_handler, flush=True)
        while True:
            rp.forward_backward(input_args=(torch.randn(8, 8),), loss_fn=lambda o, _: o.sum())
            rp.step(lambda: (opt.step(), opt.zero_grad()))
        """
    )
    # An ignored signal stays ignored across exec, and a test run started in the background by a
    # non-interactive shell (`pytest ... &`) has SIGINT ignored: the child then never sees the Ctrl-C
    # and the test times out. A user's shell starts the program with SIGINT at its default: so does
    # this test.
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    line = proc.stdout.readline().split()
    assert line == ["ready", "True"], (line, "the child must start with Python's KeyboardInterrupt handler")
    time.sleep(1.0)
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=20)
    assert time.monotonic() - start < 15
    assert proc.returncode != 0
    assert "KeyboardInterrupt" in err


@pytest.mark.timeout(60)
def test_watchdog_fails_a_stuck_call_and_dumps_thread_stacks() -> None:
    """A layer stuck past ``RPP_WATCHDOG_S``: the call fails, naming the job and the layer that does not move,
    and prints every thread's stack (the caller's wait trips it: the stuck thread is in user code)."""
    code = _script(
        """
        gate = threading.Event()
        class Stuck(nn.Module):
            def forward(self, x):
                gate.wait(4)  # a layer that hangs for a while
                return x
        rp = RoundPipe(nn.Sequential(nn.Linear(4, 4), Stuck()))
        with torch.no_grad():
            rp(torch.randn(4, 4))
        print("finished", flush=True)
        """
    )
    res = subprocess.run(
        [sys.executable, "-c", code], env=_env(RPP_WATCHDOG_S="1"), capture_output=True, text=True, timeout=50
    )
    assert res.returncode != 0 and "finished" not in res.stdout, res.stdout
    assert "roundpipe watchdog: no progress" in res.stderr
    assert "RoundPipeStalled" in res.stderr and "forward of layer 1 (Stuck), microbatch 0" in res.stderr, res.stderr
    # The stuck worker's stack is in the dump, down to the layer's forward (line 6 of the script body).
    dump = res.stderr.split("--- roundpipe thread roundpipe-cpu-worker", 1)
    assert len(dump) == 2 and "in forward" in dump[1], res.stderr


@pytest.mark.timeout(120)
def test_soak_threads_and_memory_stay_flat() -> None:
    """500 iterations of a small model: thread count constant, RSS growth under 5% after warm-up."""
    code = _script(
        """
        import psutil
        proc = psutil.Process()
        torch.manual_seed(0)
        rp = RoundPipe(nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]), optim_dtype=torch.float32,
                       model_run_config=RoundPipeRunConfig(num_microbatch=3))
        opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-3)
        x = torch.randn(12, 64)
        rss, threads = [], []
        for it in range(500):
            rp.forward_backward(input_args=(x,), loss_fn=lambda o, _: o.pow(2).mean())
            rp.step(lambda: (opt.step(), opt.zero_grad()))
            if it in (100, 499):
                rp.synchronize()
                rss.append(proc.memory_info().rss)
                threads.append(threading.active_count())
        print(rss[0], rss[1], threads[0], threads[1])
        """
    )
    res = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=110)
    assert res.returncode == 0, res.stderr
    rss0, rss1, t0, t1 = map(int, res.stdout.split())
    assert t0 == t1
    assert rss1 < rss0 * 1.05, (rss0, rss1)


def test_a_device_holds_one_queued_job_while_one_runs() -> None:
    """The dispatching thread can queue a device's next job while the current one runs (the worker then
    starts it without waiting for the dispatcher); a third job waits for the slot; ``wait_idle`` waits
    for both."""
    import threading

    from conftest import use_devices

    from roundpipe.devices import device as device_mod

    use_devices("cpu:1")
    dev = device_mod.get_devices()[0]
    started = [threading.Event() for _ in range(3)]
    release = [threading.Event() for _ in range(3)]

    def job(_dev, k: int) -> None:
        started[k].set()
        assert release[k].wait(10)

    dev.launch(job, 0)
    assert started[0].wait(10)
    t = time.perf_counter()
    dev.launch(job, 1)  # the slot is free while job 0 runs: returns at once
    assert time.perf_counter() - t < 1.0 and not started[1].is_set()
    third = threading.Thread(target=dev.launch, args=(job, 2))
    third.start()
    third.join(0.3)
    assert third.is_alive(), "a third job must wait while one runs and one is queued"
    assert not dev.drained.is_set()
    release[0].set()
    assert started[1].wait(10)  # job 1 starts as soon as job 0 is done
    third.join(10)
    assert not third.is_alive()
    release[1].set()
    assert started[2].wait(10)
    assert not dev.drained.is_set()
    release[2].set()
    dev.wait_idle()
    assert dev.drained.is_set()


@pytest.mark.parametrize("devices", ["cpu:1", "cpu:2"])
def test_a_model_let_go_after_training_is_freed(devices: str) -> None:
    """Once the caller drops a trained model (and its optimizer), nothing in the runtime keeps it: the idle
    device threads hold no reference to the last job, so the model's host and device memory come back (a second
    model built in the same process, as a notebook or a benchmark does, does not run out of memory)."""
    import gc
    import weakref

    from conftest import use_devices
    from helpers import small_mlp, train_small_mlp

    use_devices(devices)
    model = small_mlp()
    train_small_mlp(model, steps=2)
    refs = [weakref.ref(model)] + [weakref.ref(p) for p in model.optim_parameters()]
    model = None  # noqa: F841
    gc.collect()
    assert [r() is None for r in refs] == [True] * len(refs)


@pytest.mark.timeout(120)
def test_an_uncaught_error_right_after_wrapping_exits_with_the_error_not_an_abort() -> None:
    """The host buffers and the Adam state are built by background threads after wrapping; an error that
    ends the script while they build used to abort the process at exit ("terminate called without an
    active exception", exit code 134) instead of Python's traceback and exit code 1."""
    code = _script(
        """
        import roundpipe
        rp = RoundPipe(nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)]).to(torch.bfloat16),
                       optim_dtype=torch.float32, model_run_config=RoundPipeRunConfig(num_microbatch=1))
        opt = roundpipe.optim.Adam(rp.optim_parameters(), lr=1e-5)
        rp.forward_backward(input_args=(torch.randn(4, 2048).bfloat16(),), loss_fn=lambda o: o.sum())
        """
    )
    res = subprocess.run(
        [sys.executable, "-c", code], env=_env(RPP_DEVICES="cpu:1"), capture_output=True, text=True, timeout=110
    )
    assert res.returncode == 1, (res.returncode, res.stderr[-2000:])
    assert "TypeError" in res.stderr and "terminate called" not in res.stderr, res.stderr[-2000:]
