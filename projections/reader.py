"""The log reader projections use: :func:`llmgw.events.runtime.reader.read_log` (a pull consumer that never
drops events). Kept here so projection code imports its reader from its own room."""

from llmgw.events.runtime.reader import Decoder, read_log

__all__ = ["Decoder", "read_log"]
