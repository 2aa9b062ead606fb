"""Password checks run below the event loop's priority, so a burst of logins cannot starve the gateway
(docs/benchmarks.md, "Logins beside the gateway")."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

from llmgw.services.people.passwords import CHECK_NICE, PasswordChecker, hash_password

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="a thread's own nice value is Linux's")


def _nices() -> dict[int, int]:
    """Thread id to nice value, for every thread of this process."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            out[int(task.name)] = int((task / "stat").read_text().rsplit(")", 1)[1].split()[16])
        except (OSError, ValueError):
            continue  # a thread that ended meanwhile
    return out


async def test_password_checks_run_on_threads_at_the_lowest_priority_and_the_event_loop_keeps_its_own() -> None:
    loop_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    checker = PasswordChecker(concurrent=2)
    try:
        assert await checker.verify(hash_password("a long enough passphrase"), "a long enough passphrase")
        assert not await checker.verify(None, "a long enough passphrase")
        # The checkers' threads stay (idle) after their checks, each at the checks' priority.
        checking = [t.native_id for t in threading.enumerate() if t.name.startswith("password-check")]
        nices = _nices()
        assert checking and {nices[tid] for tid in checking} == {CHECK_NICE}, nices
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == loop_nice
    finally:
        checker.close()
