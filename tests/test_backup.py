"""Backup and restore (SPEC OPS-3): a real nats-server backed up, a fresh one restored, services on it."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import sqlite3
import stat
import subprocess
import tarfile
from pathlib import Path

import aiohttp
import msgspec
import nats
import nats.js.errors
import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry

from llmgw.cli.main import main as cli_main
from llmgw.cli.runtime import projections
from llmgw.events.runtime.secrets import engine_key_secret, signing_secret
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema.catalog import default_registry
from llmgw.events.schema.usage import UsageRecord
from llmgw.infra import backup as B
from llmgw.infra import nats_permissions as NP
from llmgw.projections.backends import open_backend
from llmgw.projections.rebuild import rebuild
from llmgw.services.backup.service import BackupService, due_in, newest
from tests.cluster import nats_cluster
from tests.fleet import Fleet
from tests.gguf_tiny import write_tiny_gguf
from tests.support import NatsServer, nats_server, wait_until
from tests.test_gateway import FAST_ROUTER, GATEWAY, client, make_key, make_tenant
from tests.test_nats_permissions import roles, secured  # noqa: F401 - fixtures: a server with every role's user
from tests.up import LLMGW, Up

pytestmark = [pytest.mark.timeout(240)]

LOG_STREAMS = ("LLMGW_EVENTS", "LLMGW_USAGE", "LLMGW_COMMANDS")


def data_dir_with_secrets(base: Path) -> Path:
    """A data directory as `llmgw up` leaves it: a CA, NATS users' credentials, the admin's token."""
    d = base / "data"
    (d / "pki").mkdir(parents=True)
    (d / "pki" / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\nfake\n-----END CERTIFICATE-----\n")
    (d / "pki" / "ca.key").write_text("secret CA key")
    (d / "nats" / "users").mkdir(parents=True)
    (d / "nats" / "users" / "operator.json").write_text('{"user": "operator", "password": "p"}')
    (d / "admin-token").write_text("llmgw-token")
    (d / "projections.db").write_text("derived: never in a backup")
    return d


def tables(db: Path) -> dict[str, list[tuple]]:
    """Every table of a projection database, rows sorted; of the checkpoints, names and versions (a live
    runner's position is the last event the projection read, a rebuild's the stream's head)."""
    con = sqlite3.connect(db)
    try:
        names = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        out = {
            n: sorted(con.execute(f'SELECT * FROM "{n}"').fetchall(), key=repr)
            for n in names
            if "shadow" not in n and not n.startswith("sqlite_")
        }
        out["llmgw_checkpoints"] = [(name, version) for name, _, version in out["llmgw_checkpoints"]]
        return out
    finally:
        con.close()


async def rebuilt(store: EventStore, db: Path) -> dict[str, list[tuple]]:
    """The projections folded from ``store``'s log into a fresh database."""
    backend = await open_backend(f"sqlite:///{db}")
    try:
        for p in projections():
            await rebuild(store, backend, p)
    finally:
        await backend.close()
    return tables(db)


async def messages(store: EventStore, stream: str) -> list[tuple]:
    """Every message of ``stream``: sequence, subject, headers, data, time."""
    info = await store.js.stream_info(stream)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            m = await store.js.get_msg(stream, seq)
        except nats.js.errors.NotFoundError:
            continue
        out.append((m.seq, m.subject, m.headers, m.data))
    return out


async def usage(store: EventStore, project: str, n: int) -> None:
    at = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)
    for i in range(n):
        rec = UsageRecord(request_id=f"r{i}", at=at, status=200, project_id=project, model_asked="tiny", tokens_in=i)
        await store.js.publish(f"llmgw.usage.{project}", msgspec.json.encode(rec), headers={"Nats-Msg-Id": f"r{i}"})


async def verify_clean(fleet: Fleet) -> dict:
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{fleet.admin_url}/api/v1/projections/verify", headers=fleet.api_headers()) as r,
    ):
        return await r.json()


async def test_a_restored_cluster_has_the_same_log_projections_secrets_and_keys(
    store: EventStore, nats: NatsServer, tmp_path: Path
) -> None:
    first = await Fleet(store, nats.url, tmp_path / "a").start(services=GATEWAY, router=FAST_ROUTER)
    try:
        tenant = await make_tenant(store)
        key, _ = await make_key(store, tenant)
        await first.add_model("tiny", write_tiny_gguf(tmp_path / "tiny.gguf"))
        await usage(store, tenant.project, 5)
        await first.router_caught_up()
        assert [m.id async for m in client(first, key).models.list()] == ["tiny"]
        runner = first.handles["runner"]
        for p in projections():
            head = await store.on_stream(p.stream).stream_last_seq()
            assert await runner.wait_until(p.name, head, timeout=30)
    finally:
        await first.stop()
    originals = tables(tmp_path / "a" / "projections.db")
    secret, signing = await engine_key_secret(store.js), await signing_secret(store.js)
    data = data_dir_with_secrets(tmp_path)

    result = await B.backup(store.nc, tmp_path / "backups", data_dir=data)
    assert stat.S_IMODE(os.stat(result.path).st_mode) == 0o600
    assert {f.path for f in result.manifest.files} == {
        "pki/ca.crt",
        "pki/ca.key",
        "nats/users/operator.json",
        "admin-token",
    }

    with nats_server(tmp_path / "b") as fresh:
        restored = await EventStore.connect(fresh.url, default_registry())
        try:
            await B.restore(restored.nc, Path(result.path))
            for stream in LOG_STREAMS:  # the same sequence numbers, subjects, headers (Nats-Msg-Id) and bytes
                assert await messages(restored, stream) == await messages(store, stream)
            assert await engine_key_secret(restored.js) == secret
            assert await signing_secret(restored.js) == signing
            assert await rebuilt(restored, tmp_path / "rebuilt.db") == originals

            second = await Fleet(restored, fresh.url, tmp_path / "c").start(services=GATEWAY, router=FAST_ROUTER)
            try:
                await second.router_caught_up()
                assert [m.id async for m in client(second, key).models.list()] == ["tiny"]
                body = await verify_clean(second)
                assert body["identical"], body
            finally:
                await second.stop()
        finally:
            await restored.close()


async def test_a_restore_into_a_cluster_that_has_streams_is_refused_naming_them(
    store: EventStore, tmp_path: Path
) -> None:
    await store.js.publish("llmgw.usage.p", b"{}")
    result = await B.backup(store.nc, tmp_path / "backups")
    before = await B.stream_names(store.nc)
    with pytest.raises(B.BackupError, match=r"the cluster is not empty: .*LLMGW_USAGE \(1 messages\).*--force"):
        await B.restore(store.nc, Path(result.path))
    assert await B.stream_names(store.nc) == before

    replaced = await B.restore(store.nc, Path(result.path), force=True)
    assert "LLMGW_USAGE" in replaced.replaced
    assert await B.stream_names(store.nc) == before


def truncated(path: Path) -> Path:
    out = path.with_name("truncated.tar")
    out.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return out


def flipped(path: Path) -> Path:
    """The archive with one byte of the events stream's snapshot changed (its tar framing intact)."""
    out = path.with_name("flipped.tar")
    raw = bytearray(path.read_bytes())
    with tarfile.open(path) as tar:
        member = tar.getmember("streams/LLMGW_EVENTS.snap")
    raw[member.offset_data + member.size // 2] ^= 0xFF
    out.write_bytes(bytes(raw))
    return out


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (truncated, r"truncated"),
        (flipped, r"streams/LLMGW_EVENTS\.snap does not match its sha256"),
    ],
)
async def test_a_damaged_archive_is_refused_naming_the_fault_and_changes_nothing(
    store: EventStore, tmp_path: Path, damage, reason: str
) -> None:
    for i in range(300):
        await store.js.publish(f"llmgw.evt.x.{i % 3}", b"x" * 100, headers={"Nats-Msg-Id": f"m{i}"})
    archive = damage(Path((await B.backup(store.nc, tmp_path / "backups")).path))
    with nats_server(tmp_path / "b") as fresh:
        nc = await nats.connect(fresh.url)
        try:
            with pytest.raises(B.BackupError, match=reason):
                await B.restore(nc, archive)
            assert await B.stream_names(nc) == {}
        finally:
            await nc.close()


async def test_backups_are_private_and_only_the_newest_are_kept(store: EventStore, tmp_path: Path) -> None:
    out = tmp_path / "backups"
    out.mkdir()
    (out / "notes.txt").write_text("not a backup: never deleted")
    start = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)
    paths = [(await B.backup(store.nc, out, keep=2, now=start + dt.timedelta(hours=h))).path for h in range(4)]
    assert sorted(os.listdir(out)) == sorted([Path(p).name for p in paths[-2:]] + ["notes.txt"])
    for p in paths[-2:]:
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
        assert B.read_manifest(Path(p)).format == B.FORMAT


@pytest.mark.parametrize(
    ("names", "keep", "deleted"),
    [
        ([], 3, []),
        (["llmgw-backup-20261201T000000000000Z.tar"], 1, []),
        (
            ["llmgw-backup-20261203T000000000000Z.tar", "llmgw-backup-20261201T000000000000Z.tar", "other.tar"],
            1,
            ["llmgw-backup-20261201T000000000000Z.tar"],
        ),
        (
            [".llmgw-backup-20261201T000000000000Z.tar.partial", "llmgw-backup-20261202T000000000000Z.tar"],
            1,
            [],
        ),
        # keep 0 still keeps the one just written
        (
            ["llmgw-backup-20261201T000000000000Z.tar", "llmgw-backup-20261202T000000000000Z.tar"],
            0,
            ["llmgw-backup-20261201T000000000000Z.tar"],
        ),
    ],
)
def test_rotation_deletes_only_our_archives_older_than_the_newest_n(names, keep, deleted) -> None:
    assert B.to_prune(names, keep) == deleted


@pytest.mark.parametrize(
    ("existing", "force", "refused"),
    [
        ({}, False, False),
        ({"LLMGW_EVENTS": 0}, False, True),
        ({"OTHER": 3}, False, True),
        ({"LLMGW_EVENTS": 10}, True, False),
    ],
)
def test_a_restore_is_for_an_empty_cluster_unless_forced(existing, force, refused) -> None:
    reason = B.restore_refusal(existing, ["LLMGW_EVENTS"], force)
    assert (reason is not None) == refused
    if refused:
        assert all(name in reason for name in existing) and "--force" in reason


def test_the_cli_restores_an_embedded_install_into_a_new_data_directory(tmp_path: Path) -> None:
    async def make_backup() -> str:
        with nats_server(tmp_path / "a") as server:
            store = await EventStore.connect(server.url, default_registry())
            try:
                await store.ensure_streams()
                await store.js.publish("llmgw.usage.p", b"{}", headers={"Nats-Msg-Id": "only"})
                return (await B.backup(store.nc, tmp_path / "backups", data_dir=data_dir_with_secrets(tmp_path))).path
            finally:
                await store.close()

    archive = asyncio.run(make_backup())
    new = tmp_path / "new"
    runner = CliRunner()
    result = runner.invoke(cli_main, ["--data-dir", str(new), "restore", archive], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "restored" in result.output and f"llmgw up --data-dir {new}" in result.output
    assert (new / "pki" / "ca.key").read_text() == "secret CA key"
    assert stat.S_IMODE((new / "pki" / "ca.key").stat().st_mode) == 0o600
    assert (new / "admin-token").read_text() == "llmgw-token"
    assert not (new / "projections.db").exists()

    again = runner.invoke(cli_main, ["--data-dir", str(new), "restore", archive], catch_exceptions=False)
    assert again.exit_code == 2
    assert "the cluster is not empty" in again.output


def test_the_cli_refuses_a_damaged_archive_before_it_connects(tmp_path: Path) -> None:
    bad = tmp_path / "llmgw-backup-20261201T000000000000Z.tar"
    bad.write_bytes(b"not a tar at all" * 100)
    result = CliRunner().invoke(cli_main, ["--data-dir", str(tmp_path / "d"), "restore", str(bad)])
    assert result.exit_code == 2
    assert "use another backup" in result.output
    assert not (tmp_path / "d").exists()


def test_the_every_option_reads_units_and_refuses_what_is_not_an_interval() -> None:
    from llmgw.cli.backup_cmd import parse_every

    assert parse_every("90s") == 90 and parse_every("30m") == 1800 and parse_every("24h") == 86400
    with pytest.raises(Exception, match="no interval"):
        parse_every("daily")


# -- the backup service ----------------------------------------------------------------------


async def test_the_backup_service_backs_up_as_the_control_plane_and_publishes_when_it_last_succeeded(
    roles,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    stores, probes = roles
    registry = CollectorRegistry()
    service = BackupService(stores[NP.CONTROL], tmp_path / "backups", every_s=3600, keep=3, registry=registry)
    task = asyncio.create_task(service.run())
    try:
        await wait_until(lambda: service.last is not None, what="the first backup")
    finally:
        service.stop()
        await task
    assert service.last is not None
    names = {s.name for s in B.read_manifest(Path(service.last.path)).streams}
    assert {"LLMGW_EVENTS", "KV_llmgw_secrets", "KV_llmgw_control_secrets"} <= names
    at = registry.get_sample_value("llmgw_backup_last_success_timestamp_seconds")
    assert at == dt.datetime.fromisoformat(service.last.manifest.created_at).timestamp()
    assert registry.get_sample_value("llmgw_backup_last_size_bytes") == service.last.size
    assert registry.get_sample_value("llmgw_backup_interval_seconds") == 3600

    # The control plane may back up, never restore: replacing the log is the operator's.
    await probes[NP.CONTROL].publish_refused("$JS.SNAPSHOT.RESTORE.LLMGW_EVENTS.x")


async def test_a_restarted_backup_service_takes_the_newest_archive_as_its_last_success(
    store: EventStore, tmp_path: Path
) -> None:
    out = tmp_path / "backups"
    taken = dt.datetime(2026, 12, 1, 6, tzinfo=dt.UTC)
    await B.backup(store.nc, out, now=taken)
    now = taken + dt.timedelta(hours=1)
    registry = CollectorRegistry()
    service = BackupService(store, out, every_s=86400, registry=registry, clock=lambda: now)
    task = asyncio.create_task(service.run())
    await wait_until(
        lambda: registry.get_sample_value("llmgw_backup_last_success_timestamp_seconds") == taken.timestamp(),
        what="the newest archive's time as the last success",
    )
    service.stop()
    await task
    assert service.last is None  # not due for 23 hours: nothing written
    assert len(os.listdir(out)) == 1


@pytest.mark.parametrize(
    ("last_h", "every_h", "due_h"),
    [(None, 24, 0), (1, 24, 23), (30, 24, 0), (24, 24, 0)],
)
def test_a_backup_is_due_an_interval_after_the_newest(last_h, every_h, due_h) -> None:
    now = dt.datetime(2026, 12, 2, tzinfo=dt.UTC)
    last = None if last_h is None else now - dt.timedelta(hours=last_h)
    assert due_in(last, now, every_h * 3600) == due_h * 3600


def test_the_newest_archive_is_read_from_the_names() -> None:
    names = [B.archive_name(dt.datetime(2026, 12, d, tzinfo=dt.UTC)) for d in (3, 1, 2)] + ["notes.txt"]
    assert newest(names) == dt.datetime(2026, 12, 3, tzinfo=dt.UTC)
    assert newest(["notes.txt"]) is None


async def test_the_cli_backs_up_a_running_cluster_and_keeps_the_newest(
    store: EventStore, nats: NatsServer, tmp_path: Path
) -> None:
    data = data_dir_with_secrets(tmp_path)
    out = tmp_path / "backups"
    runner = CliRunner()
    args = ["--nats", nats.url, "--data-dir", str(data), "backup", "--to", str(out), "--keep", "1"]
    for _ in range(2):
        result = await asyncio.to_thread(runner.invoke, cli_main, args, catch_exceptions=False)
        assert result.exit_code == 0, result.output
        assert "backed up 5 streams" in result.output and "and 4 files" in result.output
    assert "deleted the older" in result.output
    (archive,) = out.iterdir()
    assert stat.S_IMODE(archive.stat().st_mode) == 0o600
    checked = runner.invoke(cli_main, ["restore", str(archive), "--check"], catch_exceptions=False)
    assert checked.exit_code == 0 and "the archive is whole" in checked.output

    into = ["--nats", nats.url, "--data-dir", str(data), "restore", str(archive)]
    refused = await asyncio.to_thread(runner.invoke, cli_main, into, catch_exceptions=False)
    assert refused.exit_code == 2 and "the cluster is not empty" in refused.output
    forced = await asyncio.to_thread(runner.invoke, cli_main, [*into, "--force"], catch_exceptions=False)
    assert forced.exit_code == 0, forced.output
    assert "replaced what was there: KV_llmgw_secrets" not in forced.output  # the store fixture made no secret
    assert "replaced what was there: LLMGW_COMMANDS" in forced.output
    assert "kept the files already there" in forced.output


@pytest.mark.parametrize(
    ("path", "allowed"),
    [
        ("pki/ca.key", True),
        ("nats/users/operator.json", True),
        ("admin-token", True),
        ("../admin-token", False),
        ("pki/../../etc/passwd", False),
        ("/etc/passwd", False),
        ("projections.db", False),
        ("pkix/ca.key", False),
        ("", False),
    ],
)
def test_an_archive_may_only_name_files_a_backup_holds(path: str, allowed: bool) -> None:
    assert B.data_file_allowed(path) is allowed
    manifest = B.Manifest(
        format=B.FORMAT,
        llmgw_version="x",
        created_at="2026-12-01T00:00:00+00:00",
        streams=(),
        files=(B.FileEntry(path=path, size=1, sha256="0" * 64, mode=0o600),),
    )
    problem = B.check_members(manifest, {f"files/{path}": (1, "0" * 64)})
    assert (problem is None) is allowed


async def test_a_server_running_the_backup_service_publishes_its_last_success_on_metrics(
    store: EventStore, nats: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMGW_DATA_DIR", str(data_dir_with_secrets(tmp_path)))
    out = tmp_path / "scheduled"
    fleet = await Fleet(store, nats.url, tmp_path / "s").start(
        services=("backup",), backup_dir=str(out), backup_every_s=3600.0, backup_keep=2
    )
    try:
        await wait_until(lambda: fleet.handles["backup"].last is not None, what="the scheduled backup")
        async with (
            aiohttp.ClientSession() as s,
            s.get(f"http://127.0.0.1:{fleet.admin_port}/metrics") as r,
        ):
            text = await r.text()
    finally:
        await fleet.stop()
    (archive,) = out.iterdir()
    assert {f.path for f in B.read_manifest(archive).files} >= {"pki/ca.key", "nats/users/operator.json"}
    assert "llmgw_backup_last_success_timestamp_seconds 1." in text
    assert "llmgw_backup_interval_seconds 3600.0" in text


def test_the_backup_settings_of_a_config_file_reach_the_server_and_up_refuses_them(tmp_path: Path) -> None:
    from llmgw.cli import config_file as C

    path = tmp_path / "llmgw.yaml"
    path.write_text(
        "nats: {url: 'nats://a:4222'}\ndb: x.db\nservices: [api, backup]\nbackup: {every_s: 3600, keep: 3}\n"
    )
    config = C.server_config(C.resolve(C.load(path, {}), tmp_path / "data"))
    assert config.services == ("api", "backup")
    assert config.backup_dir == str(tmp_path / "data" / "backups")
    assert (config.backup_every_s, config.backup_keep) == (3600, 3)
    with pytest.raises(C.ConfigError, match=r"backup\.keep"):
        C.load(path, {"LLMGW_BACKUP_KEEP": "0"})

    up_file = tmp_path / "up.yaml"
    up_file.write_text("backup: {keep: 3}\n")
    args = ["up", "--data-dir", str(tmp_path / "up"), "--config", str(up_file), "--no-agent", "--no-demo"]
    result = CliRunner().invoke(cli_main, args)
    assert result.exit_code == 2
    assert "runs no backup service" in result.output


async def test_a_single_server_s_backup_restores_into_a_three_node_cluster_with_three_replicas(
    store: EventStore, tmp_path: Path
) -> None:
    for i in range(200):
        await store.js.publish(f"llmgw.evt.x.{i % 4}", b"x" * 50, headers={"Nats-Msg-Id": f"m{i}"})
    await engine_key_secret(store.js)
    archive = Path((await B.backup(store.nc, tmp_path / "backups")).path)
    with nats_cluster(tmp_path / "cluster") as cluster:
        restored = await EventStore.connect(cluster.urls, default_registry())
        try:

            async def answers() -> bool:
                # A meta leader is elected before every node's JetStream API answers ("no responders").
                try:
                    await restored.js.account_info()
                except Exception:
                    return False
                return True

            await wait_until(answers, deadline_s=60, what="the cluster's JetStream API to answer")
            await B.restore(restored.nc, archive, replicas=3)

            async def replicated(stream: str) -> bool:
                # Direct gets (the bucket's) may be answered by any replica: read once all have caught up.
                info = await restored.js.stream_info(stream)
                peers = (info.cluster.replicas or []) if info.cluster else []
                return info.config.num_replicas == 3 and len(peers) == 2 and all(p.current for p in peers)

            for stream in ("LLMGW_EVENTS", "KV_llmgw_secrets"):
                await wait_until(lambda stream=stream: replicated(stream), what=f"{stream}'s three replicas")
            assert await messages(restored, "LLMGW_EVENTS") == await messages(store, "LLMGW_EVENTS")
            assert await engine_key_secret(restored.js) == await engine_key_secret(store.js)
        finally:
            await restored.close()


@pytest.mark.parametrize(
    ("why", "says"),
    [
        ("restore failed: io: read/write on closed pipe", "flushes every write"),
        ("restore for stream '$G > LLMGW_EVENTS' is stalled", "flushes every write"),
        ("insufficient storage resources available", "insufficient storage"),
    ],
)
async def test_a_chunk_the_server_refuses_is_reported_with_what_to_do(why: str, says: str) -> None:
    class Msg(msgspec.Struct):
        data: bytes

    class Server:
        async def request(self, subject: str, payload: bytes, timeout: float) -> Msg:
            if subject.startswith("$JS.API.STREAM.RESTORE."):
                return Msg(data=b'{"deliver_subject": "$JS.SNAPSHOT.RESTORE.LLMGW_EVENTS.x"}')
            return Msg(data=msgspec.json.encode({"error": {"description": why}}))

    entry = B.StreamEntry(
        name="LLMGW_EVENTS", first_seq=1, last_seq=1, messages=1, bytes=1, size=1, sha256="", config={}, state={}
    )
    with pytest.raises(B.BackupError, match=says):
        await B.restore_stream(Server(), entry, [b"chunk"], None)  # type: ignore[arg-type]


def test_an_up_install_is_recovered_from_its_backup_into_a_new_data_directory(tmp_path: Path) -> None:
    first = Up(tmp_path / "a").start("--no-agent")
    try:
        made = first.cli("backup")
        assert made.returncode == 0, made.stderr
        before = first.cli("events", "tail", "-n", "1000", "--json")
        assert before.returncode == 0, before.stderr
    finally:
        first.stop()
    (archive,) = (tmp_path / "a" / "backups").iterdir()

    new = tmp_path / "b"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    restored = subprocess.run(
        [LLMGW, "--data-dir", str(new), "restore", str(archive)], capture_output=True, text=True, env=env, timeout=120
    )
    assert restored.returncode == 0, restored.stdout + restored.stderr
    for name in ("admin-token", "nats/users/operator.json", "nats/users/control.json"):
        assert (new / name).read_bytes() == (tmp_path / "a" / name).read_bytes(), name

    second = Up(new).start("--no-agent")
    try:
        verified = second.cli("projections", "verify")
        assert verified.returncode == 0, verified.stdout + verified.stderr
        after = second.cli("events", "tail", "-n", "1000", "--json")
        assert after.returncode == 0, after.stderr
    finally:
        second.stop()
    # Every event there was is there again, with its sequence (the new `up` adds its own after them).
    old = [json.loads(line) for line in before.stdout.splitlines() if line.strip()]
    new_events = {e["seq"]: e for e in (json.loads(line) for line in after.stdout.splitlines() if line.strip())}
    assert old and all(new_events.get(e["seq"]) == e for e in old)
