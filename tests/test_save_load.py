"""``roundpipe.save`` / ``roundpipe.load``: a Python loop saved halfway and resumed in fresh model and
optimizer objects repeats the uninterrupted loop bit for bit (asynchronous steps, a learning-rate schedule
stepped on the optimizer thread), also after a process killed while it saved, and a damaged (truncated,
corrupt) or mismatched checkpoint is refused with one clear line."""

import os
import textwrap
from typing import List, Tuple

import pytest
import torch
from helpers import ROOT, kill_when_written
from torch import nn

import roundpipe
from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe.checkpoint import CheckpointError

TESTS = os.path.join(ROOT, "tests")

STEPS = 6

# Two CPU workers for every test here (the conftest fixture; never the process's environment).
pytestmark = pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)


def build(
    seed: int = 0, dtype: torch.dtype = torch.float32
) -> Tuple[RoundPipe, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """Model, optimizer and schedule of the run, from the same seed each time (the fresh objects of a resume)."""
    torch.manual_seed(seed)
    layers = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)], nn.Linear(32, 4))
    config = RoundPipeRunConfig(num_microbatch=2)
    model = RoundPipe(layers.to(dtype), optim_dtype=torch.float32, model_run_config=config)
    optimizer = roundpipe.optim.Adam(model.optim_parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler


def batches() -> List[Tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g)) for _ in range(STEPS)]


def train(model, optimizer, scheduler, data, start: int, stop: int) -> List[torch.Tensor]:
    losses = []
    for x, y in data[start:stop]:
        loss = model.forward_backward(
            input_args=(x,), label=y, loss_fn=lambda out, lab: nn.functional.mse_loss(out, lab) / 2
        )
        model.step(lambda: (optimizer.step(), optimizer.zero_grad(), scheduler.step()))
        losses.append(loss)
    return losses


def weights(model: RoundPipe) -> List[torch.Tensor]:
    model.synchronize()
    return [p.detach().clone() for p in model.model.parameters()]


def test_resume_is_bitwise_exact(tmp_path, workers: str) -> None:
    data = batches()
    model, optimizer, scheduler = build()
    straight = train(model, optimizer, scheduler, data, 0, STEPS)
    final = weights(model)

    model, optimizer, scheduler = build()
    first = train(model, optimizer, scheduler, data, 0, STEPS // 2)
    roundpipe.save(model, optimizer, str(tmp_path / "ckpt"), scheduler=scheduler, step=STEPS // 2)
    del model, optimizer, scheduler

    model, optimizer, scheduler = build(seed=123)  # other initial weights: everything must come from the file
    extra = roundpipe.load(model, optimizer, str(tmp_path / "ckpt"), scheduler=scheduler)
    assert extra["step"] == STEPS // 2
    second = train(model, optimizer, scheduler, data, extra["step"], STEPS)
    resumed = first + second
    assert [l.item() for l in resumed] == [l.item() for l in straight]
    for a, b in zip(weights(model), final):
        assert torch.equal(a, b)


def test_bf16_weights_resume_exactly(tmp_path, workers: str) -> None:
    """bf16 weights with fp32 masters: the bf16 weights in flight (one step behind) come back as saved."""
    data = [(x.bfloat16(), y) for x, y in batches()]
    loss_fn = lambda out, lab: nn.functional.mse_loss(out.float(), lab)

    def run(resume_at: int) -> Tuple[List[float], RoundPipe]:
        model, optimizer, _ = build(dtype=torch.bfloat16)
        losses = []
        for i, (x, y) in enumerate(data):
            if i == resume_at:
                roundpipe.save(model, optimizer, str(tmp_path / "ckpt"))
                model, optimizer, _ = build(seed=123, dtype=torch.bfloat16)
                assert roundpipe.load(model, optimizer, str(tmp_path / "ckpt")) == {}
            losses.append(model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn).item())
            model.step(lambda opt=optimizer: (opt.step(), opt.zero_grad()))
        return losses, model

    straight, straight_model = run(resume_at=-1)
    resumed, model = run(resume_at=STEPS // 2)
    assert resumed == straight
    for a, b in zip(weights(model), weights(straight_model)):
        assert torch.equal(a, b)


def test_bad_checkpoints_are_refused(tmp_path, workers: str) -> None:
    model, optimizer, scheduler = build()
    train(model, optimizer, scheduler, batches(), 0, 2)
    path = roundpipe.save(model, optimizer, str(tmp_path / "ckpt"), scheduler=scheduler)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary directory left behind

    with pytest.raises(CheckpointError, match="does not exist"):
        roundpipe.load(model, optimizer, str(tmp_path / "nowhere"))
    with pytest.raises(CheckpointError, match="saved with a scheduler"):
        roundpipe.load(model, optimizer, path)
    other = RoundPipe(nn.Sequential(nn.Linear(32, 4)), optim_dtype=torch.float32)
    other_opt = roundpipe.optim.Adam(other.optim_parameters(), lr=1e-2)
    with pytest.raises(CheckpointError, match="saved for another model"):
        roundpipe.load(other, other_opt, path)
    wider = RoundPipe(nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)], nn.Linear(32, 5)))
    wider_opt = roundpipe.optim.Adam(wider.optim_parameters(), lr=1e-2)
    with pytest.raises(CheckpointError, match=r"holds param:4.weight as \(4, 32\), this model as \(5, 32\)"):
        roundpipe.load(wider, wider_opt, path, scheduler=scheduler)
    with pytest.raises(TypeError, match="optimizer must be the optimizer built on model.optim_parameters"):
        roundpipe.save(model, object(), str(tmp_path / "x"))
    with pytest.raises(TypeError, match="model must be a RoundPipe"):
        roundpipe.save(nn.Linear(2, 2), optimizer, str(tmp_path / "x"))

    before = weights(model)
    with open(os.path.join(path, "optimizer.pt"), "r+b") as f:
        f.truncate(os.path.getsize(f.name) // 2)  # a disk that filled up, a copy that stopped half-way
    with pytest.raises(CheckpointError, match="corrupt: optimizer.pt does not match its sha256") as info:
        roundpipe.load(model, optimizer, path, scheduler=scheduler)
    assert info.value.fix == "save again, or load an earlier checkpoint"
    with open(os.path.join(path, "masters.safetensors"), "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\0\0\0\1")
    with pytest.raises(CheckpointError, match="corrupt: masters.safetensors does not match its sha256"):
        roundpipe.load(model, optimizer, path, scheduler=scheduler)
    assert all(torch.equal(a, b) for a, b in zip(weights(model), before))  # a refused load changes nothing


def test_hugging_face_preset_with_tied_embeddings_resumes_exactly(tmp_path, workers: str) -> None:
    """A wrapped Hugging Face causal LM (tied input and output embeddings, rotary buffers) saves and
    resumes as a plain layer list does."""
    from cli.local_model import make_local_model, word_tokenizer
    from transformers import AutoModelForCausalLM

    path = make_local_model(str(tmp_path / "model"), word_tokenizer(), tie=True, positions=64)
    ids = torch.randint(0, 20, (2, 16), generator=torch.Generator().manual_seed(0))

    def build_lm(seed: int):
        torch.manual_seed(seed)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model = roundpipe.wrap_model_to_roundpipe(hf, optim_dtype=torch.float32)
        return model, roundpipe.optim.Adam(model.optim_parameters(), lr=1e-3)

    def run(resume_at: int) -> List[float]:
        model, optimizer = build_lm(0)
        losses = []
        for i in range(4):
            if i == resume_at:
                roundpipe.save(model, optimizer, str(tmp_path / "ckpt"))
                model, optimizer = build_lm(1)
                roundpipe.load(model, optimizer, str(tmp_path / "ckpt"))
            losses.append(model.forward_backward(input_kwargs={"input_ids": ids, "labels": ids}).item())
            model.step(lambda opt=optimizer: (opt.step(), opt.zero_grad()))
        model.synchronize()
        return losses

    assert run(resume_at=2) == run(resume_at=-1)


KILLED_SAVE = textwrap.dedent(
    """
    import os, sys, time
    import roundpipe
    from roundpipe import checkpoint
    from test_save_load import batches, build, train

    path, marker = sys.argv[1:]
    model, optimizer, scheduler = build()
    data = batches()
    train(model, optimizer, scheduler, data, 0, 2)
    roundpipe.save(model, optimizer, path, scheduler=scheduler, step=2)
    train(model, optimizer, scheduler, data, 2, 4)
    real_save_torch = checkpoint.save_torch

    def save_torch_then_hang(obj, file):
        real_save_torch(obj, file)
        with open(file, "r+b") as f:
            f.truncate(os.path.getsize(file) // 2)  # the file half-written when the kill lands
        open(marker, "w").close()
        time.sleep(120)

    checkpoint.save_torch = save_torch_then_hang
    roundpipe.save(model, optimizer, path, scheduler=scheduler, step=4)
    """
)


@pytest.mark.timeout(240)
def test_sigkill_during_save_keeps_the_previous_checkpoint(tmp_path, workers: str) -> None:
    """A process killed (SIGKILL) while ``roundpipe.save`` re-saves its checkpoint directory: ``roundpipe.load``
    of the directory gives the previous save, and the run resumed from it repeats the uninterrupted one."""
    path, marker = str(tmp_path / "ckpt"), str(tmp_path / "writing")
    env = dict(os.environ, RPP_DEVICES=workers, RPP_PROGRESS="0", PYTHONPATH=ROOT + os.pathsep + TESTS)
    kill_when_written(["-c", KILLED_SAVE, path, marker], env, marker)
    assert os.path.isdir(path + ".tmp")  # the kill landed inside the second save's write

    data = batches()
    model, optimizer, scheduler = build()
    straight = train(model, optimizer, scheduler, data, 0, STEPS)
    final = weights(model)
    model, optimizer, scheduler = build(seed=123)
    assert roundpipe.load(model, optimizer, path, scheduler=scheduler) == {"step": 2}
    resumed = train(model, optimizer, scheduler, data, 2, STEPS)
    assert [l.item() for l in resumed] == [l.item() for l in straight[2:]]
    assert all(torch.equal(a, b) for a, b in zip(weights(model), final))
    roundpipe.save(model, optimizer, path, scheduler=scheduler, step=STEPS)  # the next save replaces the leftover
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "writing"]
