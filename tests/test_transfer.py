"""Transfer layer: sliced parameter uploads and the per-layer upload waits of a job."""

import threading

import pytest
import torch

pytestmark = pytest.mark.stream_checks  # run with RPP_DEBUG_CHECK_STREAMS=1 (tests/conftest.py)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex64])
@pytest.mark.parametrize("numel,chunk_bytes", [(1000, 64), (1000, 4000), (1001, 8), (7, 1), (0, 16)])
def test_sliced_copy_equals_a_whole_copy(dtype: torch.dtype, numel: int, chunk_bytes: int) -> None:
    """Parameter uploads above CHUNK_UPLOAD_SIZE are copied in slices (transfer.chunked_upload): every
    element lands once, whatever the remainder, for any element size."""
    from roundpipe.runtime.transfer import _copy_in_chunks

    src = torch.randn(numel, dtype=torch.float32).to(dtype).reshape(-1, 1) if numel else torch.empty(0, 1, dtype=dtype)
    dst = torch.full_like(src, 7)
    _copy_in_chunks(dst, src, chunk_bytes)
    assert torch.equal(dst, src)


# ---- layer-by-layer upload waits (transfer.upload_layers(ready=...), transfer.wait_layer) ----------------


class _Logged(torch.nn.Module):
    """A layer that appends ("call", its index) to a shared log when it runs (device copies share it)."""

    def __init__(self, idx: int, log: list) -> None:
        super().__init__()
        self.idx, self.log = idx, log
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append(("call", self.idx, threading.current_thread().name))
        return self.lin(x)


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2"], indirect=True)
@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_compute_waits_for_each_layer_of_a_group_just_before_running_it(
    workers: str, grain: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job's compute stream waits for layer k's upload event right before layer k first runs (not for
    the whole group up front), once per job, in forward and in the recompute of backward."""
    from roundpipe import RoundPipe, RoundPipeRunConfig
    from roundpipe.planning.plan import ModelExecutePlan
    from roundpipe.runtime import jobs as jobs_mod

    log: list = []
    layer_of_event: dict = {}
    real_upload, real_wait = jobs_mod.upload_layers, jobs_mod.wait_layer

    def upload(  # type: ignore[no-untyped-def]
        layers, layer_ids, attrs, device, with_grad, saved_buffers=None, ready=None, seed_grads=None, slots=None
    ):
        out = real_upload(
            layers,
            layer_ids,
            attrs,
            device,
            with_grad,
            saved_buffers=saved_buffers,
            ready=ready,
            seed_grads=seed_grads,
            slots=slots,
        )
        if ready is not None:
            assert len(ready) == len(layer_ids)
            layer_of_event.update({id(ev): lid for ev, lid in zip(ready, layer_ids)})
            log.append(("upload", tuple(layer_ids), threading.current_thread().name))
        return out

    def wait(device, ready, k):  # type: ignore[no-untyped-def]
        log.append(("wait", layer_of_event[id(ready[k])], threading.current_thread().name))
        real_wait(device, ready, k)

    from roundpipe.runtime import compute as compute_mod

    monkeypatch.setattr(jobs_mod, "upload_layers", upload)
    monkeypatch.setattr(jobs_mod, "wait_layer", wait)
    monkeypatch.setattr(compute_mod, "wait_layer", wait)  # the per-layer waits of the group's compute
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_Logged(i, log) for i in range(7)])
    plan = ModelExecutePlan([range(0, 3), range(3, 7)], [range(0, 3), range(3, 6), range(6, 7)])
    rp = RoundPipe(
        model, model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=plan, recompute_grain=grain)
    )
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    rp.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).mean())
    rp.synchronize()

    # Jobs on two workers interleave in the log: split it per device thread, then per job.
    per_thread: dict = {}
    for e in log:
        per_thread.setdefault(e[-1], []).append(e[:-1])
    jobs = []
    for entries in per_thread.values():
        starts = [k for k, e in enumerate(entries) if e[0] == "upload"]
        jobs += [(entries[s][1], entries[s + 1 : e]) for s, e in zip(starts, starts[1:] + [len(entries)])]
    # forward 0-2, forward 3-5 (layer 6 is the fused last job, uploaded whole), backward 3-5, backward 0-2
    assert sorted(group for group, _ in jobs) == [(0, 1, 2), (0, 1, 2), (3, 4, 5), (3, 4, 5)]
    for group, events in jobs:
        waits = [e[1] for e in events if e[0] == "wait"]
        assert waits == list(group), (group, events)  # each layer once, in order (first microbatch only)
        for a, b in zip(group, group[1:]):
            # Layer b is waited for only after layer a has run: compute started before b's upload was needed.
            assert events.index(("call", a)) < events.index(("wait", b)) < events.index(("call", b)), (group, events)


class _Detach(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach()


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2"], indirect=True)
def test_a_backward_stage_without_gradients_still_waits_for_its_uploads(
    workers: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When no gradient reaches a backward stage (its output was detached) no microbatch computes
    there (each drops its saved stage input), but the stage still downloads the gradients it was
    seeded with: the compute stream (which the download stream follows) must have waited for every
    layer's upload first. On two workers the gradients go through the host, so the stage skips."""
    from roundpipe import RoundPipe, RoundPipeRunConfig
    from roundpipe.planning.plan import ModelExecutePlan
    from roundpipe.runtime import compute as compute_mod
    from roundpipe.runtime import jobs as jobs_mod

    waited: list = []
    real_wait = jobs_mod.wait_layer
    spy = lambda device, ready, k: (waited.append((len(ready), k)), real_wait(device, ready, k))  # noqa: E731
    monkeypatch.setattr(jobs_mod, "wait_layer", spy)
    monkeypatch.setattr(compute_mod, "wait_layer", spy)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), _Detach(), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    )
    plan = ModelExecutePlan([range(0, 2), range(2, 4), range(4, 5)], [range(0, 2), range(2, 4), range(4, 5)])
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=plan))
    seed = torch.randn(4, 4)
    model[0].weight.grad = seed.clone()  # uploaded with the layer, downloaded back unchanged
    rp(torch.randn(6, 4)).sum().backward()
    # Forward 0-1 and 2-3 wait for both their layers, backward 2-3 too (its microbatches compute);
    # backward 0-1 computes nothing and must still wait for both, after its microbatch loop.
    assert waited.count((2, 0)) == 4 and waited.count((2, 1)) == 4, waited
    assert torch.equal(model[0].weight.grad, seed)


class _PassThrough(torch.nn.Module):
    """A layer of a dict state: changes ``x``, hands ``pos`` (a large side input) along unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, state: dict) -> dict:
        return {"x": torch.tanh(self.lin(state["x"])) + state["pos"][..., :4], "pos": state["pos"]}


class _Start(torch.nn.Module):
    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> dict:
        return {"x": x, "pos": pos}


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2"], indirect=True)
def test_unchanged_side_inputs_are_downloaded_once(workers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor a layer hands along unchanged (a causal LM's position ids, rotary tables, labels) keeps
    its first host copy at every later stage boundary: one download per call, not one per backward
    stage; gradients are those of plain PyTorch."""
    from roundpipe import RoundPipe, RoundPipeRunConfig
    from roundpipe.planning.plan import ModelExecutePlan
    from roundpipe.runtime import jobs as jobs_mod

    downloaded: list = []
    real = jobs_mod.async_d2h
    monkeypatch.setattr(
        jobs_mod,
        "async_d2h",
        lambda device, ev, ts: (
            downloaded.extend(t for t in ts if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[-1] == 64),
            real(device, ev, ts),
        )[1],
    )
    torch.manual_seed(0)
    # float64: the microbatch split sums the gradients in another order than the reference's one batch,
    # which in float32 differs by more than the tolerance on some CPUs' kernels.
    layers = [_Start().double()] + [_PassThrough().double() for _ in range(6)]
    ref = torch.nn.Sequential(*layers)
    model = RoundPipe(
        torch.nn.Sequential(*[l for l in layers]),
        model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=ModelExecutePlan.layerwise(7, "train")),
    )
    x, pos, y = (
        torch.randn(4, 4, dtype=torch.float64),
        torch.randn(4, 64, dtype=torch.float64),
        torch.randn(4, 4, dtype=torch.float64),
    )
    loss = model.forward_backward(input_args=(x, pos), label=y, loss_fn=lambda o, t: ((o["x"] - t) ** 2).sum())
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    state = layers[0](x, pos)
    for layer in layers[1:]:
        state = layer(state)
    expected = ((state["x"] - y) ** 2).sum()
    expected.backward()
    assert torch.allclose(loss, expected, rtol=1e-12)
    assert all(torch.allclose(g, p.grad, rtol=1e-10, atol=1e-12) for g, p in zip(grads, ref.parameters()))
    # The side input is an input of the call: its microbatch slices come from the host and are never
    # downloaded again, whatever the number of stages.
    assert not [t for t in downloaded if any(t.shape == half.shape and torch.equal(t, half) for half in pos.chunk(2))]


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2", "cpu:3"], indirect=True)
def test_parameter_gradients_go_on_their_own_stream_with_other_devices_shares_fetched_first(
    workers: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A layer's parameter gradients download on the device's gradient stream, a stream of its own (so
    activation hand-overs on ``downstream`` never queue behind them). The shares other devices contribute
    (a tied weight's share from its last layer, the split fused job's other part) are uploaded before the
    gradient stream waits for the job's compute, so they land while it runs; on one worker nothing is
    uploaded. Gradients equal PyTorch's."""
    import copy
    import threading

    from roundpipe import RoundPipe, RoundPipeRunConfig, settings
    from roundpipe.devices import backend as backend_mod
    from roundpipe.devices import device as device_mod
    from roundpipe.host.buffers import ParamBuffers
    from roundpipe.planning.plan import ModelExecutePlan
    from roundpipe.runtime import partial_grads as partial_mod
    from roundpipe.runtime import tied_grads as tied_mod
    from roundpipe.runtime import transfer as transfer_mod

    settings.configure(debug_split_fused="1")  # the fused job's parts, as on GPUs
    device_mod.reset_devices()
    devices = device_mod.get_devices()
    assert all(d.grad_stream is not d.downstream for d in devices)

    log: list = []  # (what, thread): a device thread's uploads of shares, gradient-stream waits, downloads

    class _Recorder(backend_mod.CpuStream):
        def wait_stream(self, stream: object) -> None:
            log.append(("wait", threading.current_thread().name))
            super().wait_stream(stream)  # still ordered (the stream order checks, RPP_DEBUG_CHECK_STREAMS)

    for d in devices:
        d.grad_stream = _Recorder(d.device, f"{d.name}.grad_stream")
    real_upload, real_issued = transfer_mod.to_device, ParamBuffers.download_issued

    def upload(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
        if t.shape == (8, 8) and not isinstance(t, torch.nn.Parameter):  # gradient shares (not weights)
            log.append(("upload", threading.current_thread().name))
        return real_upload(t, dev)

    def downloaded(self: ParamBuffers, p: torch.Tensor, layer_id: int, g: object) -> None:
        log.append(("download", threading.current_thread().name))
        real_issued(self, p, layer_id, g)

    monkeypatch.setattr(transfer_mod, "to_device", upload)
    monkeypatch.setattr(partial_mod, "to_device", upload)
    monkeypatch.setattr(tied_mod, "to_device", upload)  # the tied weights' shares (TiedGrads.fetch)
    monkeypatch.setattr(ParamBuffers, "download_issued", downloaded)
    torch.manual_seed(0)
    emb, head = torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 8, bias=False)
    head.weight = emb.weight
    model = torch.nn.Sequential(
        emb, *[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(3)], head
    )
    ref = copy.deepcopy(model).double()
    rp = RoundPipe(
        model,
        model_run_config=RoundPipeRunConfig(num_microbatch=4, execute_plan=ModelExecutePlan.layerwise(5, "fused")),
    )
    x = torch.randn(8, 8)
    loss = rp.forward_backward(input_args=(x,), loss_fn=lambda out, _: out.pow(2).sum())
    ref_loss = ref(x.double()).pow(2).sum()
    ref_loss.backward()
    assert torch.allclose(loss.double(), ref_loss, rtol=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p.grad.double(), q.grad, rtol=1e-4, atol=1e-6)
    uploads = [k for k, (what, _) in enumerate(log) if what == "upload"]
    if len(devices) == 1:
        assert not uploads  # one device: the tied share never leaves it, the fused job is one part
        return
    # Several workers: the tied weight's share and the fused group's other part are uploaded, each
    # before its gradient stream waits for the compute (so before the download that follows).
    assert len(uploads) >= 2, log
    for k in uploads:
        thread = log[k][1]
        after = [what for what, t in log[k + 1 :] if t == thread and what in ("wait", "download")]
        assert after and after[0] == "wait", (k, log)
