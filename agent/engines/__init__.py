"""Engines the agent runs (ARCHITECTURE §8, FLEET-5): launch commands, the xllamacpp server, health probes.

- ``commands``: pure builders of an engine's argv and environment (the key only in the environment).
- ``xllama_server``: ``python -m llmgw.agent.engines.xllama_server``, llama.cpp's own HTTP server
  from the ``xllamacpp`` wheel, for nodes without a ``llama-server`` binary.
- ``health``: waits for ``GET /health`` to say ready.
"""
