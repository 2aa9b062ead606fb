"""`llmgw server --config FILE` (SPEC OPS-2): the file's settings reach the running services, flags win
over the environment and the environment over the file, each kind of mistake is refused naming its key,
and the reference in docs/operations.md and ops/llmgw.yaml are what the structs say."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.cli import config_file as C
from llmgw.cli.runtime import serve
from llmgw.cli.server_config import SignInConfig
from llmgw.services.access.bootstrap import DEMO_KEY_FILE
from llmgw.services.people.throttle import LoginThrottle
from tests.support import NatsServer, free_port, wait_until
from tests.up import Up, wait_for

ROOT = Path(__file__).resolve().parent.parent
LLMGW = str(Path(sys.executable).parent / "llmgw")


def write(tmp_path: Path, text: str, name: str = "llmgw.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# -- mistakes, each refused naming its key ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "says"),
    [
        # a value of the wrong type
        ("scheduler:\n  lost_after_s: soon\n", 'scheduler.lost_after_s: expected a number ≥ 1, got "soon"'),
        ("router:\n  max_attempts: 2.5\n", "router.max_attempts: expected a whole number ≥ 1, got 2.5"),
        ("admin:\n  insecure: maybe\n", 'admin.insecure: expected true or false, got "maybe"'),
        ("gateway: 8080\n", "gateway: expected a mapping, got 8080"),
        ("- scheduler\n", "expected a mapping of settings, got a list"),
        # a value out of range
        ("scheduler:\n  lost_after_s: 0.5\n", "scheduler.lost_after_s: expected a number ≥ 1, got 0.5"),
        ("router:\n  total_s: 0\n", "router.total_s: expected a number > 0, got 0"),
        ("gateway:\n  port: 70000\n", "gateway.port: expected a whole number ≥ 0 and ≤ 65535, got 70000"),
        ("scheduler:\n  stop_grace_s: -1\n", "scheduler.stop_grace_s: expected a number ≥ 0, got -1"),
        ("jobs:\n  source: disk\n", 'jobs.source: expected one of local, mirror, got "disk"'),
        ("services: [router, routr]\n", "services[1]: expected one of access, accountant, api, backup, catalog, fleet"),
        # an unknown key, with the likeliest one meant
        ("router:\n  tiemout_s: 5\n", "router.tiemout_s: unknown key (did you mean total_s?)"),
        ("schedular:\n  lost_after_s: 5\n", "schedular: unknown key (did you mean scheduler?)"),
        ("usage:\n  zzz: 1\n", "usage.zzz: unknown key (known: retention_days, prune_every_s)"),
        # a file that is not YAML
        ("router: [1\n", "not valid YAML at line 2, column 1"),
    ],
)
def test_a_mistake_in_the_file_is_refused_naming_its_key(tmp_path: Path, text: str, says: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(C.ConfigError) as refused:
        C.load(path)
    assert str(refused.value).startswith(f"{path}: ")
    assert says in str(refused.value)


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"LLMGW_SCHEDULER_LOST_AFTER_S": "soon"}, "$LLMGW_SCHEDULER_LOST_AFTER_S: scheduler.lost_after_s: expected"),
        ({"LLMGW_GATEWAY_PORT": "-1"}, "$LLMGW_GATEWAY_PORT: gateway.port: expected a whole number ≥ 0"),
        ({"LLMGW_SERVICES": "router,x"}, "$LLMGW_SERVICES: services[1]: expected one of"),
        ({"LLMGW_HUB_ALLOW_PRIVATE": "perhaps"}, "$LLMGW_HUB_ALLOW_PRIVATE: hub.allow_private: expected true or false"),
    ],
)
def test_a_mistake_in_the_environment_is_refused_naming_the_variable_and_key(env: dict[str, str], says: str) -> None:
    with pytest.raises(C.ConfigError) as refused:
        C.load(None, env)
    assert says in str(refused.value)


def test_a_missing_file_and_a_missing_nats_url_are_refused_saying_what_to_give(tmp_path: Path) -> None:
    with pytest.raises(C.ConfigError, match="no such config file"):
        C.load(tmp_path / "nowhere.yaml")
    with pytest.raises(C.ConfigError, match=r"nats.url: required: give --nats URL, \$LLMGW_NATS_URL or nats.url"):
        C.server_config(C.load(None, {"LLMGW_DB": "x.db"}))
    with pytest.raises(C.ConfigError, match=r"db: required: give --db DSN, \$LLMGW_DB or db"):
        C.server_config(C.load(None, {"LLMGW_NATS_URL": "nats://a:4222"}))


def test_a_section_whose_keys_are_all_commented_out_is_taken_as_empty(tmp_path: Path) -> None:
    path = write(tmp_path, "router:\n  # total_s: 5\nscheduler:\n  lost_after_s: 9\n")
    s = C.load(path)
    assert (s.router, s.scheduler.lost_after_s) == (C.RouterConfig(), 9)


# -- precedence -------------------------------------------------------------------------------------------


FILE = """
nats: {url: "nats://from-file:4222"}
db: file.db
gateway: {port: 1000}
scheduler: {lost_after_s: 10, park_after: 7}
router: {total_s: 100, idle_s: 11}
"""


def test_a_flag_wins_over_the_environment_which_wins_over_the_file_which_wins_over_the_defaults(
    tmp_path: Path,
) -> None:
    env = {"LLMGW_ROUTER_TOTAL_S": "200", "LLMGW_GATEWAY_PORT": "2000", "LLMGW_SCHEDULER_PARK_AFTER": "8"}
    s = C.load(write(tmp_path, FILE), env, {"gateway.port": 3000, "scheduler.park_after": 9})
    assert s.gateway.port == 3000  # flag over environment over file
    assert s.scheduler.park_after == 9  # flag over environment over file
    assert s.router.total_s == 200  # environment over file
    assert (s.scheduler.lost_after_s, s.router.idle_s) == (10, 11)  # file over defaults
    assert s.router.first_token_s == C.RouterConfig().first_token_s  # the default


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("LLMGW_", "HF_"))}
    return subprocess.run(
        [LLMGW, *args], env={**clean, **(env or {})}, capture_output=True, text=True, timeout=60, check=False
    )


def test_print_config_shows_the_effective_settings_with_flags_over_the_environment_over_the_file_and_secrets_masked(
    tmp_path: Path,
) -> None:
    path = write(tmp_path, FILE + "hub: {token: hf_secret}\ndb: postgresql://llmgw:pa55@db/llmgw\n")
    done = run_cli(
        "server", "--config", str(path), "--print-config", "--port", "3000",
        env={"LLMGW_ROUTER_TOTAL_S": "200", "LLMGW_GATEWAY_PORT": "2000", "LLMGW_DATA_DIR": str(tmp_path / "data")},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    shown = yaml.safe_load(done.stdout)
    assert shown["gateway"]["port"] == 3000
    assert shown["router"]["total_s"] == 200
    assert shown["scheduler"]["lost_after_s"] == 10
    assert shown["nats"]["url"] == "nats://from-file:4222"
    assert shown["mirror"]["port"] == 8081 + 2  # derived defaults are filled in
    assert shown["hub"]["token"] == "***"
    assert shown["db"] == "postgresql://llmgw:***@db/llmgw"
    assert "hf_secret" not in done.stdout and "pa55" not in done.stdout


def test_a_bad_file_stops_the_server_before_it_starts_with_one_line_and_exit_code_2(tmp_path: Path) -> None:
    path = write(tmp_path, "nats: {url: nats://127.0.0.1:1}\ndb: x.db\nrouter:\n  tiemout_s: 5\n")
    done = run_cli("server", "--config", str(path))
    assert done.returncode == 2
    assert done.stderr == f"error: {path}: router.tiemout_s: unknown key (did you mean total_s?)\n"


def test_the_printed_settings_read_back_as_a_file_are_the_same_settings(tmp_path: Path) -> None:
    s = C.resolve(C.load(write(tmp_path, FILE)), tmp_path)
    again = C.load(write(tmp_path, C.show(s), "shown.yaml"))
    assert again == s


# -- the file reaches the services ----------------------------------------------------------------------------


async def test_the_files_settings_are_what_the_running_scheduler_router_and_accountant_use(
    nats: NatsServer, tmp_path: Path
) -> None:
    path = write(
        tmp_path,
        f"""
nats: {{url: "{nats.url}"}}
db: "sqlite:///{tmp_path / "projections.db"}"
services: [scheduler, router, accountant, api]
gateway: {{host: 127.0.0.1, port: {free_port()}}}
admin: {{port: {free_port()}}}
scheduler: {{lost_after_s: 42, park_after: 3}}
router: {{total_s: 123, first_token_s: 7}}
usage: {{retention_days: 30, prune_every_s: 600}}
snapshots: {{every_events: 1234, every_s: 99}}
signin: {{session_hours: 2, login_failures: 3, login_block_s: 7}}
""",
    )
    config = C.server_config(C.resolve(C.load(path), tmp_path))
    stop = asyncio.Event()
    handles: dict[str, Any] = {}
    task = asyncio.create_task(serve(config, stop, handles=handles))
    try:
        await wait_until(
            lambda: {"scheduler", "router", "accountant", "signin"} <= set(handles), what="the services to start"
        )
        scheduler, router, accountant = handles["scheduler"], handles["router"], handles["accountant"]
        assert (scheduler.cfg.lost_after_s, scheduler.cfg.park_after) == (42, 3)
        assert (router.cfg.total_s, router.cfg.first_token_s) == (123, 7)
        assert router.cfg.usage_journal == str(tmp_path / "usage-journal")
        assert (accountant.retention_days, accountant.prune_every_s) == (30, 600)
        assert scheduler.snapshot_every == router.snapshot_every == (1234, 99)
        signin = handles["signin"]
        assert (signin.session_hours, signin.throttle.failures, signin.throttle.block_s) == (2, 3, 7)
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 30)


# -- the docs and the example follow the structs ----------------------------------------------------------------


def test_the_settings_reference_in_the_operations_page_is_current() -> None:
    on_disk = C.reference_on((ROOT / "docs" / "operations.md").read_text())
    assert on_disk == C.render_reference(), (
        "the settings reference in docs/operations.md is stale: run `llmgw config reference --write docs/operations.md`"
    )


def test_the_example_config_holds_every_setting_and_parses() -> None:
    text = (ROOT / "ops" / "llmgw.yaml").read_text()
    assert text == C.render_example(), "ops/llmgw.yaml is stale: run `llmgw config example > ops/llmgw.yaml`"
    s = C.load(ROOT / "ops" / "llmgw.yaml")
    for setting in C.settings():
        *parents, leaf = setting.path.split(".")
        node = yaml.safe_load(text)
        for p in parents:
            node = node[p]
        assert leaf in node, f"ops/llmgw.yaml has no {setting.path}"
    assert C.server_config(s).nats_url.startswith("nats://")


def test_every_setting_has_an_environment_variable_that_sets_it() -> None:
    names = [C.env_name(s.path) for s in C.settings()]
    assert len(set(names)) == len(names), "two settings share an environment variable"
    env = {
        "LLMGW_SCHEDULER_LOST_AFTER_S": "45",
        "LLMGW_MIRROR_URLS": "http://a, http://b",
        "LLMGW_HUB_ALLOW_PRIVATE": "1",
        "HF_ENDPOINT": "http://hub",
        "LLMGW_NATS_STREAM_REPLICAS": "",
    }
    s = C.load(None, env)
    assert s.scheduler.lost_after_s == 45
    assert s.mirror.urls == ("http://a", "http://b")
    assert s.hub.allow_private is True
    assert s.hub.endpoint == "http://hub"
    assert s.nats.stream_replicas is None


# -- `llmgw up --config FILE` ------------------------------------------------------------------------------


def test_up_refuses_in_its_file_what_it_decides_itself_naming_the_key(tmp_path: Path) -> None:
    path = write(tmp_path, "nats: {url: nats://elsewhere:4222}\n")
    done = run_cli("up", "--data-dir", str(tmp_path / "data"), "--config", str(path), "--no-agent", "--no-demo")
    assert done.returncode == 2
    assert done.stderr.startswith(f"error: {path}: nats: `llmgw up` runs its own NATS server"), done.stderr
    assert not (tmp_path / "data" / "nats").exists()  # refused before anything started


def test_a_router_setting_in_ups_file_is_what_its_gateway_answers_with(tmp_path: Path) -> None:
    path = write(tmp_path, "router: {max_body_bytes: 1000}\nsnapshots: {every_events: 0}\n")
    u = Up(tmp_path / "data").start("--config", str(path), "--no-agent")
    try:
        key = (u.data_dir / DEMO_KEY_FILE).read_text().strip()
        request = urllib.request.Request(
            f"http://127.0.0.1:{u.port}/v1/chat/completions",
            data=b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * 2000 + b'"}]}',
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 413
        assert "larger than 1000 bytes" in refused.value.read().decode()
    finally:
        u.stop()


def test_the_sign_in_settings_default_to_what_the_login_throttle_did_before_they_were_settings() -> None:
    before, now = LoginThrottle(), SignInConfig().throttle()
    assert (now.failures, now.window_s, now.block_s, now.max_block_s) == (
        before.failures,
        before.window_s,
        before.block_s,
        before.max_block_s,
    )


def test_a_server_given_only_a_file_connects_where_it_says_and_listens_on_its_ports(
    nats: NatsServer, tmp_path: Path
) -> None:
    port, admin_port = free_port(), free_port()
    path = write(
        tmp_path,
        f"""
nats: {{url: "{nats.url}"}}
db: "sqlite:///{tmp_path / "projections.db"}"
services: [router]
gateway: {{host: 127.0.0.1, port: {port}}}
admin: {{port: {admin_port}}}
router: {{usage_journal: "{tmp_path / "journal"}"}}
""",
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("LLMGW_", "HF_"))}
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([LLMGW, "server", "--config", str(path)], env=clean, stdout=out, stderr=out)
    try:

        def healthy(p: int) -> bool:
            assert proc.poll() is None, f"the server exited:\n{log.read_text()}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{p}/healthz", timeout=1) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_for(lambda: healthy(admin_port) and healthy(port), "the server to answer on the file's ports")
    finally:
        proc.terminate()
        proc.wait(30)


# -- every setting, not just the examples ------------------------------------------------------------------


@pytest.mark.parametrize("setting", C.settings(), ids=lambda s: s.path)
def test_every_setting_given_a_mapping_instead_of_its_value_is_refused_naming_its_key(
    tmp_path: Path, setting: C.Setting
) -> None:
    path = write(tmp_path, yaml.safe_dump(C.nest({setting.path: {"oops": 1}})))
    with pytest.raises(C.ConfigError) as refused:
        C.load(path)
    assert f"{path}: {setting.path}: expected " in str(refused.value)


def _valid(t: Any) -> st.SearchStrategy[Any]:
    """Values a setting of type ``t`` (msgspec.inspect) takes."""
    if isinstance(t, mi.UnionType):
        return st.one_of([_valid(u) for u in t.types])
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.LiteralType):
        return st.sampled_from(t.values)
    if isinstance(t, mi.StrType):
        return st.text(st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), max_size=20)
    if isinstance(t, mi.VarTupleType | mi.ListType):
        return st.lists(_valid(t.item_type), max_size=3).map(tuple)
    raise AssertionError(f"no strategy for {t}")


def _number(path: str, t: Any) -> st.SearchStrategy[Any]:
    op, low = C._bound(path, t) or ("≥", 0)
    top = C._upper(path, t)
    high = top if top is not None else 10**6
    if isinstance(t, mi.IntType):
        return st.integers(min_value=int(low) + (op == ">"), max_value=int(high))
    return st.floats(min_value=low, max_value=high, exclude_min=op == ">", allow_nan=False)


def _value(s: C.Setting) -> st.SearchStrategy[Any]:
    inner = C._unwrap(s.type)
    if isinstance(inner, mi.IntType | mi.FloatType):
        numbers = _number(s.path, inner)
        return numbers | st.none() if inner is not s.type else numbers
    return _valid(s.type)


# Every setting but the secrets, which --print-config masks.
SHOWN = [s for s in C.settings() if s.path not in C.SECRETS]


@given(st.lists(st.sampled_from(SHOWN), unique_by=lambda s: s.path).flatmap(
    lambda chosen: st.fixed_dictionaries({s.path: _value(s) for s in chosen})
))  # fmt: skip
@settings(max_examples=50, deadline=None)
def test_any_valid_settings_in_a_file_are_taken_as_written_and_read_back_the_same_from_what_print_config_shows(
    chosen: dict[str, Any],
) -> None:
    text = yaml.safe_dump(C.nest({k: list(v) if isinstance(v, tuple) else v for k, v in chosen.items()}))
    raw = yaml.safe_load(text)
    C.check(raw)
    loaded = msgspec.convert(raw, C.Settings)
    for path, value in chosen.items():
        node: Any = loaded
        for part in path.split("."):
            node = getattr(node, part)
        assert node == value, path
    assert msgspec.convert(yaml.safe_load(C.show(loaded)), C.Settings) == loaded


@pytest.mark.parametrize(
    "url", ["llm.corp.example", "ftp://llm.corp.example", "https://", "https://llm.corp.example/?x=1"]
)
def test_a_public_url_that_is_not_where_people_reach_the_console_is_refused(url: str) -> None:
    env = {"LLMGW_NATS_URL": "nats://a:4222", "LLMGW_DB": "x.db", "LLMGW_ADMIN_PUBLIC_URL": url}
    with pytest.raises(C.ConfigError, match=r"admin.public_url: .* e.g. https://llm.corp.example"):
        C.server_config(C.load(None, env))
    env["LLMGW_ADMIN_PUBLIC_URL"] = "https://llm.corp.example/llmgw"
    assert C.server_config(C.load(None, env)).admin_public_url == "https://llm.corp.example/llmgw"
