"""`llmgw bench console` at a tiny scale: it builds both worlds, serves the console over them as `llmgw up`
does, signs in and fetches every page — the smoke test of the benchmark, not a measure (no time is asserted)."""

from __future__ import annotations

from pathlib import Path

from llmgw.bench.console_pages import (
    PAST,
    PAST_PAGES,
    ConsoleOptions,
    Scale,
    console_json,
    console_text,
    run_console,
    targets,
)
from llmgw.cli.bench import serve_console
from llmgw.services.console.pages import PAGES

TINY = Scale(nodes=2, replicas=4, keys=20, events=200, usage=30)
SMALL = Scale(nodes=3, replicas=9, keys=30, events=400, usage=60)


async def test_the_console_bench_fetches_every_page_of_both_worlds_signed_in(tmp_path: Path) -> None:
    lines: list[str] = []
    opts = ConsoleOptions(large=SMALL, small=TINY, runs=2, base_dir=str(tmp_path))
    report = await run_console(opts, serve_console, lines.append)

    pages = {page.name for page in PAGES}
    for world in (report.small, report.large):
        assert pages <= {f.name for f in world.pages}, "every page of the console is fetched"
        assert {f.name: f.status for f in world.pages} == {f.name: 200 for f in world.pages}, lines
        assert all(f.bytes > 0 and f.runs == 2 for f in world.pages)
        past = {f.name for f in world.pages if f.name.endswith(PAST) and "?at=" in f.path}
        assert past == {f"{name}{PAST}" for name in PAST_PAGES}, "the time slider's pages, at the log's middle"
        assert world.events >= world.scale.events and world.usage == world.scale.usage
    text = console_text(report)
    assert all(f.name in text for f in report.large.pages)
    assert console_json(report)["large"]["scale"]["keys"] == SMALL.keys


def test_every_page_has_a_path_to_fetch_detail_pages_with_a_node_and_a_model() -> None:
    found = dict(targets(SMALL))
    assert {page.name for page in PAGES} <= set(found)
    assert all("{" not in path for path in found.values())
    assert found.get("node", "").endswith("/node-0000") and found.get("model", "").endswith("/model-000")


async def test_a_kept_world_is_timed_again_without_being_built_again(tmp_path: Path) -> None:
    opts = ConsoleOptions(large=SMALL, small=TINY, runs=1, keep=str(tmp_path / "kept"))
    first = await run_console(opts, serve_console, lambda line: None)
    lines: list[str] = []
    again = await run_console(opts, serve_console, lines.append)
    assert sum("reusing the world built in" in line for line in lines) == 2
    assert not any("writing the log" in line for line in lines)
    assert (again.large.events, again.large.write_s) == (first.large.events, first.large.write_s)
    assert {f.status for f in again.large.pages} == {200}
