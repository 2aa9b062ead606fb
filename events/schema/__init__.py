"""The facts on the log: envelope, registry, codec, subjects, ids, and one module of payload structs
per aggregate (``models``, ``nodes``, ``replicas``, ``tenancy``, ``access``, ``people`` …).

Pure data: nothing here does I/O or folds. A payload is a frozen msgspec Struct listed in its
module's ``EVENTS``; :mod:`~llmgw.events.schema.registry` decodes by ``(type, v)`` with upcasters.
"""
