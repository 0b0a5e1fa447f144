"""Host threads checked against the CPU workers' streams (``cpu_streams.host_checks``), and copies that do not
alias while checking.

On a GPU the optimizer thread that copies a gradient out of its host buffer before the download into it has
landed reads garbage; on CPU workers every copy has finished when it is issued, so only the checks' bookkeeping
can tell. These tests show a host read or write that the host has not ordered after a stream's access fails,
naming both sides, and that a training run with every fence in place passes the same checks.
"""

from __future__ import annotations

import copy
import threading
from typing import Iterator

import pytest
import torch
from helpers import rel_err
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig, settings
from roundpipe.devices import backend, cpu_streams
from roundpipe.devices.cpu_streams import CpuStream, StreamOrderError
from roundpipe.runtime import transfer

pytestmark = pytest.mark.stream_checks

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _checked() -> Iterator[None]:
    """Every test here needs the checks, whatever runs it (the marker turns them on too)."""
    with settings.overridden(debug_check_streams="1"):
        assert cpu_streams.enabled()
        yield


def test_a_host_read_needs_its_own_synchronize() -> None:
    a = CpuStream(CPU, "A")
    with backend.use_stream(a):
        out = torch.ones(4) * 2  # written on A, as a download is
    done = a.record_event()
    out.sum()  # outside host_checks: not checked
    with cpu_streams.host_checks():
        with pytest.raises(StreamOrderError) as info:
            out.sum()
    msg = str(info.value)
    assert "host thread 'MainThread' reads a float32[4] tensor with aten::sum" in msg.replace(
        " (storage of 16 bytes)", ""
    )
    assert (
        "that A wrote with aten::mul" in msg and "the host never synchronized the event recorded after it on A" in msg
    )
    # Another thread's synchronize orders nothing in this one.
    other = threading.Thread(target=done.synchronize)
    other.start()
    other.join()
    with cpu_streams.host_checks(), pytest.raises(StreamOrderError, match="never synchronized"):
        out.sum()
    done.synchronize()
    with cpu_streams.host_checks():
        assert out.sum().item() == 8.0


def test_a_host_write_over_a_stream_read_needs_its_end_seen() -> None:
    a = CpuStream(CPU, "A")
    weights = torch.ones(4)
    with backend.use_stream(a):
        weights.clone()  # an upload reads the host weights
    done = a.record_event()
    with cpu_streams.host_checks():
        weights.sum()  # reading beside a stream's read is fine
        with pytest.raises(
            StreamOrderError, match=r"host thread 'MainThread' writes a float32\[4\].* that A read with"
        ):
            weights.zero_()  # the optimizer overwrites the weights while the upload may still read them
    done.synchronize()
    with cpu_streams.host_checks():
        weights.zero_()
    with backend.use_stream(a):
        weights.add_(1)  # a stream writes, and the host ...
    with cpu_streams.host_checks(), pytest.raises(StreamOrderError, match="writes .* that A wrote with aten::add_"):
        weights.fill_(3)  # ... writes over it unsynchronized


def test_copies_are_real_only_while_checking() -> None:
    """Checking: a CPU download and a host scalar are copies on their stream, read after their event.
    Unchecked: the download is the tensor itself and the host checks are one shared no-op."""
    a = CpuStream(CPU, "A")
    t = torch.arange(3.0)
    with backend.use_stream(a):
        host = transfer._to_host(t)
        scalar = transfer.HostScalar(t.sum())
    assert host.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    with cpu_streams.host_checks():
        with pytest.raises(StreamOrderError, match="that A wrote with aten::clone"):
            host.sum()
        assert scalar.item() == 3.0  # synchronizes the scalar's event first
    with settings.overridden(debug_check_streams="0"):
        assert transfer._to_host(t) is not t and transfer._to_host(t).data_ptr() == t.data_ptr()
        assert transfer.HostScalar(t.sum()).event is None
        assert cpu_streams.host_checks() is cpu_streams.host_checks()


def _train(workers_model: nn.Module, is_async: bool) -> None:
    rp = RoundPipe(workers_model, model_run_config=RoundPipeRunConfig(num_microbatch=3))
    optimizer = torch.optim.SGD(rp.optim_parameters(), lr=0.1)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        x = torch.randn(9, 8, dtype=torch.float64, generator=g)
        rp.forward_backward(input_args=(x,), loss_fn=lambda o, _: o.pow(2).mean())
        rp.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=is_async)
    rp.synchronize()


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_the_optimizer_thread_reads_gradients_after_their_download(workers: str) -> None:
    """Three synchronous steps with every host access checked: the optimizer thread synchronizes each layer's
    gradient download before it copies the gradient (``host.step``), so the run passes, and equals plain
    PyTorch. Dropping that synchronize fails this test (the copy reads what the gradient stream wrote)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)).double()
    ref = copy.deepcopy(model)
    before = cpu_streams.host_ops_checked()
    _train(model, is_async=False)
    assert cpu_streams.host_ops_checked() > before + 50  # the optimizer thread's copies and SGD were checked
    optimizer = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        x = torch.randn(9, 8, dtype=torch.float64, generator=g)
        for part in torch.tensor_split(x, 3):
            ref(part).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert rel_err(p, q) < 1e-10


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_asynchronous_steps_pass_the_host_checks(workers: str) -> None:
    """The asynchronous step overlaps the next call: its publish of the weights follows the uploads that
    read them (``wait_uploads``), its gradient copies the downloads."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()
    before = cpu_streams.host_ops_checked()
    _train(model, is_async=True)
    assert cpu_streams.host_ops_checked() > before + 20  # each step's copies and SGD on two layers


def test_a_host_read_error_says_how_far_the_thread_synchronized() -> None:
    """The error tells a stale synchronize (this thread saw the writer up to an earlier op) from a missing one
    (op #0) and from a stream of another device pool that shares the writer's name."""
    a = CpuStream(CPU, "twin-grad-stream")
    with backend.use_stream(a):
        first = torch.ones(4)  # op 1
    early = a.record_event()
    with backend.use_stream(a):
        first.mul_(2)  # op 2: written after the event this thread synchronizes
    early.synchronize()
    with cpu_streams.host_checks(), pytest.raises(StreamOrderError) as info:
        first.sum()
    assert "this thread synchronized twin-grad-stream up to its op #1, the host up to #1 (of 2)" in str(info.value)
    assert "other live stream" not in str(info.value)
    twin = CpuStream(CPU, "twin-grad-stream")  # a second pool's stream of the same name
    with cpu_streams.host_checks(), pytest.raises(StreamOrderError, match="1 other live stream.s. have that name"):
        first.sum()
    del twin
