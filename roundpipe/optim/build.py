"""Build, load and cache the C++ implementations of optimizer functions.

Each function lives in ``roundpipe/csrc/<name>.cpp`` and exports a plain C ABI. It is compiled on first
use with the system C++ compiler (``$CXX``, else ``c++``/``g++``) at ``-O3 -march=native -fopenmp`` into
``<cache>/<cpu flags hash>/<name>-<source hash>.so`` and loaded with ctypes. No torch headers are
involved, so a build takes about a second and the library does not depend on the torch ABI; the OpenMP
runtime it links (``libgomp.so.1``) resolves to the one torch already loaded, so both share one pool.

The cache directory is ``$RPP_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/roundpipe`` (``~/.cache``).
Keyed by the CPU feature set (``-march=native`` code must not run on another CPU model sharing a home
directory) and by a hash of the source (with the files it includes by quotes) and the flags: an edited
source never loads a stale library.

Attributes:
    loaded_optim_functions: Loaded optimizer functions by name (one load per process).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from functools import lru_cache
from pathlib import Path
from typing import Callable, Dict, List, Optional, Set

logger = logging.getLogger(__name__)

loaded_optim_functions: Dict[str, Callable] = {}

_CSRC = Path(__file__).resolve().parent / "csrc"
_CXXFLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp",
    # Lets sqrt vectorise (no errno to set); results are unchanged for the non-negative inputs we pass.
    "-fno-math-errno",
    # No silent a*b+c contraction: the kernel spells out its fmas where torch's kernels use them.
    "-ffp-contract=off",
    "-std=c++17",
    "-shared",
    "-fPIC",
]
if platform.machine().lower() in ("x86_64", "amd64"):
    # Full-width AVX-512 loops where the CPU has them (gcc defaults to 256 bits): the Adam loop is bound by
    # the core's divider and square root, which take 16 lanes for about the time of 8 (10-25% faster on a
    # Sapphire Rapids core); a no-op on CPUs without AVX-512.
    _CXXFLAGS.append("-mprefer-vector-width=512")
_BUILD_TIMEOUT_S = 300
# Per library: what its rpp_abi_version() must return (bumped with each signature change).
_ABI_VERSION = {"adam": 4, "compact_adam": 4}

# C signatures of the exported functions: (symbol, restype, argtypes).
_SIGNATURES = {
    "adam": (
        "rpp_adam_f32",
        ctypes.c_int32,
        # n_tensors; params, grads, grad_kinds, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, numels (arrays);
        # lr, beta1, beta2, eps, weight_decay; amsgrad, maximize, decoupled, num_threads; bf16_outs (array or null);
        # flush_denormals
        [ctypes.c_int64]
        + [ctypes.c_void_p] * 8
        + [ctypes.c_double] * 5
        + [ctypes.c_int32] * 4
        + [ctypes.c_void_p, ctypes.c_int32],
    ),
    "compact_adam": (
        "rpp_compact_adam",
        ctypes.c_int32,
        # n_tensors; params, grads, exp_avgs, exp_avg_sqs, exp_avg_scales, exp_avg_sq_scales, kahan_comps,
        # steps, grad_kinds, numels, param_ids (arrays); lr, beta1, beta2, eps, weight_decay; maximize,
        # decoupled, state_kind, master_kind, block_size, num_threads; seed; flush_denormals
        [ctypes.c_int64]
        + [ctypes.c_void_p] * 11
        + [ctypes.c_double] * 5
        + [ctypes.c_int32] * 6
        + [ctypes.c_int64]
        + [ctypes.c_int32],
    ),
}

_load_lock = threading.Lock()
# Why a function failed to build or load; not retried in this process (a failing compiler would
# otherwise run again on every call).
_build_errors: Dict[str, str] = {}


class OptimBuildError(RuntimeError):
    """The C++ optimizer function could not be compiled or loaded."""


@lru_cache(maxsize=None)
def get_cpu_flags_hash() -> str:
    """Return a short hash of this CPU's model and feature flags (the ``-march=native`` target)."""
    desc = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
        keys = ("vendor_id", "model name", "flags", "Features", "CPU part")
        first = {}
        for line in lines:
            key, _, val = line.partition(":")
            key = key.strip()
            if key in keys and key not in first:
                first[key] = val.strip()
        desc += "|" + "|".join(f"{k}={first[k]}" for k in sorted(first))
    except OSError:
        desc += "|" + platform.processor()
    return hashlib.sha256(desc.encode()).hexdigest()[:16]


def _cache_dir() -> Path:
    from roundpipe import settings

    root = settings.CACHE_DIR.get()
    if root:
        base = Path(root)
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "roundpipe"
    return base / "optim" / get_cpu_flags_hash()


def _compiler() -> Optional[str]:
    for cand in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if cand and shutil.which(cand):
            return shutil.which(cand)
    return None


_LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def _source_bytes(src: Path, seen: Optional[Set[Path]] = None) -> bytes:
    """``src`` and, after it, every file it includes with quotes (from its own folder, recursively): what
    the library is built from, so an edit to an included part changes the cache key too."""
    seen = set() if seen is None else seen
    seen.add(src)
    data = src.read_bytes()
    out = [data]
    for name in _LOCAL_INCLUDE.findall(data):
        inc = (src.parent / name.decode()).resolve()
        if inc not in seen and inc.is_file():
            out.append(_source_bytes(inc, seen))
    return b"\0".join(out)


def _library_path(name: str, cxx: str) -> Path:
    src = _CSRC / f"{name}.cpp"
    key = hashlib.sha256(_source_bytes(src) + "\0".join([cxx, *_CXXFLAGS]).encode()).hexdigest()[:16]
    return _cache_dir() / f"{name}-{key}.so"


def _compile(src: Path, out: Path, cxx: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build into a private temp file and rename: concurrent processes (torchrun ranks, test workers)
    # may build the same library; rename is atomic, so a reader never sees a half-written file.
    fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".tmp.so", dir=out.parent)
    os.close(fd)
    cmd: List[str] = [cxx, *_CXXFLAGS, str(src), "-o", tmp]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
        if proc.returncode != 0:
            raise OptimBuildError(f"`{' '.join(cmd)}` failed:\n{proc.stderr[-4000:]}")
        os.replace(tmp, out)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise OptimBuildError(f"`{' '.join(cmd)}` failed: {exc!r}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_optim_function(name: str) -> None:
    """Compile (unless cached) and load ``csrc/<name>.cpp``; store it in ``loaded_optim_functions``.

    Raises:
        OptimBuildError: no compiler, a failed build, or a library that does not load.
    """
    if name not in _SIGNATURES:
        raise KeyError(f"unknown optimizer function {name!r}; known: {sorted(_SIGNATURES)}")
    cxx = _compiler()
    if cxx is None:
        raise OptimBuildError("no C++ compiler found (set $CXX or install g++)")
    path = _library_path(name, cxx)
    if not path.exists():
        logger.info("roundpipe: building %s optimizer kernel into %s", name, path)
        _compile(_CSRC / f"{name}.cpp", path, cxx)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise OptimBuildError(f"cannot load {path}: {exc}") from exc
    lib.rpp_abi_version.restype = ctypes.c_int32
    if lib.rpp_abi_version() != _ABI_VERSION[name]:
        raise OptimBuildError(f"{path} has ABI version {lib.rpp_abi_version()}, expected {_ABI_VERSION[name]}")
    symbol, restype, argtypes = _SIGNATURES[name]
    fn = getattr(lib, symbol)
    fn.restype = restype
    fn.argtypes = argtypes
    # ctypes.CDLL functions release the GIL while they run: the main thread keeps going meanwhile.
    loaded_optim_functions[name] = fn


def prebuild(name: str) -> None:
    """Build and load ``name`` in a background thread unless that was done (or failed) already, so the
    first step does not compile it (the compact kernel takes seconds); ``get_optim_function`` waits for
    that thread under the load lock, and a failure it records is reported there, at the first use."""
    if name in loaded_optim_functions or name in _build_errors:
        return

    def run() -> None:
        try:
            get_optim_function(name)
        except Exception:  # noqa: BLE001 - recorded in _build_errors (OptimBuildError) or retried at first use
            pass

    threading.Thread(target=run, name=f"roundpipe-build-{name}", daemon=True).start()


def get_optim_function(name: str) -> Callable:
    """Return the optimizer function ``name``, building and loading it on first use.

    Raises:
        OptimBuildError: see ``load_optim_function``. A failure is remembered: later calls in this
            process raise it again without rebuilding.
    """
    fn = loaded_optim_functions.get(name)
    if fn is not None:
        return fn
    # The main thread (first step of a synchronous loop) and the optimizer thread may both get here.
    with _load_lock:
        if name in _build_errors:
            raise OptimBuildError(_build_errors[name])
        if name not in loaded_optim_functions:
            try:
                load_optim_function(name)
            except OptimBuildError as exc:
                _build_errors[name] = str(exc)
                raise
        return loaded_optim_functions[name]
