"""Reference computations for comparing RoundPipe against plain PyTorch."""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from roundpipe.runtime.context import doing_recompute


def require_adam_kernel() -> None:
    """Skip the calling test where the C++ Adam kernel cannot be built (no compiler): tests of what that kernel
    writes (``RPP_DEBUG_FUSED_STAGING``) need it loaded."""
    import pytest

    from roundpipe.optim import build

    try:
        build.get_optim_function("adam")
    except build.OptimBuildError as exc:
        pytest.skip(f"no C++ Adam kernel here: {exc}")


LORA_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""Every projection of a Qwen3 / Llama decoder layer: LoRA on all of them."""


def with_lora(
    model: nn.Module, targets: List[str], seed: Optional[int] = None, std: float = 0.1, dropout: float = 0.0
) -> nn.Module:
    """``model`` with PEFT LoRA adapters (r=4, alpha 8) on ``targets``, their B matrices drawn from N(0, std)
    (after ``torch.manual_seed(seed)`` when given): PEFT starts B at zero, which would leave every A
    gradient zero, so a test could not tell a wrong adapter gradient from a right one."""
    import peft

    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=list(targets))
    peft_model = peft.get_peft_model(model, config)
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, std)
    return peft_model


def wrap_by_size(model: nn.Module, num_microbatch: int) -> Any:
    """``model`` (a Hugging Face causal LM in fp32) wrapped without its preset: an ``AutoRoundPipe`` whose
    layer groups hold one decoder layer's bytes each."""
    import roundpipe

    layer_bytes = sum(p.numel() * 4 for p in model.model.layers[0].parameters())
    return roundpipe.wrap_model_to_roundpipe(
        model,
        use_sequential_preset=False,
        lower_threshold=layer_bytes,
        upper_threshold=layer_bytes,
        model_run_config=roundpipe.RoundPipeRunConfig(num_microbatch=num_microbatch),
    )


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (0 when both are zero)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    denom = b.norm().item()
    diff = (a - b).norm().item()
    return diff if denom == 0 else diff / denom


class DropoutRecorder:
    """Records the masks each nn.Dropout of a model applies in forward (not in recompute), per call,
    so a plain PyTorch reference can apply exactly the same masks."""

    def __init__(self, model: nn.Module) -> None:
        self.masks: Dict[str, List[torch.Tensor]] = {}
        for name, mod in model.named_modules():
            if isinstance(mod, nn.Dropout):
                self.masks[name] = []
                mod.register_forward_hook(self._hook(name))

    def _hook(self, name: str):
        def hook(mod: nn.Module, inp, out) -> None:
            if mod.training and not doing_recompute():
                self.masks[name].append((out != 0).detach().cpu())

        return hook


class _MaskedDropout(nn.Module):
    def __init__(self, p: float, masks: List[torch.Tensor]) -> None:
        super().__init__()
        self.p, self.masks, self.calls = p, masks, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = self.masks[self.calls].to(x.device)
        self.calls += 1
        return x * mask.to(x.dtype) * (1.0 / (1.0 - self.p))


def with_recorded_dropout(model: nn.Module, recorder: DropoutRecorder) -> nn.Module:
    """A copy of ``model`` whose dropouts replay the recorded masks in call order."""
    ref = copy.deepcopy(model)
    for name, mod in list(ref.named_modules()):
        if isinstance(mod, nn.Dropout):
            parent_name, _, child = name.rpartition(".")
            parent = ref.get_submodule(parent_name) if parent_name else ref
            setattr(parent, child, _MaskedDropout(mod.p, recorder.masks[name]))
    return ref


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small_mlp() -> Any:
    """A seeded 6 -> 12 -> 3 ``nn.Sequential`` RoundPipe in fp32, two microbatches."""
    from roundpipe import RoundPipe, RoundPipeRunConfig

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))
    return RoundPipe(net, optim_dtype=torch.float32, model_run_config=RoundPipeRunConfig(num_microbatch=2), name="t")


def train_small_mlp(model: Any, steps: int, dp: Any = None) -> torch.Tensor:
    """``steps`` SGD steps of :func:`small_mlp` on seeded batches of 4 rows (the mean over the 4 rows per
    rank when ``dp``, a ``DataParallel``, is given); the trained parameters, flattened."""
    opt = torch.optim.SGD(list(model.optim_parameters()), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        model.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).mean())
        if dp is not None:
            dp.normalize_by(4)
        model.step(lambda: (opt.step(), opt.zero_grad()))
    model.synchronize()
    return torch.cat([p.detach().reshape(-1) for p in model.optim_parameters()])


def torchrun(
    script: str,
    args: List[str],
    tmp_path: Any,
    nproc: int = 2,
    env: Optional[Dict[str, str]] = None,
    timeout: float = 90,
    devices: Optional[str] = "cpu:1",
    survivors: bool = False,
) -> subprocess.CompletedProcess:
    """``script`` on ``nproc`` ranks with torchrun's environment, one thread per rank (and
    ``RPP_DEVICES=devices`` unless None); a short collective timeout so a broken test fails well before
    ``timeout``. A script file's ranks are started directly (:func:`launch_ranks`: torchrun's launcher
    adds 2.6 s per run on two cores); ``torchrun --standalone`` itself runs a module (``script="-m"``).
    ``survivors``: once a rank fails the others are not stopped but must end on their own, as on other nodes
    where no local agent sees the dead rank (a test of what a survivor reports; torchrun's monitor would stop
    it at its next poll, which may come before it has reported)."""
    full_env = dict(
        os.environ,
        RPP_DISABLE_TORCH_COMPILE="1",
        OMP_NUM_THREADS="1",
        RPP_DIST_TIMEOUT_S="30",
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    if devices is not None:
        full_env["RPP_DEVICES"] = devices
    full_env.update(env or {})
    if script != "-m":
        return launch_ranks([script, *args], nproc, full_env, str(tmp_path), timeout, stop_on_failure=not survivors)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    return subprocess.run(
        cmd + [script, *args], cwd=str(tmp_path), env=full_env, capture_output=True, text=True, timeout=timeout
    )


def launch_ranks(
    argv: List[str], nproc: int, env: Dict[str, str], cwd: str, timeout: float, stop_on_failure: bool = True
) -> subprocess.CompletedProcess:
    """``python ARGV`` as ``nproc`` local ranks with the variables torchrun sets (``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), until every rank has exited or,
    with ``stop_on_failure``, one has failed (then the others are stopped, as torchrun stops them). The result
    holds rank 0's output first, and the first failing rank's exit status (0 when all succeed). Ranks still running at
    ``timeout`` are killed and ``subprocess.TimeoutExpired`` raised, as ``subprocess.run`` does."""
    with socket.socket() as sock:  # a free port for the rendezvous (rank 0's TCP store binds it)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs, files = [], []
    for rank in range(nproc):
        rank_env = dict(
            env,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            GROUP_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # no pipe to fill up
        files.append((out, err))
        procs.append(
            subprocess.Popen([sys.executable, *argv], cwd=cwd, env=rank_env, stdout=out, stderr=err, text=True)
        )
    # As torchrun does (``stop_on_failure``): once a rank fails, the others are stopped (SIGTERM, then SIGKILL
    # after 5 s).
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and not (stop_on_failure and any(p.returncode for p in procs)):
        if time.monotonic() > deadline:
            for p in procs:
                p.kill()
                p.wait()
            raise subprocess.TimeoutExpired([sys.executable, *argv], timeout)
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    codes = [p.returncode for p in procs]  # a rank stopped above: negative
    texts = []
    for out, err in files:
        out.seek(0)
        err.seek(0)
        texts.append((out.read(), err.read()))
        out.close()
        err.close()
    status = next((c for c in codes if c > 0), next((c for c in codes if c != 0), 0))
    return subprocess.CompletedProcess(
        [sys.executable, *argv], status, "".join(t[0] for t in texts), "".join(t[1] for t in texts)
    )


# Ops whose result the host must wait for on CUDA (data-dependent sizes, or a value read back).
SYNC_OPS = {
    "_local_scalar_dense",  # .item(), float(t), int(t), `if t:`
    "is_nonzero",
    "nonzero",
    "masked_select",
    "equal",
    "unique_consecutive",
    "unique_dim",
    "_unique",
    "_unique2",
    "repeat_interleave",
    "bincount",
}


class SyncRecorder(TorchDispatchMode):
    """Records every aten op that would synchronise a CUDA stream with the host.

    Works on CPU tensors too, so CI checks the loss for host syncs without a GPU: it sees the ops that
    C++ issues on behalf of Python (``bool(t)``, ``int(t)``) that monkeypatching Tensor methods misses.
    Boolean-mask indexing is caught at the ``index`` op, whose internal ``nonzero`` runs below the mode.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: List[str] = []
        self.syncs: List[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops.append(name)
        bool_index = name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] if i is not None
        )
        if name in SYNC_OPS or bool_index:
            self.syncs.append(name)
        return func(*args, **(kwargs or {}))


def kill_when_written(args: List[str], env: Dict[str, str], marker: str, timeout: float = 180) -> None:
    """Run ``python ARGS`` and kill it with SIGKILL as soon as it creates file ``marker`` (a hook of the
    script writes it where the kill should land); fails with the script's stderr if it exits first."""
    import signal

    proc = subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    while not os.path.exists(marker):
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]  # type: ignore[union-attr]
        assert time.monotonic() < deadline, f"{marker} not written within {timeout} s"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
