"""Running ``python -m roundpipe`` as a user would (a subprocess), and checking what it left behind."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from typing import Dict, List, Optional, Tuple

from helpers import ROOT


def roundpipe(
    args: List[str], cwd: str, timeout: float = 180, env: Optional[Dict[str, str]] = None
) -> subprocess.CompletedProcess:
    """``python -m roundpipe ARGS`` on one CPU worker, no progress bars, this checkout's roundpipe."""
    full_env = dict(
        os.environ,
        RPP_DEVICES="cpu:1",
        RPP_PROGRESS="0",
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "roundpipe", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """Check that ``proc`` failed as a user error should: status 2, one ``roundpipe: error:`` line on
    stderr holding every fragment, no traceback. Returns the line."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("roundpipe: error: ") and " — " in lines[0], proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def snapshot(root: str) -> Dict[str, Tuple[str, int, str]]:
    """Every entry under ``root``: kind, modification time (ns) and sha256 of files, so that any
    write, deletion or new file shows as a difference."""
    out: Dict[str, Tuple[str, int, str]] = {}
    for base, dirs, files in os.walk(root):
        for name in dirs:
            path = os.path.join(base, name)
            out[os.path.relpath(path, root)] = ("dir", os.stat(path).st_mtime_ns, "")
        for name in files:
            path = os.path.join(base, name)
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            out[os.path.relpath(path, root)] = ("file", os.stat(path).st_mtime_ns, digest)
    return out
