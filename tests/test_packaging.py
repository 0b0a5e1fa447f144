"""The wheel is a complete package: built from a copy of this checkout (offline, no build isolation),
installed into a fresh target directory, it holds every module and every C++ source and header, and
the installed copy compiles and loads both optimizer kernels (``adam`` and ``compact_adam``) from its
own files into an empty kernel cache, then steps with them (``RPP_DEBUG_ADAM_IMPL=cpp``: a kernel that cannot
build is an error there, not a fallback to torch)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Iterator, List

import pytest
from helpers import ROOT

PACKAGE = Path(ROOT) / "roundpipe"
CSRC = PACKAGE / "optim" / "csrc"

# Run by the installed copy: it must be the one imported, and it builds both kernels from its own csrc.
CHECK_INSTALLED = r"""
import os, sys
import torch
import roundpipe
from roundpipe.optim import build

target = os.path.realpath(sys.argv[1])
assert os.path.realpath(roundpipe.__file__).startswith(target + os.sep), roundpipe.__file__
assert str(build._CSRC).startswith(target + os.sep), build._CSRC
torch.manual_seed(0)
plain = torch.nn.Parameter(torch.randn(1000))
compact = torch.nn.Parameter(torch.randn(1000).to(torch.bfloat16))
before = (plain.detach().clone(), compact.detach().clone())
for p, kw in ((plain, {}), (compact, {"state_dtype": "int8", "master": "bfloat16"})):
    opt = roundpipe.optim.Adam([p], lr=0.1, preallocate_state=False, **kw)
    p.grad = torch.ones_like(p)
    opt.step()
assert not torch.equal(plain.detach(), before[0]) and not torch.equal(compact.detach(), before[1])
libs = sorted(p.name.split("-")[0] for p in build._cache_dir().glob("*.so"))
print("loaded", sorted(build.loaded_optim_functions), "built", libs)
"""


def _repo_files(root: Path, suffixes: tuple) -> List[str]:
    """Paths (relative to the checkout) of the package files with these suffixes, caches left out."""
    found = [p for p in root.rglob("*") if p.is_file() and p.suffix in suffixes and "__pycache__" not in p.parts]
    return sorted(str(p.relative_to(ROOT)) for p in found)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A wheel built from a copy of the checkout (so the build leaves nothing in the checkout)."""
    if shutil.which("c++") is None and shutil.which("g++") is None and not os.environ.get("CXX"):
        pytest.skip("no C++ compiler: the kernels cannot be built")
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(Path(ROOT) / name, src / name)
    shutil.copytree(PACKAGE, src / "roundpipe", ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
    out = work / "dist"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q"]
    cmd += ["-w", str(out), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (built,) = out.glob("roundpipe-*.whl")
    yield built


@pytest.mark.timeout(300)
def test_wheel_holds_every_module_and_every_csrc_file(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    csrc = [str(p.relative_to(ROOT)) for p in sorted(CSRC.iterdir()) if p.is_file()]
    assert any(p.endswith(".h") for p in csrc)  # the header the compact kernel includes
    assert [p for p in csrc if p not in names] == []
    assert [p for p in _repo_files(PACKAGE, (".py",)) if p not in names] == []


@pytest.mark.timeout(600)
def test_installed_wheel_builds_and_loads_both_kernels(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(target), str(wheel)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    installed = sorted(p.name for p in (target / "roundpipe" / "optim" / "csrc").iterdir())
    assert installed == sorted(p.name for p in CSRC.iterdir() if p.is_file())
    env = dict(os.environ, PYTHONPATH=str(target), RPP_CACHE_DIR=str(tmp_path / "cache"), RPP_DEBUG_ADAM_IMPL="cpp")
    # Run from an empty directory: neither the checkout nor the current directory is on the path.
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    cmd = [sys.executable, "-c", CHECK_INSTALLED, str(target)]
    proc = subprocess.run(cmd, cwd=run_dir, env=env, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "loaded ['adam', 'compact_adam'] built ['adam', 'compact_adam']" in proc.stdout, proc.stdout
