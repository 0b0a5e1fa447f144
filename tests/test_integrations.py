"""Hugging Face Trainer (and TRL SFTTrainer) training RoundPipe models: ``roundpipe.integrations``.

A tiny Qwen3 trained by ``RoundPipeTrainer`` gives the losses of the same run written by hand
(``forward_backward`` + ``model.step`` + RoundPipe's Adam with the Trainer's learning-rate schedule and
clipping), and resumes from a checkpoint exactly.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Dict, List, Optional

os.environ.setdefault("RPP_DISABLE_TORCH_COMPILE", "1")

import pytest
import torch
from helpers import rel_err, wrap_by_size
from test_models import VOCAB, tiny_model

import roundpipe
from roundpipe import RoundPipeRunConfig

torch.set_num_threads(1)
transformers = pytest.importorskip("transformers")

from roundpipe.integrations import RoundPipeOptimizer, RoundPipeTrainer, with_roundpipe  # noqa: E402

workers2 = pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
BATCH, ACCUM, LR, SEQ = 4, 2, 3e-3, 12


def dataset(n: int, seed: int = 0) -> List[Dict[str, torch.Tensor]]:
    """Counting sequences from random starts (learnable); the first three labels are ignored (a prompt)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        start = int(torch.randint(0, VOCAB - 3, (1,), generator=g))
        ids = (start + torch.arange(SEQ)) % (VOCAB - 3) + 3
        labels = ids.clone()
        labels[:3] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def wrapped(dtype: torch.dtype = torch.float32) -> Any:
    return roundpipe.wrap_model_to_roundpipe(
        tiny_model("qwen3").to(dtype), model_run_config=RoundPipeRunConfig(num_microbatch=2), optim_dtype=torch.float32
    )


def trainer_settings(steps: int, save_steps: Optional[int] = None) -> Dict[str, Any]:
    """The Trainer arguments the tests here share: ``BATCH`` rows a micro-step, ``ACCUM`` of them a step,
    sequential sampling on the CPU, the loss logged every step, a checkpoint every ``save_steps`` (none
    without)."""
    return dict(
        report_to=[],
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUM,
        max_steps=steps,
        learning_rate=LR,
        logging_steps=1,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        train_sampling_strategy="sequential",
        use_cpu=True,
        disable_tqdm=True,
    )


def training_args(out: str, steps: int, save_steps: Optional[int] = None, **kw: Any) -> Any:
    return transformers.TrainingArguments(**{"output_dir": out, **trainer_settings(steps, save_steps), **kw})


def step_losses(trainer: Any) -> List[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def own_loop(
    data: List[Dict[str, torch.Tensor]],
    steps: int,
    max_grad_norm: float,
    dtype: torch.dtype = torch.float32,
    fp16: bool = False,
    schedule: int = 0,
) -> List[float]:
    """The Trainer's run written by hand: accumulation normalised by the step's label count, the
    linear schedule (over ``schedule`` steps, default ``steps``), clipping of the masters' gradients,
    optionally a GradScaler."""
    schedule = schedule or steps
    model = wrapped(dtype)
    optimizer = roundpipe.optim.Adam(model.optim_parameters(), lr=LR, decoupled_weight_decay=True)
    scaler = roundpipe.GradScaler() if fp16 else None
    losses = []
    for k in range(steps):
        batches = [data[(ACCUM * k + j) * BATCH : (ACCUM * k + j + 1) * BATCH] for j in range(ACCUM)]
        n = sum(int((b["labels"][1:] != -100).sum()) for batch in batches for b in batch)
        total = 0.0
        for batch in batches:
            kwargs = {key: torch.stack([b[key] for b in batch]) for key in ("input_ids", "labels")}
            loss = model.forward_backward(
                input_kwargs={**kwargs, "num_items_in_batch": n},
                loss_fn=lambda out, _: scaler.scale(out.loss) if scaler else out.loss,
            )
            total += (loss / scaler.get_scale() if scaler else loss).item()
        lr = LR * (schedule - k) / schedule  # the Trainer's default linear schedule, no warmup

        def step_fn(lr: float = lr) -> None:
            for group in optimizer.param_groups:
                group["lr"] = lr
            if scaler is not None:
                scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(list(model.optim_parameters()), max_grad_norm)
            scaler.step(optimizer) if scaler is not None else optimizer.step()
            optimizer.zero_grad()

        model.step(step_fn)
        if scaler is not None:
            scaler.update()
        losses.append(total)
    return losses


@workers2
def test_trainer_matches_the_hand_written_loop(workers: str, tmp_path: Any) -> None:
    steps = 20
    data = dataset(steps * BATCH * ACCUM)
    trainer = RoundPipeTrainer(
        model=wrapped(), args=training_args(str(tmp_path), steps, max_grad_norm=1.0), train_dataset=data
    )
    trainer.train()
    assert isinstance(trainer.optimizer.optimizer, RoundPipeOptimizer)  # accelerate's wrapper around ours
    assert isinstance(trainer.optimizer.optimizer.optimizer, roundpipe.optim.Adam)
    got, want = step_losses(trainer), own_loop(data, steps, max_grad_norm=1.0)
    assert len(got) == steps
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) < 1e-6
    assert want[-1] < want[0]


@workers2
def test_trainer_resumes_exactly_with_mixed_precision(workers: str, tmp_path: Any) -> None:
    """bf16 weights with fp32 masters, fp16 loss scaling (RoundPipe's GradScaler): the run matches
    the hand-written one, and resuming from the checkpoint of step 5 continues it exactly."""
    steps = 10
    data = dataset(steps * BATCH * ACCUM, seed=1)
    out = str(tmp_path / "run")

    def trainer() -> Any:
        args = training_args(out, steps, save_steps=5, fp16=True, max_grad_norm=1.0)
        return RoundPipeTrainer(model=wrapped(torch.bfloat16), args=args, train_dataset=data)

    full = trainer()
    full.train()
    ckpt = os.path.join(out, "checkpoint-5")
    files = set(os.listdir(ckpt))
    assert {
        "model.safetensors",
        "roundpipe_optim_params.safetensors",
        "optimizer.pt",
        "scheduler.pt",
        "scaler.pt",
        "rng_state.pth",
    } <= files
    # A checkpoint synchronises the model (the next step uses the newest weights); otherwise the run is
    # the hand-written one.
    assert (
        max(
            abs(a - b) / abs(b)
            for a, b in zip(step_losses(full)[:5], own_loop(data, 5, 1.0, torch.bfloat16, fp16=True, schedule=steps))
        )
        < 1e-6
    )

    resumed = trainer()
    resumed.train(resume_from_checkpoint=ckpt)
    assert step_losses(resumed)[5:] == step_losses(full)[5:]


@workers2
def test_saved_weights_load_with_from_pretrained(workers: str, tmp_path: Any) -> None:
    data = dataset(2 * BATCH * ACCUM)
    model = wrapped()
    trainer = RoundPipeTrainer(model=model, args=training_args(str(tmp_path / "run"), 2), train_dataset=data)
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"))
    trained = dict(model.original_model.named_parameters())
    assert trained.keys() == dict(loaded.named_parameters()).keys()
    for name, p in loaded.named_parameters():
        assert torch.equal(p, trained[name]), name
    assert not torch.equal(trained["model.embed_tokens.weight"], tiny_model("qwen3").model.embed_tokens.weight)


@workers2
def test_model_wrapped_by_size_saves_its_original_names(workers: str, tmp_path: Any) -> None:
    """An ``AutoRoundPipe`` (no preset) saves the Hugging Face names, not the wrapped ``.model.`` ones."""
    hf = tiny_model("llama")
    names = [n for n, _ in hf.named_parameters()]  # before wrapping; the parameter objects stay
    params = list(hf.parameters())
    model = wrap_by_size(hf, 2)
    assert any(".model." in n for n, _ in hf.named_parameters())
    trainer = RoundPipeTrainer(
        model=model, args=training_args(str(tmp_path / "run"), 1), train_dataset=dataset(BATCH * ACCUM)
    )
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"))
    assert [n for n, _ in loaded.named_parameters()] == names
    for name, p in zip(names, params):
        assert torch.equal(loaded.get_parameter(name), p), name


@workers2
def test_evaluate_and_predict_use_the_synchronized_model(workers: str, tmp_path: Any) -> None:
    data = dataset(2 * BATCH * ACCUM)
    model = wrapped()
    args = training_args(str(tmp_path), 2, per_device_eval_batch_size=BATCH)
    trainer = RoundPipeTrainer(model=model, args=args, train_dataset=data, eval_dataset=data[: 2 * BATCH])
    trainer.train()
    metrics = trainer.evaluate()
    hf = model.original_model
    with torch.no_grad():
        want = [
            hf(**{k: torch.stack([b[k] for b in data[i : i + BATCH]]) for k in ("input_ids", "labels")}).loss
            for i in (0, BATCH)
        ]
    assert rel_err(torch.tensor(metrics["eval_loss"]), torch.stack(want).mean()) < 1e-5
    predictions = trainer.predict(data[:BATCH]).predictions
    assert predictions.shape == (BATCH, SEQ, VOCAB)


@workers2
def test_optimizer_must_hold_the_optimizer_copies(workers: str) -> None:
    model = wrapped()
    with pytest.raises(ValueError, match="optim_parameters"):
        RoundPipeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)


@workers2
def test_queued_step_uses_the_learning_rate_of_its_time(workers: str) -> None:
    """The scheduler changes the learning rate right after ``step()``; the queued step keeps the old one."""
    model = wrapped()
    inner = torch.optim.SGD(model.optim_parameters(), lr=0.5)
    opt = RoundPipeOptimizer(inner, model)
    batch = {k: torch.stack([b[k] for b in dataset(BATCH)]) for k in ("input_ids", "labels")}
    model.train_step(**batch)
    masters = {n: p.detach().clone() for n, p in model.optim_named_parameters()}
    grads = {}
    model.synchronize()
    for name, p in model.model.named_parameters():
        grads[name] = p.grad.clone()
    opt.step()
    opt.param_groups[0]["lr"] = 123.0  # what a scheduler does on the main thread
    model.synchronize()
    for name, p in model.optim_named_parameters():
        assert rel_err(p, masters[name] - 0.5 * grads[name]) < 1e-6, name
    assert opt.state_dict()["param_groups"][0]["lr"] == 123.0


@workers2
def test_sft_trainer_with_roundpipe(workers: str, tmp_path: Any) -> None:
    """TRL's SFTTrainer with the mixin trains through the pipeline: the losses of RoundPipeTrainer on
    the same (already tokenized, equal-length) data."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from tokenizers import Tokenizer
    from tokenizers import models as tokenizer_models

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(tokenizer_models.WordLevel(vocab, unk_token="<unk>")),
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
    )
    steps = 3
    data = dataset(steps * BATCH * ACCUM, seed=2)
    sft_data = datasets.Dataset.from_list([{"input_ids": d["input_ids"].tolist()} for d in data])
    common = dict(trainer_settings(steps), bf16=True)
    sft_args = trl.SFTConfig(output_dir=str(tmp_path / "sft"), eos_token=None, **common)
    sft = with_roundpipe(trl.SFTTrainer)(
        model=wrapped(), args=sft_args, train_dataset=sft_data, processing_class=tokenizer
    )
    sft.train()
    plain_data = [{"input_ids": d["input_ids"], "labels": d["input_ids"]} for d in data]
    plain = RoundPipeTrainer(
        model=wrapped(),
        args=transformers.TrainingArguments(output_dir=str(tmp_path / "plain"), **common),
        train_dataset=plain_data,
    )
    plain.train()
    assert max(abs(a - b) / abs(b) for a, b in zip(step_losses(sft), step_losses(plain))) < 1e-6
    assert len(step_losses(sft)) == steps


def test_trainer_refuses_a_model_that_is_not_wrapped(tmp_path: Any) -> None:
    with pytest.raises(TypeError, match="wrap_model_to_roundpipe"):
        RoundPipeTrainer(model=copy.deepcopy(tiny_model("qwen3")), args=training_args(str(tmp_path), 1))


@pytest.mark.gpu
@pytest.mark.parametrize("workers", ["cuda"], indirect=True)
def test_trainer_on_gpus(workers: str, tmp_path: Any) -> None:
    """On CUDA (the Trainer's device is a GPU): the model and optimizer state stay on the host, the run
    matches the hand-written one, resumes (GPU reductions may differ in the last bits), and fp16 takes
    RoundPipe's GradScaler instead of accelerate's."""
    steps = 6
    data = dataset(steps * BATCH * ACCUM, seed=3)
    out = str(tmp_path / "run")

    def trainer(**kw: Any) -> Any:
        args = training_args(out, steps, save_steps=3, use_cpu=False, max_grad_norm=1.0, **kw)
        return RoundPipeTrainer(model=wrapped(torch.bfloat16), args=args, train_dataset=data)

    full = trainer()
    full.train()
    assert full.args.device.type == "cuda"
    assert all(p.device.type == "cpu" for p in full.roundpipe.parameters())
    assert all(
        t.device.type == "cpu"
        for st in full.optimizer.optimizer.optimizer.state.values()
        for t in st.values()
        if isinstance(t, torch.Tensor)
    )
    got, want = step_losses(full)[:3], own_loop(data, 3, 1.0, torch.bfloat16, schedule=steps)
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) < 1e-2, (got, want)
    resumed = trainer()
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-3"))
    assert max(abs(a - b) / abs(b) for a, b in zip(step_losses(resumed)[3:], step_losses(full)[3:])) < 1e-2

    out = str(tmp_path / "fp16")
    fp16 = trainer(fp16=True)
    assert fp16.accelerator.scaler is None and fp16.roundpipe_scaler is not None
    fp16.train()
    assert all(torch.isfinite(torch.tensor(v)) for v in step_losses(fp16))
