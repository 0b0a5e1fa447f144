"""The package's shape, checked from the source so it stays that way: no import cycle between roundpipe's
modules (annotation-only imports under ``if TYPE_CHECKING:`` counted too), no module importing a private
name of another, no file over the size limit as ``ruff format`` leaves it, no line over the width limit; the
model protocol the runtime uses declares only what a RoundPipe has; each layer imports only the layers below
it; the kept import paths import, and nothing in the package imports them."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "roundpipe"
MAX_LINES = 600
MAX_COLUMNS = 120


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: Dict[str, Path] = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolve(current: str, is_package: bool, level: int, target: str) -> str:
    """The absolute name of ``from <level dots><target> import ...`` inside module ``current``."""
    if level == 0:
        return target
    base = current.split(".") if is_package else current.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _type_checking_block(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` (annotations only: never imported at run time)."""
    return (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Name)
        and node.test.id == "TYPE_CHECKING"
        or (isinstance(node, ast.If) and isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")
    )


def imports_of(name: str, annotations: bool = False) -> List[Tuple[str, List[str]]]:
    """(imported roundpipe module, names imported from it) for every run-time import in ``name``,
    function-level imports included (they are real dependencies, only deferred); with ``annotations``,
    the annotation-only imports under ``if TYPE_CHECKING:`` too."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    out: List[Tuple[str, List[str]]] = []

    def visit(node: ast.AST) -> None:
        if _type_checking_block(node) and not annotations:
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "roundpipe":
                    out.append((alias.name, []))
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(name, is_package, node.level, node.module or "")
            if target.split(".")[0] == "roundpipe":
                names = [a.name for a in node.names]
                # ``from roundpipe import device`` imports a submodule, not a name.
                subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
                out.extend((s, []) for s in subs)
                rest = [n for n in names if f"{target}.{n}" not in MODULES]
                if rest:
                    out.append((target, rest))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def graph(annotations: bool = False) -> Dict[str, Set[str]]:
    """Module -> the roundpipe modules it imports (with ``annotations``, annotation-only imports
    included). Importing ``a.b`` runs ``a/__init__`` too, but that is the package's own business: an edge
    goes to the module named, not to its parents."""
    edges: Dict[str, Set[str]] = {}
    for name in MODULES:
        deps = set()
        for target, _ in imports_of(name, annotations):
            while target not in MODULES and "." in target:
                target = target.rsplit(".", 1)[0]
            if target != name and target in MODULES:
                deps.add(target)
        edges[name] = deps
    return edges


def find_cycle(edges: Dict[str, Set[str]]) -> List[str]:
    """One cycle of the graph as a list of modules (empty when there is none)."""
    state: Dict[str, int] = {}
    stack: List[str] = []

    def dfs(node: str) -> List[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = dfs(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(edges):
        if node not in state:
            found = dfs(node)
            if found:
                return found
    return []


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_no_import_cycle() -> None:
    # A package's __init__ may re-export its own submodules (``roundpipe.optim`` exports Adam): those
    # edges point down, so they cannot close a cycle unless a submodule imports its package back.
    cycle = find_cycle(graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_through_annotations() -> None:
    """Annotation-only imports close no loop either: a lower module names what it needs of a model
    through a protocol (``roundpipe.runtime.model_protocol``), not the wrapper above it."""
    cycle = find_cycle(graph(annotations=True))
    assert not cycle, "import cycle (annotation-only imports counted): " + " -> ".join(cycle)


def test_no_module_imports_a_private_name_of_another() -> None:
    offenders = []
    for name in MODULES:
        for target, names in imports_of(name):
            if target == name:
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private:
                offenders.append(f"{name} imports {private} from {target}")
    assert not offenders


def _ruff() -> List[str]:
    """The command that runs ruff (the one on PATH, or the one beside this Python), or [] without it."""
    found = shutil.which("ruff") or shutil.which("ruff", path=str(Path(sys.executable).parent))
    return [found] if found else []


def _formatted_lines() -> Dict[str, int]:
    """Lines of each module as ``ruff format`` would leave it (the raw count without ruff): a file is
    measured as formatted, so packing it by hand under the limit does not pass."""
    counts = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    ruff = _ruff()
    if not ruff:
        return counts
    for name, path in MODULES.items():
        out = subprocess.run(
            ruff + ["format", "--stdin-filename", str(path), "-"],
            input=path.read_text(),
            capture_output=True,
            text=True,
            cwd=ROOT,
            check=True,
        )
        counts[name] = len(out.stdout.splitlines())
    return counts


FORMATTED_LINES = _formatted_lines()


@pytest.mark.parametrize("name", sorted(MODULES))
def test_files_stay_under_the_size_limit(name: str) -> None:
    lines = FORMATTED_LINES[name]
    assert lines <= MAX_LINES, (
        f"{MODULES[name].relative_to(ROOT)} has {lines} lines as formatted (limit {MAX_LINES}); split it along its "
        "joints"
    )


def test_the_size_check_measures_formatted_text() -> None:
    """A hand-packed file counts as ruff leaves it: one line of three statements is three lines."""
    ruff = _ruff()
    if not ruff:
        pytest.skip("ruff is not installed: sizes are raw line counts")
    out = subprocess.run(
        ruff + ["format", "-"], input="a = 1; b = 2; c = 3\n", capture_output=True, text=True, cwd=ROOT
    )
    assert len(out.stdout.splitlines()) == 3


@pytest.mark.parametrize("name", sorted(MODULES))
def test_lines_stay_under_the_width_limit(name: str) -> None:
    wide = [i for i, line in enumerate(MODULES[name].read_text().splitlines(), 1) if len(line) > MAX_COLUMNS]
    assert not wide, f"{MODULES[name].relative_to(ROOT)}: lines {wide} are over {MAX_COLUMNS} columns"


def test_a_roundpipe_has_what_the_model_protocol_declares() -> None:
    """``PipelinedModel`` (and the protocols it extends) declare only members a RoundPipe has, so the
    modules typed against it ask nothing the wrapper lacks; the protocol asks nothing private of it."""
    import typing

    from torch import nn

    from roundpipe import RoundPipe
    from roundpipe.runtime.model_protocol import PipelinedModel

    model = RoundPipe(nn.Sequential(nn.Linear(2, 2)), name="protocol")
    declared: Set[str] = set()
    for proto in PipelinedModel.__mro__:
        if proto.__module__.startswith("roundpipe."):  # the protocols themselves, not typing's bases
            declared |= set(vars(proto).get("__annotations__", {}))
            declared |= {n for n, v in vars(proto).items() if callable(v) and not n.startswith("__")}
    assert {"name", "layers", "layer_size", "model_timer", "optim_units", "plan_cache"} <= declared
    assert not [n for n in declared if n.startswith("_")], sorted(declared)
    missing = sorted(n for n in declared if not hasattr(model, n))
    assert not missing, f"declared by the model protocol but not on a RoundPipe: {missing}"
    assert typing.get_type_hints(PipelinedModel)  # the annotations resolve (no name imported for types only)


# The layers, lowest first. Each imports only the layers below it and its own folder (annotation-only
# imports counted); everything else in the package (the wrapper, models, optim's math, distributed, the CLI,
# the integrations, the kept paths) stands above them all and may import any of them.
BASE = ("roundpipe.settings", "roundpipe.utils", "roundpipe.flavors", "roundpipe.rope_scaling")
FOLDERS = ("roundpipe.devices", "roundpipe.host", "roundpipe.planning", "roundpipe.runtime")
LAYERS = ("base",) + FOLDERS
ABOVE = len(LAYERS)  # the rank of everything above the layers


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def rank(name: str) -> int:
    """The layer of module ``name``: 0 for the small helpers, 1-4 for the folders, ``ABOVE`` otherwise."""
    if any(_under(name, b) for b in BASE):
        return 0
    for k, folder in enumerate(FOLDERS, 1):
        if _under(name, folder):
            return k
    return ABOVE


def upward_imports(layer: str) -> List[Tuple[str, str]]:
    """(module of ``layer``, module it imports) for each import that does not point below ``layer`` or
    inside it, annotation-only imports included."""
    k = LAYERS.index(layer)
    edges = graph(annotations=True)
    return sorted((src, dst) for src in sorted(edges) if rank(src) == k for dst in edges[src] if rank(dst) > k)


def test_the_rank_follows_the_layer_order() -> None:
    assert [rank(n) for n in ("roundpipe.utils", "roundpipe.devices.device", "roundpipe.planning.plan")] == [0, 1, 3]
    assert [rank(n) for n in ("roundpipe.host.step", "roundpipe.runtime.run", "roundpipe.roundpipe")] == [2, 4, 5]
    assert rank("roundpipe.optim.adam") == rank("roundpipe.cli.plan") == rank("roundpipe") == ABOVE


@pytest.mark.parametrize("layer", LAYERS)
def test_each_layer_imports_only_the_layers_below_it(layer: str) -> None:
    """The whole rule, without exceptions: a module of a layer imports modules of lower layers and of its
    own, nothing above."""
    upward = upward_imports(layer)
    assert not upward, f"{layer} imports from above it: {upward}"


@pytest.mark.parametrize("layer", FOLDERS)
def test_the_layer_folders_say_what_they_are_and_their_inits_import_nothing(layer: str) -> None:
    """Each folder is a package whose ``__init__`` only says what the layer is: importing one of its
    modules pays for nothing else, and the folder can close no cycle."""
    init = MODULES[layer]
    tree = ast.parse(init.read_text())
    assert ast.get_docstring(tree), f"{init.relative_to(ROOT)} says what the layer is"
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))], init
    assert [n for n in MODULES if _under(n, layer) and n != layer], f"{layer} holds modules"


def test_the_layer_rule_sees_real_imports() -> None:
    """The rule reads real imports: the runtime imports the device layer, and an import of the wrapper
    from a layer would be seen as one pointing up."""
    edges = graph(annotations=True)
    assert "roundpipe.devices.device" in edges["roundpipe.runtime.compute"]
    assert rank("roundpipe.roundpipe") > rank("roundpipe.runtime.compute")
    assert "roundpipe.runtime.run" in edges["roundpipe.roundpipe"]


#: The import paths users keep (the spec and the user docs name them); the last four are the moved module
#: itself, registered under the old name.
KEPT_PATHS = (
    "roundpipe",
    "roundpipe.roundpipe",
    "roundpipe.optim",
    "roundpipe.run_config",
    "roundpipe.models",
    "roundpipe.batch",
    "roundpipe.device",
    "roundpipe.timer",
)
MOVED = {
    "roundpipe.run_config": "roundpipe.runtime.run_config",
    "roundpipe.batch": "roundpipe.runtime.batch",
    "roundpipe.device": "roundpipe.devices.device",
    "roundpipe.timer": "roundpipe.planning.timer",
}


@pytest.mark.parametrize("path", KEPT_PATHS)
def test_a_kept_import_path_imports(path: str) -> None:
    import importlib

    module = importlib.import_module(path)
    if path in MOVED:  # one set of globals, one place to monkeypatch
        assert module is importlib.import_module(MOVED[path]), path


def _registers_itself_under_another_name(path: Path) -> bool:
    """Whether a module replaces itself in ``sys.modules`` (``sys.modules[__name__] = ...``)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if (
                    isinstance(target, ast.Subscript)
                    and isinstance(target.value, ast.Attribute)
                    and target.value.attr == "modules"
                    and isinstance(target.slice, ast.Name)
                    and target.slice.id == "__name__"
                ):
                    return True
    return False


def test_the_only_aliases_are_the_kept_paths_and_nothing_imports_them() -> None:
    """A module that stands in for another exists only for a kept path, and the package imports the real
    path: an alias kept for an old path that no user was given is deleted, not imported."""
    aliases = sorted(n for n, p in MODULES.items() if _registers_itself_under_another_name(p))
    assert aliases == sorted(MOVED), aliases
    edges = graph(annotations=True)
    users = sorted((src, dst) for src, deps in edges.items() for dst in deps & set(MOVED) if src not in MOVED)
    assert not users, f"import the moved modules by their folder path: {users}"
