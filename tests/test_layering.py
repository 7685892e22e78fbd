"""The package's shape, read from its source (ast): no private names taken from another module, no
import cycles (between modules, and between packages), lower layers below the systems, distributed,
apps and cli layers, every import going down the floors (`FLOORS`: a package imports only packages on
lower floors), commands only in cli/. Imports inside functions count. Each rule is also run on a
small made-up package that breaks it, so the checks can fail."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import engram

SRC = Path(engram.__file__).parent
LOWER = ("config", "device", "rowformat", "addressing", "storage", "model", "kernels")  # single-device core
UPPER = ("systems", "distributed", "apps", "cli", "hf", "vllm", "benchmarks")  # wrap the core from outside


def module_name(root: Path, path: Path) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def read_package(root: Path) -> dict[str, ast.Module]:
    return {
        module_name(root, p): ast.parse(p.read_text(), str(p))
        for p in sorted(root.rglob("*.py"))
        if "__pycache__" not in p.parts
    }


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """ids of the nodes inside `if TYPE_CHECKING:` blocks (imports for annotations only)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def imports(modules: dict[str, ast.Module], name: str) -> list[tuple[int, str, str | None, str | None]]:
    """(line, imported module, imported name or None, bound alias) of every import of the package's own
    modules in `name`, function-local ones included."""
    pkg = name.split(".")[0]
    tree, skip = modules[name], _type_checking_nodes(modules[name])
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == pkg:
                    out.append((node.lineno, a.name, None, a.asname))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] != pkg:
                continue
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if sub in modules:  # `from pkg.x import y` where y is a module
                    out.append((node.lineno, sub, None, a.asname or a.name))
                else:
                    out.append((node.lineno, node.module, a.name, a.asname or a.name))
    return out


def private_imports(modules: dict[str, ast.Module]) -> list[str]:
    """`from a import _x`, and `m._x` where m names another of the package's modules."""
    found = []
    for name, tree in modules.items():
        module_aliases = {}
        for line, target, imported, alias in imports(modules, name):
            if imported is not None and imported.startswith("_") and target != name:
                found.append(f"{name}:{line} imports {imported} from {target}")
            if imported is None and target != name:
                module_aliases[alias or target.split(".")[-1]] = target
                if target.split(".")[-1].startswith("_"):
                    found.append(f"{name}:{line} imports the private module {target}")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in module_aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                found.append(f"{name}:{node.lineno} uses {module_aliases[node.value.id]}.{node.attr}")
    return found


def import_graph(modules: dict[str, ast.Module]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name in modules:
        for _, target, _, _ in imports(modules, name):
            if target in modules and target != name:
                graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer_of(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


# The floors of src/engram, bottom first: a package may import only packages on lower floors (its own
# modules aside). The row formats' vocabulary, the config and the device choice at the bottom; the
# kernels speak the row format; storage and addressing use the kernels; the single-device model uses
# both; checkpoint files know the model; systems (tiers) and hf (attaching to HF models) wrap the model
# and read checkpoints; distributed wraps hf models across processes; the programs (apps) and the vLLM
# plugin use the library; the CLI registers commands over all of them; the benchmarks and
# `python -m engram` on top.
FLOORS: dict[str, int] = {
    "config": 0,
    "device": 0,
    "rowformat": 0,
    "kernels": 1,
    "storage": 2,
    "addressing": 2,
    "model": 3,
    "checkpoint": 4,
    "systems": 5,
    "hf": 5,
    "memory": 6,
    "distributed": 6,
    "apps": 7,
    "vllm": 7,
    "cli": 8,
    "benchmarks": 9,
    "__main__": 9,
    "integrations": 9,
}


def source_path(modules: dict[str, ast.Module], name: str) -> str:
    """The file of module `name`, relative to the package's parent folder ('engram/apps/lm/train.py')."""
    rel = name.replace(".", "/")
    return f"{rel}/__init__.py" if any(m.startswith(name + ".") for m in modules) else f"{rel}.py"


def climbing_imports(modules: dict[str, ast.Module], floors: dict[str, int]) -> list[str]:
    """Every import of another package that is not on a lower floor, as 'path:line (pkg, floor f)
    imports target (pkg, floor g)'; a package missing from `floors` is named too."""
    found = []
    root = next(iter(modules)).split(".")[0]
    for name in modules:
        layer = layer_of(name)
        if not layer:  # the package's own __init__ re-exports the public names
            continue
        if layer not in floors:
            found.append(f"{name}: package {layer!r} has no floor in FLOORS; give it one")
            continue
        path = source_path(modules, name)
        for line, target, _, _ in imports(modules, name):
            other = layer_of(target)
            if not other or other == layer or target.split(".")[0] != root:
                continue
            if other not in floors or floors[other] >= floors[layer]:
                found.append(
                    f"{path}:{line} ({layer}, floor {floors[layer]}) imports {target} "
                    f"({other}, floor {floors.get(other, '?')})"
                )
    return found


def package_graph(modules: dict[str, ast.Module]) -> dict[str, set[str]]:
    """The import graph between the package's top-level packages (function-local imports included)."""
    graph: dict[str, set[str]] = {layer_of(n): set() for n in modules if layer_of(n)}
    for name, targets in import_graph(modules).items():
        for target in targets:
            a, b = layer_of(name), layer_of(target)
            if a and b and a != b:
                graph[a].add(b)
    return graph


def layer_violations(modules: dict[str, ast.Module]) -> list[str]:
    found = []
    for name in modules:
        layer = layer_of(name)
        for line, target, _, _ in imports(modules, name):
            if layer == "config" and target != name:
                found.append(
                    f"{name}:{line} imports {target}: the config imports nothing else of the package"
                )
            if layer in LOWER and layer_of(target) in UPPER:
                found.append(f"{name}:{line} ({layer}) imports {target} ({layer_of(target)})")
        if layer in LOWER:
            for node in ast.walk(modules[name]):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
                if any(n.startswith("torch.distributed") for n in names):
                    found.append(f"{name}:{node.lineno} ({layer}) imports torch.distributed")
    return found


def commands_outside_cli(modules: dict[str, ast.Module]) -> list[str]:
    """argparse and `add_parser` belong to the cli package."""
    found = []
    for name, tree in modules.items():
        if layer_of(name) == "cli":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                if "argparse" in mods:
                    found.append(f"{name}:{node.lineno} imports argparse")
            if isinstance(node, ast.Attribute) and node.attr == "add_parser":
                found.append(f"{name}:{node.lineno} registers a command")
    return found


# ------------------------------------------------------------------------------------ the package


@pytest.fixture(scope="module")
def package() -> dict[str, ast.Module]:
    return read_package(SRC)


def test_the_package_is_read(package):
    assert {"engram.config", "engram.addressing.hashing", "engram.rowformat.fp8", "engram.cli"} <= set(
        package
    )
    assert len(import_graph(package)["engram.addressing.hashing"]) >= 3


def test_no_private_names_across_modules(package):
    assert private_imports(package) == []


def test_no_import_cycles(package):
    assert cycles(import_graph(package)) == []


def test_no_package_cycles(package):
    assert cycles(package_graph(package)) == []


def test_imports_go_down_the_floors(package):
    assert climbing_imports(package, FLOORS) == []


def test_lower_layers_do_not_import_upper_ones(package):
    assert layer_violations(package) == []


def test_commands_live_in_cli(package):
    assert commands_outside_cli(package) == []


# ------------------------------------------------------------------------ the checks can fail


@pytest.fixture
def broken(tmp_path: Path) -> dict[str, ast.Module]:
    root = tmp_path / "pkg"
    files = {
        "__init__.py": "",
        "config.py": "from pkg.addressing import hashing\n",
        "addressing/__init__.py": "",
        "addressing/hashing.py": "from pkg.storage.fp8 import _check\nimport torch.distributed\n",
        "storage/__init__.py": "",
        "storage/fp8.py": "def _check(): ...\n\ndef f():\n    from pkg.model import table\n    return table._rows\n",
        "model/__init__.py": "",
        "model/table.py": "from pkg.storage import fp8\nfrom pkg.systems.cache import RowCache\n",
        "systems/__init__.py": "",
        "systems/cache.py": "import argparse\n\nRowCache = None\n",
        "cli/__init__.py": "import argparse\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return read_package(root)


def test_checks_find_what_is_wrong(broken):
    assert private_imports(broken) == [
        "pkg.addressing.hashing:1 imports _check from pkg.storage.fp8",
        "pkg.storage.fp8:5 uses pkg.model.table._rows",
    ]
    assert cycles(import_graph(broken)) == [["pkg.model.table", "pkg.storage.fp8"]]
    assert layer_violations(broken) == [
        "pkg.addressing.hashing:2 (addressing) imports torch.distributed",
        "pkg.config:1 imports pkg.addressing.hashing: the config imports nothing else of the package",
        "pkg.model.table:2 (model) imports pkg.systems.cache (systems)",
    ]
    assert commands_outside_cli(broken) == ["pkg.systems.cache:1 imports argparse"]


def test_floor_checks_find_what_climbs(broken):
    floors = {"config": 0, "addressing": 1, "storage": 1, "model": 2, "systems": 3, "cli": 4}
    assert climbing_imports(broken, floors) == [
        "pkg/addressing/hashing.py:1 (addressing, floor 1) imports pkg.storage.fp8 (storage, floor 1)",
        "pkg/config.py:1 (config, floor 0) imports pkg.addressing.hashing (addressing, floor 1)",
        "pkg/model/table.py:2 (model, floor 2) imports pkg.systems.cache (systems, floor 3)",
        "pkg/storage/fp8.py:4 (storage, floor 1) imports pkg.model.table (model, floor 2)",
    ]
    assert cycles(package_graph(broken)) == [["model", "storage"]]
