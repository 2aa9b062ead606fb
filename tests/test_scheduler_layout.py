"""The scheduler's modules form layers: no module imports, even inside a function or under
TYPE_CHECKING, one that imports it back (services/scheduler/README.md draws the layers)."""

from __future__ import annotations

import ast
from pathlib import Path

SCHEDULER = Path(__file__).resolve().parent.parent / "services" / "scheduler"
PACKAGE = "llmgw.services.scheduler"


def scheduler_imports(path: Path) -> set[str]:
    """The scheduler modules ``path`` imports, anywhere in it: ``from PACKAGE import x``, ``from PACKAGE.x
    import …`` and ``import PACKAGE.x``, by module name (``x``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            if node.module == PACKAGE:
                found |= {alias.name for alias in node.names}
            elif node.module.startswith(PACKAGE + "."):
                found.add(node.module.removeprefix(PACKAGE + ".").split(".")[0])
        elif isinstance(node, ast.Import):
            found |= {
                alias.name.removeprefix(PACKAGE + ".").split(".")[0]
                for alias in node.names
                if alias.name.startswith(PACKAGE + ".")
            }
    return found


def import_graph() -> dict[str, set[str]]:
    modules = {p.stem: p for p in SCHEDULER.glob("*.py") if p.stem != "__init__"}
    return {name: scheduler_imports(path) & set(modules) - {name} for name, path in modules.items()}


def a_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle in ``graph`` as the modules along it (first = last), or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return None
        path.append(module)
        for imported in sorted(graph[module]):
            if (cycle := visit(imported)) is not None:
                return cycle
        path.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        if (cycle := visit(module)) is not None:
            return cycle
    return None


def test_no_scheduler_module_imports_one_that_imports_it_back() -> None:
    graph = import_graph()
    assert {"reconcile", "vocabulary", "state"} <= set(graph), "the scheduler's modules are where this test looks"
    cycle = a_cycle(graph)
    assert cycle is None, "import cycle: " + " → ".join(cycle or [])


def test_the_cycle_finder_finds_a_cycle_through_an_import_made_inside_a_function(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text(f"from {PACKAGE}.b import x\n")
    (tmp_path / "b.py").write_text(f"def f():\n    from {PACKAGE} import a\n")
    graph = {name: scheduler_imports(tmp_path / f"{name}.py") for name in ("a", "b")}
    assert graph == {"a": {"b"}, "b": {"a"}}
    assert a_cycle(graph) == ["a", "b", "a"]


def test_the_vocabulary_imports_neither_the_pass_nor_its_steps() -> None:
    # Every step speaks the vocabulary; were it to import one of them, the circle would be back.
    assert import_graph()["vocabulary"] <= {"placement", "preemption", "state"}
