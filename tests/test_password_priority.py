"""Password checks run below the event loop's priority, so a burst of logins cannot starve the gateway
(docs/benchmarks.md, "Logins beside the gateway")."""

from __future__ import annotations

import asyncio
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


async def test_new_passwords_are_hashed_in_the_checks_slots_so_a_burst_stays_within_the_bound() -> None:
    checker = PasswordChecker(concurrent=2)
    try:
        passwords = [f"a long enough passphrase {i}" for i in range(5)]
        hashes = await asyncio.gather(*(checker.hash(p) for p in passwords))
        assert all(await asyncio.gather(*(checker.verify(h, p) for h, p in zip(hashes, passwords, strict=True))))
        # Hashing and checking share the slots: never more than two argon2id at once, whichever they are.
        assert 1 <= checker.most_running <= 2
    finally:
        checker.close()
