"""What a user's own script meets in the Python API: arguments checked where they are given, a default
microbatch count fitted to a small batch, a model without a preset (GPT-2) trained by size, and an
out-of-range label that raises a Python exception whatever the compile setting, never aborting the
process."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, rel_err
from torch import nn

import roundpipe
from roundpipe import AutoRoundPipe, RoundPipe, RoundPipeRunConfig, settings


def tiny_gpt2(seed: int = 0) -> nn.Module:
    """A GPT-2 of two blocks, random init, no dropout (so it compares exactly with a copy); no download."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=96, n_embd=32, n_layer=2, n_head=2, n_positions=64, bos_token_id=0, eos_token_id=0,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(config).float()


def test_constructor_arguments_are_checked_where_given() -> None:
    layer = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(TypeError, match=r"RoundPipe wraps an nn.Module .* not str 'x'"):
        RoundPipe("x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"AutoRoundPipe wraps an nn.Module"):
        AutoRoundPipe([layer])  # type: ignore[arg-type]
    for bad in ("bf16", "bfloat16", torch.int8):
        with pytest.raises(TypeError) as info:
            RoundPipe(layer, optim_dtype=bad)  # type: ignore[arg-type]
        assert f"optim_dtype={bad!r}" in str(info.value)
        assert "torch.float32, torch.bfloat16 or torch.float16" in str(info.value)
    with pytest.raises(TypeError, match="optim_dtype='bf16'"):  # wrapping by size: before any module is wrapped
        roundpipe.wrap_model_to_roundpipe(nn.Sequential(nn.Linear(4, 4)), optim_dtype="bf16")
    with pytest.raises(ValueError, match="model_run_config must be a roundpipe.RoundPipeRunConfig, not dict"):
        RoundPipe(layer, model_run_config={"num_microbatch": 2})  # type: ignore[arg-type]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=f"num_microbatch={bad!r}: expected a positive integer"):
            RoundPipeRunConfig(num_microbatch=bad)  # type: ignore[arg-type]
    for field, bad in (("requires_grad", "no"), ("preserve_rng_state", 1)):
        with pytest.raises(ValueError, match=f"{field}={bad!r}: expected True, False or None"):
            RoundPipeRunConfig(**{field: bad})
    with pytest.raises(ValueError, match="output_device='gpu': expected a torch.device or a device string"):
        RoundPipeRunConfig(output_device="gpu")
    assert RoundPipe(layer, optim_dtype=torch.float32).optim_dtype == torch.float32  # the accepted values still work
    assert RoundPipe(nn.Linear(4, 4), optim_dtype=None).optim_dtype is None


def test_default_microbatch_count_fits_a_small_batch() -> None:
    """Two CPU workers: the default is 3 microbatches; a batch of one or two rows runs in as many, with
    the plain model's results. A count the user chose larger than the batch stays an error."""
    settings.configure(devices="cpu:2")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    ref = copy.deepcopy(net)
    model = RoundPipe(net)
    for rows in (1, 2, 5):
        x = torch.randn(rows, 8)
        assert rel_err(model(x), ref(x)) < 1e-6
    chosen = RoundPipe(copy.deepcopy(ref), model_run_config=RoundPipeRunConfig(num_microbatch=2))
    with pytest.raises(ValueError, match="num_microbatch=2 is larger than the batch size 1"):
        chosen(torch.randn(1, 8))
    with pytest.raises(ValueError, match="num_microbatch=4 is larger than the batch size 1"):
        model(torch.randn(1, 8), roundpipe_run_config=RoundPipeRunConfig(num_microbatch=4))


def test_gpt2_wrapped_by_size_trains_a_batch_of_one() -> None:
    """GPT-2 has no preset: ``wrap_model_to_roundpipe`` wraps it by size. A training step on one sequence
    (the default count, 2 microbatches on one worker, fitted to the batch) gives the plain model's loss
    and gradients; then a batch of two runs in two microbatches with the plain model's logits (the key /
    value cache the model would share between them is off)."""
    settings.configure(devices="cpu:1")
    model = tiny_gpt2()
    ref = copy.deepcopy(model)
    wrapped = roundpipe.wrap_model_to_roundpipe(model, optim_dtype=torch.float32)
    assert isinstance(wrapped, AutoRoundPipe) and any(isinstance(m, RoundPipe) for m in model.modules())
    opt = roundpipe.optim.Adam(wrapped.optim_parameters(), lr=1e-3)
    ids = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(1))
    loss = wrapped(input_ids=ids, labels=ids).loss
    loss.backward()
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    assert rel_err(loss, ref_loss) < 1e-5
    # The wrapped model's names, less the RoundPipes' own level.
    got = {n.replace(".model.", "."): p.grad for n, p in model.named_parameters() if p.grad is not None}
    want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys() and max(rel_err(got[n], want[n]) for n in want) < 1e-5
    wrapped.step(lambda: (opt.step(), opt.zero_grad()))
    wrapped.synchronize()
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))  # the step applied
    two = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(2))
    plain = tiny_gpt2(seed=1)
    plain.load_state_dict({n.replace(".model.", "."): t for n, t in model.state_dict().items()})  # the trained weights
    with torch.no_grad():
        assert rel_err(wrapped(input_ids=two).logits, plain(input_ids=two).logits) < 1e-5


# Runs in a subprocess: an abort (a device-side assert, a compiled kernel's failure) would kill pytest.
LABEL_SCRIPT = r"""
import os, sys, torch, roundpipe
from transformers import GPT2Config, GPT2LMHeadModel, Qwen3ForCausalLM
from roundpipe.models.configs import tiny_config

torch.manual_seed(0)
qwen = Qwen3ForCausalLM(tiny_config("qwen3", vocab_size=64, num_hidden_layers=2, num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=16))
gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32, bos_token_id=0,
                                  eos_token_id=0))
ids = torch.randint(0, 64, (2, 8))
for name, hf in (("qwen3", qwen), ("gpt2", gpt2)):
    model = roundpipe.wrap_model_to_roundpipe(hf)
    for bad in (64, -1, 10**6):
        labels = ids.clone()
        labels[1, 5] = bad
        for call in ("forward", "train_step", "no_grad"):
            if call == "train_step" and not hasattr(model, "train_step"):
                continue
            try:
                if call == "forward":
                    model(input_ids=ids, labels=labels).loss.backward()
                elif call == "train_step":
                    model.train_step(input_ids=ids, labels=labels)
                else:
                    with torch.no_grad():
                        model(input_ids=ids, labels=labels)
            except ValueError as exc:
                print(name, call, "ValueError:", exc)
            else:
                print(name, call, "no error")
    if os.environ.get("RPP_DISABLE_TORCH_COMPILE") == "1":  # compiled training is tested elsewhere (slow here)
        model(input_ids=ids, labels=ids).loss.backward()  # the model still trains after the refusals
        print(name, "trains")
if sys.argv[1] == "uncaught":
    labels = ids.clone()
    labels[0, 1] = 64
    model(input_ids=ids, labels=labels)
"""


@pytest.mark.timeout(900)
@pytest.mark.parametrize("compile_off", ["1", "0"])
def test_out_of_range_label_raises_and_never_aborts(tmp_path, compile_off: str) -> None:
    env = dict(os.environ, RPP_DISABLE_TORCH_COMPILE=compile_off, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    env["RPP_DEVICES"] = "cuda:0" if torch.cuda.is_available() else "cpu:1"
    env["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    cmd = [sys.executable, "-c", LABEL_SCRIPT, "uncaught"]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=840)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])  # an exception's exit, not a signal's
    assert proc.stderr.rstrip().splitlines()[-1] == (
        "ValueError: labels[0, 1] = 64 is not a token id of this model (vocab_size=64): a label is a token id in "
        "[0, 64) or ignore_index=-100"
    ), proc.stderr[-3000:]
    assert "no error" not in proc.stdout, proc.stdout
    lines = proc.stdout.splitlines()
    for name, calls in (("qwen3", ("forward", "train_step", "no_grad")), ("gpt2", ("forward", "no_grad"))):
        for bad in (64, -1, 10**6):
            for call in calls:
                want = f"{name} {call} ValueError: labels[1, 5] = {bad} is not a token id of this model (vocab_size=64)"
                assert any(line.startswith(want) for line in lines), (want, proc.stdout)
        assert (f"{name} trains" in lines) == (compile_off == "1")


def test_label_check_names_the_position_and_allows_ignored_and_first_labels() -> None:
    from roundpipe.models.loss import check_label_range

    labels = torch.tensor([[-5, 1, -100, 3], [0, 2, 9, 1]])  # labels[:, 0] is never a target
    check_label_range(labels, vocab_size=10)
    labels[1, 2] = 10
    with pytest.raises(ValueError, match=r"labels\[1, 2\] = 10 is not a token id of this model \(vocab_size=10\)"):
        check_label_range(labels, vocab_size=10)
    with pytest.raises(ValueError, match=r"shift_labels\[0, 0\] = -5 is not"):
        check_label_range(torch.tensor([[-5, 1]]), vocab_size=10, shifted=True, name="shift_labels")
    check_label_range(torch.tensor([[-7, 1]]), vocab_size=10, ignore_index=-7, shifted=True)


def test_call_arguments_fail_before_any_job_with_one_line() -> None:
    """A label batch of 5 for an input batch of 8 names both sizes (it used to fail inside ``loss_fn`` as
    torch's broadcast error); each other mistaken argument names itself; no layer has run."""
    settings.configure(devices="cpu:2")
    model = RoundPipe(
        nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), model_run_config=RoundPipeRunConfig(num_microbatch=2)
    )
    x, calls = torch.randn(8, 4), []  # loss_fn runs once per microbatch in a job: counted

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(out.shape[0])
        return nn.functional.mse_loss(out, y)

    cases = [
        ({"label": torch.randn(5, 4)}, ValueError, "the label batch has 5 rows but the input batch has 8"),
        ({"label": (torch.randn(5, 4), 3)}, ValueError, "label batch has 5 rows but the input batch has 8"),
        ({"loss_fn": "mse"}, TypeError, "loss_fn must be a callable .* not a str"),
        ({"input_args": [x]}, TypeError, r"input_args is the tuple .* \(input_args=\(x,\)\), not a list"),
        ({"input_kwargs": [("x", x)]}, TypeError, "input_kwargs is a dict .* not a list"),
        ({"return_outputs": "yes"}, TypeError, "return_outputs is True or False, not 'yes'"),
        ({"run_config": {"num_microbatch": 2}}, TypeError, r"forward_backward\(run_config=...\) takes a roundpipe"),
        ({"run_config": RoundPipeRunConfig(num_microbatch=9)}, ValueError, "num_microbatch=9 is larger than .* 8"),
    ]
    for change, kind, message in cases:
        args = {"input_args": (x,), "label": torch.randn(8, 4), "loss_fn": loss_fn, **change}
        with pytest.raises(kind, match=message):
            model.forward_backward(**args)
    with pytest.raises(TypeError, match=r"forward\(roundpipe_run_config=...\) takes a roundpipe.RoundPipeRunConfig"):
        model(x, roundpipe_run_config=2)  # type: ignore[arg-type]
    assert calls == []
    loss = model.forward_backward(input_args=x, label=torch.randn(8, 4), loss_fn=loss_fn)  # one tensor: one argument
    assert calls == [4, 4] and loss.dim() == 0  # the same model works: two microbatches


def test_step_arguments_fail_on_the_callers_thread() -> None:
    settings.configure(devices="cpu:1")
    model = RoundPipe(nn.Sequential(nn.Linear(4, 4)), optim_dtype=torch.float32)
    optimizer = roundpipe.optim.Adam(model.optim_parameters(), lr=1e-3)
    model.forward_backward(input_args=(torch.randn(2, 4),), loss_fn=lambda out, _: out.sum())
    with pytest.raises(TypeError, match=r"step_fn must be a function .*; got None \(the result of a call\)"):
        model.step(optimizer.step())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="step_fn must be a function .*; got a Adam"):
        model.step(optimizer)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"is_async is True or False, not <bound method .*zero_grad"):
        model.step(optimizer.step, optimizer.zero_grad)  # type: ignore[arg-type]
    model.step(lambda: (optimizer.step(), optimizer.zero_grad()))  # the right call still works
    model.synchronize()


def test_labels_split_by_a_spec_or_a_callable_are_not_checked_against_the_inputs() -> None:
    """A label whose rows differ from the inputs' is fine when the user splits it: two label rows per
    input row, split by a callable or a spec tree, give the gradients of the plain model."""
    from torch.distributed.pipelining.microbatch import TensorChunkSpec

    settings.configure(devices="cpu:2")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    ref = copy.deepcopy(net)
    x, y = torch.randn(4, 4), torch.randn(8, 4)  # labels: two per row, in row order
    loss_fn = lambda out, lab: nn.functional.mse_loss(out.repeat_interleave(2, dim=0), lab, reduction="sum")
    loss_fn(ref(x), y).backward()
    for split in (lambda label, n: list(torch.tensor_split(label, n)), (TensorChunkSpec(0),)):
        model = RoundPipe(copy.deepcopy(net), model_run_config=RoundPipeRunConfig(num_microbatch=2, split_label=split))
        model.forward_backward(
            input_args=(x,),
            label=(y,) if isinstance(split, tuple) else y,
            loss_fn=((lambda out, lab: loss_fn(out, lab[0])) if isinstance(split, tuple) else loss_fn),
        )
        for p, q in zip(model.model.parameters(), ref.parameters()):
            assert rel_err(p.grad, q.grad) < 1e-5
