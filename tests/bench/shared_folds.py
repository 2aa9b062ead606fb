"""Memory and start time of `llmgw up`'s command services on a log of 100,000 people and tenancy events.

    .venv/bin/python -m tests.bench.shared_folds [--people 20000] [--runs 3] [--base /tmp/base]

Starts a durable nats-server, writes the log (each person added with a password, a token and a
role: four events; and a tenancy tree of orgs, teams and projects making up the rest), then starts,
in a fresh process per run, the seven command services `llmgw up` runs (tenancy, access, people,
catalog, fleet, jobs, mirror) with their command verifiers, and waits until every fold has read the
log to its head. It reports the process's resident memory (RSS) then, less what it held before the
services were made, and the time from making them to all folds caught up. Modes:

- ``shared``: one :class:`~llmgw.events.commands.auth.CommandVerifier` for the process, passed to
  every service, and the people service deciding on its fold (what `llmgw up` does now);
- ``separate``: no verifier passed, so each service's processor makes its own and the people service
  folds the people and the tree again (the code as it is, with sharing switched off);
- ``base``: the code of another checkout (``--base``: a `git worktree add` of the commit before), in
  which every service made its own verifier.

The services' processors are not run (no command is sent): only their folds and verifiers start.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = ("base", "separate", "shared")
READY_WITHIN_S = 600.0  # a run whose folds have not all caught up by then fails (NotCaughtUp) instead of hanging
HASH = "$argon2id$v=19$m=19456,t=2,p=1$c2FsdHNhbHRzYWx0$aGFzaGhhc2hoYXNoaGFzaGhhc2hoYXNoaGFzaGhhc2g"


def rss_bytes() -> int:
    """This process's resident memory now (VmRSS), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


# -- the log ---------------------------------------------------------------------------------------


async def write_log(url: str, people: int) -> int:
    """Write ``people`` people (4 events each) and a tree of ``people`` tenancy events: the events written."""
    from llmgw.events.runtime.store import EventStore, NewEvent
    from llmgw.events.schema import people as P
    from llmgw.events.schema import tenancy as T
    from llmgw.events.schema.catalog import default_registry
    from llmgw.events.schema.ids import new_id
    from llmgw.events.schema.subjects import event_subject

    store = await EventStore.connect(url, default_registry())
    try:
        await store.ensure_streams()
        items: list[tuple[str, NewEvent]] = []
        tree = event_subject(T.AGGREGATE, T.TREE_ID)
        # A tree of `people` events: orgs of 3 teams of 2 projects (10 events an org).
        orgs = people // 10
        for o in range(orgs):
            org = f"o{o}"
            items.append((tree, NewEvent(payload=T.OrgCreated(org_id=org, name=f"org{o}"), actor="system:bench")))
            for t in range(3):
                team = f"{org}t{t}"
                created = T.TeamCreated(team_id=team, org_id=org, name=f"team{t}")
                items.append((tree, NewEvent(payload=created, actor="system:bench")))
                for p in range(2):
                    project = T.ProjectCreated(project_id=f"{team}p{p}", team_id=team, name=f"project{p}")
                    items.append((tree, NewEvent(payload=project, actor="system:bench")))
        for i in range(people):
            name = f"user{i}"
            subject = event_subject(P.AGGREGATE, name)
            added, issued, granted = new_id(), new_id(), new_id()  # the commands that caused them
            token = P.TokenIssued(
                name=name,
                token_id=new_id(),
                prefix=f"{i:08d}",
                secret_sha256=f"{i:064x}",
                kind="personal",
                label="bench",
                signing_key="",
            )
            role = P.RoleGranted(name=name, role="member", scope=f"team:o{i % max(orgs, 1)}t{i % 3}")
            for payload, cause in (
                (P.UserAdded(name=name), added),
                (P.PasswordSet(name=name, password_hash=HASH), added),
                (token, issued),
                (role, granted),
            ):
                items.append((subject, NewEvent(payload=payload, actor="system:bench", causation=cause)))
        await store.append_many(items)
        return len(items)
    finally:
        await store.close()


# -- one run, in a process of its own ----------------------------------------------------------------


async def start_services(url: str, mode: str, mirror_dir: str) -> dict[str, Any]:
    """Make and start the command services as `llmgw up` does, wait for every fold: what it took."""
    from llmgw.events.commands.auth import CommandVerifier
    from llmgw.events.runtime.follower import FollowerRegistry
    from llmgw.events.runtime.store import EventStore
    from llmgw.events.schema.catalog import default_registry
    from llmgw.services.access.service import AccessService
    from llmgw.services.catalog.service import CatalogService
    from llmgw.services.fleet.service import FleetService
    from llmgw.services.jobs.service import JobsConfig, JobsService
    from llmgw.services.mirror.service import MirrorConfig, MirrorService
    from llmgw.services.people.service import PeopleService
    from llmgw.services.tenancy.service import TenancyService

    store = await EventStore.connect(url, default_registry())
    gc.collect()
    before = rss_bytes()
    started = time.perf_counter()
    folds = FollowerRegistry()
    shares = "verifier" in inspect.signature(TenancyService.__init__).parameters
    if (mode == "base") == shares:
        raise SystemExit(f"mode {mode} on code that {'can' if shares else 'cannot'} share a verifier")
    kw: dict[str, Any] = {"folds": folds}
    if mode == "shared":
        kw["verifier"] = CommandVerifier(store, registry=folds)
    services = [
        TenancyService(store, **kw),
        AccessService(store, **kw),
        PeopleService(store, **kw),
        CatalogService(store, **kw),
        FleetService(store, **kw),
        JobsService(store, JobsConfig(), **kw),
        MirrorService(store, MirrorConfig(dir=mirror_dir), **kw),
    ]
    verifiers = []
    for service in services:
        service.fold.start()
        verifier = service.processor().verifier
        verifier.start()  # what the processor's run does first
        verifiers.append(verifier)
    fold_sets = {id(f): f for f in [s.fold for s in services] + [v.fold for v in verifiers]}
    await asyncio.gather(*(f.catch_up(READY_WITHIN_S) for f in fold_sets.values()))
    ready_s = time.perf_counter() - started
    gc.collect()
    after = rss_bytes()
    out = {
        "mode": mode,
        "ready_s": ready_s,
        "rss_mb": after / 2**20,
        "services_mb": (after - before) / 2**20,
        "followers": len(folds.health()),
        "code": str(Path(inspect.getfile(TenancyService)).parents[2]),
    }
    return out  # the process ends next: its folds and connection with it


def child(url: str, mode: str, base: str | None) -> None:
    if base:
        # The other checkout's code, not this one's: llmgw.* from a directory of links into it, found
        # before the editable install of this checkout (a finder appended after the path finder).
        links = Path(tempfile.mkdtemp(prefix="llmgw-base-")) / "llmgw"
        links.mkdir()
        for part in ("agent", "bench", "cli", "events", "infra", "modelfiles", "projections", "services"):
            (links / part).symlink_to(Path(base) / part)
        sys.meta_path[:] = [f for f in sys.meta_path if "Editable" not in getattr(f, "__name__", "")]
        sys.path.insert(0, str(links.parent))
    with tempfile.TemporaryDirectory() as mirror_dir:
        loop = asyncio.new_event_loop()
        print(json.dumps(loop.run_until_complete(start_services(url, mode, mirror_dir))), flush=True)
    os._exit(0)  # without closing each fold in turn: nothing here outlives the process


# -- the parent -----------------------------------------------------------------------------------------


def run_one(url: str, mode: str, base: str | None) -> dict[str, Any]:
    args = [sys.executable, "-m", "tests.bench.shared_folds", "--child", url, "--mode", mode]
    if mode == "base":
        args += ["--base", str(base)]
    done = subprocess.run(args, capture_output=True, text=True, check=False, cwd=Path(__file__).parents[2])
    if done.returncode != 0:
        raise SystemExit(f"the {mode} run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--people", type=int, default=20_000, help="people (4 events each; as many tenancy events)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--base", help="a checkout of the commit before: also measure its code")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.mode, args.base)
        return

    from tests.support import nats_server

    modes = [m for m in MODES if m != "base" or args.base]
    with tempfile.TemporaryDirectory() as tmp, nats_server(Path(tmp)) as nats:
        t0 = time.perf_counter()
        written = asyncio.run(write_log(nats.url, args.people))
        print(
            f"log: {written} events ({args.people} people, 4 events each, and the tree) "
            f"written in {time.perf_counter() - t0:.1f} s"
        )
        results: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        for _ in range(args.runs):
            for mode in modes:  # interleaved, so a drift of the machine touches every mode alike
                results[mode].append(run_one(nats.url, mode, args.base))
    print(f"the 7 command services of `llmgw up` on that log, {args.runs} runs each (median)")
    print(f"{'mode':<10} {'followers':>9} {'RSS MiB':>8} {'services MiB':>13} {'ready s':>8}")
    for mode, runs in results.items():
        print(
            f"{mode:<10} {runs[0]['followers']:>9} {statistics.median(r['rss_mb'] for r in runs):>8.0f} "
            f"{statistics.median(r['services_mb'] for r in runs):>13.0f} "
            f"{statistics.median(r['ready_s'] for r in runs):>8.2f}"
        )
    if os.environ.get("BENCH_JSON"):
        print(json.dumps(results))


if __name__ == "__main__":
    main()
