"""Model directories (SPEC FLEET-8 ``model_dirs``): weights a node keeps outside its cache are
reported by path, and placement prefers the node that holds a model's local source."""

from __future__ import annotations

from pathlib import Path

import nats.js.errors
import pytest

from llmgw.agent.weights.local import ModelDirs, list_weight_files
from tests.fleet import Fleet
from tests.gguf_tiny import write_tiny_gguf
from tests.support import wait_until
from tests.test_fleet import _last_heartbeat


def test_model_directories_report_weight_files_by_absolute_path_and_nothing_else(tmp_path: Path) -> None:
    shared = tmp_path / "lustre"
    (shared / "acme" / "llama").mkdir(parents=True)
    (shared / "acme" / "llama" / "llama-Q4_K_M.gguf").write_bytes(b"GGUF")
    (shared / "acme" / "llama" / "model.safetensors").write_bytes(b"{}")
    (shared / "acme" / "llama" / "README.md").write_text("not weights")
    (shared / ".trash").mkdir()
    (shared / ".trash" / "old.gguf").write_bytes(b"GGUF")  # hidden folders are not looked into
    deep = shared / "a" / "b" / "c" / "d" / "e"
    deep.mkdir(parents=True)
    (deep / "too-deep.gguf").write_bytes(b"GGUF")
    local = tmp_path / "nvme"
    local.mkdir()
    (local / "tiny.gguf").symlink_to(shared / "acme" / "llama" / "llama-Q4_K_M.gguf")  # a link counts as held

    found = list_weight_files([shared, local, tmp_path / "not-mounted"])
    assert found == [
        str(shared / "acme" / "llama" / "llama-Q4_K_M.gguf"),
        str(shared / "acme" / "llama" / "model.safetensors"),
        str(local / "tiny.gguf"),
    ]
    assert len(list_weight_files([shared], max_files=1)) == 1, "a huge mount is reported in part"

    dirs = ModelDirs([shared], rescan_s=60.0)
    assert dirs.due(now=0.0) and dirs.held() == []
    dirs.rescan()
    assert not dirs.due() and len(dirs.held()) == 2
    assert not ModelDirs([]).due(), "no model directories: nothing to walk"


@pytest.mark.timeout(180)
async def test_an_agent_reports_its_model_directory_and_the_model_is_placed_there(fleet: Fleet, tmp_path: Path) -> None:
    shared = tmp_path / "shared-models"
    (shared / "acme").mkdir(parents=True)
    source = shared / "acme" / "tiny-Q8_0.gguf"
    write_tiny_gguf(source)
    fleet.agent("n1")
    fleet.agent("n2", ["--model-dir", str(shared)])

    async def reported() -> bool:
        try:
            hb1, hb2 = await _last_heartbeat(fleet.store, "n1"), await _last_heartbeat(fleet.store, "n2")
        except nats.js.errors.NotFoundError:
            return False  # not registered yet
        return str(source) in hb2.weights and str(source) not in hb1.weights

    await wait_until(reported, deadline_s=30, what="n2 to report the file in its model directory")
    await fleet.add_model("tiny", source)
    [replica] = await fleet.wait_ready("tiny", 1)
    assert replica["node"] == "n2", "both nodes fit; the one holding the weights is chosen"
