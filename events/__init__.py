"""The log: what every part of llmgw writes and reads, in four layers, each a folder.

- ``schema/`` — the facts: the envelope, the registry of payload types, the codec (the only code
  that knows bytes), subjects and ids, and one module of payload structs per aggregate.
- ``folds/`` — pure folds over those facts (a key, a node, a replica, a person, the tenancy
  tree): plain functions and structs, no I/O. Every reader of a fact calls the same fold.
- ``runtime/`` — the log at run time: connecting to NATS, the event store and its reader,
  :class:`~llmgw.events.runtime.follower.Follower` (the one supervised way to keep a fold
  current), snapshots, key-value buckets and secrets, riding out NATS trouble.
- ``commands/`` — the command path: the envelope, signing and its check, roles, the client that
  sends one and the processor and shell that carry one out.

A layer imports only the layers above it in this list. ``events/`` knows nothing of services;
running nats-server, its users, certificates and backups live in ``infra/``.
"""
