"""The CLI's tables: each column as wide as its widest cell, so a long name never shifts the others."""

from __future__ import annotations

from collections.abc import Collection, Sequence


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], right: Collection[int] = ()) -> list[str]:
    """The lines of a table: ``headers``, then one line per row; columns in ``right`` (their indexes)
    are aligned right (numbers), the others left; two spaces between columns, none after the last."""
    cells = [[str(c) for c in headers], *[[("-" if c is None or c == "" else str(c)) for c in r] for r in rows]]
    widths = [max(len(line[i]) for line in cells) for i in range(len(headers))]
    last = len(headers) - 1
    out = []
    for line in cells:
        parts = [
            c.rjust(widths[i]) if i in right else (c if i == last else c.ljust(widths[i])) for i, c in enumerate(line)
        ]
        out.append("  ".join(parts).rstrip())
    return out
