"""What the in-flight log adds to a request: ``UsagePublisher.put`` with the log and without it.

    .venv/bin/python -m tests.bench.inflight [--records 20000] [--rounds 8]

In one process, rounds alternated (with, without, without, with, ...): ``put`` of the same usage
records into a publisher whose loop never runs (so only ``put`` is timed: the record encoded, and
with the log, one ``write`` of it to the page cache), then each record marked acknowledged
(``_kept``: with the log, a count and, every file, an unlink). Reported: microseconds per record,
the median over the rounds of each, and their difference — what every gateway request pays.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from llmgw.services.router.inflight import InflightLog
from llmgw.services.router.usage import INFLIGHT_DIR, UsageConfig, UsagePublisher
from tests.test_accountant import START, make_records


def one_round(records: list, directory: Path | None) -> tuple[float, float]:
    """Seconds per record for ``put`` and for marking it acknowledged."""
    publisher = UsagePublisher(None, None, UsageConfig())  # type: ignore[arg-type]
    if directory is not None:
        publisher._inflight = InflightLog(directory / INFLIGHT_DIR)
    t0 = time.perf_counter()
    for r in records:
        publisher.put(r)
    t1 = time.perf_counter()
    held = list(publisher._memory)
    t2 = time.perf_counter()
    publisher._kept(held)
    t3 = time.perf_counter()
    if publisher._inflight is not None:
        publisher._inflight.close()
    return (t1 - t0) / len(records), (t3 - t2) / len(records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    records = make_records(args.records, START)
    got: dict[str, list[tuple[float, float]]] = {"with": [], "without": []}
    with tempfile.TemporaryDirectory(prefix="llmgw-inflight-") as tmp:
        for i in range(args.rounds):
            for kind in ("with", "without") if i % 2 == 0 else ("without", "with"):
                got[kind].append(one_round(records, Path(tmp) / f"{kind}-{i}" if kind == "with" else None))
    for kind in ("without", "with"):
        put = statistics.median(p for p, _ in got[kind]) * 1e6
        kept = statistics.median(k for _, k in got[kind]) * 1e6
        print(f"{kind:<8} in-flight log: put {put:6.2f} µs/record, acknowledged {kept:5.2f} µs/record")
    medians = {kind: [statistics.median(x[j] for x in got[kind]) for j in (0, 1)] for kind in got}
    extra = sum(medians["with"]) - sum(medians["without"])
    print(f"the log adds {extra * 1e6:.2f} µs per record")


if __name__ == "__main__":
    main()
