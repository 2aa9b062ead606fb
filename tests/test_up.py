"""`llmgw up` as a user runs it: a real process, the real CLI, the same data directory twice."""

from __future__ import annotations

import json
import stat
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.events.schema.access import hash_api_key, key_prefix
from tests.support import free_port
from tests.up import LLMGW, Up


@pytest.fixture
def up(tmp_path: Path) -> Iterator[Up]:
    u = Up(tmp_path / "data", demo=True).start()
    yield u
    if u.proc and u.proc.poll() is None:
        u.stop()


def test_up_answers_health_on_both_ports_and_publishes_metrics(up: Up) -> None:
    assert up.health(up.port) == 200
    assert up.health(up.admin_port) == 200
    with urllib.request.urlopen(f"http://127.0.0.1:{up.admin_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    assert "llmgw_eventstore_appended_events_total" in text
    assert 'llmgw_projection_lag_events{projection="tenancy"}' in text


def test_the_tree_is_built_through_the_cli_and_survives_a_restart(up: Up) -> None:
    for args in (["org", "create", "acme"], ["team", "create", "acme/ml"], ["project", "create", "acme/ml/chat"]):
        done = up.cli("ctl", *args)
        assert done.returncode == 0, done.stderr
    assert "created" in done.stdout
    assert up.stop() == 0
    up.start()
    tree = json.loads(up.cli("ctl", "tree", "--json").stdout)
    assert sorted(o["name"] for o in tree) == ["acme", "default"]  # `default`: the first run's demo org
    [acme] = [o for o in tree if o["name"] == "acme"]
    assert acme["name"] == "acme"
    assert acme["children"][0]["name"] == "ml"
    assert acme["children"][0]["children"][0]["name"] == "chat"


def test_a_refused_command_prints_its_reason_and_exits_non_zero(up: Up) -> None:
    done = up.cli("ctl", "team", "create", "ghost/ml")
    assert done.returncode == 2
    assert "needs org 'ghost', which does not exist: `llmgw ctl org create ghost` first" in done.stderr
    up.cli("ctl", "org", "create", "acme")
    up.cli("ctl", "team", "create", "acme/ml")
    done = up.cli("ctl", "org", "delete", "acme")
    assert done.returncode == 2
    assert "org acme still holds 1 team (ml); delete it first" in done.stderr


def test_the_log_names_who_did_what_and_show_links_causes(up: Up) -> None:
    up.cli("ctl", "org", "create", "acme")
    lines = up.cli("events", "tail", "--json", "--type", "org.created").stdout.splitlines()
    events = [json.loads(x) for x in lines]
    assert [e["actor"] for e in events][:1] == ["system:bootstrap"], "the first run's demo org comes first"
    event = events[-1]
    assert event["actor"].startswith("user:")
    assert event["causation"]
    shown = up.cli("events", "show", event["causation"])
    assert shown.returncode == 0
    assert event["id"] in shown.stdout and "command.completed" in shown.stdout

    # The plain lines carry what `events show` takes (the sequence, the id) and what caused each event.
    [line] = up.cli("events", "tail", "-n", "1", "--type", "org.created").stdout.splitlines()
    assert line.split()[:2] == [str(event["seq"]), event["id"]] and f"by {event['causation']}" in line
    by_seq = up.cli("events", "show", str(event["seq"]))
    assert by_seq.returncode == 0 and event["id"] in by_seq.stdout and "org.created" in by_seq.stdout
    nowhere = up.cli("events", "show", "999999999")
    assert nowhere.returncode != 0 and "there is no event at sequence 999999999" in nowhere.stderr


def test_a_second_up_on_the_same_directory_is_refused(up: Up) -> None:
    second = subprocess.run(
        [LLMGW, "up", "--data-dir", str(up.data_dir), "--port", str(free_port()), "--admin-port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert second.returncode != 0
    assert "already running" in second.stderr


def test_sigterm_stops_everything_up_started(up: Up) -> None:
    nats_pid = up.nats_pid()
    assert nats_pid
    assert up.stop() == 0
    assert up.nats_pid() == 0
    assert not (up.data_dir / "run.json").exists()
    done = up.cli("ctl", "tree")
    assert done.returncode == 4 and "no running `llmgw up` found" in done.stderr


def test_the_embedded_server_flushes_before_it_acknowledges(up: Up) -> None:
    conf = (up.data_dir / "nats" / "nats.conf").read_text()
    assert "sync_interval: always" in conf


def test_projections_verify_agrees_with_the_live_tables(up: Up) -> None:
    up.cli("ctl", "org", "create", "acme")
    up.cli("ctl", "org", "rename", "acme", "acme-corp")
    done = up.cli("projections", "verify")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tenancy: identical" in done.stdout


def test_up_writes_a_demo_key_for_its_owner_only_the_first_time_and_keeps_it_on_restart(up: Up) -> None:
    demo = up.data_dir / "demo-key"
    assert stat.S_IMODE(demo.stat().st_mode) == 0o600
    key = demo.read_text().strip()
    prefix = key_prefix(key)
    assert prefix is not None, "a key in llmgw's format"
    listed = json.loads(up.cli("ctl", "key", "list", "--project", "default/default/default", "--json").stdout)
    assert [(k["name"], k["prefix"], k["state"]) for k in listed] == [("demo", prefix, "active")]
    assert up.stop() == 0
    up.start()
    assert demo.read_text().strip() == key
    assert stat.S_IMODE(demo.stat().st_mode) == 0o600
    assert len(json.loads(up.cli("ctl", "key", "list", "--json").stdout)) == 1, "no second demo key"


@pytest.mark.timeout(420)  # some twenty CLI processes in a row, each a Python start: minutes on a loaded machine
def test_a_created_key_is_printed_once_and_listed_by_its_prefix_only(up: Up) -> None:
    for args in (["org", "create", "acme"], ["team", "create", "acme/ml"], ["project", "create", "acme/ml/chat"]):
        assert up.cli("ctl", *args).returncode == 0
    create = ["key", "create", "--project", "acme/ml/chat", "--name", "ci", "--rpm", "60", "--expires", "30d"]
    done = up.cli("ctl", *create)
    assert done.returncode == 0, done.stderr
    key = done.stdout.strip()
    prefix = key_prefix(key)
    assert prefix is not None and done.stdout.count(key) == 1
    assert "created for project acme/ml/chat" in done.stderr and "will not be shown again" in done.stderr
    secret = key.split("-", 2)[2]

    listed = up.cli("ctl", "key", "list", "--project", "acme/ml/chat")
    assert listed.returncode == 0, listed.stderr
    assert f"llmgw-{prefix}-…" in listed.stdout and "ci" in listed.stdout and "active" in listed.stdout
    as_json = up.cli("ctl", "keys", "list", "--json").stdout
    assert prefix in as_json
    assert secret not in listed.stdout + as_json and hash_api_key(key) not in as_json

    refused = up.cli("ctl", "project", "delete", "acme/ml/chat")
    assert refused.returncode == 2
    assert "project acme/ml/chat still holds 1 key (ci); revoke it first" in refused.stderr
    revoked = up.cli("ctl", "key", "revoke", prefix, "--reason", "rotated")
    assert revoked.returncode == 0 and "revoked" in revoked.stdout
    assert "revoked" in up.cli("ctl", "key", "list", "--project", "acme/ml/chat").stdout

    assert up.cli("ctl", "limit", "set", "team:acme/ml", "--rpm", "600").returncode == 0
    assert up.cli("ctl", "price", "set", "smollm2", "--input", "0.1", "--output", "0.3").returncode == 0
    assert up.cli("ctl", "budget", "set", "acme/ml/chat", "--usd", "20", "--period", "day").returncode == 0
    assert "team:acme/ml" in up.cli("ctl", "limit", "list").stdout
    assert "smollm2" in up.cli("ctl", "price", "list").stdout
    assert "project:acme/ml/chat" in up.cli("ctl", "budget", "list").stdout
    bad = up.cli("ctl", "limit", "set", "team:acme/nope", "--rpm", "5")
    assert bad.returncode == 2 and "there is no team 'acme/nope' (teams: acme/ml" in bad.stderr
    assert up.cli("ctl", "project", "delete", "acme/ml/chat").returncode == 0


def test_audit_lists_who_changed_what_and_by_default_only_what_people_did(up: Up) -> None:
    for args in (["org", "create", "acme"], ["team", "create", "acme/ml"]):
        assert up.cli("ctl", *args).returncode == 0
    done = up.cli("ctl", "audit")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    me = "user:admin"  # the CLI on the machine running `up` signs with the first administrator's token
    assert any("org.created" in line and me in line and "acme" in line for line in lines), done.stdout
    assert any("team.created" in line and me in line for line in lines), done.stdout
    assert all(" user:" in line for line in lines), "people only, unless another actor is asked for"

    only = up.cli("ctl", "audit", "--type", "team.created").stdout.splitlines()
    assert len(only) == 1 and "team.created" in only[0]
    [row] = [json.loads(x) for x in up.cli("ctl", "audit", "--type", "team.created", "--json").stdout.splitlines()]
    assert row["data"]["name"] == "ml" and row["actor"] == me, "the change itself, not only that it happened"
    services = up.cli("ctl", "audit", "--actor", "svc:", "-n", "500").stdout
    assert "scheduler.elected" in services and " user:" not in services
    assert "no changes by" in up.cli("ctl", "audit", "--since", "2999-01-01T00:00:00").stdout
    bad = up.cli("ctl", "audit", "--since", "last tuesday")
    assert bad.returncode != 0 and "neither a duration" in bad.stderr
