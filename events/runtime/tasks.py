"""Stopping a service's background tasks: every service that runs some does it the same way."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable


async def cancel_and_wait(tasks: Iterable[asyncio.Task[object]]) -> None:
    """Cancel ``tasks`` and wait until each has ended.

    A task's own error is not raised here: the task has logged what it could, and a service being
    closed must go on closing what remains.
    """
    tasks = list(tasks)
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t
