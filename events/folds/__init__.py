"""Pure folds: one place where each fact of the log becomes state (docs/decisions.md, "One fold
per fact").

Each module folds one kind of aggregate — ``keys``, ``nodes``, ``replicas``, ``models``, ``quotas``,
``people``, ``tenancy``, ``mirror``, ``jobs`` — with plain functions over events and structs (the
mirror's holdings and a job are objects with an ``apply``); no I/O, no clock. Services, projections
and the CLI all read a fact through the same fold here (the CLI never folds one itself); followers
(:mod:`llmgw.events.runtime.follower`) keep them current at run time.
"""
