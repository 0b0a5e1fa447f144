"""Code written for the public RoundPipe's documentation runs unchanged: one test per finding.

Hugging Face numerics are fp32 with tiny random models; the public fine-tuning guide's calls are
compared with the plain Hugging Face model run over the same microbatches.
"""

from __future__ import annotations

import copy
import os
import threading
import warnings
from typing import Any, Dict, List

os.environ.setdefault("RPP_DISABLE_TORCH_COMPILE", "1")

import pytest
import torch
from helpers import rel_err, wrap_by_size
from test_models import assert_grads_close, grads, make_batch, tiny_model
from torch import nn
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _CustomReducer, _Replicate

import roundpipe
from roundpipe import AutoRoundPipe, ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from roundpipe.runtime.batch import avg_reducer

torch.set_num_threads(1)
transformers = pytest.importorskip("transformers")

TOL = 1e-4
workers2 = pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)


def mlp(seed: int = 0, layers: int = 3) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(layers)])


# ---------------------------------------------------------------------------------------------------------
# The public training loop: OptimizerCtx, forward_backward with Hugging Face outputs, GradScaler
# ---------------------------------------------------------------------------------------------------------


@workers2
def test_optimizer_ctx_is_exported_and_gives_the_master_copies(workers: str) -> None:
    from roundpipe import OptimizerCtx

    model = RoundPipe(mlp().to(torch.float16), optim_dtype=torch.float32)
    with OptimizerCtx():
        optimizer = torch.optim.Adam(model.parameters())
    params = optimizer.param_groups[0]["params"]
    assert [p.dtype for p in params] == [torch.float32] * 6
    assert [id(p) for p in params] == [id(p) for p in model.optim_parameters()]
    assert [n for n, _ in model.named_optim_parameters()] == [n for n, _ in model.optim_named_parameters()]


def _hf_microbatch_reference(model: nn.Module, batch: Dict[str, torch.Tensor], n: int, loss_fn: Any) -> torch.Tensor:
    """The plain Hugging Face model over the same microbatches RoundPipe makes, ``loss_fn`` per
    microbatch; returns the summed loss (gradients accumulate in ``model``)."""
    parts = {k: torch.tensor_split(v, n) for k, v in batch.items()}
    total = torch.zeros(())
    for m in range(n):
        mb = {k: v[m] for k, v in parts.items()}
        labels = mb.pop("label")
        loss = loss_fn(model, model(**mb), labels)
        loss.backward()
        total = total + loss.detach()
    return total


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2"], indirect=True)
def test_public_fine_tuning_guide_calls_match_hugging_face(workers: str) -> None:
    """The two ``forward_backward`` calls of the public guide, on ``wrap_model_to_roundpipe(qwen3)``:
    ``model.loss_function(logits=outputs.logits, ...)`` with labels passed as ``label``, and
    ``outputs.loss`` with labels in ``input_kwargs``."""
    n = 3
    hf = tiny_model("qwen3")
    ref = copy.deepcopy(hf)
    model = roundpipe.wrap_model_to_roundpipe(
        hf, model_run_config=RoundPipeRunConfig(num_microbatch=n), optim_dtype=torch.float32
    )
    batch = make_batch(padding=True)
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    # loss_function and vocab_size resolve to the Hugging Face model's.
    assert model.loss_function is hf.loss_function and model.vocab_size == hf.config.vocab_size

    loss = model.forward_backward(
        input_kwargs={"input_ids": ids, "attention_mask": mask},
        label=labels,
        loss_fn=lambda outputs, labels: (
            model.loss_function(logits=outputs.logits, labels=labels, vocab_size=model.vocab_size) / n
        ),
    )
    ref_loss = _hf_microbatch_reference(
        ref,
        {"input_ids": ids, "attention_mask": mask, "label": labels},
        n,
        lambda m, out, lab: m.loss_function(logits=out.logits, labels=lab, vocab_size=m.config.vocab_size) / n,
    )
    assert rel_err(loss, ref_loss) < TOL
    assert_grads_close(grads(hf), grads(ref), TOL)

    loss = model.forward_backward(
        input_kwargs={"input_ids": ids, "attention_mask": mask, "labels": labels},
        loss_fn=lambda outputs, _: outputs.loss / n,
    )
    ref_loss = _hf_microbatch_reference(
        ref,
        {"input_ids": ids, "attention_mask": mask, "labels": labels, "label": labels},
        n,
        lambda m, out, lab: out.loss / n,
    )
    assert rel_err(loss, ref_loss) < TOL
    assert_grads_close(grads(hf), grads(ref), TOL)


@workers2
def test_forward_takes_num_items_in_batch(workers: str) -> None:
    """``forward(..., num_items_in_batch=k)``: the sum of the token losses over k, as Hugging Face."""
    hf = tiny_model("qwen3")
    ref = copy.deepcopy(hf)
    model = roundpipe.wrap_model_to_roundpipe(hf, model_run_config=RoundPipeRunConfig(num_microbatch=3))
    batch = make_batch(padding=True)
    k = torch.tensor(100)  # e.g. the labels of two accumulated batches
    with torch.no_grad():
        got = model(**batch, num_items_in_batch=k).loss
        want = ref(**batch, num_items_in_batch=k).loss
    assert rel_err(got, want) < 1e-5


@workers2
def test_fused_call_with_hf_keywords_and_grad_scaler(workers: str) -> None:
    """The public fused call (``return_logits`` and ``num_items_in_batch`` in input_kwargs, a
    GradScaler in ``loss_fn``) and ``train_step(scale_loss=scaler.scale)`` give the scaled HF loss
    and gradients."""
    hf = tiny_model("qwen3")
    ref = copy.deepcopy(hf)
    model = roundpipe.wrap_model_to_roundpipe(hf, model_run_config=RoundPipeRunConfig(num_microbatch=3))
    scaler = roundpipe.GradScaler(init_scale=256.0)
    batch = make_batch(padding=True)
    k = int((batch["labels"][:, 1:] != -100).sum()) + 7
    kwargs = {**batch, "return_logits": False, "num_items_in_batch": k}
    ref_loss = ref(**batch, num_items_in_batch=k).loss
    ref_loss.backward()
    want = grads(ref)

    loss = model.forward_backward(input_kwargs=kwargs, loss_fn=lambda output, _: scaler.scale(output.loss))
    assert rel_err(loss / scaler.get_scale(), ref_loss) < 1e-5
    assert_grads_close({n: g / 256.0 for n, g in grads(hf).items()}, want, 1e-5)

    loss = model.train_step(**batch, num_items_in_batch=k, scale_loss=scaler.scale)
    assert rel_err(loss / scaler.get_scale(), ref_loss) < 1e-5
    assert_grads_close({n: g / 256.0 for n, g in grads(hf).items()}, want, 1e-5)


# ---------------------------------------------------------------------------------------------------------
# Wrapper attributes, modes and synchronisation
# ---------------------------------------------------------------------------------------------------------


@workers2
def test_new_attributes_reach_the_models_and_deletions_remove_them(workers: str) -> None:
    hf = tiny_model("qwen3")
    rp = roundpipe.wrap_model_to_roundpipe(hf)
    rp.my_flag = 3
    assert hf.my_flag == 3 and rp.my_flag == 3 and "my_flag" not in rp.__dict__
    del rp.my_flag
    assert not hasattr(hf, "my_flag") and not hasattr(rp.model, "my_flag")
    with pytest.raises(AttributeError):
        del rp.my_flag

    inner = mlp()
    auto = AutoRoundPipe(inner)
    auto.note = "x"
    assert inner.note == "x"
    del auto.note
    assert not hasattr(inner, "note")
    auto.name = "renamed"  # the wrapper's own attributes stay its own
    assert auto.name == "renamed" and not hasattr(inner, "name")


@workers2
def test_attribute_reads_try_the_original_model_first(workers: str) -> None:
    inner = mlp()
    inner.shared_name = "wrapped"
    original = nn.Module()
    original.shared_name = "original"
    rp = RoundPipe(inner)
    rp.set_original_model(original)
    assert rp.shared_name == "original"


@workers2
def test_train_and_eval_reach_the_original_model(workers: str) -> None:
    hf = tiny_model("qwen3")
    rp = roundpipe.wrap_model_to_roundpipe(hf)
    rp.eval()
    assert not hf.training and not hf.model.training and not rp.training
    rp.train()
    assert hf.training and hf.model.training and rp.training


@workers2
def test_auto_roundpipe_synchronize_without_optimizer(workers: str) -> None:
    auto = AutoRoundPipe(mlp())
    auto.synchronize()  # nothing to sync, no error
    out = auto(torch.randn(4, 8))
    assert out.shape == (4, 8)


# ---------------------------------------------------------------------------------------------------------
# Microbatch split and merge in the public forms
# ---------------------------------------------------------------------------------------------------------


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * scale


@workers2
def test_split_input_callable_returns_args_and_kwargs_lists(workers: str) -> None:
    module = TwoInputs()
    x, scale = torch.randn(6, 8), torch.tensor([2.0])
    seen: List[int] = []

    def custom_split(args: Any, kwargs: Any, num_microbatch: int) -> Any:
        xs = args[0].chunk(num_microbatch)
        seen.append(num_microbatch)
        return [(c, args[1]) for c in xs], [kwargs] * num_microbatch

    rp = RoundPipe(
        copy.deepcopy(module), model_run_config=RoundPipeRunConfig(num_microbatch=3, split_input=custom_split)
    )
    with torch.no_grad():
        assert rel_err(rp(x, scale), module(x, scale)) < 1e-6
    assert seen == [3]


@workers2
def test_none_in_a_split_spec_means_automatic(workers: str) -> None:
    module = TwoInputs()
    x, per_sample, shared = torch.randn(6, 8), torch.randn(6, 1), torch.randn(6, 1)[:1]
    cases = [
        (((TensorChunkSpec(0), _Replicate), None), shared),  # the public example: kwargs spec None
        ((None, None), per_sample),
        (((None, TensorChunkSpec(0)), {}), per_sample),
    ]
    for spec, scale in cases:
        rp = RoundPipe(copy.deepcopy(module), model_run_config=RoundPipeRunConfig(num_microbatch=3, split_input=spec))
        with torch.no_grad():
            assert rel_err(rp(x, scale), module(x, scale)) < 1e-6, spec
    # Labels likewise: (targets, weights) with the weights automatic.
    rp = RoundPipe(
        copy.deepcopy(module),
        model_run_config=RoundPipeRunConfig(num_microbatch=3, split_label=(TensorChunkSpec(0), None)),
    )
    y, w = torch.randn(6, 8), torch.tensor(0.5)
    loss = rp.forward_backward(
        input_args=(x, per_sample), label=(y, w), loss_fn=lambda out, lab: ((out - lab[0]) ** 2).sum() * lab[1]
    )
    ref = ((module(x, per_sample) - y) ** 2).sum() * w
    assert rel_err(loss, ref) < 1e-5


class ManyOutputs(nn.Module):
    """Per-sample logits, a per-microbatch mean (0-dim) and a constant."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> Any:
        out = self.lin(x)
        return out, out.mean(), torch.tensor(7.0)


@workers2
def test_merge_output_defaults_and_spec_trees(workers: str) -> None:
    module = ManyOutputs()
    x = torch.randn(6, 8)
    parts = [module(c) for c in x.tensor_split(3)]
    with torch.no_grad():
        # Default: cat along dim 0; 0-dim tensors averaged over the microbatches.
        rp = RoundPipe(copy.deepcopy(module), model_run_config=RoundPipeRunConfig(num_microbatch=3))
        out, mean, const = rp(x)
        assert rel_err(out, module(x)[0]) < 1e-6
        assert rel_err(mean, torch.stack([p[1] for p in parts]).mean()) < 1e-6 and mean.dim() == 0
        assert const.item() == 7.0
        # A spec tree: cat on dim 0, sum reducer, replicate; an AvgReducer.
        summed = _CustomReducer(torch.tensor(0.0), lambda a, b: a + b)
        cfg = RoundPipeRunConfig(num_microbatch=3, merge_output=(TensorChunkSpec(0), summed, _Replicate))
        out, total, const = RoundPipe(copy.deepcopy(module), model_run_config=cfg)(x)
        assert rel_err(total, sum(p[1] for p in parts)) < 1e-6 and const.item() == 7.0
        cfg = RoundPipeRunConfig(num_microbatch=3, merge_output=(None, avg_reducer, None))
        _, mean, _ = RoundPipe(copy.deepcopy(module), model_run_config=cfg)(x)
        assert rel_err(mean, torch.stack([p[1] for p in parts]).mean()) < 1e-6
        # A callable merges the whole list; per-leaf False keeps that leaf's microbatches apart.
        cfg = RoundPipeRunConfig(num_microbatch=3, merge_output=lambda outs: torch.cat([o[0] for o in outs]))
        assert rel_err(RoundPipe(copy.deepcopy(module), model_run_config=cfg)(x), module(x)[0]) < 1e-6
        cfg = RoundPipeRunConfig(num_microbatch=3, merge_output=(False, True, True))
        packed, _, _ = RoundPipe(copy.deepcopy(module), model_run_config=cfg)(x)
        packed.synchronize()
        assert len(packed) == 3 and rel_err(packed[1], parts[1][0]) < 1e-6
    with pytest.raises(ValueError, match="merge_output"):
        RoundPipeRunConfig(merge_output=(TensorChunkSpec(0), "sum"))


# ---------------------------------------------------------------------------------------------------------
# Plans
# ---------------------------------------------------------------------------------------------------------


@workers2
def test_auto_plan_returns_one_plan_per_model(workers: str) -> None:
    a, b = RoundPipe(mlp(0, 3)), RoundPipe(mlp(1, 5))
    single = ModelExecutePlan.auto("train", a)
    assert isinstance(single, ModelExecutePlan)
    plans = ModelExecutePlan.auto("train", a, b, model_memory_limit=1.0)
    assert isinstance(plans, list) and len(plans) == 2
    plans[0].check_valid(3, "train")
    plans[1].check_valid(5, "train")
    assert plans == ModelExecutePlan.auto_many("train", a, b, model_memory_limit=1.0)


@workers2
def test_a_layer_over_half_the_memory_limit_warns_and_runs(workers: str) -> None:
    model = mlp()
    ref = copy.deepcopy(model)
    rp = RoundPipe(model)
    limit = rp.layer_size[0] * 1.5  # GB: each layer is more than half of it
    with pytest.warns(RuntimeWarning, match="raised"):
        plan = ModelExecutePlan.auto("fused", rp, model_memory_limit=limit)
    x = torch.randn(4, 8)
    loss = rp.forward_backward(
        input_args=(x,), loss_fn=lambda o, _: o.sum(), run_config=RoundPipeRunConfig(execute_plan=plan)
    )
    assert rel_err(loss, ref(x).sum()) < 1e-5


# ---------------------------------------------------------------------------------------------------------
# wrap_model_to_roundpipe by size
# ---------------------------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class Net(nn.Module):
    """A trunk of blocks in a ModuleList and a head that is a Sequential with a parameter-free child."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@workers2
def test_wrapping_chains_module_lists_and_runs_small_modules_on_devices(workers: str) -> None:
    net = Net()
    ref = copy.deepcopy(net)
    threads: List[str] = []
    net.head[1].register_forward_hook(lambda *_: threads.append(threading.current_thread().name))
    block_bytes = (16 * 16 + 16) * 4
    wrapped = roundpipe.wrap_model_to_roundpipe(
        net,
        lower_threshold=block_bytes,
        upper_threshold=block_bytes * 2,
        model_run_config=RoundPipeRunConfig(num_microbatch=3),
    )
    assert isinstance(wrapped, AutoRoundPipe)
    # ModuleList elements chained: all but the last hand their microbatches on unmerged.
    assert [b.model_run_config.merge_output for b in net.blocks] == [False, False, None]
    # The head Sequential is too large for one RoundPipe: each child is one, the GELU included.
    assert all(isinstance(c, RoundPipe) for c in net.head)
    assert [c.model_run_config.merge_output for c in net.head] == [False, False, None]
    x = torch.randn(6, 16)
    out = wrapped(x)
    out.square().sum().backward()
    ref(x).square().sum().backward()
    assert rel_err(out, ref(x)) < 1e-5
    rename = lambda n: n.replace(".model.", ".")  # noqa: E731
    got = {rename(n): p.grad for n, p in net.named_parameters()}
    for n, p in ref.named_parameters():
        assert rel_err(got[n], p.grad) < 1e-5, n
    assert threads and all(t != threading.main_thread().name for t in threads)


@workers2
def test_hugging_face_loss_function_runs_on_the_devices(workers: str) -> None:
    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    wrapped = wrap_by_size(model, 3)
    assert isinstance(model.loss_function, RoundPipe)
    batch = make_batch(padding=True)
    for extra in ({}, {"num_items_in_batch": torch.tensor(77)}):
        out, want = wrapped(**batch, **extra), ref(**batch, **extra)
        assert rel_err(out.loss, want.loss) < 1e-5
        out.loss.backward()
        want.loss.backward()
        assert_grads_close({n.replace(".model.", "."): g for n, g in grads(model).items()}, grads(ref), 1e-5)


def test_spec_text_names_are_available() -> None:
    """``named_optim_parameters`` (the spec's OptimizerCtx text) next to ``optim_named_parameters``."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert hasattr(RoundPipe, "named_optim_parameters") and hasattr(AutoRoundPipe, "named_optim_parameters")
