"""`roundpipe train` end to end on CPU workers: packing, chat masks, LoRA, exact resume, export."""

from __future__ import annotations

import csv
import json
import os
from typing import Any, Dict, List

import pytest
import torch

from roundpipe.cli import main
from roundpipe.cli.checkpoint import load_tensors, resolve_checkpoint
from roundpipe.cli.config import merge, parse_train_args
from roundpipe.cli.export import export
from roundpipe.cli.tasks import IGNORE_INDEX, byte_tokenizer
from roundpipe.cli.train import Recipe, run


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


# ---------------------------------------------------------------------------------------------------------
# A local Hugging Face model with a tokenizer built here (no download)
# ---------------------------------------------------------------------------------------------------------

WORDS = "what is the color of sky grass sun snow blue green yellow white it say hello hi please thanks".split()
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% if m['role'] == 'assistant' %}<eos> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def word_tokenizer():
    """A word-level tokenizer with a chat template, built in code."""
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>"]
    vocab = {w: i for i, w in enumerate(specials + WORDS)}
    tok = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>", additional_special_tokens=specials[3:])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_local_model(path: str, tokenizer: Any, tie: bool = True) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=128, tie_word_embeddings=tie, use_cache=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def chat_rows() -> List[Dict[str, Any]]:
    facts = [("sky", "blue"), ("grass", "green"), ("sun", "yellow"), ("snow", "white")]
    rows = [{"messages": [{"role": "user", "content": f"what is the color of the {x}"}, {"role": "assistant", "content": f"it is {c}"}]} for x, c in facts]
    rows.append({"messages": [{"role": "system", "content": "say hello"}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                              {"role": "user", "content": "thanks"}, {"role": "assistant", "content": "hello please"}]})
    return rows


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
    cfg = config(model=model_dir, data=str(data), seq_len=24, pack=False, batch_size=4, microbatches=2, steps=40, lr=3e-2, warmup_steps=0,
                 lora_r=8, lora_targets=["q_proj", "v_proj", "down_proj"], output_dir=str(tmp_path / "run"))
    recipe = Recipe(cfg, out=lambda msg: None)
    recipe.setup()
    # Loss masks: only the assistant turns (and their <eos>) are trained on.
    trained = [tok.decode([t for t, l in zip(ids, labels) if l != IGNORE_INDEX]) for ids, labels in zip(recipe.stream.input_ids.tolist(), recipe.stream.labels.tolist())]
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
    argv = ["train", "--data", str(data), "--seq-len", "32", "--batch-size", "4", "--steps", "25", "--lr", "3e-3",
            "--warmup-steps", "2", "--devices", "cpu:2", "--log-every", "5", "--output-dir", str(out)]
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


@pytest.mark.parametrize("async_step, devices, data", [(True, "cpu:1", "task"), (False, "cpu:2", "task"), (True, "cpu:2", "txt")])
def test_resume_is_bitwise_exact(tmp_path, async_step: bool, devices: str, data: str) -> None:
    """Stop at step k, resume, reach step 2k: same losses, masters, optimizer state and weights as an
    uninterrupted run that never checkpointed at k."""
    keys: Dict[str, Any] = dict(steps=12, async_step=async_step, devices=devices, batch_size=8, microbatches=2, grad_accum=2, warmup_steps=3)
    if data == "txt":
        corpus = tmp_path / "c.txt"
        corpus.write_text("".join(chr(97 + (i * 7) % 26) for i in range(3000)))
        keys.update(data=str(corpus), seq_len=16, lr=1e-3)
    full = run(config(output_dir=str(tmp_path / "full"), **keys), out=lambda m: None)
    first = run(config(output_dir=str(tmp_path / "split"), stop_at=6, **keys), out=lambda m: None)
    assert first.step == 6 and first.checkpoint.endswith("step-0000006")
    resumed_cfg, _, given = parse_train_args(["--resume", "--output-dir", str(tmp_path / "split")])
    second = run(resumed_cfg, given, out=lambda m: None)
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
    assert err == [f"roundpipe: error: checkpoint {path} is corrupt: optim/master.safetensors does not match its sha256 in manifest.json — delete it and resume from an earlier checkpoint"]


def test_model_errors_are_one_line(tmp_path, capsys) -> None:
    tok = byte_tokenizer()
    model_dir = make_local_model(str(tmp_path / "m"), tok)
    data = tmp_path / "d.txt"
    data.write_text("x" * 500)
    capsys.readouterr()
    cases = [
        (["--model", str(tmp_path / "nope")], "is neither a local directory nor a built-in architecture"),
        (["--model", model_dir, "--data", str(data), "--seq-len", "256"], "seq_len=256 exceeds the model's limit (max_position_embeddings=128) — lower --seq-len to at most 128"),
        (["--model", model_dir, "--data", str(data), "--lora-r", "4", "--lora-targets", "qkv_fused"], "LoRA:"),
        (["--data", str(data), "--seq-len", "1000"], "the data has 501 tokens, fewer than one sequence of seq_len=1000"),
        (["--devices", "tpu:3"], "RPP_DEVICES='tpu:3'"),
    ]
    for args, expect in cases:
        assert main(["train", "--output-dir", str(tmp_path / "o"), *args]) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("roundpipe: error: ") and expect in err[0], (args, err)


def test_nonfinite_loss_stops_or_skips(tmp_path, capsys) -> None:
    """A NaN loss stops the run with one line (before any step uses it), or with on_nonfinite=skip drops
    that step's gradients: the weights stay finite and training goes on."""
    from roundpipe.cli import train as train_mod

    original = train_mod.Recipe._train_step
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

    train_mod.Recipe._train_step = poison_once
    try:
        assert main(["train", "--output-dir", str(tmp_path / "stop"), "--steps", "4", "--batch-size", "4", "--eval-examples", "4", "--no-async-step"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "the loss is nan at step 3" in err[0], err
        poisoned["done"] = False
        res = run(config(output_dir=str(tmp_path / "skip"), steps=4, batch_size=4, on_nonfinite="skip", async_step=False), out=lambda m: None)
        assert res.step == 4
        assert all(torch.isfinite(p).all() for p in res.model.hf_model.parameters())
    finally:
        train_mod.Recipe._train_step = original
