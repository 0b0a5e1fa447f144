"""``RPP_STEP_MODE=streamed``: asynchronous steps that hand each layer to the next forward as soon as the
optimizer has stepped it. Nothing is stale (results equal plain PyTorch's synchronous loop) and a
parameter keeps two host copies in the model dtype (weights, gradient), also with gradient accumulation."""

from __future__ import annotations

from typing import Callable, List, Tuple

import pytest
import torch
from helpers import rel_err
from torch import nn

import roundpipe
from roundpipe import RoundPipe, RoundPipeRunConfig, settings
from roundpipe.host import step as step_protocol
from roundpipe.host.buffers import ParamBuffers

pytestmark = pytest.mark.stream_checks  # run with RPP_DEBUG_CHECK_STREAMS=1 (tests/conftest.py)


@pytest.fixture(autouse=True)
def _streamed() -> None:
    settings.configure(step_mode="streamed")  # restored after each test by conftest's fixture


def make_model(dtype: torch.dtype = torch.float64) -> nn.Sequential:
    torch.manual_seed(0)
    layers: List[nn.Module] = [
        nn.Linear(6, 12),
        nn.Tanh(),
        nn.Linear(12, 12),
        nn.Tanh(),
        nn.Linear(12, 12),
        nn.Tanh(),
        nn.Linear(12, 3),
    ]
    return nn.Sequential(*layers).to(dtype)


def batches(n: int, dtype: torch.dtype = torch.float64) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 6, generator=g).to(dtype), torch.randn(6, 3, generator=g).to(dtype)) for _ in range(n)]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).sum() / 18


def plain_pytorch(make_opt: Callable[[List[nn.Parameter]], torch.optim.Optimizer], n: int) -> nn.Module:
    """The synchronous reference: every iteration sees the latest parameters."""
    ref = make_model()
    opt = make_opt(list(ref.parameters()))
    for x, y in batches(n):
        loss_fn(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    return ref


def adamw(params: List[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=2e-2, weight_decay=0.01)


def rp_adamw(params: List[nn.Parameter]) -> torch.optim.Optimizer:
    return roundpipe.optim.Adam(params, lr=2e-2, weight_decay=0.01, decoupled_weight_decay=True)


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2", "cpu:3"], indirect=True)
@pytest.mark.parametrize("num_microbatch", [1, 3])
@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("which", ["roundpipe.optim.Adam", "torch.optim.AdamW"])
def test_streamed_async_steps_equal_plain_pytorch_synchronous(
    workers: str, num_microbatch: int, grain: str, which: str
) -> None:
    model = make_model()
    rp = RoundPipe(
        model,
        optim_dtype=torch.float64,
        model_run_config=RoundPipeRunConfig(num_microbatch=num_microbatch, recompute_grain=grain),
    )
    opt = (rp_adamw if which.startswith("roundpipe") else adamw)(rp.optim_parameters())
    losses = []
    for x, y in batches(6):
        losses.append(rp.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn).item())
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
    rp.synchronize()
    ref = plain_pytorch(adamw, 6)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert rel_err(p, q) < 1e-12, n
    ref_losses, ref2 = [], make_model()
    opt2 = adamw(list(ref2.parameters()))
    for x, y in batches(6):
        loss = loss_fn(ref2(x), y)
        ref_losses.append(loss.item())
        loss.backward()
        opt2.step()
        opt2.zero_grad()
    assert losses == pytest.approx(ref_losses, rel=1e-12)  # each iteration saw the latest parameters


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_layers_are_published_in_forward_order_as_the_optimizer_steps_them(
    workers: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: List[Tuple[int, bool]] = []
    done = step_protocol.Publisher.done

    def spy(self: step_protocol.Publisher, k: int, *args: object) -> None:
        seen.append((k, step_protocol.current_publisher() is self))  # True: reported from inside optimizer.step()
        done(self, k, *args)

    monkeypatch.setattr(step_protocol.Publisher, "done", spy)
    rp = RoundPipe(make_model(), optim_dtype=torch.float64, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    opt = rp_adamw(rp.optim_parameters())
    x, y = batches(1)[0]
    rp.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
    rp.synchronize()
    units = [k for k, (_, ps) in enumerate(rp.optim_units()) if ps]
    reported = [k for k, inside in seen if inside]
    assert reported == units  # every layer with parameters, in forward order, from inside the step


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:3"], indirect=True)
def test_bf16_model_keeps_two_host_copies_and_matches_synchronous_steps(
    workers: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real case: bf16 weights, fp32 masters, the bf16 host gradient as the optimizer's .grad; the
    C++ kernel writes the converted weights in its step pass (bit for bit what copy_ gives)."""
    written: List[int] = []
    done = step_protocol.Publisher.done

    def spy(self: step_protocol.Publisher, k: int, wrote: object = ()) -> None:
        if not self.published[k] and self.masters[k]:  # first report of a layer with parameters (finish() repeats)
            written.append(len(wrote))  # type: ignore[arg-type]
        done(self, k, wrote)  # type: ignore[arg-type]

    monkeypatch.setattr(step_protocol.Publisher, "done", spy)

    def run(mode: str) -> Tuple[List[float], List[torch.Tensor], nn.Module]:
        settings.configure(step_mode=mode)
        model = make_model(torch.bfloat16)
        rp = RoundPipe(model, optim_dtype=torch.float32, model_run_config=RoundPipeRunConfig(num_microbatch=3))
        opt = rp_adamw(rp.optim_parameters())
        losses = []
        for x, y in batches(5, torch.bfloat16):
            losses.append(rp.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn).item())
            rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=mode == "streamed")
        rp.synchronize()
        return losses, [p.detach().clone() for p in model.parameters()], model

    streamed, w_streamed, model = run("streamed")
    sync, w_sync, _ = run("staged")  # is_async=False: the synchronous loop
    assert streamed == sync
    assert all(torch.equal(a, b) for a, b in zip(w_streamed, w_sync))
    for p in model.parameters():
        pa = ParamBuffers.of(p)
        assert pa.staged is None
        assert len(pa.host_buffers(p)) <= 2, len(pa.host_buffers(p))
    from roundpipe.optim.adam import _adam_kernel

    if _adam_kernel() is not None:  # the C++ kernel built: it wrote every layer's weights (2 tensors each)
        assert written and all(n == 2 for n in written), str(written)


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_two_optimizers_and_a_second_step_of_one_layer(workers: str) -> None:
    model = make_model()
    rp = RoundPipe(model, optim_dtype=torch.float64, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    params = list(rp.optim_parameters())
    # Each Linear's weight in one optimizer, its bias in another: no layer is wholly in one of them.
    opt_w, opt_b = rp_adamw(params[0::2]), rp_adamw(params[1::2])
    for x, y in batches(4):
        rp.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        rp.step(lambda: (opt_w.step(), opt_b.step(), opt_w.zero_grad(), opt_b.zero_grad()), is_async=True)
    rp.synchronize()
    ref = plain_pytorch(adamw, 4)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert rel_err(p, q) < 1e-12, n

    opt = rp_adamw(params)
    x, y = batches(1)[0]
    rp.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    rp.step(lambda: (opt.step(), opt.step()), is_async=True)  # the second step would change published layers
    with pytest.raises(RuntimeError, match="RPP_STEP_MODE=streamed"):
        rp.synchronize()


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_the_step_mode_is_read_once_when_the_model_is_built(workers: str) -> None:
    """A model keeps the step mode it was built with: the setting changed afterwards changes nothing."""
    model = make_model()
    rp = RoundPipe(model, optim_dtype=torch.float64, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    settings.configure(step_mode="staged")
    opt = rp_adamw(list(rp.optim_parameters()))
    for x, y in batches(4):
        rp.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
    rp.synchronize()
    ref = plain_pytorch(adamw, 4)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert rel_err(p, q) < 1e-12, n


@pytest.mark.parametrize("workers", ["cpu:1"], indirect=True)
def test_step_mode_env_is_checked(workers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad value fails when the model is built, naming the variable and the choices."""
    settings.restore({})  # drop this module's configure(step_mode=...): the environment decides
    monkeypatch.setenv("RPP_STEP_MODE", "stream")
    with pytest.raises(ValueError, match="RPP_STEP_MODE='stream': expected `staged` or `streamed`"):
        RoundPipe(make_model())
