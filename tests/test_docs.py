"""The docs are part of the feature: checked against the code."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from llmgw.events.schema.catalog import render_markdown

ROOT = Path(__file__).resolve().parent.parent


def test_the_event_catalogue_matches_the_registry() -> None:
    on_disk = (ROOT / "docs" / "events.md").read_text()
    assert on_disk == render_markdown(), "docs/events.md is stale: run `llmgw events catalog > docs/events.md`"


def test_the_readme_opens_with_the_two_commands() -> None:
    head = "\n".join((ROOT / "README.md").read_text().splitlines()[:30])
    assert "make up" in head and "make test" in head


# Built from parts so that this file does not name them itself.
_OUTSIDE = ("../" + "shared", "shared/" + "ARCHITECTURE", "SPEC" + ".md", "STYLE" + ".md", "/wo" + "rk/")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p]


def test_no_tracked_file_points_outside_the_repository() -> None:
    found = []
    for rel in _tracked():
        path = ROOT / rel
        if not path.is_file():
            continue  # deleted in the working tree, not yet committed
        text = path.read_bytes().decode("utf-8", errors="replace")
        for n, line in enumerate(text.splitlines(), 1):
            found += [f"{rel}:{n}: {needle}" for needle in _OUTSIDE if needle in line]
    assert not found, "the repository must stand alone; these point outside it:\n" + "\n".join(found)


def test_every_relative_link_in_the_docs_reaches_a_file() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in _LINK.findall(page.read_text()):
            if "://" in target or target.startswith(("#", "mailto:")):
                continue
            file = target.split("#", 1)[0]
            if not (page.parent / file).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert pages[1:], "no docs/*.md found"
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def test_the_architecture_page_covers_each_part_of_the_design() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    for heading in ("Layout", "Events", "Streams", "Commands", "Projections", "Services", "Deployments", "Engines"):
        assert re.search(rf"^## \d+\. {heading}", text, re.M), f"docs/architecture.md has no section on {heading}"
