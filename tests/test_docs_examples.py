"""Every Python block of README.md and docs/*.md runs as written, on CPU workers and tiny models.

How the blocks run (the conventions a page's author follows):

* The ```` ```python ```` blocks of a page run in order in one namespace, as a reader following the page
  runs them: a later block may use what an earlier one defined. Each page runs in a fresh process whose
  working directory is an empty temporary directory, on one CPU worker (``RPP_DEVICES=cpu:1``) unless a
  block chooses its devices, with progress bars off.
* A block right after an HTML comment ``<!-- no-test: REASON -->`` is not run (it is still compiled, so
  it stays valid Python). The reason says what the block needs that a test machine lacks: a GPU,
  torchrun, a package the project does not install, a file a shell command above writes, or code that
  stands for the reader's own. :data:`MAX_SKIPPED` caps how many there are.
* The one substitution: a Hugging Face hub id a block loads (``from_pretrained("Qwen/Qwen3-8B")``) is
  replaced by the path of a tiny random model of the same architecture (:data:`HUB_STAND_INS`), saved
  in the temporary directory, so nothing is downloaded; every other line runs as printed.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional

import pytest
from helpers import ROOT

#: Hub ids the pages load -> the architecture of the tiny stand-in saved in their place.
HUB_STAND_INS: Dict[str, str] = {"Qwen/Qwen3-8B": "qwen3"}
#: The most blocks the pages may mark ``no-test`` (raise it only for a block no test machine can run).
MAX_SKIPPED = 6

_MARKER = re.compile(r"^<!--\s*no-test:\s*(.*?)\s*-->\s*$")
_HUB_LOAD = re.compile(r"from_pretrained\(\s*[\"']([\w.-]+/[\w.-]+)[\"']")


@dataclass
class Block:
    """One ```` ```python ```` block: where it is, its text, and why it is not run (None: it is run)."""

    page: str
    line: int
    source: str
    skip: Optional[str]


def page_blocks(page: str) -> List[Block]:
    """The Python blocks of ``page`` (a path relative to the checkout), in order; a block indented under a
    list item loses its indentation."""
    with open(os.path.join(ROOT, page)) as f:
        lines = f.read().splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            indent = len(lines[i]) - len(lines[i].lstrip())
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
            prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marker = _MARKER.match(prev.strip())
            source = "\n".join(line[indent:] for line in lines[i + 1 : end]) + "\n"
            out.append(Block(page, i + 2, source, marker.group(1) if marker else None))
            i = end
        i += 1
    return out


_DOCS = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
PAGES = [p for p in ["README.md"] + _DOCS if page_blocks(p)]
RUN_PAGES = [p for p in PAGES if any(b.skip is None for b in page_blocks(p))]

# Runs a page's blocks (a JSON list) in one namespace; a traceback names the page and its line.
RUNNER = r"""
import json, sys
namespace = {"__name__": "__main__"}
for block in json.load(open(sys.argv[1])):
    code = compile("\n" * (block["line"] - 1) + block["source"], block["page"], "exec")
    exec(code, namespace)
    print(f"ran {block['page']}:{block['line']}", flush=True)
"""


def save_stand_in(kind: str, path: str) -> str:
    """A tiny random model of architecture ``kind`` with a tokenizer, saved as save_pretrained writes it."""
    from cli.local_model import make_local_model, word_tokenizer

    assert kind == "qwen3", kind
    return make_local_model(path, word_tokenizer(), tie=False, positions=4096)


def test_blocks_compile_and_skips_say_why() -> None:
    """Every block is valid Python, skipped ones included; a skip names its reason; there are few."""
    skipped = []
    for page in PAGES:
        for block in page_blocks(page):
            compile(block.source, f"{page}:{block.line}", "exec")
            if block.skip is not None:
                assert len(block.skip.split()) >= 3, f"{page}:{block.line}: say why it is not run"
                skipped.append(f"{page}:{block.line}")
    assert len(skipped) <= MAX_SKIPPED, skipped


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("page", RUN_PAGES)
def test_page_runs_as_written(page: str, tmp_path) -> None:
    blocks = [b for b in page_blocks(page) if b.skip is None]
    stand_ins: Dict[str, str] = {}
    for block in blocks:
        for hub_id in _HUB_LOAD.findall(block.source):
            assert hub_id in HUB_STAND_INS, f"{page}:{block.line} loads {hub_id}: add a stand-in or a no-test marker"
            if hub_id not in stand_ins:
                stand_ins[hub_id] = save_stand_in(HUB_STAND_INS[hub_id], str(tmp_path / "stand-ins" / hub_id))
    for block in blocks:
        for hub_id, path in stand_ins.items():
            block.source = re.sub(r"([\"'])" + re.escape(hub_id) + r"\1", repr(path), block.source)
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps([b.__dict__ for b in blocks]))
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, RPP_DEVICES="cpu:1", RPP_PROGRESS="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    cmd = [sys.executable, "-c", RUNNER, str(spec)]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=1100)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert [l for l in proc.stdout.splitlines() if l.startswith("ran ")] == [f"ran {page}:{b.line}" for b in blocks]
    # "As written" includes no call the libraries have deprecated: transformers' notices (torch_dtype=) and
    # Python warnings raised at a line of the page (a library's own deprecated internals are not the page's).
    notices = [l for l in proc.stderr.splitlines() if "deprecat" in l.lower()]
    deprecated = [l for l in notices if l.startswith(("[transformers]", page))]
    assert deprecated == [], deprecated


def test_trainer_example_imports_are_in_the_extra_it_names() -> None:
    """docs/trainer.md's Trainer example says which extra to install; every package it imports is in that
    extra or the core dependencies (``datasets`` included), and so is ``accelerate``, which
    ``transformers.Trainer`` needs."""
    import ast

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    page = open(os.path.join(ROOT, "docs", "trainer.md")).read()
    extra = re.search(r"pip install -e '\.\[(\w+)\]'", page)
    assert extra is not None, "docs/trainer.md names the extra to install"
    names = lambda reqs: {re.split(r"[<>=\[ ;]", r, maxsplit=1)[0].lower() for r in reqs}
    installed = names(project["dependencies"]) | names(project["optional-dependencies"][extra.group(1)])
    example = page_blocks("docs/trainer.md")[0]
    imported = set()
    for node in ast.walk(ast.parse(example.source)):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module.split(".")[0])
    assert "datasets" in imported
    assert imported - {"roundpipe"} | {"accelerate"} <= installed, (imported, installed)
