"""`llmgw bench …` as a user runs it: thin entry points over `llmgw.bench`, figures printed, never asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from llmgw.cli.main import main

LLMGW = str(Path(sys.executable).parent / "llmgw")


def test_bench_scheduler_prints_every_figure_for_the_cluster_asked_for() -> None:
    args = ["bench", "scheduler", "--nodes", "20", "--models", "5", "--replicas", "20", "--runs", "1", "--scales", ""]
    result = CliRunner().invoke(main, [*args, "--json"])

    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert body["options"]["scales"] == [20]
    names = {t["name"] for t in body["figures"]["20"]}
    assert "candidates" in names
    assert all(t["nodes"] == 20 and t["runs"] >= 1 for t in body["figures"]["20"])


def test_bench_scheduler_refuses_scales_that_are_not_node_counts() -> None:
    result = CliRunner().invoke(main, ["bench", "scheduler", "--scales", "many"])

    assert result.exit_code == 2
    assert "--scales takes node counts separated by commas, not 'many'" in result.output


def test_bench_backbone_measures_llmgw_next_to_raw_nats_on_servers_of_its_own(tmp_path: Path) -> None:
    # A process of its own, as a user runs it: the command sets up logging for the whole process.
    args = ["bench", "backbone", "--events", "50", "--repeat", "1", "--skip-rebuild", "--dir", str(tmp_path)]
    result = subprocess.run([LLMGW, *args, "--json"], capture_output=True, text=True, timeout=240)

    assert result.returncode == 0, result.stderr
    figures = {f["key"]: f for f in json.loads(result.stdout)["figures"]}
    assert figures["llmgw.read"]["baseline"] == "raw.read"
    assert figures["llmgw.read"]["ratio"] is not None
    assert all(f["lost"] == 0 for f in figures.values()), "every reader delivered every event"
    assert not list(tmp_path.iterdir()), "the temporary servers and their stores are gone after the run"
