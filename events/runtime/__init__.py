"""The log at run time: connecting, appending, reading, following.

- ``connection`` — the servers, the credential, one clear line per refusal;
  ``store`` — streams as code, append with optimistic concurrency; ``reader`` — pull consumers
  that never skip an event; ``retry`` — which NATS errors pass, and waiting them out.
- ``follower`` — :class:`Follower`, the one supervised way an in-memory reader keeps a pure fold
  current (with health, a watchdog and metrics); ``subscriber`` — a core-NATS subscription under the
  same supervision; ``followers`` — several, caught up together, for deciding commands; ``waiter`` —
  the next event on a few subjects, with a deadline.
- ``snapshots``, ``buckets``, ``secrets`` — what is kept beside the log in JetStream.
- ``tasks``, ``log_context``, ``metrics`` — what every process on the log shares: stopping
  background tasks, per-request log context, the store's Prometheus series.
"""
