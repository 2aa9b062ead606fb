"""The docs are part of the feature: checked against the code."""

from __future__ import annotations

from pathlib import Path

from llmgw.events.catalog import render_markdown

ROOT = Path(__file__).resolve().parent.parent


def test_the_event_catalogue_matches_the_registry() -> None:
    on_disk = (ROOT / "docs" / "events.md").read_text()
    assert on_disk == render_markdown(), "docs/events.md is stale: run `llmgw events catalog > docs/events.md`"


def test_the_readme_opens_with_the_two_commands() -> None:
    head = "\n".join((ROOT / "README.md").read_text().splitlines()[:30])
    assert "make up" in head and "make test" in head
