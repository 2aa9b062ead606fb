"""Time-ordered identifiers (UUIDv7, RFC 9562) for events, commands and requests."""

from __future__ import annotations

import os
import time


def new_id() -> str:
    """A UUIDv7 string: 48 bits of Unix milliseconds, then randomness, so ids sort by time."""
    ms = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    value = (ms & ((1 << 48) - 1)) << 80
    value |= 0x7 << 76  # version 7
    value |= ((rand >> 64) & 0xFFF) << 64  # rand_a
    value |= 0b10 << 62  # variant
    value |= rand & ((1 << 62) - 1)  # rand_b
    h = f"{value:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def id_time_ms(uuid7: str) -> int:
    """The Unix milliseconds a UUIDv7 was made at."""
    return int(uuid7.replace("-", "")[:12], 16)
