"""The optimizer thread's intra-op thread count: its share of the host's cores, alone or beside other ranks,
and taken again when the device pool changes (``roundpipe.host.optim_thread``)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.stream_checks  # run with RPP_DEBUG_CHECK_STREAMS=1 (tests/conftest.py)


def test_one_process_leaves_cores_to_its_issuing_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Alone on its host, the optimizer thread takes each GPU's share of torch's thread count less four
    (from 8 threads up, at least 8), so the main, device and autograd threads keep cores while a step
    runs; RPP_OPTIM_THREADS wins."""
    import threading

    from roundpipe.host import optim_thread

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 16)
    assert optim_thread.single_process_default() == 12
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    assert optim_thread.single_process_default() == 4
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)
    assert optim_thread.single_process_default() is None  # small hosts (CI's 2 cores) keep torch's count
    # Several GPUs: each one's share less 4 (32 cores, 2 GPUs: 12), at least 8 (16 cores, 2 GPUs)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 32)
    assert [optim_thread.single_process_default(d) for d in (1, 2, 4)] == [28, 12, 8]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 16)
    assert [optim_thread.single_process_default(d) for d in (1, 2)] == [12, 8]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    assert optim_thread.single_process_default(2) == 4  # never more than torch's count less 4
    monkeypatch.setattr(torch, "get_num_threads", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert optim_thread.single_process_default() is None  # several ranks: their share, not this rule

    # What the optimizer thread sets, run on a thread of its own as the optimizer thread is.
    chosen: list = []
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch, "set_num_threads", chosen.append)
    monkeypatch.setattr(optim_thread, "_base_threads", None)  # as in a fresh process: torch's count, 16
    for env in (None, "3"):
        if env is None:
            monkeypatch.delenv("RPP_OPTIM_THREADS", raising=False)
        else:
            monkeypatch.setenv("RPP_OPTIM_THREADS", env)
        t = threading.Thread(target=optim_thread._set_thread_count)
        t.start()
        t.join()
    monkeypatch.delenv("RPP_OPTIM_THREADS", raising=False)
    monkeypatch.setattr(optim_thread, "issuing_devices", lambda: 2)  # a process driving two GPUs
    t = threading.Thread(target=optim_thread._set_thread_count)
    t.start()
    t.join()
    assert chosen == [12, 3, 8]
    monkeypatch.undo()

    from roundpipe.devices import backend

    monkeypatch.setattr(backend, "parse_devices", lambda spec: [torch.device("cpu")] * 3)
    assert optim_thread.issuing_devices() == 1  # CPU workers issue no GPU work
    monkeypatch.setattr(backend, "parse_devices", lambda spec: [torch.device("cuda", 0), torch.device("cuda", 1)])
    assert optim_thread.issuing_devices() == 2


def test_the_optimizer_thread_takes_its_count_again_for_a_new_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """The optimizer thread sets its intra-op count when it starts, for the pool of that moment; after
    ``configure(devices=...)`` it sets it again before its next kernel, from torch's count before its own
    (a benchmark that ran 1 GPU first kept 60 of 64 cores for the step on 4 GPUs, against 12)."""
    import roundpipe
    from roundpipe import settings
    from roundpipe.host import optim_thread

    chosen: list = []
    optim_thread.synchronize()  # the thread has started and set its count (earlier tests, or now)
    optim_thread.submit(lambda: None)
    optim_thread.synchronize()
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("RPP_OPTIM_THREADS", raising=False)
    monkeypatch.setattr(optim_thread, "_base_threads", 64)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 60)  # what the thread sees after setting its own
    monkeypatch.setattr(torch, "set_num_threads", chosen.append)
    pools = {"cpu:1": 1, "cpu:2": 4}
    monkeypatch.setattr(optim_thread, "issuing_devices", lambda: pools[settings.DEVICES.get()])
    try:
        for spec in ("cpu:1", "cpu:2"):
            roundpipe.configure(devices=spec)
            optim_thread.submit(lambda: None)
            optim_thread.synchronize()
        optim_thread.submit(lambda: None)  # no change since: no new count
        optim_thread.synchronize()
    finally:
        settings.unconfigure("RPP_DEVICES")
        optim_thread._recount.clear()
    assert chosen == [60, 12]


def test_ranks_sharing_a_host_give_the_optimizer_a_share_of_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun sets OMP_NUM_THREADS=1 for several ranks per host; the host Adam then gets cores / ranks
    threads, less two per rank for its issuing threads when that leaves at least 4, unless
    RPP_OPTIM_THREADS says otherwise (a count the user chose is kept)."""
    import os

    from roundpipe.host import optim_thread

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)), raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert optim_thread.shared_host_default() == 14  # 16 each, two left to the device and main threads
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert optim_thread.shared_host_default() == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert optim_thread.shared_host_default() == 4  # a share under 6 is kept whole
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert optim_thread.shared_host_default() is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    assert optim_thread.shared_host_default() is None
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert optim_thread.shared_host_default() is None  # one core per rank: nothing to spread
