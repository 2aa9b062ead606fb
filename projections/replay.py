"""The cluster as it was at a moment (SPEC EVT-2): read models folded from the log up to then.

The same projections that keep the live tables fold the event log from its start up to the last
event written at or before the moment, into a scratch database of their own; the live tables and
their runners are not touched. The moment is found on the log by the time the server stamped on
each message (a binary search over sequence numbers: the stream's times only grow), so a replay
is exact whatever clocks the event writers had. A replay may start from a replay snapshot (the
projections' rows saved at a position, :mod:`llmgw.projections.replay_snapshots`) and fold only
the events after it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from functools import partial
from typing import Any

import nats.js.errors

from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import subjects as S
from llmgw.projections.apply import commit_batch, create_tables
from llmgw.projections.backends import Backend
from llmgw.projections.base import Projection
from llmgw.projections.reader import read_log


async def position_at(store: EventStore, when: datetime) -> tuple[int, datetime | None]:
    """The sequence of the last message on the event log stamped at or before ``when``, and its
    time; ``(0, None)`` when the log holds nothing that old."""
    info = await store.js.stream_info(store.stream)
    lo, hi = info.state.first_seq, info.state.last_seq
    if not info.state.messages or hi < lo:
        return 0, None
    found: tuple[int, datetime | None] = (0, None)
    while lo <= hi:
        mid = (lo + hi) // 2
        seq, stamped = await _time_of(store, mid, hi)
        if stamped is None:  # nothing from mid to hi (a gap at the end): look below
            hi = mid - 1
        elif stamped <= when:
            found, lo = (seq, stamped), seq + 1
        else:
            hi = mid - 1
    return found


async def stamp_of(store: EventStore, seq: int) -> datetime | None:
    """The time the server stamped on the message at ``seq``; None when there is none (deleted, or never written)."""
    if seq <= 0:
        return None
    found, stamped = await _time_of(store, seq, seq)
    return stamped if found == seq else None


async def _time_of(store: EventStore, seq: int, hi: int) -> tuple[int, datetime | None]:
    """The first message at or after ``seq`` (up to ``hi``) and its stamp; a deleted one is skipped."""
    while seq <= hi:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            msg = await store.js.get_msg(store.stream, seq, direct=True)
            return seq, msg.time
        seq += 1
    return seq, None


async def replay_into(
    store: EventStore,
    backend: Backend,
    until: int,
    projections: Sequence[Projection],
    after: Mapping[str, int] | None = None,
    *,
    commit: Callable[[Projection, list[Any]], Awaitable[int]] | None = None,
) -> int:
    """Fold the events up to sequence ``until`` into ``backend``; the events folded (per projection).

    Each projection folds from its position in ``after`` (its rows up to there already in ``backend``:
    a replay snapshot's, :mod:`llmgw.projections.replay_snapshots`), else from 0 into fresh tables.
    Projections that read the same subject read it once together (fleet and access both read the
    whole log: reading and decoding it is half of what a fold costs). ``commit`` folds each batch instead
    of :func:`~llmgw.projections.apply.commit_batch` on ``backend`` (the tables are made on ``backend``
    first either way): a replay's on a thread of its own, :class:`~llmgw.projections.replay_fold.TailFold`.
    """
    starts = {p.name: (after or {}).get(p.name, 0) for p in projections}
    together: dict[tuple[str, object], list[Projection]] = {}
    for projection in projections:
        if projection.stream != S.STREAM_EVENTS:
            raise ValueError(f"{projection.name} reads {projection.stream}; a replay folds the event log only")
        async with backend.transaction(projection) as tx:
            await create_tables(tx, projection)
        if until > starts[projection.name]:
            together.setdefault((projection.subject, type(projection).decode), []).append(projection)
    folded = 0
    for (subject, _), group in together.items():
        first = min(starts[p.name] for p in group)
        batches = read_log(store, subject, after=first, follow=False, until=until, decode=group[0].decode)
        async with contextlib.aclosing(batches):
            async for batch in batches:
                for projection in group:
                    start = starts[projection.name]
                    mine = batch if batch[0].seq > start else [e for e in batch if e.seq > start]
                    if mine:
                        folded += await (commit or partial(commit_batch, backend))(projection, mine)
    return folded
