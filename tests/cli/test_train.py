"""`roundpipe train` end to end on CPU workers: packing, chat masks, LoRA, exact resume, export."""

from __future__ import annotations

import csv
import json
import os
import time
from typing import Any, Dict, List, Tuple

import pytest
import torch

from roundpipe.cli import main
from roundpipe.cli.checkpoint import load_tensors, load_torch, resolve_checkpoint
from roundpipe.cli.config import merge
from roundpipe.cli.config_flags import parse_train_args
from roundpipe.cli.export import export
from roundpipe.cli.tasks import IGNORE_INDEX, byte_tokenizer
from roundpipe.cli.train import Recipe, run

from .local_model import chat_rows, make_local_model, word_tokenizer


@pytest.fixture(autouse=True)
def _restore_process_state(restore_process_state: None) -> None:
    """Every test here trains in this process (see conftest.restore_process_state)."""


def config(**keys: Any):
    keys.setdefault("devices", "cpu:1")
    keys.setdefault("log_every", 1000)
    keys.setdefault("eval_examples", 0)
    return merge({}, keys)


def losses(output_dir: str) -> Dict[int, str]:
    """step -> loss as written (repr of the float: equal strings = bitwise equal losses)."""
    with open(os.path.join(output_dir, "metrics.csv"), newline="") as f:
        return {int(r["step"]): r["loss"] for r in csv.DictReader(f)}


def compare_export(result: Any, out_dir: str, ids: torch.Tensor, atol: float) -> None:
    """The exported directory loads in transformers and computes the trained model's logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export(result.checkpoint, out_dir)
    hf = AutoModelForCausalLM.from_pretrained(out_dir, local_files_only=True).eval()
    AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    with torch.no_grad():
        want = result.model.logits(ids)
        got = hf(input_ids=ids).logits
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=atol, rtol=0), (got - want).abs().max()


# ---------------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------------


def test_chat_jsonl_lora_trains_on_responses_and_exports(tmp_path) -> None:
    tok = word_tokenizer()
    model_dir = make_local_model(str(tmp_path / "model"), tok)
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in chat_rows()) + "\n")
    cfg = config(
        model=model_dir,
        data=str(data),
        seq_len=24,
        pack=False,
        batch_size=4,
        microbatches=2,
        steps=40,
        lr=3e-2,
        warmup_steps=0,
        lora_r=8,
        lora_targets=["q_proj", "v_proj", "down_proj"],
        output_dir=str(tmp_path / "run"),
    )
    recipe = Recipe(cfg, out=lambda msg: None)
    recipe.setup()
    # Loss masks: only the assistant turns (and their <eos>) are trained on.
    trained = [
        tok.decode([t for t, l in zip(ids, labels) if l != IGNORE_INDEX])
        for ids, labels in zip(recipe.stream.input_ids.tolist(), recipe.stream.labels.tolist())
    ]
    assert trained[:4] == ["it is blue <eos>", "it is green <eos>", "it is yellow <eos>", "it is white <eos>"]
    assert trained[4] == "hello <eos> hello please <eos>"
    trainable = {n for n, p in recipe.model.hf_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    result = recipe.train()
    steps = losses(cfg.output_dir)
    assert len(steps) == 40 and float(steps[40]) < 0.8 * float(steps[1])  # plain PEFT gets 0.63x here
    # A LoRA checkpoint of a local model keeps only the adapter weights; export merges them.
    weights = load_tensors(os.path.join(result.checkpoint, "model.safetensors"))
    assert set(weights) == trainable
    prompt = tok.apply_chat_template(chat_rows()[0]["messages"][:1], tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
    compare_export(result, str(tmp_path / "export"), ids, atol=1e-5)


def test_txt_packed_full_finetune_through_cli(tmp_path, capsys) -> None:
    text = " ".join(["the quick brown fox jumps over the lazy dog"] * 40)
    data = tmp_path / "corpus.txt"
    data.write_text(text)
    out = tmp_path / "run"
    argv = [
        "train",
        "--data",
        str(data),
        "--seq-len",
        "32",
        "--batch-size",
        "4",
        "--steps",
        "25",
        "--lr",
        "3e-3",
        "--warmup-steps",
        "2",
        "--devices",
        "cpu:2",
        "--log-every",
        "5",
        "--output-dir",
        str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert f"corpus.txt: 1 examples -> {(len(text) + 1) // 32} rows x 32 tokens (packed" in printed
    assert "step 25/25 | loss" in printed and "held-out" not in printed
    steps = losses(str(out))
    assert sorted(steps) == list(range(1, 26)) and float(steps[25]) < 0.5 * float(steps[1])
    for name in ("loss.png", "summary.json", "config.yaml"):
        assert os.path.isfile(out / name), name
    summary = json.loads((out / "summary.json").read_text())
    assert summary["step"] == 25 and summary["tokens_per_s"] > 0 and summary["host_peak_rss_gib"] > 0


@pytest.mark.parametrize(
    "async_step, devices, data", [(True, "cpu:1", "task"), (False, "cpu:2", "task"), (True, "cpu:2", "txt")]
)
def test_resume_is_bitwise_exact(tmp_path, async_step: bool, devices: str, data: str) -> None:
    """Stop at step k, resume, reach step 2k: same losses, masters, optimizer state and weights as an
    uninterrupted run that never checkpointed at k."""
    keys: Dict[str, Any] = dict(
        steps=12, async_step=async_step, devices=devices, batch_size=8, microbatches=2, grad_accum=2, warmup_steps=3
    )
    if data == "txt":
        corpus = tmp_path / "c.txt"
        corpus.write_text("".join(chr(97 + (i * 7) % 26) for i in range(3000)))
        keys.update(data=str(corpus), seq_len=16, lr=1e-3)
    full = run(config(output_dir=str(tmp_path / "full"), **keys), out=lambda m: None)
    first = run(config(output_dir=str(tmp_path / "split"), stop_at=6, **keys), out=lambda m: None)
    assert first.step == 6 and first.checkpoint.endswith("step-0000006")
    args = parse_train_args(["--resume", "--output-dir", str(tmp_path / "split")])
    second = run(args.cfg, args.given, out=lambda m: None)
    assert second.step == 12
    a, b = losses(str(tmp_path / "full")), losses(str(tmp_path / "split"))
    assert sorted(b) == list(range(1, 13)) and a == b  # rows 7..12 written by the resumed run
    for rel in ("optim/master.safetensors", "optim/device.safetensors", "model.safetensors"):
        x, y = load_tensors(os.path.join(full.checkpoint, rel)), load_tensors(os.path.join(second.checkpoint, rel))
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), rel
    sx = torch.load(os.path.join(full.checkpoint, "optim/state.pt"), weights_only=True)["state"]
    sy = torch.load(os.path.join(second.checkpoint, "optim/state.pt"), weights_only=True)["state"]
    assert all(torch.equal(sx[i][k], sy[i][k]) for i in sx for k in sx[i])
    for name, p in full.model.hf_model.named_parameters():
        assert torch.equal(p, dict(second.model.hf_model.named_parameters())[name]), name
    if data == "task":
        ids = torch.tensor([list(b"abcdef>")] * 2)
        compare_export(second, str(tmp_path / "export"), ids, atol=1e-5)


def test_resume_from_corrupt_checkpoint_is_one_line(tmp_path, capsys) -> None:
    out = str(tmp_path / "run")
    run(config(output_dir=out, steps=2, batch_size=4), out=lambda m: None)
    path = resolve_checkpoint("latest", out)
    with open(os.path.join(path, "optim", "master.safetensors"), "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\0\0\1")
    assert main(["train", "--resume", "--steps", "4", "--output-dir", out]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"roundpipe: error: checkpoint {path} is corrupt: optim/master.safetensors does not match its sha256 "
        "in manifest.json, and no intact checkpoint is left before it — start the run again without --resume "
        "(with --overwrite)"
    ]


def test_model_errors_are_one_line(tmp_path, capsys) -> None:
    tok = byte_tokenizer()
    model_dir = make_local_model(str(tmp_path / "m"), tok)
    data = tmp_path / "d.txt"
    data.write_text("x" * 500)
    capsys.readouterr()
    cases = [
        (["--model", str(tmp_path / "nope")], "is neither a local directory nor a built-in architecture"),
        (
            ["--model", model_dir, "--data", str(data), "--seq-len", "256"],
            "seq_len=256 exceeds the model's limit (max_position_embeddings=128) — add --rope-scaling yarn:2, or lower "
            "--seq-len to at most 128",
        ),
        (
            ["--model", model_dir, "--data", str(data), "--batch-size", "2", "--lora-r", "4", "--lora-targets", "x"],
            "LoRA:",
        ),
        (
            ["--data", str(data), "--seq-len", "1000"],
            "the data has 501 tokens, fewer than one sequence of seq_len=1000",
        ),
        (["--devices", "tpu:3"], "--devices tpu:3 is not a device list ("),
        (["--devices", "tpu:3"], ") — use --devices cuda, cuda:0,1 or cpu:N"),
    ]
    for args, expect in cases:
        assert main(["train", "--output-dir", str(tmp_path / "o"), *args]) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("roundpipe: error: ") and expect in err[0], (args, err)


def checkpoint_tensors(output_dir: str, step: int, rel: str = "optim/master.safetensors") -> Dict[str, torch.Tensor]:
    return load_tensors(os.path.join(output_dir, "checkpoints", f"step-{step:07d}", rel))


def adam_steps(output_dir: str, step: int) -> List[float]:
    """The Adam step counts of a checkpoint's optimizer state."""
    state = torch.load(
        os.path.join(output_dir, "checkpoints", f"step-{step:07d}", "optim", "state.pt"), weights_only=True
    )["state"]
    return sorted({float(s["step"]) for s in state.values()})


def assert_step_skipped(output_dir: str, skipped: int) -> None:
    """Step ``skipped`` changed nothing (sync steps, a checkpoint per step): same masters and Adam step
    count as the step before, while the next step moves on again."""
    before, at, after = (checkpoint_tensors(output_dir, s) for s in (skipped - 1, skipped, skipped + 1))
    assert all(torch.equal(before[k], at[k]) for k in before)
    assert adam_steps(output_dir, skipped) == adam_steps(output_dir, skipped - 1) == [float(skipped - 1)]
    assert any(not torch.equal(at[k], after[k]) for k in at) and adam_steps(output_dir, skipped + 1) == [float(skipped)]
    assert all(torch.isfinite(t).all() for t in after.values())


def run_skipping_nonfinite(output_dir: str) -> Tuple[Any, List[str]]:
    """Four synchronous steps with ``on_nonfinite="skip"`` and a checkpoint after each: the run's result and
    the lines it logged."""
    logs: List[str] = []
    cfg = config(
        output_dir=output_dir,
        steps=4,
        batch_size=4,
        on_nonfinite="skip",
        async_step=False,
        save_every=1,
        keep_checkpoints=10,
    )
    return run(cfg, out=logs.append), logs


def test_nonfinite_loss_stops_or_skips(tmp_path, capsys, monkeypatch) -> None:
    """A NaN loss stops the run with one line (before any step uses it), or with on_nonfinite=skip drops
    that step's gradients: no update, and training goes on."""
    original = Recipe._train_step
    poisoned = {"done": False}

    def poison_once(self):
        # Make one batch's loss NaN by poisoning the model's output head for a single step.
        if self.step == 2 and not poisoned["done"]:
            poisoned["done"] = True
            head = self.model.hf_model.get_output_embeddings().weight
            saved = head.data.clone()
            head.data.fill_(float("nan"))
            try:
                return original(self)
            finally:
                head.data.copy_(saved)
        return original(self)

    monkeypatch.setattr(Recipe, "_train_step", poison_once)
    assert (
        main(
            [
                "train",
                "--output-dir",
                str(tmp_path / "stop"),
                "--steps",
                "4",
                "--batch-size",
                "4",
                "--eval-examples",
                "4",
                "--no-async-step",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the loss is nan at step 3" in err[0], err
    poisoned["done"] = False
    res, logs = run_skipping_nonfinite(str(tmp_path / "skip"))
    assert res.step == 4 and "roundpipe: step 3: loss is nan; its gradients were dropped (on_nonfinite=skip)" in logs
    assert_step_skipped(str(tmp_path / "skip"), 3)


def poison_gradient(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """Make the host gradients of optimizer step ``step`` NaN (the loss stays finite), as an overflow in
    backward would."""
    from roundpipe.cli.optimizer import HostOptimizer

    original = HostOptimizer.step_fn

    def step_fn(self: HostOptimizer, s: int) -> None:
        if s == step:
            next(p for p in self.clip_params if p.grad is not None).grad.view(-1)[0] = float("nan")
        original(self, s)

    monkeypatch.setattr(HostOptimizer, "step_fn", step_fn)


def test_nonfinite_gradient_norm_stops_or_skips(tmp_path, capsys, monkeypatch) -> None:
    """A NaN gradient norm under a finite loss: the step is never applied, and the run stops at it with
    one line (async steps: found two steps later, still naming it), or skips it and goes on."""
    poison_gradient(monkeypatch, 3)
    out = str(tmp_path / "stop")
    assert (
        main(
            [
                "train",
                "--output-dir",
                out,
                "--steps",
                "8",
                "--batch-size",
                "4",
                "--eval-examples",
                "0",
                "--save-every",
                "2",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "roundpipe: error: the gradient norm is nan at step 3 (the loss was finite) — lower --lr, check the "
        "data, or pass --on-nonfinite "
        "skip; the step was not applied and earlier checkpoints are intact"
    ]
    assert resolve_checkpoint("latest", out).endswith("step-0000002")  # step 4's checkpoint was not written
    rows = {int(r["step"]): r for r in csv.DictReader(open(os.path.join(out, "metrics.csv")))}
    assert max(rows) <= 4 and all(float(r["loss"]) == float(r["loss"]) for r in rows.values())
    skip = str(tmp_path / "skip")
    res, logs = run_skipping_nonfinite(skip)
    assert (
        res.step == 4
        and "roundpipe: step 3: gradient norm is nan; its gradients were dropped (on_nonfinite=skip)" in logs
    )
    assert_step_skipped(skip, 3)
    assert (
        losses(skip)[3] != "nan"
        and {int(r["step"]): r["grad_norm"] for r in csv.DictReader(open(os.path.join(skip, "metrics.csv")))}[3]
        == "nan"
    )


def test_warmup_longer_than_the_run_is_capped(tmp_path) -> None:
    """warmup_steps >= steps would never reach the peak learning rate: it is capped, and the log says so."""
    logs: List[str] = []
    run(config(output_dir=str(tmp_path / "run"), steps=4, warmup_steps=10, batch_size=4, lr=1e-3), out=logs.append)
    assert (
        "note: warmup_steps=10 is not shorter than the run (4 steps): capped at 3, so the learning rate "
        "reaches its peak at the last step" in logs
    )
    with open(os.path.join(tmp_path, "run", "metrics.csv"), newline="") as f:
        lrs = [float(r["lr"]) for r in csv.DictReader(f)]
    assert lrs == sorted(lrs) and lrs[-1] == 1e-3 and lrs[0] < 1e-3


def test_gradient_accumulation_weights_batches_by_token_count(tmp_path) -> None:
    """Accumulated batches with different numbers of trained tokens: every step equals a plain Hugging
    Face model + torch Adam on the token-weighted loss (sum of the token losses of all the step's
    batches over their token count), not the mean of the batches' means: same losses, gradient norms
    and weights."""
    from transformers import AutoModelForCausalLM

    from roundpipe.cli.data import file_stream

    tok = word_tokenizer()
    model_dir = make_local_model(str(tmp_path / "model"), tok)
    answers = [
        "blue",
        "it is green",
        "hello",
        "it is white please thanks",
        "hi",
        "it is the color of the sky",
        "yellow",
        "snow is white",
    ]
    data = tmp_path / "qa.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": "what is the color", "response": a}) for a in answers) + "\n")
    lr, steps = 1e-3, 3
    keys = dict(
        model=model_dir,
        data=str(data),
        seq_len=16,
        pack=False,
        batch_size=2,
        grad_accum=2,
        steps=steps,
        lr=lr,
        warmup_steps=0,
        min_lr_ratio=1.0,
        max_grad_norm=0.0,
        async_step=False,
        output_dir=str(tmp_path / "run"),
    )
    result = run(config(**keys), out=lambda m: None)

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    opt = torch.optim.Adam(ref.parameters(), lr=lr)  # the run's AdamW without weight decay, constant LR
    stream = file_stream(str(data), tok, 16, False, 2, 0)  # the batches the run drew (same seed)
    want, want_norms, equal_weighted = [], [], []
    for _ in range(steps):
        batches = [stream.next_batch() for _ in range(2)]
        sums, counts = [], []
        for ids, labels in batches:
            logits = ref(input_ids=ids).logits[:, :-1].float()
            target = labels[:, 1:]
            sums.append(
                torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
                )
            )
            counts.append(int((target != IGNORE_INDEX).sum()))
        loss = sum(sums) / sum(counts)
        want.append(loss.item())
        equal_weighted.append(sum(s.item() / c for s, c in zip(sums, counts)) / len(counts))
        loss.backward()
        want_norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])))
        opt.step()
        opt.zero_grad()
    got = [float(v) for _, v in sorted(losses(keys["output_dir"]).items())]
    assert len(got) == steps and all(abs(g - w) <= 1e-5 * w for g, w in zip(got, want)), (got, want)
    # The test can fail: the batches' token counts differ enough that the unweighted mean is far off.
    assert all(abs(e - w) > 1e-3 * w for e, w in zip(equal_weighted, want)), (equal_weighted, want)
    with open(os.path.join(keys["output_dir"], "metrics.csv"), newline="") as f:
        got_norms = [float(r["grad_norm"]) for r in csv.DictReader(f)]
    assert all(abs(g - w) <= 1e-5 * w for g, w in zip(got_norms, want_norms)), (got_norms, want_norms)
    # Weights after 3 Adam steps, by how far they moved: Adam divides each gradient by its own running
    # magnitude, so an element whose gradient is ~0 moves by up to lr on float32 rounding alone (here one
    # element of one matrix does); the update as a whole agrees to 1e-3.
    masters = load_tensors(os.path.join(result.checkpoint, "optim", "master.safetensors"))
    params = dict(ref.named_parameters())
    init = dict(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).named_parameters()
    )
    assert set(masters) == set(params)
    for name, m in masters.items():
        moved_rp, moved_ref = (m - init[name]).double(), (params[name] - init[name]).detach().double()
        assert (moved_rp - moved_ref).norm() <= 1e-3 * moved_ref.norm(), name


def test_float16_resume_restores_the_grad_scaler(tmp_path) -> None:
    """float16 trains with a GradScaler; its state (scale, growth tracker) goes into the checkpoint and
    comes back on resume, so stop at 3 + resume to 6 equals an uninterrupted float16 run, scaler included."""
    keys: Dict[str, Any] = dict(dtype="float16", steps=6, batch_size=8, microbatches=2, warmup_steps=2)
    full = run(config(output_dir=str(tmp_path / "full"), **keys), out=lambda m: None)
    first = run(config(output_dir=str(tmp_path / "split"), stop_at=3, **keys), out=lambda m: None)
    assert load_torch(os.path.join(first.checkpoint, "trainer.pt"))["scaler"]["_growth_tracker"] == 3  # type: ignore[index]
    args = parse_train_args(["--resume", "--output-dir", str(tmp_path / "split")])
    second = run(args.cfg, args.given, out=lambda m: None)
    want = load_torch(os.path.join(full.checkpoint, "trainer.pt"))["scaler"]  # type: ignore[index]
    got = load_torch(os.path.join(second.checkpoint, "trainer.pt"))["scaler"]  # type: ignore[index]
    assert got == want and want["_growth_tracker"] == 6 and want["scale"] == 2.0**16, (
        got,
        want,
    )  # a fresh scaler would count 3
    assert losses(str(tmp_path / "full")) == losses(str(tmp_path / "split"))
    for rel in ("optim/master.safetensors", "optim/device.safetensors"):
        x, y = load_tensors(os.path.join(full.checkpoint, rel)), load_tensors(os.path.join(second.checkpoint, rel))
        assert all(torch.equal(x[k], y[k]) for k in x), rel
    assert (
        next(iter(load_tensors(os.path.join(full.checkpoint, "optim/device.safetensors")).values())).dtype
        == torch.float16
    )


def test_checkpoint_waits_for_a_slow_optimizer_step(tmp_path, monkeypatch) -> None:
    """Async steps overlap: step k is launched while step k-1 still runs on the optimizer thread. A
    checkpoint of step k must hold step k's update (optimizer state, masters), however slow the
    optimizer is: here each step takes 0.3 s, far longer than the tiny model's forward and backward."""
    from roundpipe.cli.optimizer import HostOptimizer

    original = HostOptimizer.step_fn

    def slow_step_fn(self: HostOptimizer, step: int) -> None:
        time.sleep(0.3)
        original(self, step)

    monkeypatch.setattr(HostOptimizer, "step_fn", slow_step_fn)
    out = str(tmp_path / "run")
    run(config(output_dir=out, steps=4, batch_size=4, save_every=2, keep_checkpoints=10), out=lambda m: None)
    assert adam_steps(out, 2) == [2.0] and adam_steps(out, 4) == [4.0]
    with open(os.path.join(out, "metrics.csv"), newline="") as f:
        assert all(r["grad_norm"] not in ("", "nan") for r in csv.DictReader(f))


@pytest.mark.parametrize("state, master", [("int8", "bfloat16"), ("bfloat16", "float32")])
def test_compact_optimizer_state_trains_and_resumes_exactly(tmp_path, state: str, master: str) -> None:
    """--optim-state / --master: the compact state trains the built-in task (the loss falls like fp32
    Adam's) and a stop + resume continues bit for bit (moments, masters and stochastic rounding)."""
    keys: Dict[str, Any] = dict(
        dtype="bfloat16", steps=10, batch_size=8, microbatches=2, warmup_steps=2, optim_state=state, master=master
    )
    full = run(config(output_dir=str(tmp_path / "full"), **keys), out=lambda m: None)
    run(
        config(
            output_dir=str(tmp_path / "ref"), dtype="bfloat16", steps=10, batch_size=8, microbatches=2, warmup_steps=2
        ),
        out=lambda m: None,
    )
    first = run(config(output_dir=str(tmp_path / "split"), stop_at=5, **keys), out=lambda m: None)
    args = parse_train_args(["--resume", "--output-dir", str(tmp_path / "split")])
    second = run(args.cfg, args.given, out=lambda m: None)
    assert first.step == 5 and second.step == 10
    assert losses(str(tmp_path / "full")) == losses(str(tmp_path / "split"))
    sx = torch.load(os.path.join(full.checkpoint, "optim/state.pt"), weights_only=True)
    sy = torch.load(os.path.join(second.checkpoint, "optim/state.pt"), weights_only=True)
    assert sx["compact"]["state_dtype"] == state and sx["compact"]["master"] == master
    assert all(torch.equal(sx["state"][i][k], sy["state"][i][k]) for i in sx["state"] for k in sx["state"][i])
    masters = load_tensors(os.path.join(full.checkpoint, "optim/master.safetensors"))
    assert all(m.dtype == (torch.bfloat16 if master == "bfloat16" else torch.float32) for m in masters.values())
    mine, fp32 = losses(str(tmp_path / "full")), losses(str(tmp_path / "ref"))
    assert float(mine[10]) < float(mine[1]) and abs(float(mine[10]) - float(fp32[10])) / float(fp32[10]) < 0.05, (
        mine,
        fp32,
    )


def test_bfloat16_master_needs_bfloat16_weights(tmp_path) -> None:
    from roundpipe.cli.config import ConfigError, validate

    with pytest.raises(ConfigError, match="add --dtype bfloat16"):
        validate(config(output_dir=str(tmp_path / "x"), dtype="float32", master="bfloat16"))
    with pytest.raises(ConfigError, match="use one of float32, bfloat16, int8"):
        validate(config(output_dir=str(tmp_path / "x"), optim_state="fp8"))


def test_fused_staging_trains_the_default_task_bit_for_bit(tmp_path) -> None:
    """Fused staging under `roundpipe train`, on by default (its step function is declared with
    step_fn_zeroes_grads; bf16 weights, fp32 masters, clipping and a schedule in it, zero_grad() after the step):
    the same losses as the staging pass (RPP_DEBUG_FUSED_STAGING=0), to the last bit."""
    from helpers import require_adam_kernel

    from .runner import roundpipe as run_cli

    require_adam_kernel()
    losses = []
    for fused in ("0", "auto"):
        out = tmp_path / f"fused{fused}"
        args = ["train", "--steps", "12", "--dtype", "bf16", "--output-dir", str(out), "--eval-examples", "0"]
        proc = run_cli(args + ["--no-tensorboard"], cwd=str(tmp_path), env={"RPP_DEBUG_FUSED_STAGING": fused})
        assert proc.returncode == 0, proc.stderr[-3000:]
        with open(out / "metrics.csv") as f:
            losses.append([row["loss"] for row in csv.DictReader(f)])
    assert len(losses[0]) == 12 and losses[0] == losses[1]
