"""``roundpipe plan`` as a new user meets it: it refuses what ``roundpipe train`` refuses (a sequence
beyond the model's ``max_position_embeddings``, more microbatches than sequences), estimates the compact
optimizer state with train's flags, shows one host figure, exits alike in text and ``--json``, and
answers a config it cannot read (GPT-2's, broken JSON) with one line. ``--fp8`` (train's flag): the estimate's
bytes of a layer on the GPU, its upload and its fp8 weight copies against the runtime's own (the formats'
device copies, the projections ``roundpipe.models.fp8`` converts in tiny bf16 models), what it prints, and the
runs it refuses in train's words."""

from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, List, Tuple

import pytest

from roundpipe.cli import plan
from roundpipe.planning import estimate, memory_terms
from roundpipe.utils import GiB

from .runner import roundpipe

BUDGET = ["--gpu-memory", "80GiB", "--host-memory", "128GiB"]


def config_dir(root: Any, name: str, **config: Any) -> str:
    path = os.path.join(str(root), name)
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def qwen3_dir(root: Any, max_positions: int = 2048) -> str:
    """A small Qwen3-layout config.json (no weights: plan reads the config alone)."""
    shape = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4)
    shape.update(num_key_value_heads=2)
    return config_dir(
        root, "qwen3", model_type="qwen3", head_dim=64, vocab_size=1000, max_position_embeddings=max_positions, **shape
    )


def one_line(capsys: pytest.CaptureFixture, argv: List[str], *fragments: str) -> str:
    """``plan`` answers ``argv`` with status 2 and one ``roundpipe: error: what — fix`` line holding the fragments."""
    assert plan.main(argv) == 2
    out = capsys.readouterr()
    lines = [l for l in out.err.splitlines() if l.strip()]
    assert out.out == "" and len(lines) == 1, out.err
    assert lines[0].startswith("roundpipe: error: ") and " — " in lines[0], out.err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def test_refuses_what_train_refuses(tmp_path, capsys) -> None:
    model = qwen3_dir(tmp_path)
    assert plan.main(["--model", model, "--seq-len", "2048", *BUDGET]) == 0
    capsys.readouterr()
    # The words of roundpipe train's refusal (tests/cli/test_config.py).
    one_line(
        capsys, ["--model", model, "--seq-len", "4096", *BUDGET],
        "seq_len=4096 exceeds the model's limit (max_position_embeddings=2048) — add --rope-scaling yarn:2, or lower "
        "--seq-len to at most 2048",
    )  # fmt: skip
    more = ["--batch-size", "2", "--microbatches", "4"]
    one_line(capsys, ["--model", model, "--seq-len", "64", *more], "batch_size=2 is smaller than microbatches=4")
    one_line(capsys, ["--model", model, "--seq-len", "64", "--lora-r", "-1"], "--lora-r=-1 is negative")
    one_line(capsys, ["--model", model, "--seq-len", "0"], "--seq-len=0 must be positive")
    one_line(capsys, ["--model", model, "--seq-len", "8", "--optim-state", "int4"], "optim_state='int4' is not")
    one_line(capsys, ["--model", model, "--seq-len", "64", "--bogus"], "unrecognized arguments: --bogus", "plan --help")
    # A built-in architecture has no limit: train extends its rotary tables for the built-in task.
    assert plan.main(["--model", "qwen3-8b", "--seq-len", "131072", "--lora-r", "16", *BUDGET, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"] is True
    one_line(capsys, ["--model", "qwen3-8B", "--seq-len", "64"], "(did you mean 'qwen3-8b'?)", "qwen3-32b")


def test_compact_optimizer_state_as_train_takes_it(capsys) -> None:
    """``--optim-state`` / ``--master`` / ``--master-rounding`` change the host optimizer bytes by the
    table of docs/optimizer.md; ``bf16`` is accepted as in train."""
    n = estimate.ModelShape.builtin("qwen3-8b").params()

    def host_optimizer(*flags: str) -> float:
        plan.main(["--model", "qwen3-8b", "--seq-len", "4096", *BUDGET, "--json", *flags])
        return json.loads(capsys.readouterr().out)["host_parts"]["optimizer"]

    default = host_optimizer()
    for flags, per_param in (
        ((), 12.0),
        (("--optim-state", "bfloat16"), 8.0),
        (("--optim-state", "int8"), 6.0 + 1 / 32),
        (("--master", "bfloat16"), 10.0),
        (("--optim-state", "int8", "--master", "bf16"), 4.0 + 1 / 32),
        (("--optim-state", "int8", "--master", "bfloat16", "--master-rounding", "kahan"), 6.0 + 1 / 32),
    ):
        got = host_optimizer(*flags)
        assert got - default == pytest.approx((per_param - 12.0) * n, rel=1e-9), flags
    assert memory_terms.optimizer_state_bytes() == 12.0
    assert memory_terms.optimizer_state_bytes("int8", "bfloat16") == 4.0 + 1 / 32


def test_fp8_stage_inputs_as_train_takes_them(capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--stage-inputs fp8`` counts the host checkpoints at 1 byte and a float32 scale per 128 values (all
    36 on the host here: none kept on the GPU); a value train refuses is refused here too."""
    monkeypatch.setenv("RPP_DEBUG_DEVICE_SAVED_GB", "0")

    def checkpoints(*flags: str) -> float:
        plan.main(["--model", "qwen3-8b", "--seq-len", "262144", "--lora-r", "16", *BUDGET, "--json", *flags])
        return json.loads(capsys.readouterr().out)["host_parts"]["checkpoints"]

    side = 262144 * memory_terms.side_bytes_per_token(estimate.ModelShape.builtin("qwen3-8b"))
    assert checkpoints("--stage-inputs", "bf16") - side == 36 * 262144 * 8192
    assert checkpoints("--stage-inputs", "fp8") - side == 36 * 262144 * (4096 + 128)
    assert checkpoints("--stage-inputs", "int8") - side == 36 * 262144 * (4096 + 512)
    one_line(capsys, ["--model", "qwen3-8b", "--seq-len", "64", "--stage-inputs", "int4"], "invalid choice: 'int4'")


def test_one_host_figure_and_the_same_exit_status_in_text_and_json(capsys) -> None:
    """A host size that is not a whole number of GiB reads the same on every line; a step that does not
    fit exits 1 in text and in JSON, one that fits 0 in both."""
    budget = ["--gpu-memory", "24GiB", "--host-memory", "23.5GiB"]
    for seq, want in (("4096", 0), ("1048576", 1)):
        args = ["--model", "qwen3-0.6b", "--seq-len", seq, "--lora-r", "16", *budget]
        assert plan.main(args) == want
        text = capsys.readouterr().out
        assert set(re.findall(r"([\d.]+) GiB of host memory", text)) == {"23.5"}, text
        assert set(re.findall(r"([\d.]+) GiB per GPU", text)) == {"24.0"}, text
        assert plan.main(args + ["--json"]) == want
        got: Dict[str, Any] = json.loads(capsys.readouterr().out)
        assert got["fits"] is (want == 0) and got["host_memory"] == 23.5 * GiB


@pytest.mark.timeout(120)
def test_a_config_it_cannot_read_is_one_line(tmp_path) -> None:
    """Through the real command: GPT-2's config (other key names), broken JSON, a JSON list."""
    gpt2 = config_dir(tmp_path, "gpt2", model_type="gpt2", n_embd=768, n_layer=12, n_head=12, vocab_size=9)
    broken = os.path.join(str(tmp_path), "broken")
    os.makedirs(broken)
    with open(os.path.join(broken, "config.json"), "w") as f:
        f.write('{"hidden_size": 4,')
    listed = config_dir(tmp_path, "listed")
    with open(os.path.join(listed, "config.json"), "w") as f:
        f.write("[1, 2]")
    cases = [
        (gpt2, "(model_type 'gpt2') has no integer hidden_size, intermediate_size, num_hidden_layers"),
        (broken, "cannot read " + os.path.join(broken, "config.json") + " (JSONDecodeError: "),
        (listed, "config.json is not a JSON object"),
    ]
    for model, fragment in cases:
        for extra in ([], ["--json"]):
            proc = roundpipe(["plan", "--model", model, "--seq-len", "128", *extra], str(tmp_path))
            lines = [l for l in proc.stderr.splitlines() if l.strip()]
            assert proc.returncode == 2 and proc.stdout == "" and len(lines) == 1, proc.stderr
            assert lines[0].startswith("roundpipe: error: ") and fragment in lines[0], lines[0]


# ---- --fp8: the estimate against the runtime's own bytes, what it prints, what it refuses ----------------------


def _device_bytes(layer: Any) -> Tuple[int, int, Dict[str, int]]:
    """(bytes of ``layer``'s weights as the upload leaves them on a device, the largest fp8 weight's bytes, the host
    bytes of each parameter): a frozen weight's device copy is its format's ``device_weight`` of its packed tensors
    (``fp8.Fp8Weight``, those bytes, under FP8 GEMMs); PEFT's adapters are left out of the first."""
    import torch

    from roundpipe.host.formats import FrozenWeight
    from roundpipe.models import fp8

    total, largest, host = 0, 0, {}
    for name, p in layer.named_parameters():
        host[name] = p.host_nbytes() if isinstance(p, FrozenWeight) else p.numel() * p.element_size()
        if "lora_" in name:
            continue
        dev: torch.Tensor = p.format.device_weight(p.packed, p.shape, p.dtype) if isinstance(p, FrozenWeight) else p
        if isinstance(dev, fp8.Fp8Weight):
            total += dev.data_fp8.nbytes + dev.scale.nbytes
            largest = max(largest, dev.data_fp8.nbytes)
        else:
            total += dev.numel() * dev.element_size()
    return total, largest, host


def _tiny_bf16(head_dim: int, lora: bool) -> Tuple[Any, Any]:
    """A tiny bf16 Qwen3 of ``head_dim`` (4: k and v of 8 features, which FP8 GEMMs do not take), with PEFT LoRA
    r=8 on all seven projections; and its config."""
    import torch

    from roundpipe.models.configs import tiny_config

    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config = tiny_config("qwen3", head_dim=head_dim)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    return (peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=PROJECTIONS)) if lora else model), config


PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("head_dim", [8, 4], ids=["all seven", "k and v of 8 features"])
def test_fp8_over_an_fp8_base_counts_the_runtimes_bytes(head_dim: int) -> None:
    """LoRA over a frozen fp8 base: with ``fp8`` the estimate's decoder layer on the GPU is what the upload leaves
    there once ``fp8.enable_fp8_base`` converted it (the fp8 bytes and scales of the projections it converts, the
    others dequantized), the same upload, the fp8 casts the largest converted weight's bytes (the column-major
    copy of the input-gradient GEMM), and the unpacking of what stays packed."""
    from roundpipe.host.formats import FrozenWeight, dequantize_transient_bytes, quantize_frozen
    from roundpipe.models import fp8

    model, config = _tiny_bf16(head_dim, lora=True)
    quantize_frozen(model, "fp8")
    layer = model.base_model.model.model.layers[0]
    shape = estimate.ModelShape.from_config(config)
    kw: Dict[str, Any] = dict(seq_len=16, lora_rank=8, base_format="fp8", tile=0)
    plain, fast = estimate.estimate(shape, **kw), estimate.estimate(shape, fp8=True, **kw)
    before, _, host = _device_bytes(layer)
    assert plain.device_bytes_per_layer == before and plain.fp8 is None  # dequantized: the logical bytes
    assert fp8.enable_fp8_base(model) > 0
    after, largest, _ = _device_bytes(layer)
    assert fast.device_bytes_per_layer == after < before
    assert fast.upload_bytes_per_layer == plain.upload_bytes_per_layer == sum(host.values())
    assert fast.fp8 is not None and fast.gpu_parts["fp8 casts"] == fast.fp8.cast_bytes == largest
    frozen = {n: p for n, p in layer.named_parameters() if isinstance(p, FrozenWeight)}
    converted = {n.split(".")[1] for n, p in frozen.items() if p.format is fp8.FP8_COMPUTE}  # self_attn.q_proj...
    assert (
        set(fast.fp8.fp8_projections) == converted and set(fast.fp8.other_projections) == set(PROJECTIONS) - converted
    )
    packed = [dequantize_transient_bytes(p) for p in frozen.values() if p.format is not fp8.FP8_COMPUTE]
    assert fast.gpu_parts.get("unpacking", 0) == max(packed, default=0) == fast.fp8.unpacking_bytes
    assert (fast.dequantize_ms_per_layer > 0) == bool(packed) and plain.dequantize_ms_per_layer > 0
    assert fast.peak_host_bytes == plain.peak_host_bytes and fast.peak_gpu_bytes < plain.peak_gpu_bytes


def test_fp8_of_a_full_fine_tune_counts_the_runtimes_bytes() -> None:
    """Trained weights: the projections torchao's recipe converts (``fp8.prepare``) keep their weights in bf16, so
    a layer's device and upload bytes are those without ``fp8``; the fp8 casts are two e4m3 copies of the largest
    converted weight (its cast and the column-major copy torchao makes for the input-gradient GEMM)."""
    import torch

    from roundpipe.models import fp8

    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    model, config = _tiny_bf16(4, lora=False)
    fp8.prepare(model, True)
    layer = model.model.layers[0]
    shape = estimate.ModelShape.from_config(config)
    plain, fast = estimate.estimate(shape, 16, tile=0), estimate.estimate(shape, 16, tile=0, fp8=True)
    assert fast.device_bytes_per_layer == plain.device_bytes_per_layer == _device_bytes(layer)[0]
    assert fast.upload_bytes_per_layer == plain.upload_bytes_per_layer and fast.peak_host_bytes == plain.peak_host_bytes
    converted = {n.rsplit(".", 1)[-1]: m for n, m in layer.named_modules() if isinstance(m, Float8Linear)}
    assert fast.fp8 is not None and set(fast.fp8.fp8_projections) == set(converted)
    assert set(converted) == set(PROJECTIONS) - {"k_proj", "v_proj"}
    e4m3 = torch.empty((), dtype=torch.float8_e4m3fn).element_size()
    assert fast.gpu_parts["fp8 casts"] == 2 * max(m.weight.numel() for m in converted.values()) * e4m3
    assert fast.peak_gpu_bytes == plain.peak_gpu_bytes + fast.gpu_parts["fp8 casts"]


TINY = ["--model", "tiny", "--seq-len", "256", "--gpu-memory", "8GiB", "--host-memory", "16GiB"]
FP8_BASE = ["--lora-r", "8", "--base-format", "fp8"]


def test_fp8_names_the_choice(capsys) -> None:
    """``--fp8`` names the projections in FP8, what stays in bf16 and that FP8's speed is not estimated; over a
    frozen fp8 base a layer takes fewer GPU bytes and the same upload, a full fine-tune the same bytes."""
    results = {}
    for name, extra in {"base": FP8_BASE, "fp8": FP8_BASE + ["--fp8"], "full": [], "full fp8": ["--fp8"]}.items():
        assert plan.main(TINY + extra + ["--json"]) == 0
        results[name] = json.loads(capsys.readouterr().out)
    base, fast, full, full_fast = results["base"], results["fp8"], results["full"], results["full fp8"]
    assert base["fp8"] is None and fast["fp8"]["recipe"] == "frozen fp8 base"
    assert fast["device_bytes_per_layer"] < base["device_bytes_per_layer"] and fast["dequantize_ms_per_layer"] == 0
    assert fast["upload_bytes_per_layer"] == base["upload_bytes_per_layer"]
    assert full_fast["fp8"]["recipe"] == "torchao float8" and not full_fast["fp8"]["gemm_speed_estimated"]
    assert full_fast["device_bytes_per_layer"] == full["device_bytes_per_layer"]
    assert plan.main(TINY + FP8_BASE + ["--fp8"]) == 0
    out = capsys.readouterr().out
    assert "FP8 GEMMs (--fp8): all 7 projections of each of the 2 decoder layers, over the frozen base's" in out
    assert "in bf16: the embedding, the LM head, the norms" in out and "not in this estimate: FP8's GEMM speed" in out
    assert plan.main(TINY + FP8_BASE) == 0 and "FP8 GEMMs" not in capsys.readouterr().out


def test_fp8_refused_where_train_refuses_it(tmp_path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """In train's words: LoRA over a base not kept as fp8; this machine's GPU without FP8 GEMMs (not a
    ``--gpu-memory`` one's); and a model with no projection FP8 GEMMs take."""
    import torch

    from roundpipe.cli.config import ConfigError, fp8_problem
    from roundpipe.cli.config_flags import parse_train_args
    from roundpipe.models import fp8

    what = fp8_problem(True, 8, "nf4")
    assert what is not None
    one_line(capsys, TINY + ["--lora-r", "8", "--base-format", "nf4", "--fp8"], what[0], what[1])
    with pytest.raises(ConfigError, match=what[0]):
        parse_train_args(["--fp8", "--lora-r", "8", "--base-format", "nf4", "--output-dir", str(tmp_path / "run")])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (8, 0))
    with pytest.raises(ValueError) as no_fp8:
        fp8.check_capabilities([(8, 0)])
    one_line(capsys, TINY[:4] + ["--host-memory", "16GiB", "--fp8"], str(no_fp8.value).split(";")[0])
    assert plan.main(TINY + ["--fp8"]) == 0  # planning for another machine's GPUs
    capsys.readouterr()
    monkeypatch.undo()
    shape = dict(hidden_size=40, intermediate_size=72, num_hidden_layers=2, num_attention_heads=5, vocab_size=64)
    odd = config_dir(tmp_path, "odd", **shape)  # 40 wide: no projection's features are multiples of 16
    one_line(capsys, ["--model", odd, *TINY[2:], "--fp8"], "no decoder-layer projection to run in FP8")


@pytest.mark.gpu
def test_gpu_fp8_base_layer_allocates_the_estimated_bytes() -> None:
    """On a GPU, a decoder layer over an fp8 base converted for FP8 GEMMs, uploaded as the runtime uploads its
    parameters, holds the estimate's device bytes: its fp8 bytes, scales and norms, nothing dequantized beside them
    (``memory_allocated`` counts each tensor in the caching allocator's 512-byte blocks)."""
    import torch

    from roundpipe.host.formats import quantize_frozen
    from roundpipe.models import fp8
    from roundpipe.runtime import transfer

    model, config = _tiny_bf16(8, lora=True)
    quantize_frozen(model, "fp8")
    fp8.enable_fp8_base(model)
    layer = model.base_model.model.model.layers[0]
    expect = estimate.estimate(estimate.ModelShape.from_config(config), 16, lora_rank=8, base_format="fp8", fp8=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    copies = [transfer._upload_param(p, torch.device("cuda")) for n, p in layer.named_parameters() if "lora_" not in n]
    torch.cuda.synchronize()
    used = torch.cuda.memory_allocated() - before
    tensors = [t for c in copies for t in ((c.data_fp8, c.scale) if isinstance(c, fp8.Fp8Weight) else (c,))]
    assert sum(t.nbytes for t in tensors) == expect.device_bytes_per_layer
    assert used == sum(-(-t.nbytes // 512) * 512 for t in tensors)
