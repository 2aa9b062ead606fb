"""Every path of the repository a doc names in backticks exists, so a move cannot leave the docs behind.

A backticked word that starts with one of the repository's folders (`events/runtime/store.py`,
`ops/grafana/build.py`, `tests/faults/`) must name a file or folder that is there; a `::test` or
`#anchor` after it is not part of the path. Paths a page names as history (what a file was called
before it moved) are listed in ``FORMER_PATHS`` with the page that names them.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = (
    "events/",
    "infra/",
    "projections/",
    "services/",
    "agent/",
    "cli/",
    "bench/",
    "modelfiles/",
    "tests/",
    "ops/",
)
FORMER_PATHS = {
    ("docs/benchmarks.md", "cli/bench_scheduler.py"),  # "what was then cli/bench_scheduler.py"
    ("docs/decisions.md", "agent/weights/gguf_header.py"),  # "… is gone: … moved to modelfiles/"
}
_SPAN = re.compile(r"`([^`\s]+)`")


def named_paths(page: Path) -> list[tuple[int, str]]:
    """(line, path) for each backticked repository path on ``page``."""
    found = []
    for n, line in enumerate(page.read_text().splitlines(), 1):
        for word in _SPAN.findall(line):
            path = re.sub(r"(::|#|:\d).*$", "", word).rstrip(".,;)")
            if path.startswith(FOLDERS) and not re.search(r"[<>*{}…]", path):
                found.append((n, path))
    return found


def test_every_repository_path_the_docs_name_exists() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    missing = []
    for page in pages:
        rel = page.relative_to(ROOT).as_posix()
        for n, path in named_paths(page):
            if (rel, path) not in FORMER_PATHS and not (ROOT / path).exists():
                missing.append(f"{rel}:{n}: {path}")
    assert sum(len(named_paths(p)) for p in pages) > 100, "the docs name almost no paths: is the pattern wrong?"
    assert not missing, "the docs name paths that are not there (moved? say where to):\n" + "\n".join(missing)
