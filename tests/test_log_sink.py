"""The log sink: a stream that cannot take lines — a closed pipe, a reader that stopped, a full disk —
never fails or holds up the code that logs; what is lost is counted and said once when writing works
again. Real pipes and a real full tmpfs."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from llmgw.cli import logs
from llmgw.cli.log_sink import LineSink
from tests.test_usage_journal import fill, tmpfs


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    read_end, write_end = os.pipe()
    yield read_end, write_end
    for fd in (read_end, write_end):
        try:
            os.close(fd)
        except OSError:
            pass


def test_lines_to_a_pipe_whose_reader_has_gone_are_counted_and_never_raise(pipe: tuple[int, int]) -> None:
    read_end, write_end = pipe
    os.close(read_end)  # `llmgw up | head`: head has exited
    sink = LineSink(os.fdopen(write_end, "w", closefd=False))
    for i in range(100):
        sink.write(f"line {i}")
    assert sink.flush()
    assert sink.dropped == 100


def test_a_reader_that_stopped_reading_never_holds_up_the_code_that_logs(pipe: tuple[int, int]) -> None:
    read_end, write_end = pipe
    sink = LineSink(os.fdopen(write_end, "w", closefd=False), capacity=1000)
    # Far more than the pipe holds (64 KiB): written where they were made, the first few hundred would
    # fill it and the rest would block the caller for as long as nobody reads.
    for i in range(20_000):
        sink.write(f"request {i:05d} " + "x" * 100)
    assert sink.dropped > 0, "the lines the stream could not take were dropped, not waited for"

    received = bytearray()

    def read_all() -> None:
        while chunk := os.read(read_end, 1 << 16):
            received.extend(chunk)

    reader = threading.Thread(target=read_all, daemon=True)
    reader.start()  # the terminal reads again
    assert sink.flush(timeout_s=30)
    sink.write("after")
    assert sink.flush(timeout_s=30)
    sink.close()
    os.close(write_end)
    reader.join(30)
    text = received.decode()
    notices = [line for line in text.splitlines() if line.startswith("llmgw: ")]
    # Each loss is said once, in the first write that worked after it: together they count every line lost.
    said = [int(line.split()[1]) for line in notices]
    assert sum(said) == sink.dropped
    assert all("(the stream did not take lines as fast as they came)" in line for line in notices)
    assert text.rstrip().endswith("after")


def test_lines_lost_to_a_full_disk_are_counted_and_said_once_when_space_returns(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "small", "64k") as disk:
        out_path = disk / "up.log"
        with open(out_path, "a") as out:
            sink = LineSink(out)
            sink.write("before")
            assert sink.flush()
            fill(disk)
            for i in range(50):
                sink.write(f"while full {i} " + "y" * 200)
            assert sink.flush()
            lost = sink.dropped
            assert lost > 0
            for path in disk.iterdir():
                if path != out_path:
                    path.unlink()  # space returns
            sink.write("after")
            assert sink.flush()
            sink.close()
        lines = out_path.read_text().splitlines()
    # The page the file already had took a few lines; a line the disk cut off half-way is ended before
    # the notice, so the notice stands on a line of its own.
    assert lines[0] == "before"
    whole = [line for line in lines if line.startswith("while full") and len(line) > 200]
    notice = (
        f"llmgw: {lost} log lines could not be written and were lost (No space left on device); writing works again"
    )
    assert lines.count(notice) == 1
    assert len(whole) + lost == 50, "every line is written whole or counted as lost"
    assert lines[-2:] == [notice, "after"]


def test_structlog_the_standard_library_and_status_lines_share_one_ordered_stream(
    capfd: pytest.CaptureFixture[str],
) -> None:
    logs.configure("info", json_lines=True)
    try:
        structlog.get_logger("t").info("first", n=1)
        import logging

        logging.getLogger("aiohttp.access").warning("second")
        logs.say("third")
        assert logs.flush()
        err = capfd.readouterr().err.splitlines()
    finally:
        structlog.reset_defaults()
    assert json.loads(err[0])["event"] == "first"
    assert err[1:3] == ["second", "third"]
