"""GPU-only checks: parameter uploads overlap compute (the point of the separate streams)."""

from __future__ import annotations

import pytest
import torch
from conftest import use_devices
from torch import nn

from roundpipe import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from roundpipe.runtime import transfer

pytestmark = pytest.mark.gpu


def _intervals(prof: torch.profiler.profile):
    """(kernel intervals, host-to-device copy intervals per CUDA stream) in device time, microseconds."""
    kernels, h2d_by_stream = [], {}
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        span = (evt.time_range.start, evt.time_range.end)
        if "Memcpy HtoD" in evt.name:
            h2d_by_stream.setdefault(evt.device_resource_id, []).append(span)
        elif not evt.name.startswith(("Memcpy", "Memset")):
            kernels.append(span)
    return kernels, h2d_by_stream


def _overlap(a, b) -> float:
    """Total length of the intersection of two interval sets."""
    total = 0.0
    for s1, e1 in a:
        for s2, e2 in b:
            total += max(0.0, min(e1, e2) - max(s1, s2))
    return total


def test_parameter_upload_overlaps_compute() -> None:
    use_devices("cuda:0")
    torch.manual_seed(0)
    # Layers the size of a large model's projections (8192 x 8192 bf16, 128 MiB): each job's GPU work
    # (about 3 ms) dwarfs the per-job host overhead of issuing it (about 1 ms), as in real models.
    n_layers, width = 8, 8192
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(n_layers)]).to(torch.bfloat16)
    plan = ModelExecutePlan.layerwise(n_layers, "infer")
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=plan))
    x = torch.randn(8192, width, dtype=torch.bfloat16).pin_memory()
    with torch.no_grad():
        for _ in range(2):
            rp(x)  # warm-up: allocator, cuBLAS handles
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            out = rp(x)
            torch.cuda.synchronize()
    ref = x.cuda()
    for layer in model:
        ref = ref @ layer.weight.cuda().t()
    assert (out.float() - ref.float().cpu()).norm() / ref.float().norm() < 2e-2
    kernels, h2d_by_stream = _intervals(prof)
    assert kernels and h2d_by_stream, "profiler saw no kernels or uploads"
    # The parameter stream carries the most copies (the activation stream only the two inputs). A
    # 128 MiB weight goes up in slices of transfer.CHUNK_UPLOAD_SIZE, back to back: one upload is
    # the span from its first slice's start to its last slice's end.
    slices = sorted(max(h2d_by_stream.values(), key=len))
    per_layer = -(-width * width * 2 // transfer.CHUNK_UPLOAD_SIZE) if transfer.chunked_upload else 1
    assert len(slices) == n_layers * per_layer, (len(slices), n_layers, per_layer)
    uploads = [(slices[i][0], slices[i + per_layer - 1][1]) for i in range(0, len(slices), per_layer)]
    # Uploads issued before the first kernel (the input and layer 0's weights) cannot overlap
    # anything; every later one is a prefetch of group g+1 that should run while group g computes.
    first_kernel = min(s for s, _ in kernels)
    prefetch = [(s, e) for s, e in uploads if s >= first_kernel]
    assert len(prefetch) >= n_layers - 2
    upload_time = sum(e - s for s, e in prefetch)
    overlapped = _overlap(prefetch, kernels)
    print(
        f"prefetch h2d {upload_time:.0f} us, overlapped with compute {overlapped:.0f} us "
        f"({overlapped / upload_time:.0%})"
    )
    # Each prefetch of group g+1 runs while group g computes: at least a quarter of every upload
    # (all but the last two) overlaps compute kernels.
    per_upload = sorted(_overlap([span], kernels) / (span[1] - span[0]) for span in prefetch)
    assert all(f >= 0.25 for f in per_upload[2:]), per_upload


def test_qwen3_0_6b_trains_on_gpu_and_matches_cpu() -> None:
    """A Qwen3-0.6B-architecture model (random init, bf16) through RoundPipe on one GPU: loss and
    gradients match a plain fp32 Hugging Face run on the CPU within bf16 tolerance, and it trains."""
    import copy
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    from train_bench import build_model

    import roundpipe
    from roundpipe import RoundPipeRunConfig

    use_devices("cuda:0")
    hf = build_model("qwen3-0.6b", "cpu")  # bf16
    ref = copy.deepcopy(hf).float()
    ids = torch.randint(0, hf.config.vocab_size, (2, 256), generator=torch.Generator().manual_seed(0))
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    model = roundpipe.wrap_model_to_roundpipe(
        hf, optim_dtype=torch.float32, model_run_config=RoundPipeRunConfig(num_microbatch=2)
    )
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-2
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for name, p in hf.named_parameters():
        q = ref_params[name]
        err = ((p.grad.float() - q.grad).norm() / q.grad.norm()).item()
        worst = max(worst, err)
    print(f"loss {loss.item():.4f} vs cpu fp32 {ref_loss.item():.4f}; worst grad rel err {worst:.3g}")
    assert worst < 5e-2
    opt = roundpipe.optim.Adam(model.optim_parameters(), lr=1e-3)
    for p in hf.parameters():
        p.grad = None
    losses = [model.train_step(input_ids=ids, labels=ids).item()]
    for _ in range(5):
        model.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        losses.append(model.train_step(input_ids=ids, labels=ids).item())
    print("losses", [round(v, 3) for v in losses])
    assert losses[-1] < losses[0] - 0.5


class _HugeBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        if _Oom.armed:
            torch.empty(1 << 44, dtype=torch.uint8, device=g.device)  # 16 TiB: a real CUDA OOM
        return g


class _Oom(nn.Module):
    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _HugeBackward.apply(x)


def test_out_of_memory_in_backward_is_reported_and_recoverable() -> None:
    use_devices("cuda:0")
    rp = RoundPipe(nn.Sequential(nn.Linear(64, 64), _Oom(), nn.Linear(64, 8)), name="oom-gpu")
    x = torch.randn(32, 64)
    _Oom.armed = True
    with pytest.raises(torch.OutOfMemoryError) as info:
        rp(x).sum().backward()
    msg = str(info.value)
    print(msg.splitlines()[0])
    for fragment in (
        "model 'oom-gpu'",
        "layer 1",
        "Stage layers",
        "GiB of device memory is free",
        "num_microbatch",
        "resolve-oom",
    ):
        assert fragment in msg, (fragment, msg)
    _Oom.armed = False
    rp(x).sum().backward()
    assert rp.model[2].weight.grad is not None


def test_chunked_loss_memory_on_32k_tokens_150k_vocab() -> None:
    """The memory-light loss on 32,768 tokens x 151,936 vocabulary (bf16 hidden 2048): forward and
    backward stay under 4 GiB of extra GPU memory (full fp32 logits alone would be 18.5 GiB), and the
    loss equals cross-entropy on full fp32 logits."""
    import torch.nn.functional as F

    from roundpipe.models.loss import linear_cross_entropy

    torch.manual_seed(0)
    dev = torch.device("cuda")
    tokens, hidden_size, vocab = 32768, 2048, 151936
    hidden = (torch.randn(tokens, hidden_size, device=dev) * 0.5).bfloat16().requires_grad_(True)
    weight = (torch.randn(vocab, hidden_size, device=dev) * 0.02).bfloat16().requires_grad_(True)
    target = torch.randint(0, vocab, (tokens,), device=dev)
    target[::7] = -100
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = linear_cross_entropy(hidden, weight, target)
    loss.backward()
    torch.cuda.synchronize()
    extra = (torch.cuda.max_memory_allocated() - base) / 1024**3
    grads = hidden.grad.numel() * 2 + weight.grad.numel() * 2
    print(f"chunked loss: peak extra {extra:.2f} GiB (of which gradients {grads / 1024**3:.2f} GiB)")
    assert extra < 4.0
    with torch.no_grad():
        ref = F.cross_entropy((hidden @ weight.t()).float(), target, reduction="sum", ignore_index=-100)
    assert abs(loss.item() - ref.item()) / ref.item() < 1e-3


def test_losses_and_saved_activations_survive_the_download_race() -> None:
    """Downloads run on their own stream: a source tensor dropped by the job right after its download
    was issued must not be reused by the next kernels before the copy has read it (the loss of a
    microbatch once came back as garbage that way, about half the true value, on an H200).

    Every call's loss and gradients must equal plain PyTorch's on the same weights; forward groups of
    two layers with backward groups of one make the forward download activations mid-group too."""
    use_devices("cuda:0")
    torch.manual_seed(0)
    width, rows, n_layers = 2048, 8192, 6
    ref = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(n_layers)]).cuda()
    body = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(n_layers)])
    body.load_state_dict({k: v.cpu() for k, v in ref.state_dict().items()})
    model = RoundPipe(body)
    plan = ModelExecutePlan([range(0, 2), range(2, 4), range(4, 5)], [range(i, i + 1) for i in range(n_layers)])
    cfg = RoundPipeRunConfig(num_microbatch=4, execute_plan=plan)
    for call in range(8):
        x = torch.randn(rows, width)
        loss = model.forward_backward(input_args=(x,), loss_fn=lambda out, _: out.float().pow(2).mean(), run_config=cfg)
        expected = sum(ref(c.cuda()).float().pow(2).mean() for c in x.chunk(4))
        expected.backward()
        assert torch.allclose(loss.float(), expected.detach().cpu(), rtol=1e-4), (call, loss.item(), expected.item())
        for (name, p), q in zip(model.model.named_parameters(), ref.parameters()):
            assert torch.allclose(p.grad, q.grad.cpu(), rtol=1e-3, atol=1e-5), (call, name)
            p.grad = None
            q.grad = None


@pytest.mark.parametrize("devices", ["cuda:0", "cuda:0,1"])
def test_host_buffer_rotation_and_one_gradient_buffer_on_gpu(devices: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On GPUs, with a slow asynchronous step (the next backward's downloads race with it): staged (the
    default), the gradient downloads take the weights' buffers and the weights move to the buffer the step
    stages into, two pinned copies per parameter; streamed also keeps two, its downloads issued only once
    the step has released the single gradient buffer."""
    import time

    from roundpipe.host.buffers import ParamBuffers
    from roundpipe.optim import Adam

    if devices.count(",") + 1 > torch.cuda.device_count():
        pytest.skip("needs 2 GPUs")
    use_devices(devices)

    def run(mode: str) -> None:
        monkeypatch.setenv("RPP_STEP_MODE", mode)
        torch.manual_seed(0)
        body = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.GELU()) for _ in range(6)]).to(torch.bfloat16)
        model = RoundPipe(body, optim_dtype=torch.float32, model_run_config=RoundPipeRunConfig(num_microbatch=2))
        opt = Adam(model.optim_parameters(), lr=1e-3)

        def step() -> None:
            time.sleep(0.05)
            opt.step()
            opt.zero_grad()

        g = torch.Generator().manual_seed(1)
        for _ in range(6):
            x = torch.randn(4096, 1024, generator=g).bfloat16()
            model.forward_backward(input_args=(x,), loss_fn=lambda out, _: out.float().pow(2).mean())
            model.step(step, is_async=True)
        model.synchronize()
        bufs = [ParamBuffers.of(p).host_buffers(p) for p in body.parameters()]
        assert all(b.is_pinned() for bb in bufs for b in bb)
        counts = {len(bb) for bb in bufs}
        assert counts == {2}, (mode, counts)

    run("staged")
    run("streamed")


def test_exact_size_pinned_buffers_copy_asynchronously_and_unpin_when_freed(monkeypatch: pytest.MonkeyPatch) -> None:
    """roundpipe.devices.memory.pinned_empty: registered with CUDA (pinned, exact size), round trips through
    the GPU with non-blocking copies, and is unregistered once its last view is gone."""
    import gc

    from roundpipe.devices import memory

    unpinned = []
    real_unregister = memory._cuda_unregister
    monkeypatch.setattr(memory, "_cuda_unregister", lambda ptr: (unpinned.append(ptr), real_unregister(ptr)))
    n = 5 * 2**20 + 3  # an odd size: torch would round the block up to 16 MiB
    host = memory.pinned_empty((n,), torch.bfloat16)
    assert host.is_pinned()
    src = torch.randn(n, device="cuda").to(torch.bfloat16)
    host.copy_(src, non_blocking=True)
    back = torch.empty_like(src)
    back.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, src)
    ptr = host.data_ptr()
    view = host[10:]
    del host
    gc.collect()
    assert view.is_pinned() and not unpinned  # still registered while a view lives
    del view
    gc.collect()
    assert unpinned == [ptr]
    for _ in range(20):  # registering and freeing repeatedly neither fails nor leaks registrations
        b = memory.pinned_empty((n,), torch.bfloat16)
        b.fill_(1.0)
        del b
    gc.collect()
    assert len(unpinned) == 21


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_compact_stage_inputs_encode_on_the_gpu_as_on_the_cpu(fmt: str) -> None:
    """The compact formats' bytes, scales and decoded values on CUDA equal the CPU's (bf16 hidden states with
    outlier channels, so that int8 keeps some blocks in fp8)."""
    from roundpipe.runtime import stage_codec

    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 1000, generator=g)
    x[:, [3, 400]] *= 1e3
    x = x.to(torch.bfloat16)
    cpu, gpu = stage_codec.encode(x, fmt=fmt), stage_codec.encode(x.cuda(), fmt=fmt)
    assert torch.equal(gpu.payload.cpu().view(torch.int8), cpu.payload.view(torch.int8))
    assert torch.equal(gpu.scales.cpu(), cpu.scales)
    assert torch.equal(stage_codec.decode(gpu).cpu(), stage_codec.decode(cpu))
    if fmt == "int8":
        assert 0 < int((cpu.scales < 0).sum()) < cpu.scales.numel()


def test_stage_inputs_kept_on_the_gpu_equal_host_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """RPP_DEBUG_DEVICE_SAVED_GB on one GPU: backward-stage inputs kept on the device (no download, no upload)
    give bit-identical parameters to the host round trip, with the asynchronous step running, and the
    GPU memory peak grows by about the kept bytes."""
    from roundpipe.optim import Adam

    use_devices("cuda:0")

    def run(budget: str):
        monkeypatch.setenv("RPP_DEBUG_DEVICE_SAVED_GB", budget)
        torch.manual_seed(0)
        body = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.GELU()) for _ in range(6)]).to(torch.bfloat16)
        plan = ModelExecutePlan.layerwise(6, "train")
        model = RoundPipe(
            body, optim_dtype=torch.float32, model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=plan)
        )
        opt = Adam(model.optim_parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(4):
            x = torch.randn(4096, 1024, generator=g).bfloat16()
            model.forward_backward(input_args=(x,), loss_fn=lambda out, _: out.float().pow(2).mean())
            model.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
        model.synchronize()
        torch.cuda.synchronize()
        return [p.detach().clone() for p in model.optim_parameters()], torch.cuda.max_memory_allocated()

    host, peak_host = run("0")
    kept, peak_kept = run("1")
    for a, b in zip(host, kept):
        assert torch.equal(a, b)
    # Stage inputs of layers 1-4 (layer 5 is the fused job's), 4096 x 1024 bf16 each: 32 MiB kept
    # across the forward.
    assert peak_kept - peak_host > 16 * 2**20, (peak_host, peak_kept)


def test_auto_keeps_a_hf_models_stage_inputs_on_one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """``RPP_DEBUG_DEVICE_SAVED_GB=auto`` (the default) on one GPU, a Hugging Face model (its activations are
    known): the backward-stage inputs stay on the GPU, and two asynchronous steps give bit-identical
    weights to the host round trip (``RPP_DEBUG_DEVICE_SAVED_GB=0``)."""
    pytest.importorskip("transformers")
    from test_models import make_batch, tiny_model

    import roundpipe
    from roundpipe.optim import Adam
    from roundpipe.runtime import run as run_mod

    use_devices("cuda:0")
    # Stage inputs are what this test follows: with every stage's activations kept (the planner's choice where
    # the GPU has room) the backward needs none of them.
    monkeypatch.setenv("RPP_DEBUG_KEEP_ACTIVATIONS", "0")
    answers: list = []
    real = run_mod.Run.keep_on_device
    monkeypatch.setattr(
        run_mod.Run, "keep_on_device", lambda self, leaves: answers.append(real(self, leaves)) or answers[-1]
    )

    def run(setting: str) -> list:
        monkeypatch.setenv("RPP_DEBUG_DEVICE_SAVED_GB", setting)
        torch.manual_seed(0)
        rp = roundpipe.wrap_model_to_roundpipe(
            tiny_model("qwen3").bfloat16(),
            optim_dtype=torch.float32,
            model_run_config=RoundPipeRunConfig(num_microbatch=2),
        )
        opt = Adam(rp.optim_parameters(), lr=1e-3)
        batch = {k: v for k, v in make_batch(False, batch=4, seq=64).items() if v is not None}
        for _ in range(3):
            rp.train_step(**batch)
            rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
        rp.synchronize()
        return [p.detach().clone() for p in rp.optim_parameters()]

    host = run("0")
    assert answers and not any(answers)
    answers.clear()
    kept = run("auto")
    assert answers and all(answers)
    for a, b in zip(host, kept):
        assert torch.equal(a, b)


@pytest.mark.parametrize("devices", ["cuda:0", "cuda:0,1"])
def test_streamed_async_steps_equal_synchronous_steps_on_the_gpu(devices: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """RPP_STEP_MODE=streamed on GPUs: asynchronous steps whose layers go to the next forward as the
    host optimizer steps them give bit-identical weights to synchronous steps (the device streams
    wait for each layer's conversion; none reads a half-written weight), with two host buffers per
    parameter."""
    from roundpipe.host.buffers import ParamBuffers
    from roundpipe.optim import Adam

    if devices.count(",") + 1 > torch.cuda.device_count():
        pytest.skip("needs 2 GPUs")
    use_devices(devices)

    def run(mode: str, is_async: bool):
        monkeypatch.setenv("RPP_STEP_MODE", mode)
        torch.manual_seed(0)
        body = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.GELU()) for _ in range(8)]).to(torch.bfloat16)
        model = RoundPipe(body, optim_dtype=torch.float32, model_run_config=RoundPipeRunConfig(num_microbatch=3))
        opt = Adam(model.optim_parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            x = torch.randn(3072, 1024, generator=g).bfloat16()
            model.forward_backward(input_args=(x,), loss_fn=lambda out, _: out.float().pow(2).mean())
            model.step(lambda: (opt.step(), opt.zero_grad()), is_async=is_async)
        model.synchronize()
        buffers = max(len(ParamBuffers.of(p).host_buffers(p)) for p in body.parameters())
        return [p.detach().clone() for p in model.optim_parameters()], buffers

    streamed, buffers = run("streamed", True)
    sync, _ = run("staged", False)
    for a, b in zip(streamed, sync):
        assert torch.equal(a, b)
    assert buffers <= 2


def test_host_scalar_is_read_later_without_a_sync_when_created() -> None:
    """transfer.HostScalar: creating it queues a copy and an event (no synchronising call, checked by
    sync_debug_mode); item() returns the value once the event has passed."""
    from roundpipe.runtime.transfer import HostScalar

    x = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = x @ x  # keeps the GPU busy while the host goes on
        value = HostScalar((y[0] > 0).sum())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert value.item() == int((y[0] > 0).sum())


def test_a_host_scalar_dropped_during_a_graph_capture_leaves_pinned_memory_usable() -> None:
    """A HostScalar made on a stream and dropped by another thread while that stream captures a graph
    (``thread_local``, as ``graphs.GraphCache`` captures): the pinned allocations after the capture work.
    With the scalar's copy on the captured stream, torch's caching host allocator recorded the block's
    free event into the capture, and every later pinned allocation raised "invalid argument"."""
    import threading

    from roundpipe.runtime.transfer import HostScalar

    compute = torch.cuda.Stream()
    x = torch.arange(8, device="cuda", dtype=torch.float32)
    with torch.cuda.stream(compute):
        held = [HostScalar((x > 2).sum()) for _ in range(4)]
    assert [h.item() for h in held] == [5] * 4
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(compute):
        graph.capture_begin(capture_error_mode="thread_local")
        y = x * 2
        dropper = threading.Thread(target=held.clear)
        dropper.start()
        dropper.join()
        graph.capture_end()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x * 2)
    for _ in range(4):
        torch.empty(1024, pin_memory=True).fill_(1)
    assert HostScalar((x > 6).sum()).item() == 1


def _mean_square_calls(rp: RoundPipe, ref: nn.Module, fused: bool, calls: int, rows: int, num_microbatch: int):
    """Training calls of the mean square of the output over random ``[rows, 1024]`` inputs, through
    forward_backward (``fused``: per microbatch mean over the microbatch count, summed, equals the whole
    batch's mean) or forward + loss.backward(), each followed by the reference's on the GPU; yields
    (RoundPipe's loss, the reference's) after each call, gradients accumulating in both."""
    g = torch.Generator().manual_seed(1)
    for _ in range(calls):
        x = torch.randn(rows, 1024, generator=g)
        if fused:
            loss = rp.forward_backward(input_args=(x,), loss_fn=lambda out, _: out.pow(2).mean() / num_microbatch)
        else:
            loss = rp(x).pow(2).mean()
            loss.backward()
        ref_loss = ref(x.cuda()).pow(2).mean()
        ref_loss.backward()
        yield loss, ref_loss


@pytest.mark.parametrize("spec", ["cuda:0", "cuda:0,1"])
@pytest.mark.parametrize("fused", [False, True])
def test_tied_gradient_shares_summed_on_the_gpu_match_pytorch(spec: str, fused: bool) -> None:
    """A tied weight in the first and last of many layers, one layer per stage: the last layer's
    share is added into the first layer's gradient on the GPU before its download
    (transfer.TiedGrads; on one GPU the share never leaves it, on two the owner's download stream
    waits for the share's download on the other GPU and uploads it). On two GPUs the last group also
    runs in two parts whose gradients meet on the first part's GPU (partial_grads). The fp32 gradient
    equals plain PyTorch's, over calls that accumulate, through loss.backward() and forward_backward."""
    import copy

    if spec == "cuda:0,1" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    use_devices(spec)
    torch.manual_seed(0)
    emb, head = nn.Linear(1024, 1024, bias=False), nn.Linear(1024, 1024, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, *[nn.Sequential(nn.Linear(1024, 1024), nn.GELU()) for _ in range(6)], head)
    ref = copy.deepcopy(model).cuda()
    plan = ModelExecutePlan.layerwise(len(model), "fused" if fused else "train")
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=plan))
    for _ in _mean_square_calls(rp, ref, fused, calls=3, rows=2048, num_microbatch=2):
        err = ((emb.weight.grad - ref[0].weight.grad.cpu()).norm() / ref[0].weight.grad.norm()).item()
        assert err < 1e-5, err


@pytest.mark.parametrize("fused", [False, True])
def test_peer_handoff_on_two_gpus_matches_pytorch(fused: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """RPP_DEBUG_PEER_HANDOFF=1 on 2 GPUs: each forward job's output is copied to the other GPU's next job
    (``transfer.peer_copy``: the copy on the producer's download stream, the consumer's upload stream
    waiting on its event). Outputs and gradients equal plain PyTorch's over two calls (fp32), and every
    boundary between forward jobs on different GPUs used a peer copy."""
    import copy

    from roundpipe.runtime import jobs

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    use_devices("cuda:0,1")
    monkeypatch.setenv("RPP_DEBUG_PEER_HANDOFF", "1")
    copies = []
    real_copy = jobs.peer_copy
    monkeypatch.setattr(
        jobs, "peer_copy", lambda src, dst, leaves: (copies.append((src.id, dst.id)), real_copy(src, dst, leaves))[1]
    )
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.GELU()) for _ in range(8)])
    ref = copy.deepcopy(model).cuda()
    plan = ModelExecutePlan.layerwise(len(model), "fused" if fused else "train")
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=4, execute_plan=plan))
    for loss, ref_loss in _mean_square_calls(rp, ref, fused, calls=2, rows=4096, num_microbatch=4):
        assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-5
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        err = ((p.grad - q.grad.cpu()).norm() / q.grad.norm()).item()
        assert err < 1e-5, (name, err)
    assert copies and all(src != dst for src, dst in copies)


def test_fused_decoder_layers_on_gpu_match_hf_at_two_lengths() -> None:
    """``bench/kernels_bench.py`` on the GPU (a qwen3-1.7b-shaped layer, bf16, inductor): the whole layer
    as one op agrees with Hugging Face's layer within bf16 rounding
    (output, input and parameter gradients against an fp32 copy); a second sequence length makes the
    compiled layer's shapes dynamic, and it still compiles and agrees."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    import kernels_bench

    from roundpipe.models import kernels

    for seq in (1024, 1536):
        res = kernels_bench.main(["--batch", "2", "--seq", str(seq), "--warmup", "1", "--iters", "3"])
        assert res["ok"] == 1.0
    assert kernels.DECODER_LAYER.compiled and not any(op.failed for op in kernels.OPS)


def _small_qwen3(hidden: int, heads: int) -> nn.Module:
    """A 4-layer bf16 Qwen3 (vocab 4,096, head_dim 64, sdpa, key heads half the query heads), seeded."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=4,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        head_dim=64,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return Qwen3ForCausalLM(config).to(torch.bfloat16)


def _graph_run(graphs: str, devices: str, lengths: tuple) -> tuple:
    """A 4-layer Qwen3 (bf16, preset with fused kernels) trained a few synchronous steps per sequence
    length with ``RPP_DEBUG_GRAPHS=graphs``: (losses, parameters after training, graph counts)."""
    import roundpipe
    from roundpipe import settings
    from roundpipe.devices import device as device_mod

    settings.configure(debug_graphs=graphs)
    use_devices(devices)
    hf = _small_qwen3(1024, 16)
    model = roundpipe.wrap_model_to_roundpipe(
        hf, optim_dtype=torch.float32, model_run_config=RoundPipeRunConfig(num_microbatch=4)
    )
    opt = torch.optim.SGD(model.optim_parameters(), lr=1e-2)
    losses = []
    for seq in lengths:
        ids = torch.randint(0, 4096, (4, seq), generator=torch.Generator().manual_seed(seq))
        for _ in range(4):
            losses.append(model.train_step(input_ids=ids, labels=ids).item())
            model.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
    model.synchronize()
    devs = device_mod.get_devices()
    counts = {"captures": sum(d.graphs.captures for d in devs), "replays": sum(d.graphs.replays for d in devs)}
    params = [p.detach().float().cpu() for p in hf.parameters()]
    settings.unconfigure("RPP_DEBUG_GRAPHS")
    return losses, params, counts


@pytest.mark.parametrize("devices", ["cuda:0", "cuda:0,1"])
def test_graphed_layers_match_eager_and_recapture_a_new_length(devices: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decoder-layer jobs as CUDA graphs (``RPP_DEBUG_GRAPHS=1``) against the eager runtime, on one and
    two GPUs: the same losses and trained weights within bf16 rounding over steps at two sequence
    lengths (the second is captured anew, not replayed with the first's shapes), and the graphs really
    replay."""
    if devices == "cuda:0,1" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    # Recomputed backward stages are what may be graphed: a stage whose activations the planner keeps on the GPU
    # (it has room for all of them here) runs its forward eagerly, with autograd.
    monkeypatch.setenv("RPP_DEBUG_KEEP_ACTIVATIONS", "0")
    lengths = (128, 192)
    eager_losses, eager_params, eager_counts = _graph_run("0", devices, lengths)
    graph_losses, graph_params, counts = _graph_run("1", devices, lengths)
    print("eager", [round(v, 4) for v in eager_losses], "graphed", [round(v, 4) for v in graph_losses], counts)
    assert eager_counts["captures"] == 0
    assert counts["replays"] > 0 and counts["captures"] >= 2, counts
    for a, b in zip(eager_losses, graph_losses):
        assert abs(a - b) <= 1e-2 * abs(a), (eager_losses, graph_losses)
    worst = max(((p - q).norm() / q.norm().clamp_min(1e-12)).item() for p, q in zip(graph_params, eager_params))
    print(f"worst relative parameter difference after training: {worst:.3g}")
    assert worst < 1e-2


@pytest.mark.parametrize("attention", ["bias", "split"])
@pytest.mark.parametrize("devices", ["cuda:0", "cuda:0,1"])
def test_sequence_tiles_match_the_unsplit_sequence_in_bf16(devices: str, attention: str) -> None:
    """One 4,096-token sequence in 4 tiles over the pool (``sequence_tiles``, roundpipe.runtime.sequence) against
    the same model on the unsplit sequence, bf16 with the compiled fused kernels: loss within bf16
    rounding and every gradient's cosine >= 0.999; the tiles attend through one masked call or as two
    flash blocks (``RPP_DEBUG_TILE_ATTENTION``, roundpipe.runtime.tile_attention)."""
    if devices == "cuda:0,1" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    import roundpipe
    from roundpipe import settings

    use_devices(devices)
    settings.configure(debug_tile_attention=attention)
    hf = _small_qwen3(512, 8)
    ids = torch.randint(0, 4096, (1, 4096), generator=torch.Generator().manual_seed(1))
    results = []
    for cfg in (RoundPipeRunConfig(num_microbatch=1), RoundPipeRunConfig(sequence_tiles=4)):
        model = roundpipe.wrap_model_to_roundpipe(hf, model_run_config=cfg)
        loss = model.train_step(input_ids=ids, labels=ids)
        model.synchronize()
        results.append((float(loss), {n: p.grad.float().clone() for n, p in hf.named_parameters()}))
        hf.zero_grad(set_to_none=True)
    (loss0, g0), (loss1, g1) = results
    assert abs(loss1 - loss0) <= 1e-2 * abs(loss0), (loss0, loss1)
    worst = min(torch.nn.functional.cosine_similarity(g0[n].flatten(), g1[n].flatten(), dim=0).item() for n in g0)
    print(f"loss {loss0:.5f} unsplit, {loss1:.5f} in 4 tiles; worst gradient cosine {worst:.5f}")
    assert worst >= 0.999


def test_a_model_built_on_the_gpu_gives_its_cached_blocks_back_when_wrapped() -> None:
    """``.cuda().cpu()`` leaves the model's old blocks in torch's cache, reserved for the default stream
    that RoundPipe never allocates from; wrapping returns them (``memory.pin_module``)."""
    use_devices("cuda:0")
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)]).cuda().cpu()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    before = torch.cuda.memory_reserved(0)
    assert before - torch.cuda.memory_allocated(0) >= nbytes
    RoundPipe(model)
    assert torch.cuda.memory_reserved(0) <= before - nbytes


def test_split_tile_attention_names_the_setting_for_float32_on_the_gpu() -> None:
    """Flash attention on GPUs takes half precision: ``RPP_DEBUG_TILE_ATTENTION=split`` with a float32 model
    fails with the setting to change, before any kernel runs."""
    from roundpipe import settings
    from roundpipe.runtime import sequence

    settings.configure(debug_tile_attention="split")
    mode = sequence.SequenceRun.from_lengths([4]).attention  # as a call reads it
    with pytest.raises(ValueError, match="RPP_DEBUG_TILE_ATTENTION=split"):
        sequence.split_attention(torch.zeros(1, 2, 4, 8, device="cuda"), mode)
    assert sequence.split_attention(torch.zeros(1, 2, 4, 8, device="cuda", dtype=torch.bfloat16), mode)


def test_first_segments_of_several_gpus_at_once_after_the_pool_settles_their_type() -> None:
    """Fresh processes with expandable segments: one thread per GPU makes its first allocation at the same moment,
    after ``allocator.settle_expandable_handle_type`` (what the pool calls before its threads start). None fails
    (without the settle, torch's process-wide handle-type choice races: tests/handle_type_race.py --arm raw)."""
    import json
    import os
    import subprocess
    import sys

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(root, "tests", "handle_type_race.py"),
            "--arm",
            "settled",
            "--trials",
            "8",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["trials"] == 8 and row["failed"] == 0, row
