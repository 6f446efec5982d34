"""The runtime's modules form a DAG: no module imports, directly or through others, one
that imports it back -- imports inside functions included, since they only hide a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import disttrain

RUNTIME = Path(disttrain.__file__).parent / "runtime"


def imports_of(path: Path, siblings: set[str], level: int = 1) -> set[str]:
    """The sibling modules ``path`` imports; ``level`` is how many dots reach the runtime
    package from it (2 inside a subpackage such as ``strategies/``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == level:
            names = [node.module.split(".")[0]] if node.module else [a.name for a in node.names]
            found.update(n for n in names if n in siblings)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("disttrain.runtime."):
            found.add(node.module.split(".")[2])
    return found


def test_runtime_imports_form_a_dag():
    modules = {p.stem: [p] for p in RUNTIME.glob("*.py")}
    # A subpackage (strategies/) is one node: the imports of all its modules.
    modules.update({p.name: sorted(p.glob("*.py")) for p in RUNTIME.iterdir() if (p / "__init__.py").is_file()})
    siblings = set(modules)
    graph = {name: set().union(*(imports_of(path, siblings, 2 if path.parent != RUNTIME else 1)
                                 for path in paths)) - {name}
             for name, paths in modules.items()}
    order: list[str] = []
    state: dict[str, str] = {}

    def visit(name: str, trail: list[str]) -> None:
        if state.get(name) == "done":
            return
        assert state.get(name) != "open", f"import cycle: {' -> '.join(trail + [name])}"
        state[name] = "open"
        for dep in sorted(graph[name]):
            visit(dep, trail + [name])
        state[name] = "done"
        order.append(name)

    for name in sorted(graph):
        visit(name, [])
    assert order.index("state") < order.index("context") < order.index("loop") < order.index("resume")
    assert order.index("strategies") < order.index("checkpoint") < order.index("resume")


def test_runtime_state_lives_on_the_context(ctx):
    assert ctx.runtime is disttrain.context().runtime
    assert ctx.runtime.training is None and not list(ctx.runtime.models)
