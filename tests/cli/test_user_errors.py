"""User mistakes, through the real command (``python -m roundpipe`` in a subprocess): status 2, one
line that names the problem and the fix, no traceback, and no file of an earlier run changed.

Every training case runs with ``--output-dir <earlier run> --overwrite``: the mistake must be found
before that run's files are deleted (after loading, a wrong input costs nothing but its message).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch

from roundpipe.cli.checkpoint import load_tensors, resolve_checkpoint
from roundpipe.cli.metrics import read_metrics

from .local_model import make_local_model, word_tokenizer
from .runner import one_line_error, roundpipe, snapshot

RUN = ["--steps", "2", "--batch-size", "4", "--eval-examples", "0", "--save-every", "1"]


@pytest.fixture(scope="module")
def earlier(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    """A finished run (the built-in task, 2 steps, a checkpoint per step) and its files' snapshot."""
    root = str(tmp_path_factory.mktemp("earlier"))
    out = os.path.join(root, "run")
    proc = roundpipe(["train", *RUN, "--output-dir", out], root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"root": root, "out": out, "files": snapshot(out)}


def write(path: str, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return path


def non_utf8_txt(d: str) -> Tuple[List[str], List[str]]:
    path = write(os.path.join(d, "latin1.txt"), b"hello\nwor\xffld\n")
    return ["--data", path, "--seq-len", "4"], [
        f"{path}:2 is not valid UTF-8 (byte 0xff at byte offset 9 of the file)",
        "save the file as UTF-8",
    ]


def non_utf8_jsonl(d: str) -> Tuple[List[str], List[str]]:
    first = b'{"text": "fine"}\n'
    path = write(os.path.join(d, "latin1.jsonl"), first + b'{"text": "caf\xe9"}\n')
    offset = len(first) + len(b'{"text": "caf')
    return ["--data", path, "--seq-len", "4"], [
        f"{path}:2 is not valid UTF-8 (byte 0xe9 at byte offset {offset} of the file)"
    ]


def non_string_fields(d: str) -> Tuple[List[str], List[str]]:
    path = write(
        os.path.join(d, "numbers.jsonl"), b'{"prompt": "ok", "response": "yes"}\n\n{"prompt": 0, "response": null}\n'
    )
    return ["--data", path, "--seq-len", "4"], [
        f"{path}:3: field 'prompt' is the int 0, not a string",
        "write 'prompt' as a JSON string",
    ]


def null_response(d: str) -> Tuple[List[str], List[str]]:
    path = write(os.path.join(d, "nulls.jsonl"), b'{"prompt": "hi", "response": null}\n')
    return ["--data", path, "--seq-len", "4"], [f"{path}:1: field 'response' is null, not a string"]


def chat_without_assistant(d: str) -> Tuple[List[str], List[str]]:
    rows = [{"messages": [{"role": "human", "content": "hi"}, {"role": "gpt", "content": "hello"}]}] * 2
    path = write(os.path.join(d, "sharegpt.jsonl"), "\n".join(json.dumps(r) for r in rows).encode())
    return ["--data", path, "--seq-len", "4"], [
        f"{path} holds no training examples: 2 of 2 rows have chat messages without an 'assistant' turn (roles "
        "found: gpt, human)",
        "rename the roles 'gpt', 'human' to user/assistant",
    ]


def model_without_tokenizer(d: str) -> Tuple[List[str], List[str]]:
    model = make_local_model(os.path.join(d, "no-tokenizer"), word_tokenizer())
    for name in os.listdir(model):
        if "token" in name or name.endswith(".jinja"):
            os.remove(os.path.join(model, name))
    data = write(os.path.join(d, "chat.jsonl"), b'{"prompt": "hi", "response": "hello"}\n')
    return ["--model", model, "--data", data], [
        f"the model directory {model} has no tokenizer files",
        "tokenizer.json",
        "tokenizer.save_pretrained",
    ]


def negative_lr(d: str) -> Tuple[List[str], List[str]]:
    return ["--lr", "-1e-3"], ["lr=-0.001 must be positive"]


def data_and_task(d: str) -> Tuple[List[str], List[str]]:
    path = write(os.path.join(d, "t.txt"), b"some text " * 20)
    return ["--data", path, "--task", "addition"], ["both data", "task (addition)", "drop --task"]


def cuda_without_gpu(d: str) -> Tuple[List[str], List[str]]:
    if torch.cuda.is_available():
        pytest.skip("a GPU is there")
    return ["--devices", "cuda"], [
        "--devices cuda asks for GPUs, but torch.cuda.is_available() is False",
        "--devices cpu:N",
    ]


def batch_larger_than_the_data(d: str) -> Tuple[List[str], List[str]]:
    """Hugging Face's Trainer never repeats a row within a batch: a batch of 64 from 3 rows is refused, not
    trained on the same rows 21 times over."""
    path = write(os.path.join(d, "three.jsonl"), b"".join(b'{"text": "row %d"}\n' % i for i in range(3)))
    return ["--data", path, "--no-pack", "--seq-len", "16", "--batch-size", "64"], [
        "batch_size=64 is more than the 3 row(s) of the data (three.jsonl: 3 examples -> 3 rows x 16 tokens",
        "every batch would hold each row 21.3 times on average",
        "lower --batch-size to at most 3",
    ]


CASES: Dict[str, Callable[[str], Tuple[List[str], List[str]]]] = {
    f.__name__: f
    for f in (
        non_utf8_txt,
        non_utf8_jsonl,
        non_string_fields,
        null_response,
        chat_without_assistant,
        model_without_tokenizer,
        negative_lr,
        data_and_task,
        cuda_without_gpu,
        batch_larger_than_the_data,
    )
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", list(CASES))
def test_mistake_is_one_line_and_the_earlier_run_stays(earlier: Dict[str, Any], tmp_path: Any, case: str) -> None:
    args, fragments = CASES[case](str(tmp_path))
    proc = roundpipe(["train", *args, "--output-dir", earlier["out"], "--overwrite"], str(tmp_path))
    line = one_line_error(proc, *fragments)
    if case == "cuda_without_gpu":
        assert "use --devices cuda" not in line  # it used to suggest the very flag that failed
    assert snapshot(earlier["out"]) == earlier["files"]


@pytest.mark.timeout(180)
def test_new_run_into_an_earlier_run_is_refused(earlier: Dict[str, Any]) -> None:
    proc = roundpipe(["train", *RUN, "--output-dir", earlier["out"]], earlier["root"])
    one_line_error(proc, f"output_dir {earlier['out']} already holds a run", "--resume", "--overwrite")
    assert snapshot(earlier["out"]) == earlier["files"]
    proc = roundpipe(["train", "--resume", "--overwrite", "--output-dir", earlier["out"]], earlier["root"])
    one_line_error(proc, "--overwrite and --resume are both given")
    assert snapshot(earlier["out"]) == earlier["files"]


@pytest.mark.timeout(240)
def test_overwrite_starts_clean_and_export_gives_the_new_weights(earlier: Dict[str, Any], tmp_path: Any) -> None:
    out = str(tmp_path / "run")
    shutil.copytree(earlier["out"], out)
    old_weights = load_tensors(os.path.join(resolve_checkpoint("latest", out), "model.safetensors"))
    with open(os.path.join(out, "notes.txt"), "w") as f:
        f.write("not the run's")
    proc = roundpipe(
        [
            "train",
            "--steps",
            "3",
            "--seed",
            "1",
            "--batch-size",
            "4",
            "--eval-examples",
            "0",
            "--output-dir",
            out,
            "--overwrite",
        ],
        str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--overwrite: deleted the earlier run's" in proc.stdout
    assert [int(r["step"]) for r in read_metrics(os.path.join(out, "metrics.csv"))] == [1, 2, 3]
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["latest", "step-0000003"]
    with open(os.path.join(out, "summary.json")) as f:
        assert json.load(f)["step"] == 3
    with open(os.path.join(out, "notes.txt")) as f:
        assert f.read() == "not the run's"  # only the run's own files go
    exported = str(tmp_path / "hf")
    proc = roundpipe(["export", out, exported], str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    new_weights = load_tensors(os.path.join(out, "checkpoints", "step-0000003", "model.safetensors"))
    got = load_tensors(os.path.join(exported, "model.safetensors"))
    assert all(torch.equal(got[k], new_weights[k]) for k in new_weights)
    assert any(not torch.equal(new_weights[k], old_weights[k]) for k in new_weights)


@pytest.mark.timeout(180)
def test_unwritable_output_dir_is_found_before_the_model_loads(tmp_path: Any) -> None:
    """The model directory's weights are garbage: had the model loaded first, that error would show."""
    model = make_local_model(str(tmp_path / "model"), word_tokenizer())
    write(os.path.join(model, "model.safetensors"), b"not safetensors")
    data = write(str(tmp_path / "d.txt"), b"hi hello " * 50)
    blocker = write(str(tmp_path / "a-file"), b"")
    targets = [os.path.join(blocker, "out")] + (["/sys/roundpipe-test-out"] if os.path.isdir("/sys/kernel") else [])
    for target in targets:
        proc = roundpipe(
            ["train", "--model", model, "--data", data, "--seq-len", "8", "--output-dir", target], str(tmp_path)
        )
        one_line_error(proc, f"cannot write to output_dir {target}", "pick a writable --output-dir")
    assert sorted(os.listdir(tmp_path)) == ["a-file", "d.txt", "model"]


@pytest.mark.timeout(60)
def test_export_of_a_missing_run_names_export(tmp_path: Any) -> None:
    missing = str(tmp_path / "no-such-run")
    line = one_line_error(
        roundpipe(["export", missing, str(tmp_path / "out")], str(tmp_path)),
        f"'{missing}' does not exist",
        "roundpipe export",
    )
    assert "--resume" not in line
    line = one_line_error(
        roundpipe(["export", str(tmp_path), str(tmp_path / "out")], str(tmp_path)),
        "no checkpoint found",
        "roundpipe export",
    )
    assert "--resume" not in line
