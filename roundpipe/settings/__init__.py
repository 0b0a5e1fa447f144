"""Every ``RPP_*`` setting in one place: its type, default, accepted range and one line of doc.

A setting is read from the environment each time it is asked for (so a test or a launcher may change
the variable between runs), unless :func:`configure` has set it in this process, which wins. Bad
values raise ``ValueError`` naming the variable and what it accepts. Nothing else in roundpipe reads
``os.environ`` for an ``RPP_*`` variable. Settings under ``RPP_DEBUG_*`` are internal (debugging aids
and test modes that may change without notice); ``markdown_table()`` renders the user guide's table of
the others, ``markdown_table(internal=True)`` the internal one. An ``RPP_*`` variable set in the
environment that roundpipe does not know (a renamed or removed one, a typo) draws one warning at
import, naming what to use instead (``roundpipe.settings.retired``).

    from roundpipe import settings
    settings.STEP_MODE.get()             # -> 'staged'
    roundpipe.configure(devices="cpu:2", compile=False)
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Generic, Iterator, List, Optional, Tuple, TypeVar

from roundpipe.settings import retired as retired_settings
from roundpipe.settings.parsers import (
    boolean,
    choice,
    device_spec,
    integer,
    number,
    parse_size_gib,
    profiler_kind,
    tristate,
)

T = TypeVar("T")

_overrides: Dict[str, Any] = {}
_lock = threading.Lock()


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One ``RPP_*`` variable."""

    name: str
    """The environment variable."""
    parse: Callable[[str], T]
    """Turns the variable's text into the value; raises ``ValueError`` with the accepted values."""
    default: T
    """The value when the variable is unset or empty."""
    default_text: str
    """The default as the user guide shows it."""
    accepts: str
    """What the variable accepts, for the user guide."""
    doc: str
    """One line: what it changes."""

    @property
    def internal(self) -> bool:
        """Whether this is a debugging aid or test mode (``RPP_DEBUG_*``) rather than a user setting: the
        namespace is the one statement of it, so no internal setting goes by a user's name."""
        return self.name.startswith(INTERNAL_PREFIX)

    def get(self) -> T:
        """The value: ``configure``'s if set in this process, else the environment's, else the default."""
        if self.name in _overrides:
            return _overrides[self.name]
        raw = os.environ.get(self.name)
        if raw is None or not raw.strip():
            return self.default
        try:
            return self.parse(raw.strip())
        except ValueError as exc:
            raise ValueError(
                f"{self.name}={raw!r}: expected {self.accepts}{'; ' + str(exc) if str(exc) else ''}"
            ) from None

    def is_set(self) -> bool:
        """Whether the user chose a value (environment or ``configure``), as opposed to the default."""
        return self.name in _overrides or bool(os.environ.get(self.name, "").strip())


#: The namespace of the internal settings.
INTERNAL_PREFIX = "RPP_DEBUG_"
REGISTRY: Dict[str, Setting[Any]] = {}


def _register(setting: Setting[T]) -> Setting[T]:
    REGISTRY[setting.name] = setting
    return setting


# ---- devices and runtime ----------------------------------------------------------------------------
DEVICES: Setting[str] = _register(
    Setting(
        "RPP_DEVICES",
        device_spec,
        "",
        "all GPUs, else `cpu:1`",
        "`cuda`, `cuda:0,2`, `cpu:N`",
        "The devices RoundPipe runs on: GPUs, or N CPU workers.",
    )
)
GPU_MEMORY_GIB: Setting[Optional[float]] = _register(
    Setting(
        "RPP_GPU_MEMORY",
        parse_size_gib,
        None,
        "the whole GPU",
        "a size such as `24GiB`, `24GB`, `20000MiB`",
        "Cap each GPU this process uses to this much memory (a per-process limit); the planner plans to it.",
    )
)
HOST_MEMORY_GIB: Setting[Optional[float]] = _register(
    Setting(
        "RPP_HOST_MEMORY",
        parse_size_gib,
        None,
        "available memory less 5% (at least 2 GiB)",
        "a size such as `100GiB`",
        "Host memory this process may use in all; the planner keeps activation checkpoints within it.",
    )
)


def _number_or_auto(raw: str) -> Optional[float]:
    return None if raw.lower() == "auto" else number(0.0)(raw)


DEBUG_DEVICE_SAVED_GB: Setting[Optional[float]] = _register(
    Setting(
        "RPP_DEBUG_DEVICE_SAVED_GB",
        _number_or_auto,
        None,
        "auto",
        "`auto` or a number of GiB >= 0",
        "Backward-stage inputs a call may keep on its (single) device instead of the host (auto: the "
        "device memory its plan leaves free, in forward_backward calls of models that report their activations).",
    )
)
DEBUG_KEEP_ACTIVATIONS: Setting[str] = _register(
    Setting(
        "RPP_DEBUG_KEEP_ACTIVATIONS",
        tristate,
        "auto",
        "auto",
        "`auto`, `1` or `0`",
        "Backward stages whose forward keeps its autograd graph on the device, so that the backward needs no "
        "recompute (forward_backward calls on one device): auto, those the planner fits in the room the plan leaves "
        "on a GPU; `1`, every stage it can keep (the last, fused one needs none), room or not, CPU workers too; "
        "`0`, none.",
    )
)
#: How backward-stage inputs may be kept (``roundpipe.runtime.stage_codec``): the one list of the modes, read
#: by the codec, the CLI and this setting (``RoundPipeRunConfig.stage_inputs``' type repeats it; a test checks).
STAGE_INPUT_MODES: Tuple[str, ...] = ("bf16", "fp8", "int8")
STAGE_INPUTS: Setting[str] = _register(
    Setting(
        "RPP_STAGE_INPUTS",
        choice(*STAGE_INPUT_MODES),
        "bf16",
        "bf16",
        "`bf16` (as the layers produce them), `fp8` or `int8`",
        "Backward-stage inputs kept on the host from the forward to the backward: as computed, or one byte a value "
        "with a float32 scale per block (fp8, 128 values; int8, 32 values, a fifth of fp8's rounding error): about "
        "half the host memory; backward recomputes from the rounded values.",
    )
)
DEBUG_TILE_ATTENTION: Setting[str] = _register(
    Setting(
        "RPP_DEBUG_TILE_ATTENTION",
        choice("auto", "split", "bias"),
        "auto",
        "auto",
        "`auto`, `split` or `bias`",
        "How a sequence tile (`sequence_tiles`) attends to the tiles before it: two flash-attention blocks merged "
        "by their log-sum-exp, or one call with a bottom-right causal mask; `auto`: split on CPU workers and on GPUs "
        "where the blocks run on cuDNN's fused attention (half precision, checked once per device), else bias",
    )
)
DEBUG_FUSED_STAGING: Setting[str] = _register(
    Setting(
        "RPP_DEBUG_FUSED_STAGING",
        tristate,
        "auto",
        "auto",
        "`auto`, `1` or `0`",
        "roundpipe.optim.Adam writes an asynchronous step's new bf16 weights into their staging buffer in its own "
        "pass, instead of a copy after the step function; that buffer is the gradient's, so the step function must "
        "call zero_grad() after optimizer.step() and read no gradient after it (a missed zero_grad() raises). "
        "auto: for step functions that say so (roundpipe.optim.step_fn_zeroes_grads: roundpipe train's, the "
        "Trainer's); `1`: for every step function.",
    )
)
STEP_MODE: Setting[str] = _register(
    Setting(
        "RPP_STEP_MODE",
        choice("staged", "streamed"),
        "staged",
        "staged",
        "`staged` or `streamed`",
        "Asynchronous steps: `staged` (one step stale; two host copies of each weight in the model dtype with one "
        "training call per step, three otherwise) or "
        "`streamed` (not stale, two copies: the next forward follows the step layer by layer); read when the "
        "model is built.",
    )
)
DEBUG_SPLIT_FUSED: Setting[str] = _register(
    Setting(
        "RPP_DEBUG_SPLIT_FUSED",
        tristate,
        "auto",
        "auto",
        "`auto`, `1` or `0`",
        "On several devices, split the fused forward-backward job (the loss head) by microbatch over the devices "
        "(auto: where the devices compute at once: GPUs, or CPU workers in the stress mode).",
    )
)
DEBUG_PEER_HANDOFF: Setting[str] = _register(
    Setting(
        "RPP_DEBUG_PEER_HANDOFF",
        tristate,
        "auto",
        "auto",
        "`auto`, `1` or `0`",
        "On several GPUs, a forward job's output and a backward job's input gradients go straight to the GPU of the "
        "next job (a peer copy) instead of through pinned host memory (auto: on a pool of more than two GPUs that "
        "can all reach each other, except in calls of one long sequence; docs/execute-plans.md).",
    )
)
DEBUG_GRAPHS: Setting[str] = _register(
    Setting(
        "RPP_DEBUG_GRAPHS",
        tristate,
        "auto",
        "auto",
        "`auto`, `1` or `0`",
        "Run the decoder-layer jobs' per-microbatch compute as captured CUDA graphs, weights in fixed device slots "
        "(auto: on a pool of several GPUs; `1` on CPU workers runs a stand-in of the same data flow, for tests).",
    )
)
WATCHDOG_S: Setting[Optional[float]] = _register(
    Setting(
        "RPP_WATCHDOG_S",
        _number_or_auto,
        None,
        "auto: 10 x the slowest job the planner expects, at least 600",
        "`auto` or seconds >= 0",
        "A call whose threads all wait with no progress for this long fails, naming each thread's job, layer and "
        "the event it waits for, and prints their stacks (0: waits never time out).",
    )
)
DEBUG_STRESS_DELAY_S: Setting[float] = _register(
    Setting(
        "RPP_DEBUG_STRESS_DELAY_S",
        number(0.0),
        0.0,
        "0 (off)",
        "seconds >= 0",
        "Test mode: CPU workers compute concurrently and every RoundPipe wait first sleeps up to this long.",
    )
)
DEBUG_CHECK_STREAMS: Setting[str] = _register(
    Setting(
        "RPP_DEBUG_CHECK_STREAMS",
        tristate,
        "auto",
        "auto",
        "`auto`, `1` or `0`",
        "Test mode: CPU workers' streams record what each op reads and writes and raise when an op is not ordered "
        "after another stream's access to the same data; host threads (the optimizer thread, the main thread in a "
        "RoundPipe call) raise on reading data whose stream write they did not synchronize; CPU downloads copy "
        "(auto: in the stress mode).",
    )
)
PROFILER: Setting[Optional[str]] = _register(
    Setting(
        "RPP_PROFILER",
        profiler_kind,
        None,
        "off",
        "`torch`, `nvtx` or unset",
        "Mark each device job and blocking wait as a profiler range (read at import).",
    )
)
DEBUG_TIMER: Setting[bool] = _register(
    Setting(
        "RPP_DEBUG_TIMER",
        boolean,
        False,
        "0",
        "`1` or `0`",
        "Log the timer's per-layer estimates as they change (read at import).",
    )
)

# ---- optimizer ------------------------------------------------------------------------------------
OPTIM_THREADS: Setting[Optional[int]] = _register(
    Setting(
        "RPP_OPTIM_THREADS",
        integer(1),
        None,
        "each GPU's share of torch's thread count less 4 (at least 8) when it is 8 or more, or this rank's "
        "share of the cores",
        "a positive integer",
        "Intra-op threads of the host optimizer thread.",
    )
)
DEBUG_ADAM_IMPL: Setting[str] = _register(
    Setting(
        "RPP_DEBUG_ADAM_IMPL",
        choice("auto", "cpp", "torch"),
        "auto",
        "auto",
        "`auto`, `cpp` or `torch`",
        "Host Adam kernel: the C++ one (auto falls back to torch when it cannot build) or torch's fused one.",
    )
)
CACHE_DIR: Setting[Optional[str]] = _register(
    Setting(
        "RPP_CACHE_DIR",
        str,
        None,
        "`$XDG_CACHE_HOME/roundpipe`",
        "a directory",
        "Where the C++ optimizer kernels are built and cached.",
    )
)

# ---- models ---------------------------------------------------------------------------------------
DISABLE_TORCH_COMPILE: Setting[bool] = _register(
    Setting(
        "RPP_DISABLE_TORCH_COMPILE",
        boolean,
        False,
        "0",
        "`1` or `0`",
        "Run the fused kernels and the chunked loss eagerly instead of through torch.compile.",
    )
)
DEBUG_FUSED_KERNELS: Setting[str] = _register(
    Setting(
        "RPP_DEBUG_FUSED_KERNELS",
        tristate,
        "auto",
        "auto",
        "`auto`, `1` or `0`",
        "Fused RMSNorm / rotary / SwiGLU kernels for Qwen3 and Llama layers (auto: on GPUs with Triton).",
    )
)
DEBUG_LORA_COMPUTE: Setting[str] = _register(
    Setting(
        "RPP_DEBUG_LORA_COMPUTE",
        choice("peft", "base"),
        "peft",
        "peft",
        "`peft` or `base`",
        "The dtype the fused LoRA linear computes float32 adapters over a bf16 / fp16 base in: `peft`, float32 as "
        "PEFT does; `base`, the base's dtype (the adapter weights cast to it per call, float32 gradients), within "
        "its rounding of PEFT.",
    )
)
SEQ_TILE: Setting[int] = _register(
    Setting(
        "RPP_SEQ_TILE",
        integer(0),
        16384,
        "16384",
        "tokens per tile, an integer >= 0 (`0`: off)",
        "Qwen3 / Llama layers longer than this run norms, projections and MLP in tiles of this many tokens.",
    )
)

# ---- data parallel and CLI ------------------------------------------------------------------------
DIST_BACKEND: Setting[str] = _register(
    Setting(
        "RPP_DIST_BACKEND",
        str,
        "gloo",
        "gloo",
        "a torch.distributed backend (`gloo`, `nccl`)",
        "Backend of the default process group under torchrun.",
    )
)
DIST_TIMEOUT_S: Setting[float] = _register(
    Setting(
        "RPP_DIST_TIMEOUT_S",
        number(0.0, low_inclusive=False),
        60.0,
        "60",
        "seconds > 0",
        "How long a rank waits for a peer in a gradient collective before failing.",
    )
)
DIST_MAIN_TIMEOUT_S: Setting[float] = _register(
    Setting(
        "RPP_DIST_MAIN_TIMEOUT_S",
        number(0.0, low_inclusive=False),
        1800.0,
        "1800",
        "seconds > 0",
        "Timeout of the main thread's collectives (setup, barriers, checkpoint waits).",
    )
)
PROGRESS: Setting[bool] = _register(
    Setting(
        "RPP_PROGRESS",
        boolean,
        True,
        "1",
        "`1` or `0`",
        "Progress bars of `roundpipe train` (also off when stderr is not a terminal).",
    )
)


def configure(devices: Optional[str] = None, compile: Optional[bool] = None, **values: Any) -> None:  # noqa: A002
    """Choose settings for this process instead of through environment variables.

    ``devices`` is ``RPP_DEVICES`` (re-creating the device workers if they exist), ``compile`` the
    inverse of ``RPP_DISABLE_TORCH_COMPILE``; other settings by lower-case name without the prefix,
    e.g. ``configure(step_mode="streamed")``. Values are checked as the environment's text would be.
    """
    chosen: List[Tuple[Setting[Any], Any]] = []
    if devices is not None:
        chosen.append((DEVICES, str(devices)))
    if compile is not None:
        chosen.append((DISABLE_TORCH_COMPILE, not compile))
    for key, value in values.items():
        setting = REGISTRY.get("RPP_" + key.upper())
        if setting is None:
            retired = retired_settings.RETIRED.get("RPP_" + key.upper())
            raise TypeError(
                f"configure() got an unknown setting {key!r}"
                + (f" (RPP_{key.upper()}: {retired})" if retired else "")
                + f"; known: {sorted(n[4:].lower() for n in REGISTRY)}"
            )
        chosen.append((setting, _checked(setting, value) if isinstance(value, str) else value))
    if devices is not None:
        chosen[0] = (DEVICES, _checked(DEVICES, str(devices)))
    with _lock:
        for setting, value in chosen:
            _overrides[setting.name] = value
    _notify([setting.name for setting, _ in chosen])


def unconfigure(*names: str) -> None:
    """Forget ``configure``'s choices (all, or the named variables): the environment applies again."""
    with _lock:
        dropped = [name for name in (names or list(_overrides)) if _overrides.pop(name, _MISSING) is not _MISSING]
    _notify(dropped)


def _checked(setting: Setting[T], raw: str) -> T:
    """``setting.parse(raw)`` with the error message of a bad environment value."""
    try:
        return setting.parse(raw.strip())
    except ValueError:
        raise ValueError(f"{setting.name}={raw!r}: expected {setting.accepts}") from None


_MISSING = object()
# Who must know when a setting changes in this process: the device layer re-creates its workers when
# RPP_DEVICES changes. Registered by the modules that own the state (this module imports none of them).
_observers: Dict[str, List[Callable[[], None]]] = {}


def on_change(setting: Setting[Any], callback: Callable[[], None]) -> None:
    """Call ``callback()`` after ``configure`` / ``unconfigure`` changes ``setting`` in this process."""
    _observers.setdefault(setting.name, []).append(callback)


def _notify(names: List[str]) -> None:
    for name in dict.fromkeys(names):
        for callback in _observers.get(name, []):
            callback()


@contextlib.contextmanager
def overridden(**values: Any) -> Iterator[None]:
    """``configure(**values)`` for the duration of a ``with`` block (tests, benchmarks)."""
    saved = dict(_overrides)
    configure(**values)
    try:
        yield
    finally:
        restore(saved)


def snapshot() -> Dict[str, Any]:
    """``configure``'s current choices (for :func:`restore`)."""
    with _lock:
        return dict(_overrides)


def restore(saved: Dict[str, Any]) -> None:
    """Make ``configure``'s choices ``saved`` again (a :func:`snapshot`), notifying what changed."""
    with _lock:
        changed = [n for n in set(_overrides) | set(saved) if _overrides.get(n, _MISSING) is not saved.get(n, _MISSING)]
        _overrides.clear()
        _overrides.update(saved)
    _notify(changed)


def default_num_microbatch(num_devices: int) -> int:
    """Microbatches when the run configuration names none: one per device, and one ready for the first free."""
    return num_devices + 1


def markdown_table(internal: bool = False) -> str:
    """The user settings as the markdown table of the user guide, or with ``internal`` the ``RPP_DEBUG_*`` ones."""
    rows = [
        f"| `{s.name}` | {s.accepts} | {s.default_text} | {s.doc} |"
        for s in REGISTRY.values()
        if s.internal == internal
    ]
    return "\n".join(["| variable | accepts | default | what it does |", "|---|---|---|---|", *rows])


# A renamed or removed RPP_* variable still set in the environment draws one warning naming its replacement.
retired_settings.warn_unknown(os.environ, REGISTRY)
