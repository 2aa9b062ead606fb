"""Passwords: argon2id hashes, and a bounded number of them computed at a time.

An argon2id check costs about 64 MiB and a few hundred milliseconds of one core, on purpose. A
burst of logins must not take every core and the memory the gateway needs, so checks run in
threads (argon2 releases the GIL) at most ``concurrent`` at a time; the others wait their turn.
A login for an unknown person is checked against a fixed hash all the same, so the answer's time
does not say whether the name exists.
"""

from __future__ import annotations

import asyncio
import functools

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError

MIN_LENGTH = 12
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


class PasswordChecker:
    """Checks passwords, at most ``concurrent`` at a time (the rest queue)."""

    def __init__(self, concurrent: int = 2) -> None:
        self._slots = asyncio.Semaphore(concurrent)
        self.concurrent = concurrent
        self.running = 0
        self.most_running = 0  # the most checks that ran at once (what the bound holds to)

    async def verify(self, password_hash: str | None, password: str) -> bool:
        async with self._slots:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
            try:
                return await asyncio.to_thread(verify_now, password_hash, password)
            finally:
                self.running -= 1
