"""Pure folds: one place where each fact of the log becomes state (docs/decisions.md, "One fold
per fact").

Each module folds one kind of aggregate — ``keys``, ``nodes``, ``replicas``, ``people``,
``tenancy`` — with plain functions over events and frozen structs; no I/O, no clock. Services,
projections and the CLI all read a fact through the same fold here; followers
(:mod:`llmgw.events.runtime.follower`) keep them current at run time.
"""
