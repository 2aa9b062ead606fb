"""Nothing in ``cli/`` folds events itself: what the CLI knows from the log it reads through the
shared folds in ``events/folds`` (docs/decisions.md, "One fold per fact"), or from a projection.

A command may still tell events apart to say them in words or to know when to stop following
(``mirror fetch`` printing each verified file, ``model remove --purge`` stopping at the purge's
end). What it may not do is keep what they say: that is a fold, and a second fold of one fact
drifts from the first (as the fleet projection's and the scheduler's once did). The test reads
the source: no function of ``cli/`` that tests an event payload's type stores anything in a
collection or an object, and the folds it uses come from ``llmgw.events.folds``, not a service.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

CLI = Path(__file__).resolve().parent.parent / "cli"
SCHEMA = "llmgw.events.schema"
NOT_PAYLOADS = {f"{SCHEMA}.{m}" for m in ("envelope", "codec", "registry", "subjects", "ids")}
STORING_CALLS = {"update", "append", "extend", "insert", "add", "setdefault", "__setitem__"}


def cli_modules() -> Iterator[tuple[Path, ast.Module]]:
    for path in sorted(CLI.glob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def payload_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(aliases of payload schema modules, payload names imported directly) in a module."""
    modules: set[str] = set()
    names: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or node.module is None:
            continue
        if node.module == SCHEMA:
            modules |= {a.asname or a.name for a in node.names if f"{SCHEMA}.{a.name}" not in NOT_PAYLOADS}
        elif node.module.startswith(SCHEMA + ".") and node.module not in NOT_PAYLOADS:
            names |= {a.asname or a.name for a in node.names}
    return modules, names


def is_payload_type(node: ast.expr, modules: set[str], names: set[str]) -> bool:
    if isinstance(node, ast.Tuple):
        return any(is_payload_type(e, modules, names) for e in node.elts)
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return node.value.id in modules
    return isinstance(node, ast.Name) and node.id in names


def tells_payloads_apart(node: ast.AST, modules: set[str], names: set[str]) -> bool:
    """Whether ``node`` tests a payload's type: ``isinstance(p, E.X)`` or ``case E.X():``."""
    for n in ast.walk(node):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "isinstance":
            if len(n.args) == 2 and is_payload_type(n.args[1], modules, names):
                return True
        if isinstance(n, ast.MatchClass) and is_payload_type(n.cls, modules, names):
            return True
    return False


def stores(node: ast.AST) -> Iterator[tuple[ast.AST, str]]:
    """Each store under ``node`` beyond rebinding a name (an attribute or item set, a counter moved, a
    collection grown), with the name of what it stores into."""
    for n in ast.walk(node):
        targets: list[ast.expr] = []
        if isinstance(n, ast.Assign):
            targets = [t for t in n.targets if isinstance(t, ast.Attribute | ast.Subscript)]
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Attribute | ast.Subscript):
            targets = [n.target]
        elif isinstance(n, ast.AugAssign):
            targets = [n.target]
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in STORING_CALLS:
            targets = [n.func.value]
        for t in targets:
            while isinstance(t, ast.Attribute | ast.Subscript | ast.Call):
                t = t.func if isinstance(t, ast.Call) else t.value
            yield n, t.id if isinstance(t, ast.Name) else ast.unparse(t)


def bound(node: ast.AST) -> set[str]:
    """The names ``node`` binds (assignments, loop targets, with ... as)."""
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def what_it_keeps(function: ast.FunctionDef | ast.AsyncFunctionDef, modules: set[str], names: set[str]) -> list[str]:
    """Where ``function`` keeps what events say past the event: a store into something that outlives
    one event — made before the loop over the events, a parameter (the state a helper is handed), or
    not the function's at all (``self``, a global). A flag a loop steers by (``started = True``) is
    a rebound name, not a store; a list made to say one event in words is made afresh for it."""
    params = {a.arg for a in (*function.args.posonlyargs, *function.args.args, *function.args.kwonlyargs)}
    local = bound(function) - params
    loops = [
        n
        for n in ast.walk(function)
        if isinstance(n, ast.For | ast.AsyncFor | ast.While) and tells_payloads_apart(n, modules, names)
    ]
    kept = []
    for node, name in stores(function):
        loop = next((lp for lp in loops if any(n is node for n in ast.walk(lp))), None)
        fresh = name in local and (loop is None or name in bound(loop))
        if not fresh:
            kept.append(f"line {node.lineno}: {ast.unparse(node).splitlines()[0]}")
    return kept


def test_no_cli_command_keeps_what_the_events_it_tells_apart_say() -> None:
    folding = {}
    seen = 0
    for path, tree in cli_modules():
        modules, names = payload_names(tree)
        for function in ast.walk(tree):
            if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef) and tells_payloads_apart(
                function, modules, names
            ):
                seen += 1
                if kept := what_it_keeps(function, modules, names):
                    folding[f"{path.name}:{function.name}"] = kept
    assert seen, "no cli function tells payloads apart any more: this test reads nothing (update it)"
    assert not folding, f"cli/ folds events by hand (call the fold in events/folds instead): {folding}"


def test_the_cli_takes_its_folds_from_events_folds_never_from_a_service() -> None:
    from_services = []
    for path, tree in cli_modules():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("llmgw.services."):
                continue
            folds = [a.name for a in node.names if a.name.endswith("State") or a.name.startswith("fold")]
            if node.module.endswith(".state") or folds:
                from_services.append(f"{path.name}:{node.lineno}: from {node.module} import {', '.join(folds)}")
    assert not from_services, f"move the fold to events/folds and import it from there: {from_services}"


def test_a_fold_kept_by_hand_in_the_cli_is_caught_and_a_line_said_is_not() -> None:
    """The reading above finds the fold `ctl job` once kept by hand (each step's data gathered across
    the job's events), a helper filling the state it is handed, and lets a line be built for one event."""
    tree = ast.parse(
        "from llmgw.events.schema import jobs as J\n"
        "def follow(events):\n"
        "    decided = {}\n"
        "    for e in events:\n"
        "        if isinstance(e.payload, J.JobStep):\n"
        "            decided.update(e.payload.data)\n"
        "def step(state, p):\n"
        "    if isinstance(p, J.JobStep):\n"
        "        state[p.step] = p.data\n"
        "def line(p):\n"
        "    parts = []\n"
        "    if isinstance(p, J.JobStep):\n"
        "        parts.append(p.step)\n"
        "    return ' '.join(parts)\n"
    )
    modules, names = payload_names(tree)
    follow, step, line = tree.body[1:]
    assert all(tells_payloads_apart(f, modules, names) for f in (follow, step, line))
    assert what_it_keeps(follow, modules, names) == ["line 6: decided.update(e.payload.data)"]
    assert what_it_keeps(step, modules, names) == ["line 9: state[p.step] = p.data"]
    assert what_it_keeps(line, modules, names) == []
