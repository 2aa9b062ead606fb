"""Keeping a pure fold current with some subjects of the log, for deciding commands on it.

:class:`Followers` is what a command service (and the command verifier) folds the log with: one
supervised :class:`~llmgw.events.runtime.follower.Follower` per subject, :meth:`Followers.catch_up` to
wait, with a deadline, until every one has read the log up to its head, and :meth:`Followers.seq`: the
sequence an aggregate was at as the fold has read it, which the command shell appends a decision with.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Mapping

from llmgw.events.runtime.follower import Follower, FollowerRegistry
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema.envelope import RecordedEvent


class NotCaughtUp(Exception):
    """A fold did not read the log up to its head in time: a decision now would be on stale state."""


CATCH_UP_S = 10.0  # the most a command waits for its service's folds; under a caller's 15 s deadline


class Followers:
    """Keeps a pure fold current with some subjects of the log: one supervised :class:`Follower` each.

    ``subjects`` maps each subject filter to its fold's name, as ``/healthz`` and the
    ``llmgw_fold_healthy`` metric of ``registry`` (the process's) show it. ``apply`` gets every event
    on those subjects once, in order per subject; an event it raises on is quarantined and the fold
    goes on. The fold also remembers which commands caused the events it read (their causation),
    which is how a command that was applied already is recognised, whatever the service folds.

    The folds read in the background, from :meth:`start` (or the first :meth:`catch_up`) until
    :meth:`close`; they apply events only while the event loop is free, never in the middle of a
    synchronous ``decide``. A decision is still made on a fold that may move on while it is being
    appended: the ``expected`` sequence it carries guards the append, as it always did.
    """

    def __init__(
        self,
        store: EventStore,
        subjects: Mapping[str, str],
        apply: Callable[[RecordedEvent], Awaitable[None] | None],
        *,
        registry: FollowerRegistry | None = None,
        wait_s: float = CATCH_UP_S,
    ) -> None:
        self.store = store
        self.apply = apply
        self.names = dict(subjects)
        self.registry = registry if registry is not None else FollowerRegistry()
        self.wait_s = wait_s
        self.caused: dict[str, int] = {}  # command id -> sequence of the first event it caused
        self.seqs: dict[str, int] = {}  # subject -> the last sequence on it read (under a wildcard filter)
        self.folds: dict[str, Follower] = {}
        self._moved = asyncio.Condition()  # notified after each batch any of the folds applied
        self._closed = False

    @property
    def positions(self) -> dict[str, int]:
        """Each subject's position: the last sequence on it the fold has read (0 before it starts)."""
        return {s: self.folds[s].position if s in self.folds else 0 for s in self.names}

    def start(self) -> Followers:
        """Start following the log (once); the folds appear in the registry from here on."""
        if self._closed:
            raise NotCaughtUp(f"the service is stopping: its folds ({', '.join(self.names.values())}) are closed")
        if not self.folds:
            self.folds = {
                subject: Follower(
                    self.store, subject, self._fold, name=name, after=0, registry=self.registry, on_batch=self._notify
                ).start()
                for subject, name in self.names.items()
            }
        return self

    async def close(self) -> None:
        self._closed = True
        for fold in self.folds.values():
            await fold.close()

    def _fold(self, event: RecordedEvent) -> Awaitable[None] | None:
        # Before the fold: an event it raises on (quarantined) still moves its aggregate on.
        self.seqs[event.subject] = event.seq
        if event.envelope.causation:
            self.caused.setdefault(event.envelope.causation, event.seq)
        return self.apply(event)

    async def _notify(self) -> None:
        async with self._moved:
            self._moved.notify_all()

    async def catch_up(self, timeout: float | None = None) -> None:
        """Return once every fold has read its subject up to the log's last event on it as of now.

        Raises :class:`NotCaughtUp` naming the fold and its health when one does not within
        ``timeout`` seconds (default: the fold's ``wait_s``): a failed or stalled fold refuses, never hangs.
        ``math.inf`` waits as long as reading takes (a service starting on a long log).
        """
        self.start()
        # The last sequence on each subject (wildcards included): the fold is current once it has read that far.
        heads = await asyncio.gather(*(self.store.last_seq(s) for s in self.folds))
        targets = dict(zip(self.folds, heads, strict=True))
        wait_s = self.wait_s if timeout is None else timeout
        end = None if math.isinf(wait_s) else asyncio.get_running_loop().time() + wait_s
        for subject, last in targets.items():
            fold = self.folds[subject]
            if fold.position >= last:
                continue
            try:
                async with asyncio.timeout_at(end), self._moved:
                    await self._moved.wait_for(lambda f=fold, last=last: f.position >= last)
            except TimeoutError:
                raise NotCaughtUp(
                    f"the {fold.name} fold has read the log to {fold.position} of {last} and did not catch up "
                    f"within {wait_s:.0f} s ({fold.health().reason()}): nothing was decided; send the command "
                    "again once the process's /healthz shows the fold live"
                ) from None

    def seq(self, subject: str) -> int:
        """The last sequence on ``subject`` (one aggregate's) the fold has read: what a decision made on
        the fold now expects it to be still. 0 when none was read (a new aggregate)."""
        exact = self.folds.get(subject)
        if exact is not None:
            # Followed by a filter of its own: where that follower has read to, past an event that could
            # not be decoded too, so one poisoned event does not make every later append conflict.
            return exact.position
        return self.seqs.get(subject, 0)

    def follows(self, subject: str) -> bool:
        """Whether ``subject`` is under one of the followed filters (``*`` one token, ``>`` the rest)."""
        return any(_matches(f, subject) for f in self.names)

    def applied(self, command_id: str) -> int | None:
        """The sequence of the first event ``command_id`` caused, or None when it caused none yet."""
        return self.caused.get(command_id)


def _matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` is one token, a final ``>`` one or more."""
    want, got = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(got) > i
        if i >= len(got) or (token != "*" and token != got[i]):
            return False
    return len(got) == len(want)
