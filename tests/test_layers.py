"""The package's layers, read from its imports (docs/design.md): CuPy is imported only by the
backends and the adapters; torch and jax only by the adapters and the modules that exist for
them (the torch modules, the drop-ins, the context-parallel ring, the bench harness), never
below adapters/; and no two modules of cuattn import each other, directly or through
others."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "cuattn"

CUPY_HOMES = ("cuattn/backends/", "cuattn/adapters/")
# Modules whose job is one framework's: torch modules, the transformers/DeepSpeed/SDPA drop-ins,
# the context-parallel ring over torch.distributed, the bench harness timing torch's peers.
FRAMEWORK_HOMES = (
    "cuattn/adapters/",
    "cuattn/compat/",
    "cuattn/nn.py",
    "cuattn/sdpa.py",
    "cuattn/distributed/ring.py",
    "cuattn/tools/bench/",
)
FRAMEWORKS = ("torch", "jax", "jaxlib")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of its code (lazy imports count)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found |= imports_of_node(node, path)
    return found


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _importers_of(roots: tuple[str, ...], allowed: tuple[str, ...]) -> list[str]:
    return [
        _rel(path)
        for path in MODULES.values()
        if not _rel(path).startswith(allowed)
        and any(name.split(".")[0] in roots for name in imports(path))
    ]


def test_only_backends_and_adapters_import_cupy():
    assert _importers_of(("cupy", "cupy_backends"), CUPY_HOMES) == []


def test_only_the_framework_layers_import_torch_or_jax():
    assert _importers_of(FRAMEWORKS, FRAMEWORK_HOMES) == []


def _module_imports(path: Path) -> set[str]:
    """The cuattn modules ``path`` imports at module level (what an import cycle is made of:
    an import inside a function runs after both modules are loaded)."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= imports_of_node(node, path)
    return {n for n in names if n in MODULES and n != module_name(path)}


def imports_of_node(node: ast.AST, path: Path) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    assert isinstance(node, ast.ImportFrom)
    base = node.module or ""
    if node.level:
        anchor = module_name(path).split(".")
        if path.name != "__init__.py":
            anchor = anchor[:-1]
        base = ".".join(anchor[: len(anchor) - node.level + 1] + ([base] if base else []))
    return {base, *(f"{base}.{alias.name}" for alias in node.names)}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (module -> modules it imports) as a path, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_module_of_cuattn_imports_itself_back():
    graph = {name: _module_imports(path) for name, path in MODULES.items()}
    # a package's __init__ importing its own submodules is how a package is built, not a cycle
    for name in graph:
        graph[name] = {m for m in graph[name] if not m.startswith(name + ".")}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


@pytest.mark.parametrize(
    "graph, has_cycle",
    [({"a": {"b"}, "b": {"c"}, "c": set()}, False), ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True)],
)
def test_the_cycle_finder_sees_a_cycle(graph, has_cycle):
    assert (find_cycle(graph) is not None) == has_cycle
