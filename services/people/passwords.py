"""Passwords: argon2id hashes, and a bounded number of them computed at a time.

An argon2id check costs about 64 MiB and a few hundred milliseconds of one core, on purpose. A
burst of logins must not take every core and the memory the gateway needs, so checks run in
threads (argon2 releases the GIL) at most ``concurrent`` at a time; the others wait their turn.
Those threads run at the lowest CPU priority (nice 19, Linux): each check starts one thread per
argon2 lane (4), and at equal priority 2 checks' 8 threads would take 8/9 of the process's CPU
from the event loop that serves the gateway (docs/benchmarks.md, "Logins beside the gateway").
Idle cores still go to the checks; a busy gateway comes first.
A login for an unknown person is checked against a fixed hash all the same, so the answer's time
does not say whether the name exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError

T = TypeVar("T")

MIN_LENGTH = 12
CHECK_NICE = 19  # the checks' threads yield to everything else in the process (and on the machine)
_hasher = PasswordHasher()  # argon2id, RFC 9106's second recommendation: 64 MiB, 3 passes, 4 lanes


@functools.cache
def _nobody() -> str:
    """The hash an unknown name is checked against: made at the first such check, not at import (every
    CLI call imports this module, and a hash costs 64 MiB and a fraction of a second)."""
    return _hasher.hash("the hash an unknown name is checked against")


def hash_password(password: str) -> str:
    """The argon2id hash of ``password`` (PHC string), as it is written to the log."""
    return _hasher.hash(password)


def password_problem(password: str) -> str | None:
    """Why ``password`` may not be used, or None."""
    if len(password) < MIN_LENGTH:
        return f"a password needs at least {MIN_LENGTH} characters"
    if not password.isprintable():
        return "a password is printable characters only"
    return None


def verify_now(password_hash: str | None, password: str) -> bool:
    """Whether ``password`` matches ``password_hash`` (None: nobody; checked anyway, for the time)."""
    try:
        return _hasher.verify(password_hash or _nobody(), password) and password_hash is not None
    except (VerificationError, InvalidHashError):
        return False


def _lower_priority(nice: int) -> None:
    """Run this thread (and the lane threads argon2 starts from it, which inherit it) at ``nice``:
    on Linux a thread's nice value is its own."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


class PasswordChecker:
    """Checks passwords, at most ``concurrent`` at a time (the rest queue), on threads of its own at
    the lowest priority (``nice``)."""

    def __init__(self, concurrent: int = 2, nice: int | None = None) -> None:
        self._slots = asyncio.Semaphore(concurrent)
        self.nice = CHECK_NICE if nice is None else nice
        self._pool = ThreadPoolExecutor(
            max_workers=concurrent,
            thread_name_prefix="password-check",
            initializer=_lower_priority,
            initargs=(self.nice,),
        )
        self.concurrent = concurrent
        self.running = 0
        self.most_running = 0  # the most checks that ran at once (what the bound holds to)

    async def verify(self, password_hash: str | None, password: str) -> bool:
        return await self._run(verify_now, password_hash, password)

    async def _run(self, work: Callable[..., T], *args: Any) -> T:
        """``work`` on the checkers' threads, within the bound: checks and new hashes alike."""
        async with self._slots:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
            try:
                return await asyncio.get_running_loop().run_in_executor(self._pool, work, *args)
            finally:
                self.running -= 1

    async def hash(self, password: str) -> str:
        """The argon2id hash of a new password, made in the same bounded, low-priority slots as the checks:
        a password set over HTTP costs what a sign-in costs, and a burst of either cannot take the
        cores and the memory the gateway needs."""
        return await self._run(hash_password, password)

    def close(self) -> None:
        """Let the idle threads go (a check under way finishes first)."""
        self._pool.shutdown(wait=False)
