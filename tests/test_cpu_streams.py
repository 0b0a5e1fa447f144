"""CPU workers' streams checked for order (``roundpipe.devices.cpu_streams``), two wrappers' shared buffers,
and the hand-over of a split fused job's gradients that never comes (``threads.wait_or_stall``).

On CPU workers stream work runs at once, so a dropped ``wait_event`` never gives a wrong result; with
``RPP_DEBUG_CHECK_STREAMS`` (on in the stress mode) the streams record what each op reads and writes and raise
when an op is not ordered after another stream's access. The mutant tests below drop one wait at one
call site (``_drop_waits``) and show the run fails naming the streams and the event; the same run
unmutated passes with the checks on.
"""

from __future__ import annotations

import copy
import sys
import time
from typing import Callable, Iterator, List

import pytest
import torch
from helpers import rel_err
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig, settings
from roundpipe.devices import backend, cpu_streams, threads
from roundpipe.devices.cpu_streams import CpuEvent, CpuStream, StreamOrderError
from roundpipe.devices.threads import RoundPipeWorkerError
from roundpipe.planning.plan import ModelExecutePlan
from roundpipe.runtime.partial_grads import PartialGrads

pytestmark = pytest.mark.stream_checks  # run with RPP_DEBUG_CHECK_STREAMS=1 (tests/conftest.py)

STRESS_S = 0.001


@pytest.fixture
def checked() -> Iterator[None]:
    """The stress mode, which turns the checks on (``RPP_DEBUG_CHECK_STREAMS=auto``)."""
    with settings.overridden(debug_stress_delay_s=STRESS_S):
        assert cpu_streams.enabled()
        yield


def _drop_waits(monkeypatch: pytest.MonkeyPatch, module: str, function: str) -> List[str]:
    """The mutant: every ``CpuStream.wait_event`` called from ``module.function`` does nothing. Returns
    the list the dropped calls are noted in (a test asserts the mutant was reached)."""
    dropped: List[str] = []
    real = CpuStream.wait_event

    def wait_event(self: CpuStream, event: object) -> None:
        caller = sys._getframe(1)
        if caller.f_code.co_name == function and caller.f_globals.get("__name__") == module:
            dropped.append(self.name)
            return
        real(self, event)

    monkeypatch.setattr(CpuStream, "wait_event", wait_event)
    return dropped


def _split_model(num_microbatch: int = 4) -> RoundPipe:
    """Three groups, the last (two layers) the fused job that splits over the CPU workers."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 5)).double()
    plan = ModelExecutePlan([range(0, 2), range(2, 3)], [range(0, 2), range(2, 3), range(3, 5)])
    return RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=num_microbatch, execute_plan=plan))


def _train(rp: RoundPipe, calls: int = 2) -> None:
    x = torch.randn(10, 8, dtype=torch.float64)
    for _ in range(calls):
        rp.forward_backward(input_args=(x,), loss_fn=lambda o, _: o.pow(2).mean())


def _bn_inference() -> Callable[[], None]:
    """Inference calls of a model with buffers: each call's upload reads the buffers the previous call's
    forward downloaded (``upload_layers`` waits for ``buffer_downloaded``)."""

    def run() -> None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 5)).double()
        rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2))
        x = torch.randn(10, 8, dtype=torch.float64)
        for _ in range(3):
            with torch.no_grad():
                rp(x)

    return run


# ---- the stand-in itself ---------------------------------------------------------------------------


def test_checks_follow_the_stress_mode_and_the_setting() -> None:
    with settings.overridden(debug_check_streams="auto", debug_stress_delay_s=0.0):
        assert not cpu_streams.enabled()
    with settings.overridden(debug_check_streams="auto", debug_stress_delay_s=STRESS_S):
        assert cpu_streams.enabled()
        with settings.overridden(debug_check_streams="0"):
            assert not cpu_streams.enabled()
    with settings.overridden(debug_check_streams="1"):
        assert cpu_streams.enabled()


def test_a_read_needs_the_writers_event_waited_for_or_synchronized(checked: None) -> None:
    cpu = torch.device("cpu")
    a, b = CpuStream(cpu, "A"), CpuStream(cpu, "B")
    src = torch.ones(4)
    with backend.use_stream(a):
        host = src * 2  # written on A
    done = a.record_event()
    with pytest.raises(StreamOrderError, match=r"B reads a float32\[4\] tensor .* that A wrote .* on A") as info:
        with backend.use_stream(b):
            host.clone()
    assert "in test_cpu_streams.test_a_read_needs_the_writers_event_waited_for_or_synchronized" in str(info.value)
    b.wait_event(done)
    with backend.use_stream(b):
        host.clone()  # ordered now
    a.wait_stream(b)  # A follows B's read ...
    with backend.use_stream(a):
        host.add_(1)  # ... and writes again: B's earlier wait does not cover this write
    with pytest.raises(StreamOrderError, match="no event was recorded after it"):
        with backend.use_stream(b):
            host.sum()
    ev = CpuEvent()
    ev.record(a)
    ev.synchronize()  # the host saw A's work end: any stream may read
    with backend.use_stream(b):
        host.sum()
    with pytest.raises(StreamOrderError, match="A writes a float32.* that B read with aten::sum"):
        with backend.use_stream(a):
            host.zero_()  # a write on A while B may still be reading


def test_checks_off_record_nothing() -> None:
    with settings.overridden(debug_stress_delay_s=0.0, debug_check_streams="0"):
        cpu = torch.device("cpu")
        a, b = CpuStream(cpu, "A"), CpuStream(cpu, "B")
        before = cpu_streams.ops_checked()
        with backend.use_stream(a):
            host = torch.ones(4) * 2
        with backend.use_stream(b):
            host.clone()
        assert cpu_streams.ops_checked() == before and a.pos == 0


class _TorchLikeStream:
    """What torch.cuda.Stream.wait_event does with an event it does not own: ``event.wait(self)``."""

    def __init__(self) -> None:
        self.waited: List[object] = []

    def wait_event(self, event: object) -> None:
        self.waited.append(event)
        event.wait(self)  # type: ignore[attr-defined]


@pytest.mark.parametrize("check", ["0", "1"])
def test_a_cuda_stream_waits_on_a_cpu_event_without_looping(check: str) -> None:
    # A host buffer's "downloaded" event starts as a CpuEvent (complete) and is waited for by the GPU's
    # upload stream before the first download: torch calls event.wait(stream), which must not call back.
    with settings.overridden(debug_check_streams=check):
        cpu_streams.refresh()
        stream = _TorchLikeStream()
        event = CpuEvent()
        event.record(CpuStream(torch.device("cpu"), "A"))
        stream.wait_event(event)
        assert stream.waited == [event]
    cpu_streams.refresh()


# ---- the runtime, unmutated and with one wait dropped ----------------------------------------------


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_unmutated_runs_pass_the_checks(workers: str, checked: None) -> None:
    """The split fused job, a training run and inference with buffers: every cross-stream access is
    ordered, and the checks did see the ops."""
    before = cpu_streams.ops_checked()
    with settings.overridden(debug_split_fused="1"):
        _train(_split_model())
    _bn_inference()()
    assert cpu_streams.ops_checked() > before + 500


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_split_part_uploaded_before_its_download_landed_fails(
    workers: str, checked: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mutant (a): the primary part of a split fused job uploads a part's host buffers without waiting
    for that part's download event (``PartialGrads.fetch``)."""
    dropped = _drop_waits(monkeypatch, "roundpipe.runtime.partial_grads", "fetch")
    with settings.overridden(debug_split_fused="1"):
        rp = _split_model()
        with pytest.raises(RoundPipeWorkerError) as info:
            _train(rp)
    assert dropped
    assert isinstance(info.value.original, StreamOrderError)  # type: ignore[attr-defined]
    msg = str(info.value)
    assert "cpu-worker0.grad_stream reads" in msg and "that cpu-worker1.grad_stream wrote" in msg, msg
    assert "float64[" in msg and "partial_grads.publish" in msg and "never waited" in msg, msg


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_split_part_mutant_passes_unchecked(workers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Why the checks exist: without them the same mutant trains on CPU workers without a sign."""
    dropped = _drop_waits(monkeypatch, "roundpipe.runtime.partial_grads", "fetch")
    with settings.overridden(debug_split_fused="1", debug_stress_delay_s=STRESS_S, debug_check_streams="0"):
        _train(_split_model())
    assert dropped


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
@pytest.mark.parametrize(
    "function, run, reader, writer_event",
    [
        # Mutant (b): a stage's host input uploaded before the download that wrote it (another device's).
        ("async_h2d", lambda: _train(_split_model()), ".upstream reads", "transfer._copy_after_compute"),
        # Layer buffers uploaded before the previous forward's buffer download landed.
        ("upload_layers", _bn_inference(), ".param_upstream reads", "transfer.download_layer"),
        # A layer computed before its parameter upload (``wait_layer``).
        ("wait_layer", lambda: _train(_split_model()), ".compute_stream reads", "transfer.upload_layers"),
    ],
    ids=["async_h2d", "upload_layers", "wait_layer"],
)
def test_dropped_transfer_wait_fails(
    workers: str,
    checked: None,
    monkeypatch: pytest.MonkeyPatch,
    function: str,
    run: Callable[[], None],
    reader: str,
    writer_event: str,
) -> None:
    """Each ``wait_event`` of ``roundpipe.runtime.transfer`` dropped in turn: the run fails naming the stream
    that read too early and the event it should have waited for."""
    dropped = _drop_waits(monkeypatch, "roundpipe.runtime.transfer", function)
    with pytest.raises(RoundPipeWorkerError, match="StreamOrderError") as info:
        run()
    assert dropped
    msg = str(info.value)
    assert reader in msg and writer_event in msg and "never waited" in msg, msg


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_kept_keys_and_values_uploaded_before_their_download_fails(
    workers: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mutant: a sequence-tiled backward job uploads a layer's kept keys and values without waiting for the
    forward's download of them (``sequence.TileKV.layer``). Unchecked, a CPU download would hand the upload the
    forward's own tensor; the download's copy (real while checking) shows the missing wait: the upload on the
    compute stream reads what a download stream wrote. The same run unmutated passes (tests/test_sequence.py,
    also with these checks)."""
    transformers = pytest.importorskip("transformers")
    from roundpipe import models
    from roundpipe.models import configs

    dropped = _drop_waits(monkeypatch, "roundpipe.runtime.sequence", "layer")
    torch.manual_seed(0)
    config = configs.tiny_config("qwen3", attn_implementation="sdpa")
    model = transformers.AutoModelForCausalLM.from_config(config).double()
    ids = torch.randint(1, config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    # Stages of several layers: a stage's kept keys and values are downloaded after its outputs, so no other
    # wait of the backward (its input's upload) happens to cover them.
    plan = ModelExecutePlan([range(0, 2), range(2, 5)], [range(0, 2), range(2, 5)])
    rp = models.wrap_model(model, model_run_config=RoundPipeRunConfig(sequence_tiles=3, execute_plan=plan))
    with (
        settings.overridden(debug_check_streams="1"),
        pytest.raises(RoundPipeWorkerError, match="StreamOrderError") as info,
    ):
        rp.train_step(input_ids=ids, labels=ids)
    assert dropped
    msg = str(info.value)
    assert "compute_stream reads" in msg and "downstream wrote" in msg and "sequence.py" in msg, msg
    assert "transfer._copy_after_compute" in msg and "never waited" in msg, msg


# ---- a fused part that never hands its gradients over ----------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
@pytest.mark.parametrize("how", ["hangs", "skips"])
def test_part_that_never_hands_over_fails_within_the_watchdog(
    workers: str, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Part 1 of the split fused job never publishes its gradients (stuck in a wait, or returning
    without): part 0 fails within ``RPP_WATCHDOG_S`` naming the part and the layer, and every thread
    goes idle (the stuck part aborts with the run)."""
    never = threads.AnnotatedEvent("test.never")
    real_publish = PartialGrads.publish

    def publish(self: PartialGrads, part: int, *args: object) -> None:
        if part == 1:
            if how == "hangs":
                never.wait()  # aborts (RoundPipeAborted) once the run has failed
            return
        real_publish(self, part, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(PartialGrads, "publish", publish)
    limit = 0.4
    with settings.overridden(debug_split_fused="1", watchdog_s=limit):
        rp = _split_model()
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="fused part 1 never handed over its gradients") as info:
            _train(rp, calls=1)
        elapsed = time.monotonic() - start
    msg = str(info.value)
    assert "layer 3 (Tanh)" in msg and "RPP_WATCHDOG_S" in msg and "cpu-worker0" in msg, msg
    assert isinstance(info.value.original, threads.RoundPipeStalled)  # type: ignore[attr-defined]
    assert elapsed < limit + 3.0, elapsed
    deadline = time.monotonic() + 5
    while any(t.is_alive() and t.is_active for t in threads.roundpipe_threads) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not [t.name for t in threads.roundpipe_threads if t.is_alive() and t.is_active]


# ---- two wrappers of one model ---------------------------------------------------------------------


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_two_wrappers_of_one_model_order_its_running_statistics(workers: str) -> None:
    """Two RoundPipe wrappers of one model share its host buffers: each call's upload of BatchNorm's running
    statistics waits for the other wrapper's last download of them (``attribute.buffer_downloaded`` is kept on
    the buffer, not on a wrapper's layer). Alternating calls with the checks on: the statistics are plain
    PyTorch's after the same calls (inference and training calls, both update them in training mode)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 5)).double()
    ref = copy.deepcopy(model)
    a = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    b = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=3))
    with settings.overridden(debug_stress_delay_s=STRESS_S, debug_check_streams="1"):
        for k in range(8):
            x = torch.randn(12, 8, dtype=torch.float64)
            rp, n = (a, 2) if k % 2 == 0 else (b, 3)
            if k % 4 < 2:  # inference in training mode: nothing after the call waits for the buffers' download
                with torch.no_grad():
                    rp(x)
                    for part in torch.tensor_split(x, n):
                        ref(part)
            else:
                rp.forward_backward(input_args=(x,), loss_fn=lambda o, _: o.pow(2).mean())
                for part in torch.tensor_split(x, n):
                    ref(part).pow(2).mean().backward()
    for (name, buf), (_, want) in zip(model.named_buffers(), ref.named_buffers()):
        assert rel_err(buf, want) < 1e-10, (name, buf, want)
