"""The package's shape, checked from the source so it stays that way: no import cycle between roundpipe's
modules (annotation-only imports under ``if TYPE_CHECKING:`` counted too, as ``shared/tools/import_cycles.py
--strict`` counts them), no module importing a private name of another, no file over the size limit, no line
over the width limit; the model protocol the lower modules use declares only what a RoundPipe has; the
layer folders (``devices``, ``planning``, ``runtime``) import only what their rules allow."""

from __future__ import annotations

import ast
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
    through a protocol (``roundpipe.model_protocol``), not the wrapper above it."""
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


@pytest.mark.parametrize("name", sorted(MODULES))
def test_files_stay_under_the_size_limit(name: str) -> None:
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, (
        f"{MODULES[name].relative_to(ROOT)} has {lines} lines (limit {MAX_LINES}); split it along its joints"
    )


@pytest.mark.parametrize("name", sorted(MODULES))
def test_lines_stay_under_the_width_limit(name: str) -> None:
    wide = [i for i, line in enumerate(MODULES[name].read_text().splitlines(), 1) if len(line) > MAX_COLUMNS]
    assert not wide, f"{MODULES[name].relative_to(ROOT)}: lines {wide} are over {MAX_COLUMNS} columns"


def test_a_roundpipe_has_what_the_model_protocol_declares() -> None:
    """``PipelinedModel`` (and the protocols it extends) declare only members a RoundPipe has, so the
    modules typed against it ask nothing the wrapper lacks."""
    import typing

    from torch import nn

    from roundpipe import RoundPipe
    from roundpipe.model_protocol import PipelinedModel

    model = RoundPipe(nn.Sequential(nn.Linear(2, 2)), name="protocol")
    declared: Set[str] = set()
    for proto in PipelinedModel.__mro__:
        if proto.__module__.startswith("roundpipe."):  # the protocols themselves, not typing's bases
            declared |= set(vars(proto).get("__annotations__", {}))
            declared |= {n for n, v in vars(proto).items() if callable(v) and not n.startswith("__")}
    assert {"name", "layers", "layer_size", "model_timer", "optim_units", "_replan_pays"} <= declared
    missing = sorted(n for n in declared if not hasattr(model, n))
    assert not missing, f"declared by the model protocol but not on a RoundPipe: {missing}"
    assert typing.get_type_hints(PipelinedModel)  # the annotations resolve (no name imported for types only)


def test_the_device_layer_knows_nothing_of_runs() -> None:
    """Dispatch goes run -> device, never back: the worker runs callables."""
    deps = graph()["roundpipe.devices.device"]
    assert not deps & {
        "roundpipe.runtime.run",
        "roundpipe.runtime.jobs",
        "roundpipe.runtime.pipeline",
        "roundpipe.roundpipe",
        "roundpipe.planning.plan",
    }


# The three layer folders (issue 40 item 2). Rules stated as they hold; the known exceptions are listed
# by name, so a new crossing fails here and a removed one is a line to delete.
LAYERS = ("roundpipe.devices", "roundpipe.planning", "roundpipe.runtime")
UPPER = ("roundpipe.optim", "roundpipe.models", "roundpipe.cli", "roundpipe.distributed", "roundpipe.integrations")
TOP = ("roundpipe.roundpipe", "roundpipe.wrapper", "roundpipe.run_config")


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _layer_modules(layer: str) -> List[str]:
    return sorted(n for n in MODULES if _under(n, layer) and n != layer)


def _crossings(layer: str) -> Set[Tuple[str, str]]:
    """(module of ``layer``, module outside it) for each import, annotation-only imports included."""
    edges = graph(annotations=True)
    return {(src, dst) for src in _layer_modules(layer) for dst in edges[src] if not _under(dst, layer)}


def test_the_layer_folders_exist_and_their_inits_import_nothing() -> None:
    """Each folder is a package whose ``__init__`` only says what the layer is: importing one of its
    modules pays for nothing else, and the folder can close no cycle."""
    for layer in LAYERS:
        init = MODULES[layer]
        tree = ast.parse(init.read_text())
        assert ast.get_docstring(tree), f"{init.relative_to(ROOT)} says what the layer is"
        assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))], init
        assert _layer_modules(layer), f"{layer} holds modules"


def test_the_device_layer_imports_only_settings_and_utils_from_outside() -> None:
    """``roundpipe.devices`` runs callables: nothing of plans, runs, optimizers, models, the CLI or the
    wrapper; from the rest of the package only ``roundpipe.settings`` and ``roundpipe.utils``."""
    outside = {dst for _, dst in _crossings("roundpipe.devices")}
    assert outside <= {"roundpipe.settings", "roundpipe.utils"}, sorted(_crossings("roundpipe.devices"))
    forbidden = ("roundpipe.planning", "roundpipe.runtime") + UPPER + TOP
    assert not [d for d in outside if any(_under(d, f) for f in forbidden)]


def test_the_planning_layer_imports_no_optimizer_model_cli_or_wrapper() -> None:
    """Planning decides; it imports nothing of the optimizer, the presets, the CLI, data parallel or the
    wrapper. Known exception, both ways between planning and runtime (no module cycle, a test above checks):
    ``plan`` asks ``runtime.partial_grads`` how a layer's gradient splits, ``simulate`` which microbatches
    each part of a split group runs, and ``plan_choice`` (the plan of one call) reads the call's batch and
    run. The other planning modules import nothing of the runtime."""
    crossings = _crossings("roundpipe.planning")
    forbidden = UPPER + TOP[:2]
    assert not [c for c in crossings if any(_under(c[1], f) for f in forbidden)], sorted(crossings)
    into_runtime = {c for c in crossings if _under(c[1], "roundpipe.runtime")}
    assert into_runtime <= {
        ("roundpipe.planning.plan", "roundpipe.runtime.partial_grads"),
        ("roundpipe.planning.plan_choice", "roundpipe.runtime.batch"),
        ("roundpipe.planning.plan_choice", "roundpipe.runtime.partial_grads"),
        ("roundpipe.planning.plan_choice", "roundpipe.runtime.run"),
        ("roundpipe.planning.simulate", "roundpipe.runtime.partial_grads"),
    }, sorted(into_runtime)


def test_the_runtime_layer_reaches_the_optimizer_only_where_listed() -> None:
    """The runtime imports nothing of the presets, the CLI, data parallel, the integrations or the wrapper
    above it. Of ``roundpipe.optim`` it may use the package's face only: the optimizer thread and the step
    protocol it shares with the runtime are the host layer's (``roundpipe.host``)."""
    crossings = _crossings("roundpipe.runtime")
    forbidden = UPPER[1:] + TOP[:2]
    assert not [c for c in crossings if any(_under(c[1], f) for f in forbidden)], sorted(crossings)
    optim_internals = {c for c in crossings if _under(c[1], "roundpipe.optim") and c[1] != "roundpipe.optim"}
    assert not optim_internals, sorted(optim_internals)


def test_the_host_layer_imports_only_settings_helpers_and_devices() -> None:
    """``roundpipe.host`` (host buffers, events, the optimizer thread, the step protocol and cycle) imports
    from the rest of the package only the settings, the small helpers and the device layer."""
    init = ast.parse(MODULES["roundpipe.host"].read_text())
    assert ast.get_docstring(init) and not [n for n in ast.walk(init) if isinstance(n, (ast.Import, ast.ImportFrom))]
    allowed = ("roundpipe.settings", "roundpipe.setting_parsers", "roundpipe.utils", "roundpipe.flavors")
    outside = {dst for _, dst in _crossings("roundpipe.host")}
    assert not [d for d in outside if d not in allowed and not _under(d, "roundpipe.devices")], sorted(outside)


def test_the_folder_rules_see_crossings() -> None:
    """The rules above read real imports: the runtime does import the device layer."""
    assert ("roundpipe.runtime.compute", "roundpipe.devices.device") in _crossings("roundpipe.runtime")


KEPT_FOLDER = {"roundpipe.device": "devices", "roundpipe.batch": "runtime"}
KEPT_FOLDER.update({k: "planning" for k in ("roundpipe.plan", "roundpipe.timer", "roundpipe.estimate")})
KEPT_PATHS = tuple(KEPT_FOLDER)


def test_kept_import_paths_are_the_moved_modules_and_nothing_imports_them() -> None:
    """The documented paths of moved modules are for users: each is the moved module itself (one set of
    globals, one place to monkeypatch), and the package imports the real path."""
    import importlib

    for kept in KEPT_PATHS:
        real = kept.replace("roundpipe.", "roundpipe." + KEPT_FOLDER[kept] + ".", 1)
        assert importlib.import_module(kept) is importlib.import_module(real), kept
    edges = graph(annotations=True)
    users = sorted((src, dst) for src, deps in edges.items() for dst in deps & set(KEPT_PATHS) if src not in KEPT_PATHS)
    assert not users, f"import the moved modules by their folder path: {users}"
