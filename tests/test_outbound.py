"""Outbound safety (issue "Trust", item 8): the mirror refuses private and link-local destinations unless configured.

The rule is a table; the enforcement is tested at the connection: a hub on loopback is refused
when a fetch is asked for, and a hub that looks public (``localhost`` pinned as if it were a public
host) redirecting a file to loopback, to cloud metadata or to a name that resolves privately gets
its file refused, with nothing written.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import click
import msgspec
import pytest
from aiohttp.abc import AbstractResolver, ResolveResult

from llmgw.cli.server_cmd import server
from llmgw.cli.up_cmd import up
from llmgw.events.commands.errors import CommandRejectedError
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import mirror as E
from llmgw.events.schema import outcomes as O
from llmgw.modelfiles.outbound import (
    ALLOW_HINT,
    DestinationRefused,
    OutboundResolver,
    address_kind,
    refusal,
)
from llmgw.services.mirror.hub import HubClient, HubError, shown
from tests.fakehub import FakeHub
from tests.test_mirror import REPO, Rig, blob, files_under

pytestmark = [pytest.mark.timeout(120)]


# -- the rule --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("127.0.0.1", "loopback"),
        ("127.8.9.10", "loopback"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("169.254.169.254", "link-local"),
        ("0.0.0.0", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("240.0.0.1", "reserved"),
        ("100.64.0.1", "non-public"),
        ("::1", "loopback"),
        ("::", "unspecified"),
        ("fe80::1", "link-local"),
        ("fc00::1", "private"),
        ("fd12:3456::1", "private"),
        ("ff02::1", "multicast"),
        ("::ffff:169.254.169.254", "link-local"),
        ("::ffff:10.0.0.1", "private"),
        ("::ffff:127.0.0.1", "loopback"),
        ("64:ff9b::a9fe:a9fe", "link-local"),  # NAT64 of 169.254.169.254
        ("2002:7f00:1::1", "loopback"),  # 6to4 of 127.0.0.1
        ("8.8.8.8", None),
        ("93.184.216.34", None),
        ("2606:4700:4700::1111", None),
        ("::ffff:8.8.8.8", None),
    ],
)
def test_each_kind_of_address_is_named_and_public_ones_pass(address: str, kind: str | None) -> None:
    assert address_kind(ipaddress.ip_address(address)) == kind


def test_a_refusal_names_the_host_the_address_and_the_flag() -> None:
    reason = refusal("https://hub.example/acme/x", ["169.254.169.254"], allow_private=False)
    assert reason is not None
    assert "hub.example resolves to 169.254.169.254" in reason and "link-local" in reason
    assert ALLOW_HINT in reason and "--hub-allow-private" in reason


def test_an_address_written_in_the_url_is_named_once() -> None:
    reason = refusal("http://127.0.0.1:8080/x", ["127.0.0.1"], allow_private=False)
    assert reason is not None and reason.startswith("127.0.0.1 is a loopback address")


def test_a_name_with_one_private_answer_among_public_ones_is_refused() -> None:
    assert refusal("https://hub.example", ["8.8.8.8", "10.0.0.7"], allow_private=False) is not None


def test_public_answers_and_the_flag_let_a_connection_through() -> None:
    assert refusal("https://hub.example", ["8.8.8.8", "2606:4700:4700::1111"], allow_private=False) is None
    assert refusal("http://10.0.0.7:8080", ["10.0.0.7"], allow_private=True) is None


def test_a_link_local_address_with_a_scope_is_still_link_local() -> None:
    reason = refusal("http://[fe80::1%25eth0]/", ["fe80::1%eth0"], allow_private=False)
    assert reason is not None and "link-local" in reason


# -- the resolver ----------------------------------------------------------------------------


class FakeDNS(AbstractResolver):
    """Answers names from a map, as DNS would: what the outbound rule then sees."""

    def __init__(self, answers: dict[str, str]) -> None:
        self.answers = answers

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        if host not in self.answers:
            raise OSError(f"no such host {host}")
        address = self.answers[host]
        fam = socket.AF_INET6 if ":" in address else socket.AF_INET
        return [ResolveResult(hostname=host, host=address, port=port, family=fam, proto=0, flags=0)]

    async def close(self) -> None:
        pass


async def test_the_resolver_refuses_a_name_that_answers_with_a_private_address() -> None:
    resolver = OutboundResolver(False, inner=FakeDNS({"metadata.test": "169.254.169.254", "hub.test": "8.8.8.8"}))
    with pytest.raises(DestinationRefused, match=re.escape("metadata.test resolves to 169.254.169.254")):
        await resolver.resolve("metadata.test", 80)
    assert [a["host"] for a in await resolver.resolve("hub.test", 80)] == ["8.8.8.8"]


async def test_the_resolver_lets_private_answers_through_when_allowed_and_pinned_hosts_always() -> None:
    allowed = OutboundResolver(True, inner=FakeDNS({"hub.lan": "10.0.0.7"}))
    assert [a["host"] for a in await allowed.resolve("hub.lan", 80)] == ["10.0.0.7"]
    pinned = OutboundResolver(False, pinned={"hub.test": "127.0.0.1"}, inner=FakeDNS({}))
    assert [a["host"] for a in await pinned.resolve("hub.test", 80)] == ["127.0.0.1"]


async def test_the_hub_client_checks_its_endpoint_before_asking_the_hub(hub: FakeHub) -> None:
    hub.add_repo(REPO)
    client = HubClient(hub.url)
    with pytest.raises(HubError) as refused:
        await client.info(REPO, "main")
    assert refused.value.code == "refused_destination" and ALLOW_HINT in refused.value.message
    assert hub.requests == [], "nothing was asked of a refused hub"
    assert (await HubClient(hub.url, resolver=OutboundResolver(True)).info(REPO, "main")).repo == REPO


# -- the mirror ------------------------------------------------------------------------------


@pytest.fixture
async def hub() -> AsyncIterator[FakeHub]:
    h = await FakeHub().start()
    yield h
    await h.stop()


async def test_a_hub_on_loopback_is_refused_without_the_flag_and_nothing_is_downloaded(
    store: EventStore, hub: FakeHub, tmp_path: Path
) -> None:
    hub.add_repo(REPO)
    hub.add_file(REPO, "tiny-Q8_0.gguf", blob(5000))
    rig = await Rig(store, hub, tmp_path, hub_allow_private=False).start()
    try:
        with pytest.raises(CommandRejectedError) as refused:
            await rig.fetch()
        assert refused.value.code == "refused_destination"
        assert "127.0.0.1 is a loopback address" in str(refused.value) and ALLOW_HINT in str(refused.value)
        assert hub.requests == [] and files_under(rig.root) == []
        rejected = [
            e.payload for e in await store.read("llmgw.evt.command.>") if isinstance(e.payload, O.CommandRejected)
        ]
        assert [r.code for r in rejected] == ["refused_destination"], "the log says why the fetch was refused"
        assert ALLOW_HINT in rejected[0].reason
    finally:
        await rig.stop()


@pytest.mark.parametrize(
    "cdn",
    [
        "http://127.0.0.1:{port}",  # an address in the URL: aiohttp asks no resolver, the middleware checks it
        "http://169.254.169.254",  # cloud metadata
        "http://[::ffff:127.0.0.1]:{port}",
        "http://cdn.test:{port}",  # a name whose DNS answer is loopback: the resolver checks it
    ],
)
async def test_a_redirect_to_a_private_destination_is_refused_and_the_file_is_not_written(
    store: EventStore, hub: FakeHub, tmp_path: Path, cdn: str
) -> None:
    hub.add_repo(REPO)
    f = hub.add_file(REPO, "tiny-Q8_0.gguf", blob(5000), lfs=True)  # LFS: the hub redirects it to its CDN
    hub.cdn_url = cdn.format(port=hub.cdn_port)
    # The hub itself stands for a public one: `localhost` is pinned, as a public host's address would be.
    resolver = OutboundResolver(False, pinned={"localhost": "127.0.0.1"}, inner=FakeDNS({"cdn.test": "127.0.0.1"}))
    rig = Rig(store, hub, tmp_path, hub_allow_private=False)
    rig.config = msgspec.structs.replace(rig.config, hub=f"http://localhost:{hub.port}")
    await rig.start(resolver=resolver)
    try:
        await rig.fetch()
        outcome = await rig.outcome()
        assert outcome.type == "mirror.fetch_failed"
        assert isinstance(outcome.payload, E.FetchFailed) and outcome.payload.code == "refused"
        assert "tiny-Q8_0.gguf" in outcome.payload.reason and ALLOW_HINT in outcome.payload.reason
        assert f.bytes_served == 0 and not [r for r in hub.requests if r[1].startswith("/cdn/")]
        assert files_under(rig.root) == [], "neither the file nor a partial of it is written"
    finally:
        await rig.stop()


async def test_the_same_redirect_goes_through_when_its_destination_is_allowed(
    store: EventStore, hub: FakeHub, tmp_path: Path
) -> None:
    hub.add_repo(REPO)
    f = hub.add_file(REPO, "tiny-Q8_0.gguf", blob(5000), lfs=True)
    hub.cdn_url = f"http://cdn.test:{hub.cdn_port}"
    resolver = OutboundResolver(False, pinned={"localhost": "127.0.0.1", "cdn.test": "127.0.0.1"})
    rig = Rig(store, hub, tmp_path, hub_allow_private=False)
    rig.config = msgspec.structs.replace(rig.config, hub=f"http://localhost:{hub.port}")
    await rig.start(resolver=resolver)
    try:
        await rig.fetch()
        assert (await rig.outcome()).type == "mirror.fetch_completed"
        assert f.bytes_served == len(f.data)
    finally:
        await rig.stop()


async def test_with_the_flag_a_hub_on_loopback_works_as_before(store: EventStore, hub: FakeHub, tmp_path: Path) -> None:
    hub.add_repo(REPO)
    hub.add_file(REPO, "tiny-Q8_0.gguf", blob(5000), lfs=True)
    rig = await Rig(store, hub, tmp_path, hub_allow_private=True).start()
    try:
        await rig.fetch()
        assert (await rig.outcome()).type == "mirror.fetch_completed"
    finally:
        await rig.stop()


# -- the flag --------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [up, server])
def test_the_flag_and_its_variable_reach_up_and_server_and_are_off_by_default(
    command: click.Command, monkeypatch: pytest.MonkeyPatch
) -> None:
    required = ["--nats", "nats://x", "--db", "sqlite:///x"] if command is server else []
    assert command.make_context("llmgw", list(required)).params["hub_allow_private"] is False
    assert command.make_context("llmgw", [*required, "--hub-allow-private"]).params["hub_allow_private"] is True
    monkeypatch.setenv("LLMGW_HUB_ALLOW_PRIVATE", "1")
    assert command.make_context("llmgw", list(required)).params["hub_allow_private"] is True


def test_credentials_in_a_hub_url_are_never_shown() -> None:
    assert shown("https://alice:s3cret@hub.example:8443/base") == "https://hub.example:8443/base"
    assert shown("https://hub.example") == "https://hub.example"
    assert "s3cret" not in HubClient("https://alice:s3cret@hub.example").shown
