"""The package's import graph: no circles, and each group imports only its own and the groups listed before it.

Every import counts, a function's deferred one too: a circle broken only at import time is still a circle
in the design.  ``python tests/test_layout.py`` prints each module with its floor (0: imports nothing of
dlite's) and any circle.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "dlite_cli"

# Groups, foundations first: a module may import its own group and the groups before it, never one after.
GROUPS = ["core", "data", "models", "decoding", "training", "vllm_engine", "bench", "serve", "cli"]
TOP_LEVEL = {"__init__": "core", "__main__": "cli", "cli": "cli", "pipeline": "cli"}


def module_name(path: Path) -> str:
    """``src/dlite_cli/core/config.py`` -> ``dlite_cli.core.config``; a package's ``__init__.py`` is the package."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the dlite modules it imports (anywhere in its body)."""
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets.add(base)
                targets.update(f"{base}.{alias.name}" for alias in node.names)
        graph[name] = {target for target in targets if target in paths and target != name}
    return graph


def components(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components (Tarjan), each sorted: a module alone, or the modules of a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The components of more than one module."""
    return [component for component in components(graph) if len(component) > 1]


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Module -> its floor: 0 if it imports no dlite module, else one above the highest it imports (the modules of a
    circle share one floor)."""
    floor: dict[str, int] = {}
    for component in components(graph):  # Tarjan's order: every component after those it imports
        below = [floor[target] for member in component for target in graph[member] if target not in component]
        floor.update((member, 1 + max(below) if below else 0) for member in component)
    return floor


def group(module: str) -> str:
    """The group a module belongs to: its subpackage, or for a top-level module its entry in TOP_LEVEL."""
    parts = module.split(".")[1:] or ["__init__"]
    return parts[0] if len(parts) > 1 or parts[0] in GROUPS else TOP_LEVEL[parts[0]]


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_each_group_imports_only_its_own_and_the_groups_listed_before_it():
    graph = import_graph()
    upward = [
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        if GROUPS.index(group(target)) > GROUPS.index(group(module))
    ]
    assert upward == []


if __name__ == "__main__":
    graph = import_graph()
    floor = floors(graph)
    for module in sorted(graph, key=lambda name: (floor[name], name)):
        print(f"{floor[module]:3d}  {module}")
    print(f"{len(graph)} modules on {max(floor.values()) + 1} floors; circles: {circles(graph) or 'none'}")
    sys.exit(1 if circles(graph) else 0)
